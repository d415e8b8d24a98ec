"""qwZ's and qgZ's quantization: packed formats with their torch twins, Triton kernels, and the ops
that launch them.

By role: for qwZ (weights), `weight_format.py` (the packed format, torch twins, argument checks),
`weight_kernels.py` (the Triton kernels), `weight_ops.py` (their launchers and the
`zpp::quantize_weight` / `zpp::dequantize_weight` ops with their bucket forms); for qgZ
(gradients), `grad_format.py` (the packed format and its arithmetic, the torch twins, argument
checks), `grad_tiles.py` and `grad_kernels.py` (the Triton tile helpers and the kernels, with their
design), `grad_ops.py` (tuning, launchers, the `zpp::qgz_*` ops); `triton_common.py` holds what
both share (the guarded Triton import, the interpreter switch, launch helpers).

Importing this package registers its ops with torch.library, and this is where that happens for
the whole package (`runtime.ops` imports it before any graph can call them).
"""

from . import grad_ops, weight_ops  # noqa: F401  (registers the zpp::quantize_*, zpp::dequantize_*, zpp::qgz_* ops)

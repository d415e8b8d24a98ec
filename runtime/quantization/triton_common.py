"""What the qgZ (``grad_*.py``) and qwZ (``weight_*.py``) Triton kernels share.

The one guarded Triton import (without Triton the ops run their torch twins on every device),
the one reading of ``TRITON_INTERPRET``, the NaN-propagating max and the rounding constant the
kernels compute with, the float dtypes both techniques take, and the launch plumbing: the check
that Triton can run a block size, SM count, 4-byte aligned byte buffers, the launch context (and
with it where compiled kernels are kept).
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from ...torch_compat import cache_kernels_beside_inductors

try:  # Triton is optional: without it the torch twins serve every device.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None
    tl = None
    HAS_TRITON = False

__all__ = [
    "HAS_TRITON",
    "SUPPORTED_DTYPES",
    "ROUND_MAGIC",
    "interpreting",
    "require_triton",
    "num_sms",
    "aligned_u8",
    "launch_context",
]

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# 1.5 * 2**23. For |t| < 2**22, t + ROUND_MAGIC (an IEEE float32 add, round to nearest even) lands
# where the float spacing is 1: the add rounds t to an integer, half to even, and the low mantissa
# bits of the sum hold that integer in two's complement. Integer codes without a float -> int
# conversion instruction (the GPU's conversion unit is a fraction of its FP32 rate).
ROUND_MAGIC = 12582912.0


def interpreting() -> bool:
    """Whether Triton runs its kernels in the interpreter (``TRITON_INTERPRET=1``: CPU tensors).
    The kernels then emulate what the interpreter does differently from the GPU (a fused
    multiply-add that rounds twice, a float32 -> bfloat16 cast that truncates)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def require_triton(kernels: str, block_size: int, handled: bool, rule: str) -> None:
    """Raise unless the Triton ``kernels`` can run ``block_size`` (``handled``: whether it
    follows ``rule``, e.g. "a multiple of 16"). The ops send other block sizes to the twins;
    only a direct call of a launcher gets here."""
    if not HAS_TRITON:
        raise RuntimeError(f"the Triton {kernels} kernels need triton, which is not installed "
                           "(pip install triton; the zpp ops run the torch twins without it)")
    if not handled:
        raise ValueError(f"the Triton {kernels} kernels need a block_size that is {rule}, "
                         f"got {block_size}")


def num_sms(device: torch.device) -> int:
    """Multiprocessors of a CUDA device; under the interpreter a small count, so that each
    persistent program walks several tiles (the loop the tests need to reach)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 3


def aligned_u8(buf: torch.Tensor) -> torch.Tensor:
    """``buf`` contiguous and starting 4-byte aligned (copied if not), so that the kernels can
    read its bytes as int32 / float32 words."""
    buf = buf.contiguous()
    if buf.data_ptr() % 4 != 0:
        buf = buf.clone()
    return buf


@contextlib.contextmanager
def launch_context(t: torch.Tensor) -> Iterator[None]:
    """Around a kernel launch: selects the tensor's CUDA device and has Triton keep the compiled
    kernel in Inductor's cache folder, where a restarted job finds it; under the interpreter,
    silences numpy's warnings about casting the (discarded) codes of non-finite values."""
    with contextlib.ExitStack() as stack:
        if t.is_cuda:
            cache_kernels_beside_inductors(t.get_device())
            stack.enter_context(torch.cuda.device(t.device))
        if interpreting():
            import numpy as np
            stack.enter_context(np.errstate(invalid="ignore", over="ignore"))
        yield


if HAS_TRITON:
    INF = tl.constexpr(float("inf"))       # Triton kernels read module globals only as constexpr
    MAGIC = tl.constexpr(ROUND_MAGIC)

    @triton.jit
    def nanmax(a, b):
        """max that propagates NaN (one FMNMX.NAN on sm_80+; the interpreter's max does too)."""
        return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)

"""qwZ's packed weight format, its arithmetic, the torch twins and the argument checks of its ops.

A shard of n elements is cut into nb = ceil(n / B) blocks of B elements. The packed form is one
uint8 tensor of `packed_weight_bytes(n, B)` bytes:

    [ nb*B int8 codes (tail of the last block is padding, code 0) | nb float32 scales ]

B is a multiple of 4, so the packed size is too: R packed shards concatenated by an all-gather
keep every chunk's scale array 4-byte aligned, and `zpp::dequantize_weight` reads all R chunks in
one launch.

Arithmetic (float32, identical in the Triton kernels and their torch twins, bit for bit):

    absmax = max |x| over the block, NaN counted as +inf
    absmax < 2**-119            -> zero block: scale = 0, codes 0
    absmax == +inf              -> non-finite block: scale = +inf (a marker), codes
                                   NaN -> -128, +inf -> 127, -inf -> -127, finite -> 0
    otherwise                   -> scale = absmax / 127,  inv = 127 / absmax  (both IEEE
                                   round-to-nearest divisions, `tl.math.div_rn` in Triton)
                                   code  = round_half_even(clamp(x * inv, -127, 127))
    dequantized = float32(code) * scale, then cast to the output dtype (round to nearest even);
    in a non-finite block: -128 -> NaN, 127 -> +inf, -127 -> -inf, any other code -> 0.

Why this formula: one multiply per element instead of a division (a correctly rounded division
takes several instructions on the GPU; these kernels are memory-bound with little slack for bf16);
the product is correctly rounded everywhere, so kernel and twin agree. The clamp never acts
(|x| <= absmax gives |x * inv| <= 127 (1 + 2**-24)**2 < 127.5), so the kernels leave it out; they
are compiled without FMA contraction (``enable_fp_fusion=False``), so that x * inv is rounded
before the add of the rounding trick, as in the twin. Normal blocks never emit -128.

Why the 2**-119 cut-off: blocks holding only zeros and values below ~1.5e-36 would need a
subnormal scale (or overflow 127 / absmax); GPUs may flush subnormals to zero where the CPU does
not. Treating them as zero blocks (absolute error < 1.5e-36) keeps both paths identical.
NaN payloads (bit patterns) are not specified: torch's own float32->bfloat16 cast picks its own.

The twins below are the CPU implementation of the ``zpp::*_weight`` and ``zpp::*_bucket`` ops
(``weight_ops.py``) and the oracle the Triton kernels (``weight_kernels.py``) match bit for
bit; they are kept apart from the kernels because they are the spec and need no Triton.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..buckets import join_shards, split_rows
from .triton_common import SUPPORTED_DTYPES

__all__ = [
    "TINY_ABSMAX",
    "packed_weight_bytes",
    "quantize_weight_reference",
    "dequantize_weight_reference",
    "quantize_bucket_reference",
    "dequantize_bucket_reference",
    "check_quantize_args",
    "check_dequantize_args",
    "check_bucket_layout",
]

TINY_ABSMAX = 2.0**-119  # below this a block is a zero block (see module docstring)


def packed_weight_bytes(n: int, block_size: int) -> int:
    """Bytes of the packed form of n elements: nb*B int8 codes plus nb float32 scales."""
    nb = (n + block_size - 1) // block_size
    return nb * block_size + 4 * nb


def _check_block_size(block_size: int) -> None:
    if block_size < 32 or block_size % 4 != 0:
        raise ValueError(f"block_size must be a multiple of 4 and >= 32, got {block_size}")


def check_quantize_args(x: torch.Tensor, block_size: int) -> None:
    _check_block_size(block_size)
    if x.dim() != 1 or x.numel() < 1:
        raise ValueError(f"quantize_weight takes a non-empty 1-D tensor, got shape {tuple(x.shape)}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"quantize_weight takes float32, bfloat16 or float16, got {x.dtype}")


def check_dequantize_args(packed: torch.Tensor, n: int, block_size: int, dtype: torch.dtype) -> int:
    """Validates the arguments and returns R, the number of packed chunks."""
    _check_block_size(block_size)
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if packed.dtype != torch.uint8 or packed.dim() != 1:
        raise ValueError(f"packed must be a 1-D uint8 tensor, got {packed.dtype} {tuple(packed.shape)}")
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dequantize_weight returns float32, bfloat16 or float16, got {dtype}")
    chunk = packed_weight_bytes(n, block_size)
    if packed.numel() % chunk != 0:
        raise ValueError(
            f"packed has {packed.numel()} bytes, not a multiple of packed_weight_bytes({n}, {block_size}) = {chunk}"
        )
    return packed.numel() // chunk


# ---------------------------------------------------------------------------------------------
# torch reference twins (the CPU implementation of the ops, and the oracle for the kernels)
# ---------------------------------------------------------------------------------------------


def quantize_weight_reference(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """Pure-torch quantize: 1-D float tensor -> packed uint8 (codes, then float32 scales)."""
    check_quantize_args(x, block_size)
    n, B = x.numel(), block_size
    nb = (n + B - 1) // B
    xf = F.pad(x.float(), (0, nb * B - n)).view(nb, B)

    amax = xf.abs().amax(dim=1)  # NaN where a block holds one (amax propagates NaN)
    amax = torch.where(torch.isnan(amax), float("inf"), amax)  # +inf iff non-finite block
    amax = torch.where(amax < TINY_ABSMAX, 0.0, amax)
    # Tensor-by-tensor divisions: torch computes `127.0 / t` as reciprocal(t) * 127 (and may do
    # `t / 127.0` as a multiply), which is not the correctly rounded quotient the kernel computes.
    c127 = torch.full_like(amax, 127.0)
    scale = amax / c127  # 0 -> 0, inf -> inf
    # 127/absmax for normal blocks; 0 for zero and non-finite blocks (finite x then map to 0).
    normal = (amax > 0) & (amax < float("inf"))
    inv = torch.where(normal, c127 / torch.where(normal, amax, 1.0), 0.0)
    q = torch.round(torch.clamp(xf * inv[:, None], -127.0, 127.0))  # round = half to even
    nonfinite = torch.isinf(scale)
    if bool(nonfinite.any()):  # finite data skips these passes
        nonfinite_code = torch.where(torch.isnan(xf), -128.0, torch.where(xf > 0, 127.0, -127.0))
        special = torch.where(torch.isfinite(xf), 0.0, nonfinite_code)
        q = torch.where(nonfinite[:, None], special, q)

    packed = torch.empty(packed_weight_bytes(n, B), dtype=torch.uint8, device=x.device)
    packed[: nb * B] = q.to(torch.int8).view(-1).view(torch.uint8)
    packed[nb * B :] = scale.view(torch.uint8)
    return packed


def dequantize_weight_reference(
    packed: torch.Tensor, n: int, block_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """Pure-torch dequantize of R concatenated packed chunks of n elements -> R*n values."""
    R = check_dequantize_args(packed, n, block_size, dtype)
    B = block_size
    nb = (n + B - 1) // B
    chunks = packed.contiguous().view(R, packed_weight_bytes(n, B))
    codes = chunks[:, : nb * B].contiguous().view(torch.int8).view(R, nb, B).float()
    scales = chunks[:, nb * B :].contiguous().view(torch.float32).view(R, nb, 1)

    val = codes * scales
    marked = torch.isinf(scales)  # non-finite blocks
    if bool(marked.any()):
        special = torch.where(
            codes == -128,
            float("nan"),
            torch.where(codes == 127, float("inf"), torch.where(codes == -127, float("-inf"), 0.0)),
        )
        val = torch.where(marked, special, val)
    return val.view(R, nb * B)[:, :n].to(dtype).reshape(-1)


def quantize_bucket_reference(shards: list[torch.Tensor], segments: list[int], block_size: int) -> torch.Tensor:
    """Pure-torch quantize of a bucket's shards joined side by side (`runtime/buckets.py`)."""
    check_bucket_layout(segments, [s.numel() for s in shards], block_size, exact=False)
    return quantize_weight_reference(join_shards(shards, segments), block_size)


def dequantize_bucket_reference(
    packed: torch.Tensor, segments: list[int], sizes: list[int], block_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """Pure-torch dequantize of a gathered bucket straight into its members' layout: the R*n
    values of `dequantize_weight_reference` (n = sum(segments)) as `zpp::split_bucket` splits
    them (`runtime/buckets.py`)."""
    check_bucket_layout(segments, sizes, block_size, exact=True)
    n = sum(segments)
    return split_rows(dequantize_weight_reference(packed, n, block_size, dtype).view(-1, n), segments, sizes)


def check_bucket_layout(segments: list[int], sizes: list[int], block_size: int, exact: bool) -> None:
    """Each member's `size` values must fit its segment of whole blocks. `exact`: the segment is
    the size padded to whole blocks (a split bucket's members); otherwise it may be longer (a
    rank's shard can be shorter than its member's size)."""
    if len(segments) != len(sizes) or not segments:
        raise ValueError(f"segments and sizes must be non-empty and of one length, got {segments} and {sizes}")
    for segment, size in zip(segments, sizes):
        padded = -(-size // block_size) * block_size
        if size < 1 or segment % block_size or (segment != padded if exact else segment < padded):
            need = "its size padded to" if exact else "at least its size in"
            raise ValueError(f"each segment must be {need} whole blocks of {block_size}, got segment {segment} "
                             f"for size {size}")

"""qwZ: block-wise symmetric INT8 quantization of a flat weight shard, packed with its scales.

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
costs ~10 instructions on the GPU and these kernels are memory-bound with little slack for bf16);
the product is correctly rounded everywhere, so kernel and twin agree. The clamp sits between the
multiply and the add of the rounding trick below, so the GPU compiler cannot fuse them into an FMA
(which would round once instead of twice and break bit-equality). Normal blocks never emit -128.

Why the 2**-119 cut-off: blocks holding only zeros and values below ~1.5e-36 would need a
subnormal scale (or overflow 127 / absmax); GPUs may flush subnormals to zero where the CPU does
not. Treating them as zero blocks (absolute error < 1.5e-36) keeps both paths identical.
NaN payloads (bit patterns) are not specified: torch's own float32->bfloat16 cast picks its own.

Speed: the kernels use 16-byte accesses only where Triton can prove the alignment, i.e. when n
and packed_weight_bytes(n, B) are multiples of 16 (pad shards to a multiple of 4*B elements);
other sizes are correct but use scalar accesses. Block sizes for the kernels are powers of 2
(others fall back to the torch twin); R, the chunk count, is a grid dimension (<= 65535).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:  # Triton is optional: without it only the torch twins are registered.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - depends on the machine
    triton = None
    tl = None
    HAS_TRITON = False

__all__ = [
    "HAS_TRITON",
    "packed_weight_bytes",
    "quantize_weight",
    "dequantize_weight",
    "quantize_weight_reference",
    "dequantize_weight_reference",
    "quantize_weight_triton",
    "dequantize_weight_triton",
]

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TINY_ABSMAX = 2.0**-119  # below this a block is a zero block (see module docstring)
ROUND_MAGIC = 12582912.0  # 1.5 * 2**23: t + MAGIC rounds t to an integer, half to even
DEFAULT_ELEMS_PER_PROGRAM = 8192  # elements of one [rows, B] tile per Triton program


def packed_weight_bytes(n: int, block_size: int) -> int:
    """Bytes of the packed form of n elements: nb*B int8 codes plus nb float32 scales."""
    nb = (n + block_size - 1) // block_size
    return nb * block_size + 4 * nb


def _check_block_size(block_size: int) -> None:
    if block_size < 32 or block_size % 4 != 0:
        raise ValueError(f"block_size must be a multiple of 4 and >= 32, got {block_size}")


def _check_quantize_args(x: torch.Tensor, block_size: int) -> None:
    _check_block_size(block_size)
    if x.dim() != 1 or x.numel() < 1:
        raise ValueError(f"quantize_weight takes a non-empty 1-D tensor, got shape {tuple(x.shape)}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"quantize_weight takes float32, bfloat16 or float16, got {x.dtype}")


def _check_dequantize_args(packed: torch.Tensor, n: int, block_size: int, dtype: torch.dtype) -> int:
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
    _check_quantize_args(x, block_size)
    n, B = x.numel(), block_size
    nb = (n + B - 1) // B
    xf = F.pad(x.float(), (0, nb * B - n)).view(nb, B)

    a = xf.abs()
    amax = torch.where(torch.isnan(a), float("inf"), a).amax(dim=1)  # +inf iff non-finite block
    amax = torch.where(amax < TINY_ABSMAX, 0.0, amax)
    # Tensor-by-tensor divisions: torch computes `127.0 / t` as reciprocal(t) * 127 (and may do
    # `t / 127.0` as a multiply), which is not the correctly rounded quotient the kernel computes.
    c127 = torch.full_like(amax, 127.0)
    scale = amax / c127  # 0 -> 0, inf -> inf
    # 127/absmax for normal blocks; 0 for zero and non-finite blocks (finite x then map to 0).
    normal = (amax > 0) & (amax < float("inf"))
    inv = torch.where(normal, c127 / torch.where(normal, amax, 1.0), 0.0)
    q = torch.round(torch.clamp(xf * inv[:, None], -127.0, 127.0))  # round = half to even

    nonfinite_code = torch.where(torch.isnan(xf), -128.0, torch.where(xf > 0, 127.0, -127.0))
    special = torch.where(torch.isfinite(xf), 0.0, nonfinite_code)
    q = torch.where(torch.isinf(scale)[:, None], special, q)

    packed = torch.empty(packed_weight_bytes(n, B), dtype=torch.uint8, device=x.device)
    packed[: nb * B] = q.to(torch.int8).view(-1).view(torch.uint8)
    packed[nb * B :] = scale.view(torch.uint8)
    return packed


def dequantize_weight_reference(
    packed: torch.Tensor, n: int, block_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """Pure-torch dequantize of R concatenated packed chunks of n elements -> R*n values."""
    R = _check_dequantize_args(packed, n, block_size, dtype)
    B = block_size
    nb = (n + B - 1) // B
    chunks = packed.contiguous().view(R, packed_weight_bytes(n, B))
    codes = chunks[:, : nb * B].contiguous().view(torch.int8).view(R, nb, B).float()
    scales = chunks[:, nb * B :].contiguous().view(torch.float32).view(R, nb, 1)

    val = codes * scales
    special = torch.where(
        codes == -128,
        float("nan"),
        torch.where(codes == 127, float("inf"), torch.where(codes == -127, float("-inf"), 0.0)),
    )
    val = torch.where(torch.isinf(scales), special, val)
    return val.view(R, nb * B)[:, :n].to(dtype).reshape(-1)


# ---------------------------------------------------------------------------------------------
# Triton kernels: each program owns a [ROWS, BLOCK] tile (ROWS consecutive blocks), so block
# size never decides the grid: one program per small block reached only 31% of copy bandwidth.
# ---------------------------------------------------------------------------------------------

if HAS_TRITON:
    _TINY = tl.constexpr(TINY_ABSMAX)  # Triton kernels read module globals only as constexpr
    _MAGIC = tl.constexpr(ROUND_MAGIC)

    @triton.jit
    def _quantize_kernel(x_ptr, codes_ptr, scales_ptr, n, nb, BLOCK: tl.constexpr, ROWS: tl.constexpr):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # block indices of this tile
        offs = rows.to(tl.int64)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)  # padding reads 0

        a = tl.abs(x)
        amax = tl.max(tl.where(a == a, a, float("inf")), axis=1)  # NaN counts as inf
        amax = tl.where(amax < _TINY, 0.0, amax)
        scale = tl.math.div_rn(amax, 127.0)  # IEEE division: '/' would be approximate on GPU
        normal = (amax > 0.0) & (amax < float("inf"))
        inv = tl.where(normal, tl.math.div_rn(127.0, tl.where(normal, amax, 1.0)), 0.0)

        # Round half to even without a float->int conversion instruction: for |t| <= 127,
        # t + 1.5*2**23 lands in [2**23, 2**24) where the float spacing is 1, so the add rounds
        # t to an integer and the low byte of the float's bits is that integer as int8.
        t = tl.minimum(tl.maximum(x * inv[:, None], -127.0), 127.0)
        code = (t + _MAGIC).to(tl.int32, bitcast=True).to(tl.int8)

        if tl.max(amax, axis=0) == float("inf"):  # rare: some block of this tile holds inf/NaN
            special = tl.where(
                x != x, -128, tl.where(x == float("inf"), 127, tl.where(x == float("-inf"), -127, 0))
            ).to(tl.int8)
            code = tl.where((amax == float("inf"))[:, None], special, code)

        live = rows < nb
        tl.store(codes_ptr + offs, code, mask=live[:, None])  # padding codes are 0 (x read as 0)
        tl.store(scales_ptr + rows, scale, mask=live)

    @triton.jit
    def _dequantize_kernel(
        codes_ptr,  # the packed bytes as int8
        words_ptr,  # the same bytes as float32 (scales live there)
        out_ptr,
        n,
        nb,
        chunk_bytes,  # packed_weight_bytes(n, B)
        chunk_words,  # chunk_bytes // 4
        scale_word0,  # nb * B // 4: first scale of a chunk, in words
        BLOCK: tl.constexpr,
        ROWS: tl.constexpr,
        SOFT_BF16: tl.constexpr,
    ):
        chunk = tl.program_id(1).to(tl.int64)  # a 2-D grid: no tile straddles two chunks
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        live = rows < nb
        offs = rows.to(tl.int64)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]

        code = tl.load(codes_ptr + chunk * chunk_bytes + offs, mask=live[:, None], other=0).to(tl.float32)
        scale = tl.load(words_ptr + chunk * chunk_words + scale_word0 + rows, mask=live, other=0.0)
        val = code * scale[:, None]

        if tl.max(scale, axis=0) == float("inf"):  # rare: a non-finite block in this tile
            special = tl.where(
                code == -128.0,
                float("nan"),
                tl.where(code == 127.0, float("inf"), tl.where(code == -127.0, float("-inf"), 0.0)),
            )
            val = tl.where((scale == float("inf"))[:, None], special, val)

        out_ty = out_ptr.dtype.element_ty
        if SOFT_BF16:
            # The interpreter's float32->bfloat16 cast truncates; round to nearest even on the
            # bits instead (NaN stays NaN: its top 16 bits keep a set mantissa bit). On the GPU
            # the native cast (cvt.rn.bf16) does the same rounding.
            bits = val.to(tl.uint32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            res = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            res = val.to(out_ty)
        tl.store(out_ptr + chunk * n + offs, res, mask=live[:, None] & (offs < n))


def _tile(block_size: int, nb: int, elems_per_program: int | None, num_warps: int | None) -> tuple[int, int]:
    """(blocks per program, warps): a power-of-2 tile of about elems_per_program elements."""
    elems = elems_per_program or DEFAULT_ELEMS_PER_PROGRAM
    rows = max(1, elems // block_size)
    rows = 1 << (rows.bit_length() - 1)  # tl.arange needs a power of 2
    rows = min(rows, triton.next_power_of_2(nb))  # small inputs: don't compute masked rows
    warps = num_warps or (4 if rows * block_size <= 4096 else 8)
    return rows, warps


def _check_triton_block(block_size: int) -> None:
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed")
    if block_size & (block_size - 1):
        raise ValueError(f"the Triton kernels need a power-of-2 block_size, got {block_size}")


def quantize_weight_triton(
    x: torch.Tensor,
    block_size: int,
    *,
    elems_per_program: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Triton quantize (CUDA, or CPU tensors under TRITON_INTERPRET=1); same bytes as the twin."""
    _check_quantize_args(x, block_size)
    _check_triton_block(block_size)
    x = x.contiguous()
    n, B = x.numel(), block_size
    nb = (n + B - 1) // B
    packed = torch.empty(packed_weight_bytes(n, B), dtype=torch.uint8, device=x.device)
    codes = packed[: nb * B].view(torch.int8)
    scales = packed[nb * B :].view(torch.float32)
    rows, warps = _tile(B, nb, elems_per_program, num_warps)
    _quantize_kernel[(triton.cdiv(nb, rows),)](x, codes, scales, n, nb, BLOCK=B, ROWS=rows, num_warps=warps)
    return packed


def dequantize_weight_triton(
    packed: torch.Tensor,
    n: int,
    block_size: int,
    dtype: torch.dtype,
    *,
    elems_per_program: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Triton dequantize of R concatenated packed chunks; same values as the twin."""
    R = _check_dequantize_args(packed, n, block_size, dtype)
    _check_triton_block(block_size)
    B = block_size
    nb = (n + B - 1) // B
    out = torch.empty(R * n, dtype=dtype, device=packed.device)
    if R == 0:
        return out
    # The scales are read as float32 words, so the bytes must start 4-byte aligned.
    if not packed.is_contiguous() or packed.data_ptr() % 4 != 0:
        packed = packed.clone()
    chunk = packed_weight_bytes(n, B)
    rows, warps = _tile(B, nb, elems_per_program, num_warps)
    _dequantize_kernel[(triton.cdiv(nb, rows), R)](
        packed.view(torch.int8),
        packed.view(torch.float32),
        out,
        n,
        nb,
        chunk,
        chunk // 4,
        nb * B // 4,
        BLOCK=B,
        ROWS=rows,
        SOFT_BF16=(dtype == torch.bfloat16 and not packed.is_cuda),
        num_warps=warps,
    )
    return out


# ---------------------------------------------------------------------------------------------
# torch.library ops: twins as the default (CPU) kernels, Triton on CUDA.
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("zpp::quantize_weight", mutates_args=())
def quantize_weight(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """Quantizes a 1-D weight shard to packed INT8 blocks plus float32 scales (uint8 bytes)."""
    return quantize_weight_reference(x, block_size)


@quantize_weight.register_fake
def _(x, block_size):
    return x.new_empty(packed_weight_bytes(x.numel(), block_size), dtype=torch.uint8)


@torch.library.custom_op("zpp::dequantize_weight", mutates_args=())
def dequantize_weight(packed: torch.Tensor, n: int, block_size: int, dtype: torch.dtype) -> torch.Tensor:
    """Dequantizes R concatenated packed shards of n elements each to R*n values of `dtype`."""
    return dequantize_weight_reference(packed, n, block_size, dtype)


@dequantize_weight.register_fake
def _(packed, n, block_size, dtype):
    return packed.new_empty(packed.numel() // packed_weight_bytes(n, block_size) * n, dtype=dtype)


if HAS_TRITON:

    @quantize_weight.register_kernel("cuda")
    def _(x, block_size):
        if block_size & (block_size - 1):  # the kernels tile by powers of 2
            return quantize_weight_reference(x, block_size)
        return quantize_weight_triton(x, block_size)

    @dequantize_weight.register_kernel("cuda")
    def _(packed, n, block_size, dtype):
        if block_size & (block_size - 1):
            return dequantize_weight_reference(packed, n, block_size, dtype)
        return dequantize_weight_triton(packed, n, block_size, dtype)

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
takes several instructions on the GPU; these kernels are memory-bound with little slack for bf16);
the product is correctly rounded everywhere, so kernel and twin agree. The clamp never acts
(|x| <= absmax gives |x * inv| <= 127 (1 + 2**-24)**2 < 127.5), so the kernels leave it out; they
are compiled without FMA contraction (``enable_fp_fusion=False``), so that x * inv is rounded
before the add of the rounding trick, as in the twin. Normal blocks never emit -128.

Why the 2**-119 cut-off: blocks holding only zeros and values below ~1.5e-36 would need a
subnormal scale (or overflow 127 / absmax); GPUs may flush subnormals to zero where the CPU does
not. Treating them as zero blocks (absolute error < 1.5e-36) keeps both paths identical.
NaN payloads (bit patterns) are not specified: torch's own float32->bfloat16 cast picks its own.

Speed: the kernels use 16-byte accesses only where Triton can prove the alignment, i.e. when n
and packed_weight_bytes(n, B) are multiples of 16 (pad shards to a multiple of 4*B elements);
other sizes are correct but use scalar accesses. When n is a multiple of the program tile they
also run without masks. Block sizes for the kernels are powers of 2 (others fall back to the
torch twin); R, the chunk count, is a grid dimension (<= 65535). Each thread holds about 64
elements of its blocks in quantize, 32 in dequantize (ELEMS_PER_THREAD; see the tile comment
above the kernels), so that the per-block work is amortized over many elements (instruction
counts per element in docs/performance.md, "Kernel design: what was measured"). Non-finite blocks are
a rare branch that rewrites its tile from a second read, so it costs the common path no
registers.

The guarded Triton import, the NaN-propagating max, the rounding constant and the launch helpers
come from ``triton_common.py``, shared with qgZ (``grad_quant*.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .buckets import join_shards, member_starts, split_rows
from .triton_common import (
    HAS_TRITON,
    SUPPORTED_DTYPES,
    aligned_u8,
    interpreting,
    launch_context,
    require_triton,
    tl,
    triton,
)

if HAS_TRITON:
    from .triton_common import INF, MAGIC, nanmax

__all__ = [
    "HAS_TRITON",
    "packed_weight_bytes",
    "quantize_weight",
    "dequantize_weight",
    "quantize_weight_reference",
    "dequantize_weight_reference",
    "quantize_weight_triton",
    "dequantize_weight_triton",
    "quantize_bucket",
    "quantize_bucket_reference",
    "quantize_bucket_triton",
    "dequantize_bucket",
    "dequantize_bucket_reference",
    "dequantize_bucket_triton",
]

TINY_ABSMAX = 2.0**-119  # below this a block is a zero block (see module docstring)


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
    R = _check_dequantize_args(packed, n, block_size, dtype)
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
    _check_bucket_layout(segments, [s.numel() for s in shards], block_size, exact=False)
    return quantize_weight_reference(join_shards(shards, segments), block_size)


def dequantize_bucket_reference(
    packed: torch.Tensor, segments: list[int], sizes: list[int], block_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """Pure-torch dequantize of a gathered bucket straight into its members' layout: the R*n
    values of `dequantize_weight_reference` (n = sum(segments)) as `zpp::split_bucket` splits
    them (`runtime/buckets.py`)."""
    _check_bucket_layout(segments, sizes, block_size, exact=True)
    n = sum(segments)
    return split_rows(dequantize_weight_reference(packed, n, block_size, dtype).view(-1, n), segments, sizes)


def _check_bucket_layout(segments: list[int], sizes: list[int], block_size: int, exact: bool) -> None:
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


# ---------------------------------------------------------------------------------------------
# Triton kernels. A program owns ROWS consecutive blocks. Tile shapes are chosen so that each
# thread holds long runs of its blocks in registers (ELEMS_PER_THREAD, 32-64 elements):
# the per-block work (absmax reduction across threads, two divisions, the scale store) is then
# amortized over many elements, and the hot path has no clamp, no cross-thread reduction per
# element group and no per-element NaN select.
#
# Quantize tile [ROWS, REP, C]: element (r, j, c) is block r, element j*C + c. Triton's blocked
# layout then puts 16 consecutive elements (one 16-byte vector of int8 codes) per thread along
# c, threads along c and r, and the REP axis inside each thread, so a block's absmax is REP*16
# elements in-thread plus log2(C/16) shuffles.
# ---------------------------------------------------------------------------------------------

if HAS_TRITON:
    _TINY = tl.constexpr(TINY_ABSMAX)  # Triton kernels read module globals only as constexpr

    @triton.jit
    def _special_code(x):
        """Codes of a non-finite block: NaN -> -128, +inf -> 127, -inf -> -127, finite -> 0."""
        return tl.where(x != x, -128, tl.where(x == INF, 127, tl.where(x == -INF, -127, 0)))

    @triton.jit
    def _member(m, M: tl.constexpr, v0, v1, v2, v3, v4, v5, v6, v7):
        """Member m's value among v0..v7, for launches of M members (those past M are never read)."""
        v = v0
        if M > 1:
            v = tl.where(m == 1, v1, v)
        if M > 2:
            v = tl.where(m == 2, v2, v)
        if M > 3:
            v = tl.where(m == 3, v3, v)
        if M > 4:
            v = tl.where(m == 4, v4, v)
        if M > 5:
            v = tl.where(m == 5, v5, v)
        if M > 6:
            v = tl.where(m == 6, v6, v)
        if M > 7:
            v = tl.where(m == 7, v7, v)
        return v

    @triton.jit
    def _first_block(m, M: tl.constexpr, nb0, nb1, nb2, nb3, nb4, nb5, nb6):
        """Member m's first block: the blocks of the members before it (nb0..nb6)."""
        first = (m * 0).to(tl.int64)
        if M > 1:
            first += tl.where(m > 0, nb0, 0)
        if M > 2:
            first += tl.where(m > 1, nb1, 0)
        if M > 3:
            first += tl.where(m > 2, nb2, 0)
        if M > 4:
            first += tl.where(m > 3, nb3, 0)
        if M > 5:
            first += tl.where(m > 4, nb4, 0)
        if M > 6:
            first += tl.where(m > 5, nb5, 0)
        if M > 7:
            first += tl.where(m > 6, nb6, 0)
        return first

    @triton.jit
    def _quantize_kernel(x0, x1, x2, x3, x4, x5, x6, x7, codes_ptr, scales_ptr, n0, n1, n2, n3, n4, n5, n6, n7,
                         nb0, nb1, nb2, nb3, nb4, nb5, nb6, nb7, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                         C: tl.constexpr, M: tl.constexpr, EVEN: tl.constexpr, INTERP: tl.constexpr):
        """Grid (tiles, M): program (i, m) quantizes blocks [i * ROWS, (i + 1) * ROWS) of member m,
        whose n_m elements are read from x_m and whose nb_m blocks (the last ones past n_m are
        padding, read as 0) follow the blocks of the members before it in the packed output."""
        pid, m = tl.program_id(0), tl.program_id(1)
        nb = _member(m, M, nb0, nb1, nb2, nb3, nb4, nb5, nb6, nb7)
        if pid * ROWS < nb:  # members have different sizes; the grid covers the largest
            first = _first_block(m, M, nb0, nb1, nb2, nb3, nb4, nb5, nb6)
            _quantize_tile(_member(m, M, x0, x1, x2, x3, x4, x5, x6, x7), codes_ptr + first * BLOCK,
                           scales_ptr + first, _member(m, M, n0, n1, n2, n3, n4, n5, n6, n7), nb, pid,
                           BLOCK, ROWS, C, EVEN, INTERP)

    @triton.jit
    def _quantize_tile(x_ptr, codes_ptr, scales_ptr, n, nb, pid, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                       C: tl.constexpr, EVEN: tl.constexpr, INTERP: tl.constexpr):
        """Quantizes tile `pid` (blocks [pid * ROWS, (pid + 1) * ROWS)) of n elements in nb blocks."""
        REP: tl.constexpr = BLOCK // C
        # int32 offsets inside the tile, one int64 base per program
        offs = ((tl.arange(0, ROWS) * BLOCK)[:, None, None] + (tl.arange(0, REP) * C)[None, :, None]
                + tl.arange(0, C)[None, None, :])
        start = pid.to(tl.int64) * (ROWS * BLOCK)
        rows = pid * ROWS + tl.arange(0, ROWS)  # block indices of this tile
        live = rows < nb
        if EVEN:  # n is a multiple of the tile: no masks
            x = tl.load(x_ptr + start + offs).to(tl.float32)
        else:     # padding (and rows past the end) read 0
            lim = tl.minimum(n - start, ROWS * BLOCK).to(tl.int32)
            x = tl.load(x_ptr + start + offs, mask=offs < lim, other=0.0).to(tl.float32)

        # absmax, NaN propagated (FMNMX.NAN with |.| operands: one instruction per element)
        if INTERP:  # the interpreter runs tl.reduce per element in Python; its tl.max skips NaN
            a = tl.abs(x)
            amax = tl.max(tl.max(tl.where(a != a, INF, a), 2), 1)
        else:
            amax = tl.reduce(tl.reduce(tl.abs(x), 2, nanmax), 1, nanmax)
        amax = tl.where(amax < _TINY, 0.0, amax)  # NaN compares false: stays NaN
        bad = ~(amax < INF)                        # inf or NaN: a non-finite block
        scale = tl.where(bad, INF, tl.math.div_rn(amax, 127.0))  # IEEE division ('/' is approximate)
        normal = (amax > 0.0) & ~bad
        inv = tl.where(normal, tl.math.div_rn(127.0, tl.where(normal, amax, 1.0)), 0.0)

        # Round half to even without a float->int conversion instruction: for |t| <= 127,
        # t + 1.5*2**23 lands in [2**23, 2**24) where the float spacing is 1, so the add rounds
        # t to an integer and the low byte of the float's bits is that integer as int8. No clamp:
        # |x| <= absmax gives |x * inv| <= 127 (1 + 2**-24)**2 < 127.5. The kernel is compiled
        # without FMA contraction, so x * inv is rounded before the add, as in the twin.
        code = (x * inv[:, None, None] + MAGIC).to(tl.int32, bitcast=True).to(tl.int8)
        if EVEN:
            tl.store(codes_ptr + start + offs, code)
            tl.store(scales_ptr + rows, scale)
        else:  # padding codes are 0 (x read as 0)
            tl.store(codes_ptr + start + offs, code, mask=live[:, None, None])
            tl.store(scales_ptr + rows, scale, mask=live)

        if tl.max(bad.to(tl.int32), axis=0) > 0:  # RARE: a block of this tile holds inf/NaN
            # Again, from the input read a second time (nothing of the common path stays live):
            # non-finite blocks have inv = 0, so only their non-finite values need special codes.
            if EVEN:
                x = tl.load(x_ptr + start + offs).to(tl.float32)
            else:  # the same mask, from a bound the compiler does not merge with the first one
                lim16 = tl.minimum(n - start, ROWS * BLOCK + 16).to(tl.int32)
                x = tl.load(x_ptr + start + offs, mask=offs < lim16, other=0.0).to(tl.float32)
            code = (x * inv[:, None, None] + MAGIC).to(tl.int32, bitcast=True)
            code = tl.where(tl.abs(x) < INF, code, _special_code(x)).to(tl.int8)
            if EVEN:
                tl.store(codes_ptr + start + offs, code)
            else:
                tl.store(codes_ptr + start + offs, code, mask=live[:, None, None])

    @triton.jit
    def _dequantize_kernel(
        codes_ptr, words_ptr, out_ptr, chunk_bytes, chunk_words, scale_word0,
        n0, n1, n2, n3, n4, n5, n6, n7, nb0, nb1, nb2, nb3, nb4, nb5, nb6, nb7,
        out0, out1, out2, out3, out4, out5, out6, out7,
        BLOCK: tl.constexpr, ROWS: tl.constexpr, G: tl.constexpr, V: tl.constexpr, M: tl.constexpr,
        EVEN: tl.constexpr, SOFT_BF16: tl.constexpr,
    ):
        """Grid (tiles, R, M): program (i, c, m) dequantizes blocks [i * ROWS, (i + 1) * ROWS) of
        member m in chunk c.

            codes_ptr, words_ptr      the R packed chunks as int8 codes / as float32 words (scales)
            out_ptr                   the output
            chunk_bytes, chunk_words  a packed chunk's size, in bytes / in 4-byte words
            scale_word0               a chunk's first scale, in words (its blocks * B // 4)
            n_m, nb_m, out_m          member m: elements per chunk, its blocks per chunk (after the
                                      blocks of the members before it), where its R * n_m values start
            BLOCK, ROWS               elements per block; blocks per program
            G, V                      threads along a run of G * V elements of a block; elements
                                      per thread vector (16 bytes of output)
            M                         members (one: a plain dequantization, out_0 = 0)
            EVEN, SOFT_BF16           every n_m is a multiple of the tile (no masks); bf16 output
                                      rounded on the bits (the interpreter's cast truncates)
        """
        pid, chunk, m = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2)
        nb = _member(m, M, nb0, nb1, nb2, nb3, nb4, nb5, nb6, nb7)
        if pid * ROWS < nb:  # members have different sizes; the grid covers the largest
            first = _first_block(m, M, nb0, nb1, nb2, nb3, nb4, nb5, nb6)
            _dequantize_tile(codes_ptr + first * BLOCK, words_ptr + first,
                             out_ptr + _member(m, M, out0, out1, out2, out3, out4, out5, out6, out7),
                             _member(m, M, n0, n1, n2, n3, n4, n5, n6, n7), nb, chunk_bytes, chunk_words,
                             scale_word0, pid, chunk, BLOCK, ROWS, G, V, EVEN, SOFT_BF16)

    @triton.jit
    def _dequantize_tile(codes_ptr, words_ptr, out_ptr, n, nb, chunk_bytes, chunk_words, scale_word0, pid, chunk,
                         BLOCK: tl.constexpr, ROWS: tl.constexpr, G: tl.constexpr, V: tl.constexpr,
                         EVEN: tl.constexpr, SOFT_BF16: tl.constexpr):
        """Dequantizes tile `pid` of chunk `chunk` (n elements in nb blocks) to out_ptr + chunk * n."""
        # Tile [G, ROWS, REP, V]: element (g, r, j, v) is element j*G*V + g*V + v of block r. The
        # codes are read with the output's vector width (4 or 8 bytes), so loads and 16-byte
        # stores share one register layout: no shuffle through shared memory.
        REP: tl.constexpr = BLOCK // (G * V)
        offs = ((tl.arange(0, G) * V)[:, None, None, None] + (tl.arange(0, ROWS) * BLOCK)[None, :, None, None]
                + (tl.arange(0, REP) * (G * V))[None, None, :, None] + tl.arange(0, V)[None, None, None, :])
        start = pid.to(tl.int64) * (ROWS * BLOCK)
        rows = pid * ROWS + tl.arange(0, ROWS)
        cptr = codes_ptr + chunk * chunk_bytes + start
        sptr = words_ptr + chunk * chunk_words + scale_word0 + rows
        optr = out_ptr + chunk * n + start
        if EVEN:
            code = tl.load(cptr + offs).to(tl.float32)
            scale = tl.load(sptr)
        else:
            live = rows < nb
            code = tl.load(cptr + offs, mask=live[None, :, None, None], other=0).to(tl.float32)
            scale = tl.load(sptr, mask=live, other=0.0)
        s4 = scale[None, :, None, None]
        _store_values(optr, offs, code * s4, n - start, ROWS * BLOCK, EVEN, SOFT_BF16)

        if tl.max(scale, axis=0) == INF:  # RARE: a non-finite block in this tile
            # Rewrite those blocks (the codes are read again: no register cost to the common path).
            inf_rows = (s4 == INF) & (offs >= 0)
            code = tl.load(cptr + offs, mask=inf_rows, other=0).to(tl.float32)
            special = tl.where(
                code == -128.0, float("nan"), tl.where(code == 127.0, INF, tl.where(code == -127.0, -INF, 0.0))
            )
            _store_values(optr, offs, special, n - start, ROWS * BLOCK, False, SOFT_BF16, inf_rows)

    @triton.jit
    def _store_values(optr, offs, val, left, TILE: tl.constexpr, EVEN: tl.constexpr, SOFT_BF16: tl.constexpr,
                      where=None):
        """Stores float32 values in the output dtype at optr + offs (offs < left, and where)."""
        if SOFT_BF16:
            # The interpreter's float32->bfloat16 cast truncates; round to nearest even on the
            # bits instead (NaN stays NaN: its top 16 bits keep a set mantissa bit). On the GPU
            # the native cast (cvt.rn.bf16) does the same rounding.
            bits = val.to(tl.uint32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            res = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            res = val.to(optr.dtype.element_ty)
        if EVEN:
            tl.store(optr + offs, res)
        else:
            mask = offs < tl.minimum(left, TILE).to(tl.int32)
            if where is not None:
                mask = mask & where
            tl.store(optr + offs, res, mask=mask)


# Default register tile per thread (elements), see _tile. Dequantize holds less: its fp32 output
# ran faster so (docs/performance.md, "Kernel design: what was measured").
ELEMS_PER_THREAD = {"quantize": 64, "dequantize": 32}


def _tile(kernel: str, block_size: int, nb: int, elems_per_program: int | None,
          num_warps: int | None) -> tuple[int, int, int]:
    """(ROWS blocks per program, warps, elements per thread): a power-of-2 tile of about
    elems_per_program elements (default: ELEMS_PER_THREAD[kernel] per thread with 4 warps)."""
    B = block_size
    warps = num_warps or 4
    elems = elems_per_program or warps * 32 * ELEMS_PER_THREAD[kernel]
    rows = max(1, elems // B)
    rows = 1 << (rows.bit_length() - 1)  # tl.arange needs a power of 2
    rows = min(rows, triton.next_power_of_2(nb))  # small inputs: don't compute masked rows
    ept = max(1, rows * B // (32 * warps))
    return rows, warps, ept


def _require_triton(block_size: int) -> None:
    require_triton("qwZ", block_size, triton_handles_block(block_size), "a power of 2")


def triton_handles_block(block_size: int) -> bool:
    """The kernels tile by powers of 2; the ops send other block sizes to the twins."""
    return block_size & (block_size - 1) == 0


# Members per launch (the kernels' argument slots); a bucket of more members takes several launches.
MAX_MEMBERS = 8


def _slots(values: list, filler: object) -> list:
    """`values` in the kernels' MAX_MEMBERS argument slots (the unused ones are never read)."""
    return list(values) + [filler] * (MAX_MEMBERS - len(values))


def _launch_quantize(shards: list[torch.Tensor], codes: torch.Tensor, scales: torch.Tensor, blocks: list[int],
                     B: int, elems_per_program: int | None, num_warps: int | None) -> None:
    """Quantizes each shard into its `blocks` blocks, the shards' blocks one after another in
    codes and scales; at most MAX_MEMBERS shards per launch."""
    first = 0
    for group in range(0, len(shards), MAX_MEMBERS):
        xs, nbs = shards[group:group + MAX_MEMBERS], blocks[group:group + MAX_MEMBERS]
        rows, warps, ept = _tile("quantize", B, max(nbs), elems_per_program, num_warps)
        # C: 16 codes (one 16-byte vector) per thread, B // ept threads per block
        C = min(B, 16 * max(1, B // max(ept, 16)))
        even = all(x.numel() == nb * B and nb % rows == 0 for x, nb in zip(xs, nbs))
        _quantize_kernel[(triton.cdiv(max(nbs), rows), len(xs))](
            *_slots(xs, xs[0]), codes[first * B:], scales[first:], *_slots([x.numel() for x in xs], 0),
            *_slots(nbs, 0), BLOCK=B, ROWS=rows, C=C, M=len(xs), EVEN=even, INTERP=interpreting(),
            num_warps=warps, enable_fp_fusion=False,
        )
        first += sum(nbs)


def _launch_dequantize(packed: torch.Tensor, n: int, out: torch.Tensor, sizes: list[int], starts: list[int],
                       B: int, elems_per_program: int | None, num_warps: int | None) -> None:
    """Dequantizes each member (sizes[m] values per chunk of `packed`, whose chunks hold n values)
    to out[starts[m]:], chunk after chunk; at most MAX_MEMBERS members per launch."""
    packed = aligned_u8(packed)  # the scales are read as float32 words
    chunk = packed_weight_bytes(n, B)
    R = packed.numel() // chunk
    codes, words = packed.view(torch.int8), packed.view(torch.float32)
    V = 16 // out.element_size()
    G = min(16, B // V)
    first = 0
    for group in range(0, len(sizes), MAX_MEMBERS):
        ns, outs = sizes[group:group + MAX_MEMBERS], starts[group:group + MAX_MEMBERS]
        nbs = [(size + B - 1) // B for size in ns]
        rows, warps, _ = _tile("dequantize", B, max(nbs), elems_per_program, num_warps)
        _dequantize_kernel[(triton.cdiv(max(nbs), rows), R, len(ns))](
            codes[first * B:], words[first:], out, chunk, chunk // 4, (n + B - 1) // B * B // 4,
            *_slots(ns, 0), *_slots(nbs, 0), *_slots(outs, 0), BLOCK=B, ROWS=rows, G=G, V=V, M=len(ns),
            EVEN=all(size % (rows * B) == 0 for size in ns),
            SOFT_BF16=(out.dtype == torch.bfloat16 and not packed.is_cuda), num_warps=warps,
        )
        first += sum(nbs)


def quantize_weight_triton(
    x: torch.Tensor,
    block_size: int,
    *,
    elems_per_program: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Triton quantize (CUDA, or CPU tensors under TRITON_INTERPRET=1); same bytes as the twin."""
    _check_quantize_args(x, block_size)
    _require_triton(block_size)
    n, B = x.numel(), block_size
    nb = (n + B - 1) // B
    packed = torch.empty(packed_weight_bytes(n, B), dtype=torch.uint8, device=x.device)
    with launch_context(x):
        _launch_quantize([x.contiguous()], packed[: nb * B].view(torch.int8), packed[nb * B :].view(torch.float32),
                         [nb], B, elems_per_program, num_warps)
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
    _require_triton(block_size)
    out = torch.empty(R * n, dtype=dtype, device=packed.device)
    if R > 0:
        with launch_context(packed):
            _launch_dequantize(packed, n, out, [n], [0], block_size, elems_per_program, num_warps)
    return out


def quantize_bucket_triton(
    shards: list[torch.Tensor],
    segments: list[int],
    block_size: int,
    *,
    elems_per_program: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Triton quantize of a bucket's shards joined side by side; same bytes as the twin. The
    shards are read in place: a segment is whole blocks, so each block holds one shard's values
    (and the padding to the segment's end, read as zeros)."""
    _check_bucket_layout(segments, [s.numel() for s in shards], block_size, exact=False)
    for shard in shards:
        _check_quantize_args(shard, block_size)
    _require_triton(block_size)
    B, n = block_size, sum(segments)
    packed = torch.empty(packed_weight_bytes(n, B), dtype=torch.uint8, device=shards[0].device)
    with launch_context(shards[0]):
        _launch_quantize([s.contiguous() for s in shards], packed[:n].view(torch.int8), packed[n:].view(torch.float32),
                         [segment // B for segment in segments], B, elems_per_program, num_warps)
    return packed


def dequantize_bucket_triton(
    packed: torch.Tensor,
    segments: list[int],
    sizes: list[int],
    block_size: int,
    dtype: torch.dtype,
    *,
    elems_per_program: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Triton dequantize of a gathered bucket into its members' layout; same values as the twin.
    Each member's values are written where `zpp::split_bucket` would copy them (the gaps between
    members stay unwritten)."""
    _check_bucket_layout(segments, sizes, block_size, exact=True)
    n = sum(segments)
    R = _check_dequantize_args(packed, n, block_size, dtype)
    _require_triton(block_size)
    starts, length = member_starts(R, sizes, dtype.itemsize)
    out = torch.empty(length, dtype=dtype, device=packed.device)
    if R > 0:
        with launch_context(packed):
            _launch_dequantize(packed, n, out, list(sizes), starts, block_size, elems_per_program, num_warps)
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


@torch.library.custom_op("zpp::quantize_bucket", mutates_args=())
def quantize_bucket(shards: list[torch.Tensor], segments: list[int], block_size: int) -> torch.Tensor:
    """`zpp::quantize_weight` of `zpp::join_bucket`, in one pass: each shard is quantized into
    its place, so the joined shards are never materialized."""
    return quantize_bucket_reference(shards, segments, block_size)


@quantize_bucket.register_fake
def _(shards, segments, block_size):
    return shards[0].new_empty(packed_weight_bytes(sum(segments), block_size), dtype=torch.uint8)


@torch.library.custom_op("zpp::dequantize_bucket", mutates_args=())
def dequantize_bucket(
    packed: torch.Tensor, segments: list[int], sizes: list[int], block_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """`zpp::split_bucket` of `zpp::dequantize_weight`, in one pass: each member's weight is
    written where the split would copy it, so the rank-major values are never materialized."""
    return dequantize_bucket_reference(packed, segments, sizes, block_size, dtype)


@dequantize_bucket.register_fake
def _(packed, segments, sizes, block_size, dtype):
    chunks = packed.numel() // packed_weight_bytes(sum(segments), block_size)
    return packed.new_empty(member_starts(chunks, sizes, dtype.itemsize)[1], dtype=dtype)


if HAS_TRITON:

    @quantize_weight.register_kernel("cuda")
    def _(x, block_size):
        launch = quantize_weight_triton if triton_handles_block(block_size) else quantize_weight_reference
        return launch(x, block_size)

    @dequantize_weight.register_kernel("cuda")
    def _(packed, n, block_size, dtype):
        launch = dequantize_weight_triton if triton_handles_block(block_size) else dequantize_weight_reference
        return launch(packed, n, block_size, dtype)

    @dequantize_bucket.register_kernel("cuda")
    def _(packed, segments, sizes, block_size, dtype):
        launch = dequantize_bucket_triton if triton_handles_block(block_size) else dequantize_bucket_reference
        return launch(packed, segments, sizes, block_size, dtype)

    @quantize_bucket.register_kernel("cuda")
    def _(shards, segments, block_size):
        launch = quantize_bucket_triton if triton_handles_block(block_size) else quantize_bucket_reference
        return launch(shards, segments, block_size)

"""The qwZ Triton kernels behind ``zpp::quantize_weight``, ``zpp::dequantize_weight``,
``zpp::quantize_bucket`` and ``zpp::dequantize_bucket`` (launched by ``weight_ops.py``; the
format and arithmetic they match bit for bit, and their torch twins, in ``weight_format.py``).
One kernel of each kind serves a plain shard and a bucket: a launch covers up to 8 members.

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
come from ``triton_common.py``, shared with qgZ (``grad_*.py``).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .triton_common import INF, MAGIC, nanmax
from .weight_format import TINY_ABSMAX

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
def qwz_quantize_kernel(x0, x1, x2, x3, x4, x5, x6, x7, codes_ptr, scales_ptr, n0, n1, n2, n3, n4, n5, n6, n7,
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
def qwz_dequantize_kernel(
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

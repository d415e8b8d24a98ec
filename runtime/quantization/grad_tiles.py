"""Tile helpers of the qgZ Triton kernels (``grad_kernels.py``): the tile layout, values ->
codes (block scales, rounding, packing, stores) and codes -> values (loads, decoding, sums).

How the kernels stay bit-exact with the twins (``grad_format.py``): launched with
``enable_fp_fusion=False`` (no implicit contraction), explicit ``tl.fma`` where the formula has
one; divisions by ``tl.math.div_rn``; rint and float->int via ``bitcast(t + 1.5 * 2**23)`` (exact
round-half-even for ``|t| < 2**22``, ``tl_code``); codes -> float via ``bitcast(field ^ E) - bias``
(``tl_decode``), exact. Under the interpreter (whose fma rounds twice and whose bf16 conversion
truncates) the fma is emulated as in the twin and bf16 is decoded / encoded with bit operations.
The GPU path is checked against the twins by ``examples/bench_grad_kernels.py`` (column "exact").

Tiles. A tile is BPP consecutive blocks of one piece (a program does one, or in
qgz_reduce_requantize a sequence of them). The unit of work is the "octet" (8 consecutive
elements: one int32 word of INT4 codes, two of INT8 codes), and a tile is held as 8 "lanes" of
shape [G, BPP, REP, U]: lane k of octet (g, r, j, u) is element 8 * (j*G*U + g*U + u) + k of
block r. Memory accesses use tensors whose last axis is one thread's vector (up to 16 bytes) and
whose other axes are [G, BPP, REP, U, ...]; Triton's blocked layouts then all put G (then BPP)
across the threads and everything else inside a thread, so lanes, codes and values change shape
without moving data (no shared memory), and a block's absmax is an in-thread max over REP*U*8
elements plus log2(G) shuffles. INT4 packing and unpacking are shifts and masks of whole words
(nibble k = lane k). U = 2 (quantize, dequantize) keeps a warp's input loads within fewer lines
per instruction than U = 4; the exception is the output of qgz_dequantize_reduce (see
``_tl_dequant_tile`` in ``grad_kernels.py``).

What the helpers here and the kernels in ``grad_kernels.py`` take (one line per group of
arguments; a docstring names only what is its own)::

    x0..x7, a0..a7     the tile's 8 lanes, float32 [G, BPP, REP, U]: values, or sums of sources
    c0..c7             codes of the 8 lanes
    B, OB              elements per quantization block; its octets, B // 8
    BITS, Q            code width, 4 or 8 (IN_BITS / OUT_BITS: of the sources / of the output);
                       q = 2**(BITS - 1) - 1, the largest code
    G, BPP, REP, U     the tile's shape: threads per block, blocks per tile, octet vectors per
                       thread and block, octets per thread vector (TUNING's ``octets``)
    K                  sources summed (the ranks whose pieces arrived)
    octet, blk_octet   octet index in the tile; the same octet's index in its block (``tl_octets``)
    b0, blk, nb        the tile's first block, its block indices, blocks per piece
    omask              octets inside the piece (``tl_octet_mask``)
    w, wb, s           one source's code words (INT4: w twice; INT8: octet halves), its scales
    srcs               the K (w, wb, s) of a tile, one flat tuple (``tl_load_tile``)
    in_w32, in_f32     the received sources viewed as int32 code words / float32 scales;
                       out_w32, out_f32 the output, w32_ptr, f32_ptr, w_ptr likewise
    base, base0, stride     word offsets: a source's piece; source 0's piece; source k's is
                            base0 + k * stride
    wbase, obase       word offsets: the tile's first code word; the output piece
    inv, scale         per block: q / absmax (0 unless finite and > 0), absmax / q (+inf: the
                       marker of a non-finite block)
    zero               a run-time 0 (``nb >> 31``; see ``tl_decode``)
    MASKED, PAD        masked accesses (a partial tile); B // 8 is no power of 2 (padding octets)
    CHECK, FIRST, SLOW non-finite inputs get their codes; the first source (no add); slow path
                       (inf-marker scales read as markers, not as scales)
    EMU                the interpreter runs the kernel: fma emulated (``tl_fma``)
"""
from __future__ import annotations

import triton
import triton.language as tl

from .grad_format import FLT_MAX
from .triton_common import INF, MAGIC, nanmax

_FLT_MAX = tl.constexpr(FLT_MAX)   # Triton kernels read module globals only as constexpr


# ---- the tile layout -------------------------------------------------------------------------

@triton.jit
def tl_octets(G: tl.constexpr, BPP: tl.constexpr, REP: tl.constexpr, U: tl.constexpr,
              OB: tl.constexpr):
    """(octet index in the tile [G, BPP, REP, U], octet index in its block [G, 1, REP, U]);
    OB = octets per block (the in-block index runs to the next power of 2)."""
    o = ((tl.arange(0, G) * U)[:, None, None, None] + (tl.arange(0, REP) * (G * U))[None, None, :, None]
         + tl.arange(0, U)[None, None, None, :])
    return o + (tl.arange(0, BPP) * OB)[None, :, None, None], o


@triton.jit
def tl_split8(x, G: tl.constexpr, BPP: tl.constexpr, REP: tl.constexpr, U: tl.constexpr):
    """[G, BPP, REP, U, 8] -> lanes x[..., k], k = 0..7 (in-thread: register renaming)."""
    e, o = tl.split(tl.reshape(x, (G, BPP, REP, U, 2, 2, 2)))   # last axis: k & 1
    e0, e1 = tl.split(e)                                        # (k >> 1) & 1
    o0, o1 = tl.split(o)
    x0, x4 = tl.split(e0)                                       # k >> 2
    x2, x6 = tl.split(e1)
    x1, x5 = tl.split(o0)
    x3, x7 = tl.split(o1)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def tl_join8(x0, x1, x2, x3, x4, x5, x6, x7, G: tl.constexpr, BPP: tl.constexpr,
             REP: tl.constexpr, U: tl.constexpr):
    """Inverse of tl_split8."""
    e = tl.join(tl.join(x0, x4), tl.join(x2, x6))
    o = tl.join(tl.join(x1, x5), tl.join(x3, x7))
    return tl.reshape(tl.join(e, o), (G, BPP, REP, U, 8))


@triton.jit
def tl_pair_words(G: tl.constexpr, BPP: tl.constexpr, REP: tl.constexpr, U: tl.constexpr,
                  OB: tl.constexpr):
    """INT8 codes, two words per octet: (word index in the tile, octet index in its block),
    both [G, BPP, REP, U // 2, 4], the last axis one 16-byte vector (two octets). Built
    from aranges, so that the compiler sees the 4-word alignment (derived by a reshape of
    the octet index, it does not: the accesses fall back to 8-byte vectors)."""
    o = ((tl.arange(0, G) * U)[:, None, None, None, None]
         + (tl.arange(0, REP) * (G * U))[None, None, :, None, None]
         + (tl.arange(0, U // 2) * 2)[None, None, None, :, None])     # first octet of pair
    j = tl.arange(0, 4)[None, None, None, None, :]
    blk = (tl.arange(0, BPP) * OB)[None, :, None, None, None]
    return 2 * (o + blk) + j, o + j // 2


@triton.jit
def tl_pair_mask(pair_blk_octet, blk, nb, OB: tl.constexpr, MASKED: tl.constexpr):
    """Mask of the pair words (see tl_pair_words), word by word."""
    if MASKED:
        m = (pair_blk_octet < OB) & (blk < nb)[None, :, None, None, None]
    else:
        m = pair_blk_octet < OB
    return m


@triton.jit
def tl_octet_mask(blk_octet, blk, nb, B: tl.constexpr, MASKED: tl.constexpr):
    """Octets inside the piece (and inside their block, when B / 8 is no power of 2)."""
    if MASKED:
        m = (blk_octet < B // 8) & (blk < nb)[None, :, None, None]
    else:
        m = blk_octet < B // 8
    return m


@triton.jit
def tl_block_ids(b0, nb, G: tl.constexpr, BPP: tl.constexpr):
    """Index of each thread's block, [G, BPP, 1, 1], for the loads and stores of block
    scales. Laid out as the tile: Triton lays out a memory access by the contiguity of its
    addresses, and a [BPP] vector of consecutive blocks gets one block per lane, which the
    arithmetic then converts to the tile's layout through shared memory (two barriers per
    source and tile). Times a run-time 1, the index shows no contiguity, and in one-warp
    programs the layout Triton picks maps every element to the same thread as the tile does
    (no conversion, sm_90 SASS); with 4 warps it still differs."""
    one = (nb >> 31) + 1                                       # nb >= 0: a run-time 1
    bid = b0 + (tl.arange(0, BPP) * one)[None, :, None, None]
    return tl.broadcast_to(bid, (G, BPP, 1, 1))


# ---- values -> codes -------------------------------------------------------------------------

@triton.jit
def tl_fma(a, b, c, EMU: tl.constexpr):
    """float32 a * b + c with one rounding. GPU: FFMA. Interpreter (whose fma rounds twice):
    exact product in float64, TwoSum, round-to-odd, then round to float32 -- the same
    algorithm as the torch twin's ``_fma_f32``."""
    if EMU:
        p = a.to(tl.float64) * b.to(tl.float64)
        cd = c.to(tl.float64)
        t = p + cd
        bp = t - p
        err = (p - (t - bp)) + (cd - bp)
        bits = t.to(tl.int64, bitcast=True)
        fix = (err != 0.0) & (tl.abs(t) < INF) & ((bits & 1) == 0)
        step = tl.where((err > 0.0) == (t > 0.0), 1, -1).to(tl.int64)
        r = tl.where(fix, (bits + step).to(tl.float64, bitcast=True), t).to(tl.float32)
    else:
        r = tl.fma(a, b, c)
    return r


@triton.jit
def tl_scales(x0, x1, x2, x3, x4, x5, x6, x7, Q: tl.constexpr):
    """Per block: (scale, inv, bad). absmax with NaN propagated (FMNMX.NAN, |.| operands:
    one instruction per element); a block is non-finite (bad) unless absmax < inf."""
    m = nanmax(nanmax(nanmax(tl.abs(x0), tl.abs(x1)), nanmax(tl.abs(x2), tl.abs(x3))),
               nanmax(nanmax(tl.abs(x4), tl.abs(x5)), nanmax(tl.abs(x6), tl.abs(x7))))
    amax = tl.reduce(tl.reduce(tl.reduce(m, 3, nanmax), 2, nanmax), 0, nanmax)
    bad = ~(amax < INF)
    qv = tl.full(amax.shape, Q * 1.0, tl.float32)
    scale = tl.where(bad, INF, tl.math.div_rn(amax, qv))
    pos = (amax > 0.0) & ~bad
    inv = tl.where(pos, tl.minimum(tl.math.div_rn(qv, tl.where(pos, amax, 1.0)), _FLT_MAX), 0.0)
    return scale, inv, bad


@triton.jit
def tl_code(x, inv, BITS: tl.constexpr, CHECK: tl.constexpr, EMU: tl.constexpr):
    """int32 whose low BITS bits are the code of x in offset binary (code + 2**(BITS-1)),
    with zeros above them up to bit 21: rint of the exact product x * inv in one FFMA with
    MAGIC plus the offset (an even number: its ties go to even as the product's do), so
    that packing adds codes without masks or borrows. |x * inv| <= q (1 + 2**-24) < q + 1/2:
    no clamp.
    CHECK: non-finite x (found only in blocks with inv = 0, whose finite values get code
    0) get NaN -> -(q+1), +inf -> q, -inf -> -q."""
    Q: tl.constexpr = (1 << (BITS - 1)) - 1
    c = tl_fma(x, inv, tl.zeros_like(x) + (MAGIC + (Q + 1)), EMU).to(tl.int32, bitcast=True)
    if CHECK:
        sp = tl.where(x != x, -Q - 1, tl.where(x > 0.0, Q, -Q)) + (Q + 1)
        c = tl.where(tl.abs(x) < INF, c, sp)
    return c


@triton.jit
def tl_pack_bytes(c0, c1, c2, c3, k256):
    """Four offset-binary INT8 codes (``tl_code``) -> one word, two's complement. Bits
    8..21 of a code are zero and its magic-number bits start at bit 22: only the low half
    needs a mask; those of c2, c3 leave the word. IMAD by a run-time 256 (constant shifts
    get distributed over the sums by LLVM, which costs more instructions per word)."""
    lo = (c1 * k256 + c0) & 0xFFFF
    hi = c3 * k256 + c2
    return (hi * (k256 * k256) + lo) ^ -2139062144            # 0x80808080


@triton.jit
def tl_quant_store(x0, x1, x2, x3, x4, x5, x6, x7, inv, w_ptr, wbase, octet, omask, blk, nb,
                   zero, BITS: tl.constexpr, G: tl.constexpr, BPP: tl.constexpr,
                   REP: tl.constexpr, U: tl.constexpr, OB: tl.constexpr,
                   MASKED: tl.constexpr, CHECK: tl.constexpr, EMU: tl.constexpr):
    """Codes of the 8 lanes (inv [1, BPP, 1, 1]) packed and stored at word wbase + ...
    Offset-binary codes (``tl_code``) have zeros between their field and bit 22, so the
    fields add up without carries. INT4: 7 IMAD, one mask, one XOR (two's complement) per
    8 codes; INT8: the same with bytes (``tl_pack_bytes``), stored as 16-byte vectors."""
    c0 = tl_code(x0, inv, BITS, CHECK, EMU)
    c1 = tl_code(x1, inv, BITS, CHECK, EMU)
    c2 = tl_code(x2, inv, BITS, CHECK, EMU)
    c3 = tl_code(x3, inv, BITS, CHECK, EMU)
    c4 = tl_code(x4, inv, BITS, CHECK, EMU)
    c5 = tl_code(x5, inv, BITS, CHECK, EMU)
    c6 = tl_code(x6, inv, BITS, CHECK, EMU)
    c7 = tl_code(x7, inv, BITS, CHECK, EMU)
    if BITS == 4:
        # Horner steps by a run-time 16 (IMAD): with constant shifts LLVM distributes them
        # over the sums, more instructions per word. Codes 0..2 carry the magic number's
        # bits from bit 22 up (masked); those of codes 3..7 leave the word in the shift by 12.
        k16 = 16 + zero
        hi = (((c7 * k16 + c6) * k16 + c5) * k16 + c4) * k16 + c3
        lo = ((c2 * k16 + c1) * k16 + c0) & 0xFFF
        w = (hi * (4096 + zero) + lo) ^ -2004318072         # 0x88888888: two's complement
        if MASKED:
            tl.store(w_ptr + wbase + octet, w, mask=omask)
        else:
            tl.store(w_ptr + wbase + octet, w)
    else:
        k256 = 256 + zero
        wa = tl_pack_bytes(c0, c1, c2, c3, k256)
        wb = tl_pack_bytes(c4, c5, c6, c7, k256)
        ww = tl.reshape(tl.join(wa, wb), (G, BPP, REP, U // 2, 4))
        idx, pair_blk_octet = tl_pair_words(G, BPP, REP, U, OB)
        if MASKED:
            tl.store(w_ptr + wbase + idx, ww, mask=tl_pair_mask(pair_blk_octet, blk, nb, OB, MASKED))
        else:
            tl.store(w_ptr + wbase + idx, ww)


# ---- codes -> values: the sources of the reduction kernels, loaded and summed ----------------

@triton.jit
def tl_decode(w, zero, MASK: tl.constexpr, POS: tl.constexpr, WIDTH: tl.constexpr):
    """Field ``w & MASK`` (a two's complement code of WIDTH bits at bit POS, POS + WIDTH <=
    23) -> float32 code, exactly, in two instructions: LOP3 ``(w & MASK) ^ E``, then FADD.
    E holds the exponent of 2**(23 - POS), which makes the field's unit 1, and the field's
    sign bit, which turns the field into offset binary: the float is 2**(23 - POS) + code +
    2**(WIDTH-1). So the code comes out unscaled at every position and the FFMA takes the
    block's scale as loaded (no per-position copies of it; subnormal scales stay exact:
    FFMA does not flush them, nor does the twin's float64 emulation). ``zero`` is a
    run-time 0: ``zero + E`` stays in a register (a LOP3 takes one immediate; with two the
    compiler emits two LOP3s)."""
    E: tl.constexpr = ((150 - POS) << 23) | (1 << (POS + WIDTH - 1))
    OFF: tl.constexpr = float(2 ** (23 - POS) + 2 ** (WIDTH - 1))
    return ((w & MASK) ^ (zero + E)).to(tl.float32, bitcast=True) - OFF


@triton.jit
def tl_marker_value(c, Q: tl.constexpr):
    """What code c of a block whose scale is the inf marker stands for: -(q+1) -> NaN,
    q -> +inf, -q -> -inf, any other code -> 0."""
    v = tl.where(c == Q * 1.0, INF, tl.where(c == -Q * 1.0, -INF, 0.0))
    return tl.where(c == -Q - 1.0, INF - INF, v)        # inf - inf = NaN


@triton.jit
def tl_acc_code(acc, c, s, Q: tl.constexpr, FIRST: tl.constexpr, SLOW: tl.constexpr,
                EMU: tl.constexpr):
    """acc + c * s with one rounding (the first source: c * s). Slow path: blocks whose scale
    is the inf marker contribute ``tl_marker_value``."""
    x = c
    y = s
    if SLOW:
        marker = s == INF
        x = tl.where(marker, tl_marker_value(c, Q), c)
        y = tl.where(marker, 1.0, s)
    if FIRST:
        r = x * y
    else:
        r = tl_fma(x, y, acc, EMU)
    return r


@triton.jit
def tl_load_words(w_ptr, wbase, octet, omask, blk, nb, BITS: tl.constexpr, G: tl.constexpr,
                  BPP: tl.constexpr, REP: tl.constexpr, U: tl.constexpr, OB: tl.constexpr,
                  MASKED: tl.constexpr):
    """Code words of the tile's octets: INT4 -> (w, w), w [G, BPP, REP, U] one word per
    octet; INT8 -> (wa, wb), each [G, BPP, REP, U] (elements 0..3 and 4..7 of the octet),
    loaded as 16-byte vectors. Masked octets read as 0 words (codes 0)."""
    if BITS == 4:
        if MASKED:
            w = tl.load(w_ptr + wbase + octet, mask=omask, other=0)
        else:
            w = tl.load(w_ptr + wbase + octet)
        wb = w
    else:
        idx, pair_blk_octet = tl_pair_words(G, BPP, REP, U, OB)
        if MASKED:
            ww = tl.load(w_ptr + wbase + idx, mask=tl_pair_mask(pair_blk_octet, blk, nb, OB, MASKED),
                         other=0)
        else:
            ww = tl.load(w_ptr + wbase + idx)
        w, wb = tl.split(tl.reshape(ww, (G, BPP, REP, U, 2)))
    return w, wb


@triton.jit
def tl_load_source(w32_ptr, f32_ptr, base, cw, b0, blk, octet, omask, nb, BITS: tl.constexpr,
                   B: tl.constexpr, G: tl.constexpr, BPP: tl.constexpr, REP: tl.constexpr,
                   U: tl.constexpr, MASKED: tl.constexpr):
    """The tile's code words and block scales of the piece at word offset ``base`` (``cw``
    code words): (w, wb, scale [G, BPP, 1, 1])."""
    bid = tl_block_ids(b0, nb, G, BPP)
    if MASKED:
        s = tl.load(f32_ptr + base + cw + bid, mask=bid < nb, other=0.0)
    else:
        s = tl.load(f32_ptr + base + cw + bid)
    wt = base + b0.to(tl.int64) * (B * BITS // 32)
    w, wb = tl_load_words(w32_ptr, wt, octet, omask, blk, nb, BITS, G, BPP, REP, U, B // 8,
                          MASKED)
    return w, wb, s


@triton.jit
def tl_load_tile(in_w32, in_f32, base0, stride, b0, octet, blk_octet, nb, K: tl.constexpr,
                 BITS: tl.constexpr, B: tl.constexpr, G: tl.constexpr, BPP: tl.constexpr,
                 REP: tl.constexpr, U: tl.constexpr, MASKED: tl.constexpr):
    """All K sources of the tile of blocks [b0, b0 + BPP), the piece of source k at word
    offset ``base0 + k * stride``: a tuple (w, wb, scale) * K. The loads are independent,
    so all of them can be in flight together."""
    blk = b0 + tl.arange(0, BPP)
    omask = tl_octet_mask(blk_octet, blk, nb, B, MASKED)
    cw = tl.cast(nb, tl.int64) * (B * BITS // 32)          # code words per piece
    srcs = ()
    for k in tl.static_range(K):
        srcs = srcs + tl_load_source(in_w32, in_f32, base0 + k * stride, cw, b0, blk, octet,
                                     omask, nb, BITS, B, G, BPP, REP, U, MASKED)
    return srcs


@triton.jit
def tl_accumulate(a0, a1, a2, a3, a4, a5, a6, a7, w, wb, s, zero, BITS: tl.constexpr,
                  FIRST: tl.constexpr, SLOW: tl.constexpr, EMU: tl.constexpr):
    """Accumulate one source (its code words, scales [G, BPP, 1, 1]) into the 8 lanes. Per
    code LOP3 + FADD + FFMA; per word one shift (INT4 nibbles 5..7, INT8 bytes 2, 3 sit
    above bit 22)."""
    Q: tl.constexpr = (1 << (BITS - 1)) - 1
    if BITS == 4:
        h = w >> 12                                          # nibbles 5..7 at bits 8..19
        c0 = tl_decode(w, zero, 0xF, 0, 4)
        c1 = tl_decode(w, zero, 0xF0, 4, 4)
        c2 = tl_decode(w, zero, 0xF00, 8, 4)
        c3 = tl_decode(w, zero, 0xF000, 12, 4)
        c4 = tl_decode(w, zero, 0xF0000, 16, 4)
        c5 = tl_decode(h, zero, 0xF00, 8, 4)
        c6 = tl_decode(h, zero, 0xF000, 12, 4)
        c7 = tl_decode(h, zero, 0xF0000, 16, 4)
    else:
        # bytes 2, 3 at bits 0..15; a run-time shift count, else the compiler extracts
        # byte 2 with a PRMT and still needs the XOR (one more instruction per word)
        ha = w >> (16 + zero)
        hb = wb >> (16 + zero)
        c0 = tl_decode(w, zero, 0xFF, 0, 8)
        c1 = tl_decode(w, zero, 0xFF00, 8, 8)
        c2 = tl_decode(ha, zero, 0xFF, 0, 8)
        c3 = tl_decode(ha, zero, 0xFF00, 8, 8)
        c4 = tl_decode(wb, zero, 0xFF, 0, 8)
        c5 = tl_decode(wb, zero, 0xFF00, 8, 8)
        c6 = tl_decode(hb, zero, 0xFF, 0, 8)
        c7 = tl_decode(hb, zero, 0xFF00, 8, 8)
    a0 = tl_acc_code(a0, c0, s, Q, FIRST, SLOW, EMU)
    a1 = tl_acc_code(a1, c1, s, Q, FIRST, SLOW, EMU)
    a2 = tl_acc_code(a2, c2, s, Q, FIRST, SLOW, EMU)
    a3 = tl_acc_code(a3, c3, s, Q, FIRST, SLOW, EMU)
    a4 = tl_acc_code(a4, c4, s, Q, FIRST, SLOW, EMU)
    a5 = tl_acc_code(a5, c5, s, Q, FIRST, SLOW, EMU)
    a6 = tl_acc_code(a6, c6, s, Q, FIRST, SLOW, EMU)
    a7 = tl_acc_code(a7, c7, s, Q, FIRST, SLOW, EMU)
    return a0, a1, a2, a3, a4, a5, a6, a7


@triton.jit
def tl_sum_tile(srcs, zero, K: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr,
                BPP: tl.constexpr, REP: tl.constexpr, U: tl.constexpr, SLOW: tl.constexpr,
                EMU: tl.constexpr):
    """The 8 lanes of the sum, in source order, of the loaded sources (``tl_load_tile``):
    acc = code_0 * s_0, then acc = fma(code_k, s_k, acc)."""
    z = tl.zeros((G, BPP, REP, U), tl.float32)
    a0, a1, a2, a3, a4, a5, a6, a7 = tl_accumulate(z, z, z, z, z, z, z, z, srcs[0], srcs[1],
                                                   srcs[2], zero, BITS, True, SLOW, EMU)
    for k in tl.static_range(1, K):
        a0, a1, a2, a3, a4, a5, a6, a7 = tl_accumulate(
            a0, a1, a2, a3, a4, a5, a6, a7, srcs[3 * k], srcs[3 * k + 1], srcs[3 * k + 2],
            zero, BITS, False, SLOW, EMU)
    return a0, a1, a2, a3, a4, a5, a6, a7

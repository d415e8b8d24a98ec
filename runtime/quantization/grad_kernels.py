"""The qgZ Triton kernels behind ``zpp::qgz_quantize``, ``zpp::qgz_reduce_requantize`` and
``zpp::qgz_dequantize_reduce`` (launched by ``grad_ops.py``; tile helpers and the table of
what they take in ``grad_tiles.py``; the format in ``grad_format.py``).

Kernel design (memory bound: the aim is the bandwidth of a copy of the same bytes): a program
works on 2-D tiles of ``BPP`` whole blocks (``TUNING``, per kernel and input bits) of one piece,
one tile per program except in ``qgz_reduce_requantize``. The tile lives in registers as 8
"lanes" (lane k = elements 8i + k), so one int32 word of INT4 codes (or two of INT8) is one column
of the lanes: packing and unpacking are shifts and masks of whole words, with no conversion
instructions (the GPU's conversion unit runs at a fraction of its FP32 rate). Block absmax:
elementwise max over the lanes, then one row reduction. The reduction kernels sum the sources
inside the program (each source read once, all loads in flight together; accumulators in
registers), always on the fast path; a tile that needs more (rare, tile-uniform) is done again on
the slow path, overwriting it: in ``qgz_dequantize_reduce`` one that holds an inf marker, in
``qgz_reduce_requantize`` one with a block whose sum is not finite (an inf marker makes it so:
code * inf is +-inf or NaN, and stays so). ``qgz_dequantize_reduce`` stores through a [block,
element] view, so that consecutive threads write consecutive 16-byte vectors (the compiler moves
the values through shared memory); stored from the lane layout, each warp instruction wrote
half-sectors spread over 32 lines, far below copy bandwidth for fp32 outputs. The slice reordering
of ``qgz_quantize`` is only the address each program reads: no transpose copy.

The two reduction kernels load and sum their sources alike (``tl_load_tile``, ``tl_sum_tile``).
The decode yields each code itself (``tl_decode``), not code * 2**POS, so the FFMA takes the
block's scale as loaded (no scaled copies of it, no exactness condition on it: subnormal scales
stay on the fast path); INT8 codes are read as 16-byte vectors. ``qgz_reduce_requantize`` reads K
sources per output element: there instructions and load latency show. Its grid is persistent:
``programs_per_sm`` programs per SM, split over the pieces, all resident at once (the launcher
caps their registers to fit), walk the full tiles of their piece (unmasked), each issuing the next
tile's loads (all sources, 16-byte vectors) before the current tile's arithmetic, so that a
program's loads are in flight while it computes; a piece's partial last tile comes after the loop.
A program is one warp (TUNING): its blocks, their absmax and their scales stay within the warp, so
the loop has no shared memory and no barrier (sm_90 SASS); with 4 warps Triton split a tile's
blocks over the warps, and each tile took barriers to move the scales and the absmax between them.
A thread holds ``elems_per_thread`` elements, so that the prefetched words fit in registers. With
INT4 sources that one tile in flight per program left the loads waiting on DRAM, so a program also
asks L2 for the tile after it (``prefetch.global.L2``, one line per thread: no registers). Block
scales are loaded and stored through a block index laid out as the tile (``tl_block_ids``): laid
out by its contiguity, a [BPP] vector of scales went through shared memory, with two barriers per
source and tile (in one-warp programs the index keeps them in registers; with 4 warps the
conversion remains). Packing multiplies by a run-time 16 or 256 (IMAD chains): LLVM would
distribute constant shifts over the sums, costing more instructions.

With INT4 sources ``qgz_reduce_requantize`` is bound by instructions, not bytes: the exact
decode-and-fma (LOP3, FADD, FFMA per code and source, one shift per word) is most of what it
issues per output element. Tiles are assigned statically: claiming them from atomic counters made
the compiler issue the next tile's loads later in the loop. The measurements behind these choices
are in docs/performance.md ("Kernel design: what was measured").

Arguments of the kernels and their helpers: the table in ``grad_tiles.py``, and::

    x_ptr, S, N, R     the gradient (float32, or 16-bit words / pairs, MODE); shard size; nodes,
                       ranks per node
    V, MODE, EVEN      elements per 16-byte vector of the gradient; how it is read
                       (``_tl_load_grad``); S is a multiple of the tile (no masks)
    lim                elements of the tile inside the shard / the output
    piece_words        words of one packed piece (its code words, then its scales)
    P, full_tiles      pieces; full tiles per piece
    t, nprog, nxt      a tile of the persistent loop; programs per piece; the next tile's loads
    TAIL, CHUNK, L2    a partial last tile; tiles between two looks for the slow path; L2 prefetch
    out_ptr, scale     dequantize_reduce's output (int16 bits when ENCODE_BF16) and its factor
    ENCODE_BF16        the interpreter stores bf16 by bits (its cast truncates)
"""
from __future__ import annotations

import triton
import triton.language as tl

from .grad_tiles import (
    tl_block_ids,
    tl_join8,
    tl_load_tile,
    tl_octet_mask,
    tl_octets,
    tl_quant_store,
    tl_scales,
    tl_split8,
    tl_sum_tile,
)
from .triton_common import INF

# ---- qgz_quantize ----------------------------------------------------------------------------

@triton.jit
def _tl_load_grad(x_ptr, xb, octet, blk_octet, lim, OB: tl.constexpr, G: tl.constexpr,
                  BPP: tl.constexpr, REP: tl.constexpr, U: tl.constexpr, V: tl.constexpr,
                  MODE: tl.constexpr, MASKED: tl.constexpr, PAD: tl.constexpr):
    """The tile's elements as 8 float32 lanes. xb: the tile's first element (int64); lim:
    elements of the tile inside the shard (masked loads read 0 past it, and in the padding
    octets of blocks whose octet count is no power of 2). MODE 0: float elements in V-element
    (16-byte) vectors; 1: bfloat16 elements read as int16 bits; 2: bfloat16 pairs read as
    int32 (one instruction per element to decode); 3: float16 pairs read as int32."""
    if MODE >= 2:   # [G, BPP, REP, U, 4] pairs; an octet is 4 pairs (16 bytes)
        idx = (octet * 4)[:, :, :, :, None] + tl.arange(0, 4)[None, None, None, None, :]
        if MASKED:
            msk = idx * 2 < lim
            if PAD:
                msk = msk & (blk_octet < OB)[:, :, :, :, None]
            w = tl.load(x_ptr + xb // 2 + idx, mask=msk, other=0)
        else:
            w = tl.load(x_ptr + xb // 2 + idx)
        if MODE == 2:
            lo = (w << 16).to(tl.float32, bitcast=True)
            hi = (w & -65536).to(tl.float32, bitcast=True)
        else:
            lo = w.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            hi = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        x = tl.reshape(tl.join(lo, hi), (G, BPP, REP, U, 8))
    else:
        idx = ((octet * 8)[:, :, :, :, None, None] + (tl.arange(0, 8 // V) * V)[None, None, None, None, :, None]
               + tl.arange(0, V)[None, None, None, None, None, :])
        if MASKED:
            msk = idx < lim
            if PAD:
                msk = msk & (blk_octet < OB)[:, :, :, :, None, None]
            xi = tl.load(x_ptr + xb + idx, mask=msk, other=0)
        else:
            xi = tl.load(x_ptr + xb + idx)
        if MODE == 1:
            x = (xi.to(tl.int32) << 16).to(tl.float32, bitcast=True)
        else:
            x = xi.to(tl.float32)
        x = tl.reshape(x, (G, BPP, REP, U, 8))
    return tl_split8(x, G, BPP, REP, U)


@triton.jit
def qgz_quantize_kernel(x_ptr, w32_ptr, f32_ptr, S, nb, N, R, BITS: tl.constexpr,
                        B: tl.constexpr, BPP: tl.constexpr, G: tl.constexpr,
                        REP: tl.constexpr, U: tl.constexpr, V: tl.constexpr,
                        MODE: tl.constexpr, EVEN: tl.constexpr, EMU: tl.constexpr):
    Q: tl.constexpr = (1 << (BITS - 1)) - 1
    OB: tl.constexpr = B // 8
    PAD: tl.constexpr = (OB & (OB - 1)) != 0       # octets per block not a power of 2
    MASKED: tl.constexpr = (not EVEN) or PAD
    pid = tl.program_id(0)
    piece = tl.program_id(1)        # output piece: destination local rank r outer, node m inner
    local_rank = piece // N
    node = piece % N
    shard = node * R + local_rank   # the reorder: read shard (m, r) of g viewed [N, R, S]
    blk = pid * BPP + tl.arange(0, BPP)
    octet, blk_octet = tl_octets(G, BPP, REP, U, OB)
    omask = (blk_octet < OB) & (blk < nb)[None, :, None, None]      # codes to store
    t0 = pid.to(tl.int64) * (BPP * B)
    xb = shard.to(tl.int64) * S + t0
    lim = tl.minimum(S - t0, BPP * B).to(tl.int32)           # elements of the tile in the shard
    x0, x1, x2, x3, x4, x5, x6, x7 = _tl_load_grad(x_ptr, xb, octet, blk_octet, lim, OB, G, BPP, REP, U,
                                                   V, MODE, MASKED, PAD)
    scale, inv, bad = tl_scales(x0, x1, x2, x3, x4, x5, x6, x7, Q)
    inv4 = inv[None, :, None, None]
    piece_words = tl.cast(nb, tl.int64) * (B * BITS // 32 + 1)     # piece size in words
    wbase = piece.to(tl.int64) * piece_words + pid.to(tl.int64) * (BPP * OB * BITS // 4)
    zero = nb >> 31                                            # nb >= 0: a run-time 0
    tl_quant_store(x0, x1, x2, x3, x4, x5, x6, x7, inv4, w32_ptr, wbase, octet, omask, blk, nb,
                   zero, BITS, G, BPP, REP, U, OB, MASKED, False, EMU)
    scales_base = piece.to(tl.int64) * piece_words + tl.cast(nb, tl.int64) * (B * BITS // 32)
    if MASKED:
        tl.store(f32_ptr + scales_base + blk, scale, mask=blk < nb)
    else:
        tl.store(f32_ptr + scales_base + blk, scale)
    if tl.max(bad.to(tl.int32), axis=0) > 0:    # RARE: non-finite values in this tile
        # Rewrite the tile's codes with the special ones, from the input read again (nothing
        # of the common path stays live for this branch). lim1 == lim in effect; a
        # different bound keeps the compiler from holding the first load's mask.
        lim1 = tl.minimum(S - t0, BPP * B + 16).to(tl.int32)
        x0, x1, x2, x3, x4, x5, x6, x7 = _tl_load_grad(x_ptr, xb, octet, blk_octet, lim1, OB, G, BPP,
                                                       REP, U, V, MODE, MASKED, PAD)
        tl_quant_store(x0, x1, x2, x3, x4, x5, x6, x7, inv4, w32_ptr, wbase, octet, omask, blk,
                       nb, zero, BITS, G, BPP, REP, U, OB, MASKED, True, EMU)


# ---- qgz_reduce_requantize -------------------------------------------------------------------

@triton.jit
def _tl_sum_requant_store(srcs, out_w32, out_f32, obase, b0, octet, blk_octet, nb, K: tl.constexpr,
                          IN_BITS: tl.constexpr, OUT_BITS: tl.constexpr, B: tl.constexpr,
                          G: tl.constexpr, BPP: tl.constexpr, REP: tl.constexpr,
                          U: tl.constexpr, MASKED: tl.constexpr, SLOW: tl.constexpr,
                          EMU: tl.constexpr):
    """Sum the loaded sources of the tile in source order, requantize, store; returns
    per block whether its sum is not finite (then the tile needs the slow path)."""
    Q: tl.constexpr = (1 << (OUT_BITS - 1)) - 1
    zero = nb >> 31                                            # nb >= 0: a run-time 0
    a0, a1, a2, a3, a4, a5, a6, a7 = tl_sum_tile(srcs, zero, K, IN_BITS, G, BPP, REP, U, SLOW,
                                                 EMU)
    scale, inv, bad = tl_scales(a0, a1, a2, a3, a4, a5, a6, a7, Q)
    blk = b0 + tl.arange(0, BPP)
    omask = tl_octet_mask(blk_octet, blk, nb, B, MASKED)
    wb = obase + b0.to(tl.int64) * (B * OUT_BITS // 32)
    tl_quant_store(a0, a1, a2, a3, a4, a5, a6, a7, inv[None, :, None, None], out_w32, wb,
                   octet, omask, blk, nb, zero, OUT_BITS, G, BPP, REP, U, B // 8, MASKED, SLOW,
                   EMU)
    bid = tl_block_ids(b0, nb, G, BPP)                  # the G threads of a block store alike
    sp = out_f32 + obase + tl.cast(nb, tl.int64) * (B * OUT_BITS // 32) + bid
    s4 = tl.broadcast_to(scale[None, :, None, None], (G, BPP, 1, 1))
    if MASKED:
        tl.store(sp, s4, mask=bid < nb)
    else:
        tl.store(sp, s4)
    return bad


@triton.jit
def _tl_or(a, b):
    return a | b


@triton.jit
def _tl_prefetch_lines(ptrs, on):
    """``prefetch.global.L2`` of the line of each pointer where ``on``."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.b32 $0, 0; }",
        "=r,l,r", [ptrs, on.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _tl_prefetch_l2(in_w32, in_f32, base0, stride, t, full_tiles, nb, K: tl.constexpr,
                    BITS: tl.constexpr, B: tl.constexpr, BPP: tl.constexpr):
    """If full tile t exists: ask L2 for its lines, code words and scales of every source
    (``prefetch.global.L2``, one 128-byte line per element: no registers wait for it)."""
    LPS: tl.constexpr = (BPP * B * BITS // 8 + 127) // 128      # code lines per source
    KP: tl.constexpr = triton.next_power_of_2(K)
    src = tl.arange(0, KP)[:, None]
    line = tl.arange(0, triton.next_power_of_2(LPS))[None, :]
    b0 = tl.minimum(t, full_tiles - 1).to(tl.int64) * BPP
    on = (src < K) & (t < full_tiles)
    words = base0 + src * stride + b0 * (B * BITS // 32) + line * 32
    # the tile's scales: BPP floats, in at most two lines (its first and last scale's)
    scales = (base0 + src * stride + tl.cast(nb, tl.int64) * (B * BITS // 32) + b0
              + tl.arange(0, 2)[None, :] * (BPP - 1))
    _tl_prefetch_lines(in_w32 + words, on & (line < LPS))
    _tl_prefetch_lines(in_f32 + scales, tl.broadcast_to(on, (KP, 2)))


@triton.jit
def _tl_step(nxt, t, nprog, full_tiles, in_w32, in_f32, out_w32, out_f32, base0, stride,
             obase, octet, blk_octet, nb, K: tl.constexpr, IN_BITS: tl.constexpr,
             OUT_BITS: tl.constexpr, B: tl.constexpr, G: tl.constexpr, BPP: tl.constexpr,
             REP: tl.constexpr, U: tl.constexpr, PAD: tl.constexpr, L2: tl.constexpr,
             EMU: tl.constexpr):
    """Fast path over full tile t, whose loads ``nxt`` holds; returns (per block whether its
    sum is not finite: the tile needs the slow path, the next tile's loads). The next
    tile's loads are issued before this tile's arithmetic, so that they are in flight
    while the program computes (the last tile's "next" is itself again: read, never used);
    with L2, the tile after it is prefetched into L2."""
    cur = nxt
    nxt = tl_load_tile(in_w32, in_f32, base0, stride,
                       tl.minimum(t + nprog, full_tiles - 1) * BPP, octet, blk_octet, nb, K,
                       IN_BITS, B, G, BPP, REP, U, PAD)
    if L2:
        _tl_prefetch_l2(in_w32, in_f32, base0, stride, t + 2 * nprog, full_tiles, nb, K,
                        IN_BITS, B, BPP)
    bad = _tl_sum_requant_store(cur, out_w32, out_f32, obase, t * BPP, octet, blk_octet, nb, K,
                                IN_BITS, OUT_BITS, B, G, BPP, REP, U, PAD, False, EMU)
    return bad, nxt


@triton.jit
def _tl_slow_tiles(bad, t0, step, in_w32, in_f32, out_w32, out_f32, base0, stride, obase,
                   octet, blk_octet, nb, K: tl.constexpr, IN_BITS: tl.constexpr,
                   OUT_BITS: tl.constexpr, B: tl.constexpr, G: tl.constexpr,
                   BPP: tl.constexpr, REP: tl.constexpr, U: tl.constexpr,
                   MASKED: tl.constexpr, EMU: tl.constexpr):
    """The slow path over the tiles t0 + j * step whose bit j of ``bad`` (uint32) is set,
    read again, overwriting what the fast path stored. One test covers inf markers and
    overflowed sums alike: a marker makes its block's sum inf or NaN (code * inf), and inf
    / NaN survive the later additions."""
    t = t0
    while bad != 0:
        if (bad & 1) != 0:
            again = tl_load_tile(in_w32, in_f32, base0, stride, t * BPP, octet, blk_octet, nb, K,
                                 IN_BITS, B, G, BPP, REP, U, MASKED)
            _tl_sum_requant_store(again, out_w32, out_f32, obase, t * BPP, octet, blk_octet, nb, K,
                                  IN_BITS, OUT_BITS, B, G, BPP, REP, U, MASKED, True, EMU)
        bad = bad >> 1
        t += step


@triton.jit
def qgz_reduce_requantize_kernel(in_w32, in_f32, out_w32, out_f32, P, nb, full_tiles,
                                 K: tl.constexpr, IN_BITS: tl.constexpr,
                                 OUT_BITS: tl.constexpr, B: tl.constexpr,
                                 BPP: tl.constexpr, G: tl.constexpr, REP: tl.constexpr,
                                 U: tl.constexpr, PAD: tl.constexpr, TAIL: tl.constexpr,
                                 CHUNK: tl.constexpr, L2: tl.constexpr, EMU: tl.constexpr):
    """Grid (programs, P): program (i, p) does the full tiles i, i + programs, ... of piece
    p (unmasked unless PAD), then, if the piece ends in a partial tile (TAIL) and i == 0,
    that tile. Tiles whose sums are not all finite (RARE) get the slow path after every
    CHUNK (<= 32) tiles of the program: each block keeps a bit per tile in a register, and
    the program combines them once per chunk, not per tile (a per-tile combination costs a
    reduction across the program's threads on every tile)."""
    i = tl.program_id(0)
    nprog = tl.num_programs(0)
    p = tl.program_id(1)
    octet, blk_octet = tl_octets(G, BPP, REP, U, B // 8)
    # source k, piece p at word (k * P + p) * pw_in; every source read once
    pw_in = tl.cast(nb, tl.int64) * (B * IN_BITS // 32 + 1)      # piece size in words
    pw_out = tl.cast(nb, tl.int64) * (B * OUT_BITS // 32 + 1)
    base0 = p.to(tl.int64) * pw_in
    stride = P * pw_in
    obase = p.to(tl.int64) * pw_out
    no_bits = tl.full((), 0, tl.uint32)
    if full_tiles > 0:   # then i < full_tiles (the launcher's grid)
        nxt = tl_load_tile(in_w32, in_f32, base0, stride, i * BPP, octet, blk_octet, nb, K,
                           IN_BITS, B, G, BPP, REP, U, PAD)
        if L2:
            _tl_prefetch_l2(in_w32, in_f32, base0, stride, i + nprog, full_tiles, nb, K,
                            IN_BITS, B, BPP)
        c = i
        while c < full_tiles:
            end = tl.minimum(c + nprog * CHUNK, full_tiles)
            bad = tl.zeros((BPP,), tl.uint32)       # per block: bit j = its tile c + j * nprog
            bit = no_bits + 1
            t = c
            while t < end:
                flag, nxt = _tl_step(nxt, t, nprog, full_tiles, in_w32, in_f32, out_w32,
                                     out_f32, base0, stride, obase, octet, blk_octet, nb, K,
                                     IN_BITS, OUT_BITS, B, G, BPP, REP, U, PAD, L2, EMU)
                bad = bad | tl.where(flag, bit, no_bits)
                bit = bit << 1
                t += nprog
            # one reduction across the program's threads per chunk, not per tile
            _tl_slow_tiles(tl.reduce(bad, 0, _tl_or), c, nprog, in_w32, in_f32, out_w32,
                           out_f32, base0, stride, obase, octet, blk_octet, nb, K, IN_BITS, OUT_BITS, B,
                           G, BPP, REP, U, PAD, EMU)
            c += nprog * CHUNK
    if TAIL:   # the partial last tile (one per piece) goes through the slow path, masked
        if i == 0:
            _tl_slow_tiles(no_bits + 1, full_tiles, 1, in_w32, in_f32, out_w32, out_f32,
                           base0, stride, obase, octet, blk_octet, nb, K, IN_BITS, OUT_BITS, B, G, BPP,
                           REP, U, True, EMU)


# ---- qgz_dequantize_reduce -------------------------------------------------------------------

@triton.jit
def _tl_dequant_tile(in_w32, in_f32, out_ptr, piece_words, octet, blk_octet, b0, nb, lim, scale,
                     K: tl.constexpr, BITS: tl.constexpr, B: tl.constexpr, G: tl.constexpr,
                     BPP: tl.constexpr, REP: tl.constexpr, U: tl.constexpr,
                     MASKED: tl.constexpr, PAD: tl.constexpr, SLOW: tl.constexpr,
                     ENCODE_BF16: tl.constexpr, EMU: tl.constexpr):
    """Sum the sources over the tile, times ``scale``, stored in the output dtype; returns
    whether the tile holds an inf-marker block (then it needs the slow path: the fast one
    read the marker as a scale)."""
    srcs = tl_load_tile(in_w32, in_f32, piece_words * 0, piece_words, b0, octet, blk_octet, nb, K, BITS, B,
                        G, BPP, REP, U, MASKED)
    a0, a1, a2, a3, a4, a5, a6, a7 = tl_sum_tile(srcs, nb >> 31, K, BITS, G, BPP, REP, U,
                                                 SLOW, EMU)
    marker = srcs[2] == INF
    for k in tl.static_range(1, K):
        marker = marker | (srcs[3 * k + 2] == INF)
    # marker [G, BPP, 1, 1]: the G threads of a block hold it alike (a warp's shuffles)
    slow = tl.max(tl.reshape(tl.max(marker.to(tl.int32), 0), (BPP,)), 0) > 0
    y = tl_join8(a0, a1, a2, a3, a4, a5, a6, a7, G, BPP, REP, U) * scale
    # Back to memory order, [block, element in block]: the store then gets its own layout
    # (consecutive threads, consecutive 16-byte vectors; the compiler moves the values
    # through shared memory). Stored in the register layout, each warp instruction would
    # write half-sectors spread over 32 lines.
    OPB: tl.constexpr = G * REP * U * 8                     # element slots per block
    y = tl.reshape(tl.permute(y, (1, 2, 0, 3, 4)), (BPP, OPB))
    e = tl.arange(0, OPB)[None, :]
    idx = (tl.arange(0, BPP) * B)[:, None] + e
    if ENCODE_BF16:  # interpreter: out_ptr is the bf16 output viewed as int16; exact RNE
        u = y.to(tl.uint32, bitcast=True)
        r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        r = tl.where(y != y, 0x7FC0, r)
        res = r.to(tl.int16)
    else:            # GPU: cvt.rn (round to nearest even), as torch's .to()
        res = y.to(out_ptr.dtype.element_ty)
    t0 = b0.to(tl.int64) * B
    if MASKED:
        msk = idx < lim
        if PAD:
            msk = msk & (e < B)
        tl.store(out_ptr + t0 + idx, res, mask=msk)
    else:
        tl.store(out_ptr + t0 + idx, res)
    return slow


@triton.jit
def qgz_dequantize_reduce_kernel(in_w32, in_f32, out_ptr, S, nb, scale, K: tl.constexpr,
                                 BITS: tl.constexpr, B: tl.constexpr, BPP: tl.constexpr,
                                 G: tl.constexpr, REP: tl.constexpr, U: tl.constexpr,
                                 EVEN: tl.constexpr, ENCODE_BF16: tl.constexpr,
                                 EMU: tl.constexpr):
    OB: tl.constexpr = B // 8
    PAD: tl.constexpr = (OB & (OB - 1)) != 0
    MASKED: tl.constexpr = (not EVEN) or PAD
    pid = tl.program_id(0)
    b0 = pid * BPP
    octet, blk_octet = tl_octets(G, BPP, REP, U, OB)
    lim = tl.minimum(S - pid.to(tl.int64) * (BPP * B), BPP * B).to(tl.int32)
    piece_words = tl.cast(nb, tl.int64) * (B * BITS // 32 + 1)
    # Fast path unconditionally; a tile with inf markers (RARE, tile-uniform) is done again,
    # overwriting it.
    if _tl_dequant_tile(in_w32, in_f32, out_ptr, piece_words, octet, blk_octet, b0, nb, lim, scale, K,
                        BITS, B, G, BPP, REP, U, MASKED, PAD, False, ENCODE_BF16, EMU):
        _tl_dequant_tile(in_w32, in_f32, out_ptr, piece_words, octet, blk_octet, b0, nb, lim, scale, K,
                         BITS, B, G, BPP, REP, U, MASKED, PAD, True, ENCODE_BF16, EMU)

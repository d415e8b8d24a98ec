"""qgZ gradient kernels: block quantization with slice reordering, and the two reductions.

qgZ replaces the gradient reduce-scatter by a two-hop all-to-all (ZeRO++ paper, section 3.3).
World ``W = N * R`` (``N`` nodes of ``R`` ranks), rank ``r = m * R + l``; every rank holds a full
flat gradient of ``W * S`` elements (padded by the caller) and must end with its ZeRO shard
``r`` (elements ``[r*S, (r+1)*S)``) of the *mean* over ranks::

    qgz_quantize            g viewed [N, R, S] -> reordered [R, N, S] -> packed pieces
                            (chunk l = the N pieces destined to local rank l)
    all_to_all (intra)      chunk l -> local rank l of the same node
    qgz_reduce_requantize   R sources x N pieces -> float32 sum per piece -> N packed pieces
    all_to_all (inter)      piece m -> node m (ranks of equal local index)
    qgz_dequantize_reduce   N sources -> float32 sum * scale (1/W) -> [S] in the output dtype

With ``N == 1`` the inter hop and the requantization are skipped (``qgz_dequantize_reduce``
over ``R`` sources); with ``R == 1`` the intra hop is skipped (``qgz_dequantize_reduce`` over
``N`` sources of what ``qgz_quantize`` produced).

Packed piece (``S`` elements, ``nb = ceil(S / B)`` blocks of ``B`` elements, ``bits`` in {4, 8})::

    [ codes: nb * B * bits / 8 bytes ][ scales: nb float32 ]        piece_bytes() bytes

INT4: two codes per byte, element 2i in the low nibble, 2i+1 in the high one (two's complement);
INT8: one int8 code per byte. Codes past ``S`` are 0. ``piece_bytes`` is a multiple of 4, so
concatenated pieces keep their scales 4-byte aligned.

Quantization (identical, bit for bit, in the Triton kernels and in the torch twins)::

    q       = 7 (INT4) or 127 (INT8)
    absmax  = max |x| over the block's finite values (float32; bf16/fp16 inputs are upcast exactly)
    scale   = absmax / q                       IEEE float32 division (round to nearest even)
    inv     = min(q / absmax, FLT_MAX)         IEEE float32 division; 0 when absmax == 0
    code    = rint(x * inv)                    float32 product, rint = round half to even
    value   = code * scale                     float32 product

``|x * inv| <= q (1 + 2**-24)**2 < q + 1/2``, so ``code`` never leaves ``[-q, q]`` (the twin
clamps anyway; it never triggers). One division per block, not per element, keeps the kernels
memory bound. Error per element: ``|value - x| <= scale * (0.5 + 4 q 2**-24) < scale *
(0.5 + 2**-15)``; the tests use ``(0.5 + 2**-12) * scale``. The FLT_MAX clamp only matters for
blocks whose absmax is below ``q / FLT_MAX`` (about 4e-37; also where ``scale`` is subnormal the
bound is ``absmax``): those round toward zero instead of producing ``inf * 0 = NaN``. An all-zero
block has scale 0, codes 0, and dequantizes to exact zeros.

Non-finite values: a block holding inf or NaN gets ``scale = +inf`` as a marker; NaN -> code
``-(q+1)``, +inf -> ``q``, -inf -> ``-q``, finite values -> 0. Dequantizing an inf-scale block maps
``-(q+1)`` -> NaN, ``q`` -> +inf, ``-q`` -> -inf, everything else -> 0. So an inf in one rank's
gradient stays visible (inf, or NaN where +inf met -inf) through both hops, and no NaN appears
where there was none. Normal blocks never emit ``-(q+1)``.

Reductions, in source order with one rounding per source (a fused multiply-add): ``acc =
code_0 * scale_0``, then ``acc = fma(code_k, scale_k, acc)`` in float32, k = 1, 2, ...; then
``acc * float32(scale)`` and a round-to-nearest-even cast to the output dtype. (FMA is both
cheaper on the GPU and more accurate; the twin computes it exactly with a float64 round-to-odd
sum, see ``_fma_f32``.)

How the Triton kernels stay bit-exact: launched with ``enable_fp_fusion=False`` (no implicit
contraction), explicit ``tl.fma`` where the formula has one; divisions by ``tl.math.div_rn``;
rint and float->int via ``bitcast(t + 1.5 * 2**23)`` (exact round-half-even for ``|t| < 2**22``);
codes -> float via ``bitcast(0x4B000000 | offset-binary field) - bias`` (exact). Under the
interpreter (whose fma rounds twice and whose bf16 conversion truncates) the fma is emulated as
in the twin and bf16 is decoded / encoded with bit operations. The GPU path is checked against
the twins by ``examples/bench_grad_kernels.py`` (column "exact").

Kernel design (memory bound; target >= 85% of copy bandwidth at >= 256 MB): one program owns
a 2-D tile of ``BPP`` whole blocks (``TUNING``: 4K-16K elements) of one piece, loaded with
16-byte vector accesses. The tile lives in registers as 8 "lanes" (lane k = elements 8i + k),
so one int32 word of INT4 codes (or two of INT8) is one column of the lanes: packing and
unpacking are shifts and masks of whole words, with no conversion instructions (the conversion
unit runs at 1/8 of the FP32 rate on Hopper). Block absmax: elementwise max over the lanes, then
one row reduction. The reduction kernels loop over the sources inside the program (each source
read once; accumulators in registers). The rare paths (non-finite values, scales below 2**-100)
are tile-uniform branches. The slice reordering of ``qgz_quantize`` is only the address each
program reads: no transpose copy. Budget check (sm_90 SASS, not yet timed): the instruction
issue rate, not DRAM, is the risk for INT4 -> INT4 ``qgz_reduce_requantize`` (about 26
instructions per output element with 4 sources, against about 25 at 85% of an H200's copy
bandwidth); the other kernels have margin.
"""
from __future__ import annotations

import math
import os

import torch

try:  # Triton is optional: without it the torch twins serve every device.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # pragma: no cover - exercised only where triton is missing
    triton = None
    tl = None
    HAS_TRITON = False

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "HAS_TRITON",
    "piece_bytes",
    "num_blocks",
    "qgz_quantize",
    "qgz_reduce_requantize",
    "qgz_dequantize_reduce",
    "qgz_quantize_ref",
    "qgz_reduce_requantize_ref",
    "qgz_dequantize_reduce_ref",
    "qgz_quantize_triton",
    "qgz_reduce_requantize_triton",
    "qgz_dequantize_reduce_triton",
    "quantize_pieces_ref",
    "dequantize_pieces_ref",
    "unpack_pieces",
]

DEFAULT_BLOCK_SIZE = 256
SUPPORTED_BITS = (4, 8)
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FLT_MAX = 3.4028234663852886e38


def _qmax(bits: int) -> int:
    return (1 << (bits - 1)) - 1


def _check_block(block_size: int) -> None:
    if block_size < 32 or block_size % 8 != 0:
        raise ValueError(f"qgZ block_size must be a multiple of 8 and >= 32, got {block_size}")


def _check_bits(bits: int, what: str = "bits") -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"qgZ {what} must be 4 or 8, got {bits}")


def num_blocks(shard_size: int, block_size: int) -> int:
    """Quantization blocks per piece: ceil(shard_size / block_size)."""
    return (shard_size + block_size - 1) // block_size


def piece_bytes(shard_size: int, block_size: int, bits: int) -> int:
    """Bytes of one packed piece of ``shard_size`` elements: codes then float32 scales."""
    _check_bits(bits)
    _check_block(block_size)
    nb = num_blocks(shard_size, block_size)
    return nb * block_size * bits // 8 + 4 * nb


# ---------------------------------------------------------------------------------------------
# torch reference twins (CPU implementation of the ops; also valid on CUDA tensors)
# ---------------------------------------------------------------------------------------------

def _quantize_blocks(x: torch.Tensor, bits: int):
    """x float32 [..., nb, B] (padding zero) -> (codes int32 [..., nb, B], scales [..., nb])."""
    q = _qmax(bits)
    finite = torch.isfinite(x)
    bad = ~finite.all(dim=-1)
    x0 = torch.where(finite, x, torch.zeros((), dtype=x.dtype, device=x.device))
    absmax = x0.abs().amax(dim=-1)
    qt = torch.full_like(absmax, float(q))
    scale = absmax / qt                                   # IEEE division (tensor / tensor)
    inv = torch.where(absmax > 0, qt / absmax, torch.zeros_like(absmax))
    inv = inv.clamp_max(FLT_MAX)
    t = x0 * inv.unsqueeze(-1)
    code = torch.round(t).clamp_(-q, q).to(torch.int32)  # round half to even
    special = torch.where(
        torch.isnan(x), -(q + 1),
        torch.where(x == math.inf, q, torch.where(x == -math.inf, -q, 0))).to(torch.int32)
    code = torch.where(bad.unsqueeze(-1), special, code)
    scale = torch.where(bad, torch.full_like(scale, math.inf), scale)
    return code, scale


def _dequantize_blocks(code: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    """codes int32 [..., nb, B], scales float32 [..., nb] -> float32 [..., nb, B]."""
    q = _qmax(bits)
    s = scale.unsqueeze(-1)
    v = code.to(torch.float32) * s
    f = torch.zeros((), dtype=torch.float32, device=code.device)
    special = torch.where(code == q, f + math.inf,
                          torch.where(code == -q, f - math.inf,
                                      torch.where(code == -(q + 1), f + math.nan, f)))
    return torch.where(torch.isinf(s) & (s > 0), special, v)


def _pack(code: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    """codes int32 [P, nb, B], scales [P, nb] -> uint8 [P * piece_bytes]."""
    P = code.shape[0]
    if bits == 4:
        c = code.reshape(P, -1)
        byte = (c[:, 0::2] & 15) | ((c[:, 1::2] & 15) << 4)
    else:
        byte = code.reshape(P, -1) & 255
    byte = byte.to(torch.uint8)
    sbytes = scale.to(torch.float32).contiguous().view(torch.uint8).reshape(P, -1)
    return torch.cat([byte, sbytes], dim=1).reshape(-1)


def unpack_pieces(buf: torch.Tensor, num_pieces: int, shard_size: int, bits: int, block_size: int):
    """uint8 [num_pieces * piece_bytes] -> (codes int32 [P, nb, B], scales float32 [P, nb])."""
    nb = num_blocks(shard_size, block_size)
    pb = piece_bytes(shard_size, block_size, bits)
    cb = nb * block_size * bits // 8
    if buf.dtype != torch.uint8 or buf.numel() != num_pieces * pb:
        raise ValueError(f"expected uint8[{num_pieces * pb}] ({num_pieces} pieces of {pb} bytes), "
                         f"got {buf.dtype}[{buf.numel()}]")
    b = buf.reshape(num_pieces, pb)
    raw = b[:, :cb].to(torch.int32)
    if bits == 4:
        lo = ((raw & 15) ^ 8) - 8
        hi = ((raw >> 4) ^ 8) - 8
        code = torch.stack([lo, hi], dim=-1).reshape(num_pieces, nb, block_size)
    else:
        code = ((raw ^ 128) - 128).reshape(num_pieces, nb, block_size)
    scale = b[:, cb:].contiguous().view(torch.float32).reshape(num_pieces, nb)
    return code, scale


def quantize_pieces_ref(x: torch.Tensor, bits: int, block_size: int) -> torch.Tensor:
    """x [P, S] (any float dtype, read as float32) -> packed uint8 [P * piece_bytes(S)]."""
    P, S = x.shape
    nb = num_blocks(S, block_size)
    xf = x.to(torch.float32)
    if nb * block_size != S:
        xf = torch.nn.functional.pad(xf, (0, nb * block_size - S))
    code, scale = _quantize_blocks(xf.reshape(P, nb, block_size), bits)
    return _pack(code, scale, bits)


def dequantize_pieces_ref(buf: torch.Tensor, num_pieces: int, shard_size: int, bits: int,
                          block_size: int) -> torch.Tensor:
    """packed uint8 [P * piece_bytes] -> float32 [P, S]."""
    code, scale = unpack_pieces(buf, num_pieces, shard_size, bits, block_size)
    v = _dequantize_blocks(code, scale, bits)
    return v.reshape(num_pieces, -1)[:, :shard_size]


def _exact_products(code: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    """code * scale, exact, in float64 (<= 8 + 24 significant bits); inf-marker blocks give
    -(q+1) -> NaN, q -> +inf, -q -> -inf, other codes -> 0."""
    q = _qmax(bits)
    s = scale.double().unsqueeze(-1)
    p = code.double() * s
    f = torch.zeros((), dtype=torch.float64, device=code.device)
    special = torch.where(code == q, f + math.inf,
                          torch.where(code == -q, f - math.inf,
                                      torch.where(code == -(q + 1), f + math.nan, f)))
    return torch.where(torch.isinf(s) & (s > 0), special, p)


def _fma_f32(acc: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """float32(acc + p) with ONE rounding, for float32 ``acc`` and an exact float64 ``p``: the
    float64 sum rounded to odd (TwoSum error decides), then rounded to float32 -- correctly
    rounded because 53 >= 24 + 2 (Boldo & Melquiond). Equals the GPU's FFMA(code, scale, acc)."""
    c = acc.double()
    t = p + c
    bp = t - p
    err = (p - (t - bp)) + (c - bp)                       # t + err == p + c exactly
    bits = t.view(torch.int64)
    fix = (err != 0) & torch.isfinite(t) & ((bits & 1) == 0)
    step = torch.where((err > 0) == (t > 0), 1, -1)
    return torch.where(fix, (bits + step).view(torch.float64), t).to(torch.float32)


def _sum_sources(buf, num_sources, num_pieces, shard_size, bits, block_size):
    """float32 [P, nb*B]: acc = code_0 * scale_0, then acc = fma(code_k, scale_k, acc) for the
    sources in order (one rounding per source)."""
    pb = piece_bytes(shard_size, block_size, bits)
    per = num_pieces * pb
    acc = None
    for k in range(num_sources):
        code, scale = unpack_pieces(buf[k * per:(k + 1) * per], num_pieces, shard_size, bits,
                                    block_size)
        p = _exact_products(code, scale, bits).reshape(num_pieces, -1)
        acc = p.to(torch.float32) if acc is None else _fma_f32(acc, p)
    return acc


def qgz_quantize_ref(grad: torch.Tensor, num_nodes: int, ranks_per_node: int, bits: int,
                     block_size: int) -> torch.Tensor:
    S = _check_quantize_args(grad, num_nodes, ranks_per_node, bits, block_size)
    x = grad.reshape(num_nodes, ranks_per_node, S).transpose(0, 1)   # [R, N, S]
    return quantize_pieces_ref(x.reshape(ranks_per_node * num_nodes, S), bits, block_size)


def qgz_reduce_requantize_ref(recv: torch.Tensor, num_sources: int, num_pieces: int,
                              shard_size: int, in_bits: int, out_bits: int,
                              block_size: int) -> torch.Tensor:
    _check_reduce_args(recv, num_sources, num_pieces, shard_size, in_bits, block_size)
    _check_bits(out_bits, "out_bits")
    acc = _sum_sources(recv, num_sources, num_pieces, shard_size, in_bits, block_size)
    nb = num_blocks(shard_size, block_size)
    code, scale = _quantize_blocks(acc.reshape(num_pieces, nb, block_size), out_bits)
    return _pack(code, scale, out_bits)


def qgz_dequantize_reduce_ref(recv: torch.Tensor, num_sources: int, shard_size: int, bits: int,
                              block_size: int, dtype: torch.dtype, scale: float) -> torch.Tensor:
    _check_reduce_args(recv, num_sources, 1, shard_size, bits, block_size)
    _check_dtype(dtype)
    acc = _sum_sources(recv, num_sources, 1, shard_size, bits, block_size)[0, :shard_size]
    st = torch.tensor(scale, dtype=torch.float32, device=acc.device)
    return (acc * st).to(dtype)


# ---------------------------------------------------------------------------------------------
# argument checks (shared by twins, Triton launchers and fake impls)
# ---------------------------------------------------------------------------------------------

def _check_dtype(dtype) -> None:
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"qgZ supports float32, bfloat16 and float16, got {dtype}")


def _check_quantize_args(grad, num_nodes, ranks_per_node, bits, block_size) -> int:
    _check_bits(bits)
    _check_block(block_size)
    _check_dtype(grad.dtype)
    if grad.dim() != 1:
        raise ValueError(f"qgz_quantize expects a 1-D gradient, got shape {tuple(grad.shape)}")
    if num_nodes < 1 or ranks_per_node < 1:
        raise ValueError(f"bad topology {num_nodes} nodes x {ranks_per_node} ranks")
    W = num_nodes * ranks_per_node
    n = grad.numel()
    if n == 0 or n % W != 0:
        raise ValueError(f"gradient of {n} elements is not W * S with W = {W}, S >= 1 "
                         "(the caller pads)")
    return n // W


def _check_reduce_args(recv, num_sources, num_pieces, shard_size, bits, block_size) -> None:
    _check_bits(bits)
    _check_block(block_size)
    if num_sources < 1 or num_pieces < 1 or shard_size < 1:
        raise ValueError(f"bad sizes: sources={num_sources} pieces={num_pieces} S={shard_size}")
    want = num_sources * num_pieces * piece_bytes(shard_size, block_size, bits)
    if recv.dtype != torch.uint8 or recv.dim() != 1 or recv.numel() != want:
        raise ValueError(f"expected uint8[{want}] ({num_sources} sources x {num_pieces} pieces of "
                         f"{shard_size} elements, {bits} bits, block {block_size}), got "
                         f"{recv.dtype}{list(recv.shape)}")


# ---------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------

def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


if HAS_TRITON:
    _INF = tl.constexpr(float("inf"))
    _FLT_MAX = tl.constexpr(FLT_MAX)
    # Integer <-> float without the conversion unit (16/clk/SM on Hopper, against 128 for FP32):
    # for |t| < 2**22, t + 1.5 * 2**23 (IEEE add, round to nearest even) holds rint(t) in its low
    # mantissa bits, two's complement; and bitcast(0x4B000000 | n) == 2**23 + n for 0 <= n < 2**23.
    _MAGIC = tl.constexpr(12582912.0)
    _TWO23 = tl.constexpr(0x4B000000)
    _TINY = tl.constexpr(2.0 ** -100)  # below this a scale * 2**-16 could be subnormal (inexact)

    # A tile of BPP blocks is held as 8 "lanes" X0..X7 of shape [BPP, NW = next_pow2(B) // 8]:
    # lane k holds the block elements 8 i + k. One int32 word of INT4 codes is exactly one column
    # of the 8 lanes (nibble k = lane k); two words of INT8 codes are one column (byte k of word
    # 0 / 1 = lane k / k + 4). Unpacking and packing are shifts and masks of whole words.

    @triton.jit
    def _tl_field(wxe, POS: tl.constexpr, WIDTH: tl.constexpr):
        """``wxe`` = word in offset binary, OR-ed with 0x4B000000 (fields below bit 23 intact).
        Field of ``WIDTH`` bits at bit ``POS`` (POS + WIDTH <= 23) -> float32 ``code * 2**POS``,
        exactly: one AND keeps field + exponent bits (2**23 + field), one FADD removes the bias."""
        OFF: tl.constexpr = 8388608.0 + (1 << (WIDTH - 1 + POS))
        MASK: tl.constexpr = (((1 << WIDTH) - 1) << POS) | 0x4B000000
        return (wxe & MASK).to(tl.float32, bitcast=True) - OFF

    @triton.jit
    def _tl_split8(x, BPP: tl.constexpr, NW: tl.constexpr):
        """[BPP, 8 * NW] -> lanes (x[:, 8i + k] for k = 0..7)."""
        e, o = tl.split(tl.reshape(x, (BPP, NW, 2, 2, 2)))   # last axis: k & 1
        e0, e1 = tl.split(e)                                 # (k >> 1) & 1
        o0, o1 = tl.split(o)
        x0, x4 = tl.split(e0)                                # k >> 2
        x2, x6 = tl.split(e1)
        x1, x5 = tl.split(o0)
        x3, x7 = tl.split(o1)
        return x0, x1, x2, x3, x4, x5, x6, x7

    @triton.jit
    def _tl_join8(x0, x1, x2, x3, x4, x5, x6, x7, BPP: tl.constexpr, NW: tl.constexpr):
        """Inverse of _tl_split8."""
        e = tl.join(tl.join(x0, x4), tl.join(x2, x6))
        o = tl.join(tl.join(x1, x5), tl.join(x3, x7))
        return tl.reshape(tl.join(e, o), (BPP, NW * 8))

    @triton.jit
    def _tl_fma(a, b, c, EMU: tl.constexpr):
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
            fix = (err != 0.0) & (tl.abs(t) < _INF) & ((bits & 1) == 0)
            step = tl.where((err > 0.0) == (t > 0.0), 1, -1).to(tl.int64)
            r = tl.where(fix, (bits + step).to(tl.float64, bitcast=True), t).to(tl.float32)
        else:
            r = tl.fma(a, b, c)
        return r

    @triton.jit
    def _tl_acc_lane(acc, f, s, s_pos, s_inf, P: tl.constexpr, Q: tl.constexpr,
                     FIRST: tl.constexpr, SLOW: tl.constexpr, EMU: tl.constexpr):
        """acc + code * scale for one lane, one rounding (the first source: code * scale).
        ``f`` = code * 2**P (exact). Fast path: f * (s * 2**-P) == code * s exactly while
        s * 2**-P is normal. Slow path (the tile holds inf markers or scales < 2**-100): exact
        code first; inf-marker blocks contribute -(q+1) -> NaN, q -> +inf, -q -> -inf, else 0."""
        if SLOW:
            cf = f * (2.0 ** -P)
            sp = tl.where(cf == Q * 1.0, _INF, tl.where(cf == -Q * 1.0, -_INF, 0.0))
            sp = tl.where(cf == -Q - 1.0, _INF - _INF, sp)   # inf - inf = NaN
            x = tl.where(s_inf, sp, cf)
            y = tl.where(s_inf, 1.0, s)
        else:
            x = f
            y = s_pos
        if FIRST:
            r = x * y
        else:
            r = _tl_fma(x, y, acc, EMU)
        return r

    @triton.jit
    def _tl_acc_source(a0, a1, a2, a3, a4, a5, a6, a7, w32_ptr, f32_ptr, base, blk, nb,
                       BITS: tl.constexpr, B: tl.constexpr, BPP: tl.constexpr, NW: tl.constexpr,
                       FIRST: tl.constexpr, SLOW: tl.constexpr, EMU: tl.constexpr):
        """Accumulate the piece at byte offset ``base`` (blocks ``blk``) into the 8 lanes."""
        Q: tl.constexpr = (1 << (BITS - 1)) - 1
        rowok = blk < nb
        i = tl.arange(0, NW)
        m = rowok[:, None] & (i < B // 8)[None, :]
        wbase = base // 4
        cw = tl.cast(nb, tl.int64) * (B * BITS // 32)          # code words per piece
        s = tl.load(f32_ptr + wbase + cw + blk, mask=rowok, other=0.0)[:, None]
        si = s == _INF
        if BITS == 4:
            w = tl.load(w32_ptr + wbase + blk[:, None] * (B // 8) + i[None, :], mask=m, other=0)
            wx = (w ^ -2004318072) | _TWO23          # 0x88888888: nibbles to offset binary
            hx = ((w >> 20) ^ 0x888) | _TWO23         # nibbles 5..7 moved to bits 0..11
            s4 = s * 0.0625
            s8 = s * 0.00390625
            a0 = _tl_acc_lane(a0, _tl_field(wx, 0, 4), s, s, si, 0, Q, FIRST, SLOW, EMU)
            a1 = _tl_acc_lane(a1, _tl_field(wx, 4, 4), s, s4, si, 4, Q, FIRST, SLOW, EMU)
            a2 = _tl_acc_lane(a2, _tl_field(wx, 8, 4), s, s8, si, 8, Q, FIRST, SLOW, EMU)
            a3 = _tl_acc_lane(a3, _tl_field(wx, 12, 4), s, s * 0.000244140625, si, 12, Q, FIRST,
                              SLOW, EMU)
            a4 = _tl_acc_lane(a4, _tl_field(wx, 16, 4), s, s * 1.52587890625e-05, si, 16, Q,
                              FIRST, SLOW, EMU)
            a5 = _tl_acc_lane(a5, _tl_field(hx, 0, 4), s, s, si, 0, Q, FIRST, SLOW, EMU)
            a6 = _tl_acc_lane(a6, _tl_field(hx, 4, 4), s, s4, si, 4, Q, FIRST, SLOW, EMU)
            a7 = _tl_acc_lane(a7, _tl_field(hx, 8, 4), s, s8, si, 8, Q, FIRST, SLOW, EMU)
        else:
            j = tl.arange(0, 2 * NW)
            m2 = rowok[:, None] & (j < B // 4)[None, :]
            w = tl.load(w32_ptr + wbase + blk[:, None] * (B // 4) + j[None, :], mask=m2, other=0)
            wa, wb = tl.split(tl.reshape(w, (BPP, NW, 2)))
            ax = (wa ^ -2139062144) | _TWO23         # 0x80808080: bytes to offset binary
            bx = (wb ^ -2139062144) | _TWO23
            ah = ((wa >> 16) ^ 0x8080) | _TWO23       # bytes 2, 3 moved to bits 0..15
            bh = ((wb >> 16) ^ 0x8080) | _TWO23
            s8 = s * 0.00390625
            a0 = _tl_acc_lane(a0, _tl_field(ax, 0, 8), s, s, si, 0, Q, FIRST, SLOW, EMU)
            a1 = _tl_acc_lane(a1, _tl_field(ax, 8, 8), s, s8, si, 8, Q, FIRST, SLOW, EMU)
            a2 = _tl_acc_lane(a2, _tl_field(ah, 0, 8), s, s, si, 0, Q, FIRST, SLOW, EMU)
            a3 = _tl_acc_lane(a3, _tl_field(ah, 8, 8), s, s8, si, 8, Q, FIRST, SLOW, EMU)
            a4 = _tl_acc_lane(a4, _tl_field(bx, 0, 8), s, s, si, 0, Q, FIRST, SLOW, EMU)
            a5 = _tl_acc_lane(a5, _tl_field(bx, 8, 8), s, s8, si, 8, Q, FIRST, SLOW, EMU)
            a6 = _tl_acc_lane(a6, _tl_field(bh, 0, 8), s, s, si, 0, Q, FIRST, SLOW, EMU)
            a7 = _tl_acc_lane(a7, _tl_field(bh, 8, 8), s, s8, si, 8, Q, FIRST, SLOW, EMU)
        return a0, a1, a2, a3, a4, a5, a6, a7

    @triton.jit
    def _tl_sum_sources(w32_ptr, f32_ptr, base0, stride, blk, nb, K: tl.constexpr,
                        BITS: tl.constexpr, B: tl.constexpr, BPP: tl.constexpr,
                        NW: tl.constexpr, SLOW: tl.constexpr, EMU: tl.constexpr):
        """Sum, in source order, of the pieces at byte offsets ``base0 + k * stride`` (k < K):
        acc = code_0 * s_0, then acc = fma(code_k, s_k, acc). Unrolled and branch-free, so that
        the loads of all sources can be in flight together."""
        z = tl.zeros((BPP, NW), tl.float32)
        a0, a1, a2, a3, a4, a5, a6, a7 = _tl_acc_source(z, z, z, z, z, z, z, z, w32_ptr, f32_ptr,
                                                        base0, blk, nb, BITS, B, BPP, NW, True,
                                                        SLOW, EMU)
        for k in tl.static_range(1, K):
            a0, a1, a2, a3, a4, a5, a6, a7 = _tl_acc_source(a0, a1, a2, a3, a4, a5, a6, a7,
                                                            w32_ptr, f32_ptr, base0 + k * stride,
                                                            blk, nb, BITS, B, BPP, NW, False,
                                                            SLOW, EMU)
        return a0, a1, a2, a3, a4, a5, a6, a7

    @triton.jit
    def _tl_any_slow(f32_ptr, base0, stride, blk, nb, K: tl.constexpr, BITS: tl.constexpr,
                     B: tl.constexpr):
        """Does any source's tile hold an inf-marker block or a scale below 2**-100?"""
        rowok = blk < nb
        cw = tl.cast(nb, tl.int64) * (B * BITS // 32)
        s = tl.load(f32_ptr + base0 // 4 + cw + blk, mask=rowok, other=1.0)
        flag = (s == _INF) | ((s > 0.0) & (s < _TINY))
        for k in tl.static_range(1, K):
            s = tl.load(f32_ptr + (base0 + k * stride) // 4 + cw + blk, mask=rowok, other=1.0)
            flag = flag | (s == _INF) | ((s > 0.0) & (s < _TINY))
        return tl.max(flag.to(tl.int32), axis=0) > 0

    @triton.jit
    def _tl_fin_abs(x):
        """(|x| where finite else 0, 1 where non-finite else 0)."""
        a = tl.abs(x)
        fin = a < _INF                  # false for +-inf and NaN
        return tl.where(fin, a, 0.0), tl.where(fin, 0, 1)

    @triton.jit
    def _tl_code(x, inv, bad, Q: tl.constexpr, CHECK: tl.constexpr):
        """int32 whose low bits are the two's complement code of x (see _MAGIC)."""
        c = (x * inv + _MAGIC).to(tl.int32, bitcast=True)
        if CHECK:
            sp = tl.where(x != x, -Q - 1, tl.where(x == _INF, Q, tl.where(x == -_INF, -Q, 0)))
            c = tl.where(bad, sp, c)
        return c

    @triton.jit
    def _tl_quant_store(x0, x1, x2, x3, x4, x5, x6, x7, w32_ptr, f32_ptr, base, blk, nb,
                        BITS: tl.constexpr, B: tl.constexpr, BPP: tl.constexpr,
                        NW: tl.constexpr, NAN_FREE: tl.constexpr):
        """Quantize 8 lanes (entries past the piece's end must be 0) and store blocks ``blk`` of
        the piece at byte offset ``base``. ``NAN_FREE``: the caller knows there is no NaN (sums
        of inputs without inf markers: only overflow to +-inf is possible); then a block's max
        |x| is its finite absmax unless it is inf, which marks the block anyway."""
        Q: tl.constexpr = (1 << (BITS - 1)) - 1
        rowok = blk < nb
        if NAN_FREE:
            amax = tl.max(tl.maximum(
                tl.maximum(tl.maximum(tl.abs(x0), tl.abs(x1)), tl.maximum(tl.abs(x2), tl.abs(x3))),
                tl.maximum(tl.maximum(tl.abs(x4), tl.abs(x5)), tl.maximum(tl.abs(x6), tl.abs(x7)))),
                axis=1)
            nbad = tl.where(amax == _INF, 1, 0)
            amax = tl.where(amax == _INF, 0.0, amax)
        else:
            a0, b0 = _tl_fin_abs(x0)    # elementwise over the lanes first, one row reduction
            a1, b1 = _tl_fin_abs(x1)
            a2, b2 = _tl_fin_abs(x2)
            a3, b3 = _tl_fin_abs(x3)
            a4, b4 = _tl_fin_abs(x4)
            a5, b5 = _tl_fin_abs(x5)
            a6, b6 = _tl_fin_abs(x6)
            a7, b7 = _tl_fin_abs(x7)
            amax = tl.max(tl.maximum(tl.maximum(tl.maximum(a0, a1), tl.maximum(a2, a3)),
                                     tl.maximum(tl.maximum(a4, a5), tl.maximum(a6, a7))), axis=1)
            nbad = tl.max(b0 | b1 | b2 | b3 | b4 | b5 | b6 | b7, axis=1)
        qv = tl.full((BPP,), Q * 1.0, tl.float32)
        scale = tl.math.div_rn(amax, qv)
        safe = tl.where(amax > 0.0, amax, 1.0)
        inv = tl.where(amax > 0.0, tl.math.div_rn(qv, safe), 0.0)
        inv = tl.minimum(inv, _FLT_MAX)[:, None]
        # |x * inv| <= q (1 + 2**-24)**2 < q + 1/2, so rint never leaves [-q, q] (no clamp).
        bad = (nbad > 0)[:, None]
        if tl.max(nbad, axis=0) > 0:    # rare: non-finite values somewhere in this tile
            c0 = _tl_code(x0, inv, bad, Q, True)
            c1 = _tl_code(x1, inv, bad, Q, True)
            c2 = _tl_code(x2, inv, bad, Q, True)
            c3 = _tl_code(x3, inv, bad, Q, True)
            c4 = _tl_code(x4, inv, bad, Q, True)
            c5 = _tl_code(x5, inv, bad, Q, True)
            c6 = _tl_code(x6, inv, bad, Q, True)
            c7 = _tl_code(x7, inv, bad, Q, True)
            scale = tl.where(nbad > 0, _INF, scale)
        else:
            c0 = _tl_code(x0, inv, bad, Q, False)
            c1 = _tl_code(x1, inv, bad, Q, False)
            c2 = _tl_code(x2, inv, bad, Q, False)
            c3 = _tl_code(x3, inv, bad, Q, False)
            c4 = _tl_code(x4, inv, bad, Q, False)
            c5 = _tl_code(x5, inv, bad, Q, False)
            c6 = _tl_code(x6, inv, bad, Q, False)
            c7 = _tl_code(x7, inv, bad, Q, False)
        wbase = base // 4
        cw = tl.cast(nb, tl.int64) * (B * BITS // 32)
        i = tl.arange(0, NW)
        if BITS == 4:
            w = (c0 & 15) | ((c1 & 15) << 4) | ((c2 & 15) << 8) | ((c3 & 15) << 12)
            w = w | ((c4 & 15) << 16) | ((c5 & 15) << 20) | ((c6 & 15) << 24) | (c7 << 28)
            m = rowok[:, None] & (i < B // 8)[None, :]
            tl.store(w32_ptr + wbase + blk[:, None] * (B // 8) + i[None, :], w, mask=m)
        else:
            wa = (c0 & 255) | ((c1 & 255) << 8) | ((c2 & 255) << 16) | (c3 << 24)
            wb = (c4 & 255) | ((c5 & 255) << 8) | ((c6 & 255) << 16) | (c7 << 24)
            w = tl.reshape(tl.join(wa, wb), (BPP, 2 * NW))
            j = tl.arange(0, 2 * NW)
            m = rowok[:, None] & (j < B // 4)[None, :]
            tl.store(w32_ptr + wbase + blk[:, None] * (B // 4) + j[None, :], w, mask=m)
        tl.store(f32_ptr + wbase + cw + blk, scale, mask=rowok)

    @triton.jit
    def _qgz_quantize_kernel(x_ptr, w32_ptr, f32_ptr, S, nb, N, R, BITS: tl.constexpr,
                             B: tl.constexpr, BPP: tl.constexpr, NW: tl.constexpr,
                             DECODE_BF16: tl.constexpr):
        pid = tl.program_id(0)
        o = tl.program_id(1)            # output piece: destination local rank l outer, node m inner
        l = o // N
        mm = o % N
        shard = mm * R + l              # the reorder: read shard (m, l) of g viewed [N, R, S]
        blk = pid * BPP + tl.arange(0, BPP)
        c = tl.arange(0, 8 * NW)
        idx = blk[:, None] * B + c[None, :]
        msk = (c < B)[None, :] & (idx < S)
        ptrs = x_ptr + shard.to(tl.int64) * S + idx
        if DECODE_BF16:  # interpreter: x_ptr is the bf16 tensor viewed as int16; exact decode
            xi = tl.load(ptrs, mask=msk, other=0)
            x = (xi.to(tl.int32) << 16).to(tl.float32, bitcast=True)
        else:            # fp32 / fp16 / bf16 read in their own dtype, upcast exactly
            x = tl.load(ptrs, mask=msk, other=0.0).to(tl.float32)
        x0, x1, x2, x3, x4, x5, x6, x7 = _tl_split8(x, BPP, NW)
        pb = tl.cast(nb, tl.int64) * (B * BITS // 8 + 4)
        _tl_quant_store(x0, x1, x2, x3, x4, x5, x6, x7, w32_ptr, f32_ptr, o.to(tl.int64) * pb,
                        blk, nb, BITS, B, BPP, NW, False)

    @triton.jit
    def _qgz_reduce_requantize_kernel(in_w32, in_f32, out_w32, out_f32, P, nb, K: tl.constexpr,
                                      IN_BITS: tl.constexpr, OUT_BITS: tl.constexpr,
                                      B: tl.constexpr, BPP: tl.constexpr, NW: tl.constexpr,
                                      EMU: tl.constexpr):
        pid = tl.program_id(0)
        p = tl.program_id(1)
        blk = pid * BPP + tl.arange(0, BPP)
        pb_in = tl.cast(nb, tl.int64) * (B * IN_BITS // 8 + 4)
        pb_out = tl.cast(nb, tl.int64) * (B * OUT_BITS // 8 + 4)
        # source k, piece p at byte (k * P + p) * pb_in; every source read once
        base0 = p.to(tl.int64) * pb_in
        stride = P * pb_in
        if _tl_any_slow(in_f32, base0, stride, blk, nb, K, IN_BITS, B):   # rare, tile-uniform
            a0, a1, a2, a3, a4, a5, a6, a7 = _tl_sum_sources(in_w32, in_f32, base0, stride, blk, nb,
                                                             K, IN_BITS, B, BPP, NW, True, EMU)
            _tl_quant_store(a0, a1, a2, a3, a4, a5, a6, a7, out_w32, out_f32,
                            p.to(tl.int64) * pb_out, blk, nb, OUT_BITS, B, BPP, NW, False)
        else:
            a0, a1, a2, a3, a4, a5, a6, a7 = _tl_sum_sources(in_w32, in_f32, base0, stride, blk, nb,
                                                             K, IN_BITS, B, BPP, NW, False, EMU)
            _tl_quant_store(a0, a1, a2, a3, a4, a5, a6, a7, out_w32, out_f32,
                            p.to(tl.int64) * pb_out, blk, nb, OUT_BITS, B, BPP, NW, True)

    @triton.jit
    def _qgz_dequantize_reduce_kernel(in_w32, in_f32, out_ptr, S, nb, scale, K: tl.constexpr,
                                      BITS: tl.constexpr, B: tl.constexpr, BPP: tl.constexpr,
                                      NW: tl.constexpr, ENCODE_BF16: tl.constexpr,
                                      EMU: tl.constexpr):
        pid = tl.program_id(0)
        blk = pid * BPP + tl.arange(0, BPP)
        pb = tl.cast(nb, tl.int64) * (B * BITS // 8 + 4)
        base0 = pb * 0
        if _tl_any_slow(in_f32, base0, pb, blk, nb, K, BITS, B):            # rare, tile-uniform
            a0, a1, a2, a3, a4, a5, a6, a7 = _tl_sum_sources(in_w32, in_f32, base0, pb, blk, nb, K,
                                                             BITS, B, BPP, NW, True, EMU)
        else:
            a0, a1, a2, a3, a4, a5, a6, a7 = _tl_sum_sources(in_w32, in_f32, base0, pb, blk, nb, K,
                                                             BITS, B, BPP, NW, False, EMU)
        y = _tl_join8(a0, a1, a2, a3, a4, a5, a6, a7, BPP, NW) * scale
        c = tl.arange(0, 8 * NW)
        idx = blk[:, None] * B + c[None, :]
        msk = (c < B)[None, :] & (idx < S)
        if ENCODE_BF16:  # interpreter: out_ptr is the bf16 output viewed as int16; exact RNE
            u = y.to(tl.uint32, bitcast=True)
            r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
            r = tl.where(y != y, 0x7FC0, r)
            tl.store(out_ptr + idx, r.to(tl.int16), mask=msk)
        else:            # GPU: cvt.rn (round to nearest even), as torch's .to()
            tl.store(out_ptr + idx, y.to(out_ptr.dtype.element_ty), mask=msk)


# Elements per program tile and warps per program, per kernel (the benchmark's --sweep reports
# alternatives on the GPU).
TUNING = {
    "quantize": dict(tile_elems=4096, num_warps=4),
    "reduce_requantize": dict(tile_elems=16384, num_warps=8),
    "dequantize_reduce": dict(tile_elems=16384, num_warps=8),
}


def _tile(kernel: str, block_size: int, tile_elems):
    """(BPP blocks per program, NW = columns per lane = next_pow2(B) / 8)."""
    bp2 = triton.next_power_of_2(block_size)
    bpp = triton.next_power_of_2(max(1, (tile_elems or TUNING[kernel]["tile_elems"]) // bp2))
    return bpp, bp2 // 8


def _aligned_u8(buf: torch.Tensor) -> torch.Tensor:
    buf = buf.contiguous()
    if buf.storage_offset() % 4 != 0:
        buf = buf.clone()
    return buf


class _LaunchCtx:
    """Selects the tensor's CUDA device; under the interpreter, silences numpy's warnings about
    casting the (discarded) codes of non-finite values."""

    def __init__(self, t: torch.Tensor):
        self.t = t
        self.cms = []

    def __enter__(self):
        if self.t.is_cuda:
            self.cms.append(torch.cuda.device(self.t.device))
        if _interpreting():
            import numpy as np
            self.cms.append(np.errstate(invalid="ignore", over="ignore"))
        for cm in self.cms:
            cm.__enter__()
        return self

    def __exit__(self, *exc):
        for cm in reversed(self.cms):
            cm.__exit__(*exc)
        return False


def _opts(kernel: str, num_warps):
    return dict(num_warps=num_warps or TUNING[kernel]["num_warps"], enable_fp_fusion=False)


def _require_triton():
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed")


def qgz_quantize_triton(grad, num_nodes, ranks_per_node, bits, block_size, *, tile_elems=None,
                        num_warps=None):
    """Triton launcher of ``zpp::qgz_quantize`` (CPU tensors work under TRITON_INTERPRET=1)."""
    _require_triton()
    S = _check_quantize_args(grad, num_nodes, ranks_per_node, bits, block_size)
    grad = grad.contiguous()
    nb = num_blocks(S, block_size)
    P = num_nodes * ranks_per_node
    out = torch.empty(P * piece_bytes(S, block_size, bits), dtype=torch.uint8, device=grad.device)
    bpp, nw = _tile("quantize", block_size, tile_elems)
    interp = _interpreting()
    decode = interp and grad.dtype == torch.bfloat16
    x = grad.view(torch.int16) if decode else grad
    with _LaunchCtx(grad):
        _qgz_quantize_kernel[(triton.cdiv(nb, bpp), P)](
            x, out.view(torch.int32), out.view(torch.float32), S, nb, num_nodes, ranks_per_node,
            BITS=bits, B=block_size, BPP=bpp, NW=nw, DECODE_BF16=decode,
            **_opts("quantize", num_warps))
    return out


def qgz_reduce_requantize_triton(recv, num_sources, num_pieces, shard_size, in_bits, out_bits,
                                 block_size, *, tile_elems=None, num_warps=None):
    """Triton launcher of ``zpp::qgz_reduce_requantize``."""
    _require_triton()
    _check_reduce_args(recv, num_sources, num_pieces, shard_size, in_bits, block_size)
    _check_bits(out_bits, "out_bits")
    recv = _aligned_u8(recv)
    nb = num_blocks(shard_size, block_size)
    out = torch.empty(num_pieces * piece_bytes(shard_size, block_size, out_bits),
                      dtype=torch.uint8, device=recv.device)
    bpp, nw = _tile("reduce_requantize", block_size, tile_elems)
    with _LaunchCtx(recv):
        _qgz_reduce_requantize_kernel[(triton.cdiv(nb, bpp), num_pieces)](
            recv.view(torch.int32), recv.view(torch.float32), out.view(torch.int32),
            out.view(torch.float32), num_pieces, nb, K=num_sources, IN_BITS=in_bits,
            OUT_BITS=out_bits, B=block_size, BPP=bpp, NW=nw, EMU=_interpreting(),
            **_opts("reduce_requantize", num_warps))
    return out


def qgz_dequantize_reduce_triton(recv, num_sources, shard_size, bits, block_size, dtype, scale,
                                 *, tile_elems=None, num_warps=None):
    """Triton launcher of ``zpp::qgz_dequantize_reduce``."""
    _require_triton()
    _check_reduce_args(recv, num_sources, 1, shard_size, bits, block_size)
    _check_dtype(dtype)
    recv = _aligned_u8(recv)
    nb = num_blocks(shard_size, block_size)
    out = torch.empty(shard_size, dtype=dtype, device=recv.device)
    bpp, nw = _tile("dequantize_reduce", block_size, tile_elems)
    encode = _interpreting() and dtype == torch.bfloat16
    with _LaunchCtx(recv):
        _qgz_dequantize_reduce_kernel[(triton.cdiv(nb, bpp),)](
            recv.view(torch.int32), recv.view(torch.float32),
            out.view(torch.int16) if encode else out, shard_size, nb, float(scale),
            K=num_sources, BITS=bits, B=block_size, BPP=bpp, NW=nw, ENCODE_BF16=encode,
            EMU=_interpreting(), **_opts("dequantize_reduce", num_warps))
    return out


# ---------------------------------------------------------------------------------------------
# torch.library ops
# ---------------------------------------------------------------------------------------------

@torch.library.custom_op("zpp::qgz_quantize", mutates_args=())
def qgz_quantize(grad: torch.Tensor, num_nodes: int, ranks_per_node: int, bits: int,
                 block_size: int) -> torch.Tensor:
    """Quantize a flat gradient of W*S elements into R*N packed pieces, chunk l (destination
    local rank) outer, node m inner; piece (l, m) holds shard m*R + l."""
    return qgz_quantize_ref(grad, num_nodes, ranks_per_node, bits, block_size)


@qgz_quantize.register_fake
def _(grad, num_nodes, ranks_per_node, bits, block_size):
    W = num_nodes * ranks_per_node
    S = grad.numel() // W
    return grad.new_empty((W * piece_bytes(S, block_size, bits),), dtype=torch.uint8)


@torch.library.custom_op("zpp::qgz_reduce_requantize", mutates_args=())
def qgz_reduce_requantize(recv: torch.Tensor, num_sources: int, num_pieces: int, shard_size: int,
                          in_bits: int, out_bits: int, block_size: int) -> torch.Tensor:
    """Per piece: float32 sum over sources of the dequantized pieces (one rounding per source),
    requantized to out_bits."""
    return qgz_reduce_requantize_ref(recv, num_sources, num_pieces, shard_size, in_bits, out_bits,
                                     block_size)


@qgz_reduce_requantize.register_fake
def _(recv, num_sources, num_pieces, shard_size, in_bits, out_bits, block_size):
    return recv.new_empty((num_pieces * piece_bytes(shard_size, block_size, out_bits),),
                          dtype=torch.uint8)


@torch.library.custom_op("zpp::qgz_dequantize_reduce", mutates_args=())
def qgz_dequantize_reduce(recv: torch.Tensor, num_sources: int, shard_size: int, bits: int,
                          block_size: int, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """[S] in dtype = (float32 sum over sources of the dequantized pieces) * scale."""
    return qgz_dequantize_reduce_ref(recv, num_sources, shard_size, bits, block_size, dtype, scale)


@qgz_dequantize_reduce.register_fake
def _(recv, num_sources, shard_size, bits, block_size, dtype, scale):
    return recv.new_empty((shard_size,), dtype=dtype)


if HAS_TRITON:
    @qgz_quantize.register_kernel("cuda")
    def _(grad, num_nodes, ranks_per_node, bits, block_size):
        return qgz_quantize_triton(grad, num_nodes, ranks_per_node, bits, block_size)

    @qgz_reduce_requantize.register_kernel("cuda")
    def _(recv, num_sources, num_pieces, shard_size, in_bits, out_bits, block_size):
        return qgz_reduce_requantize_triton(recv, num_sources, num_pieces, shard_size, in_bits,
                                            out_bits, block_size)

    @qgz_dequantize_reduce.register_kernel("cuda")
    def _(recv, num_sources, shard_size, bits, block_size, dtype, scale):
        return qgz_dequantize_reduce_triton(recv, num_sources, shard_size, bits, block_size, dtype,
                                            scale)

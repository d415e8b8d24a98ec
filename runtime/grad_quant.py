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
a 2-D tile of ``BPP`` whole blocks (``TUNING``, per kernel and input bits: 2K-8K elements) of
one piece. The tile lives in registers as 8 "lanes" (lane k = elements 8i + k), so one int32
word of INT4 codes (or two of INT8) is one column of the lanes: packing and unpacking are shifts
and masks of whole words, with no conversion instructions (the conversion unit runs at 1/8 of
the FP32 rate on Hopper). Block absmax: elementwise max over the lanes, then one row reduction.
The reduction kernels sum the sources inside the program (each source read once, all loads in
flight together; accumulators in registers), always on the fast path; a tile that holds inf
markers, scales below 2**-100 or a sum that overflowed (rare, tile-uniform) is done again on
the slow path, overwriting it. ``qgz_dequantize_reduce`` stores through a [block, element]
view, so that consecutive threads write consecutive 16-byte vectors (the compiler moves the
values through shared memory); stored from the lane layout, each warp instruction wrote
half-sectors spread over 32 lines, and fp32 outputs ran at ~30% of copy. The slice reordering
of ``qgz_quantize`` is only the address each program reads: no transpose copy.

Measured (H200, 256 MB gradient, 2 nodes x 4 ranks, see the benchmark): ``qgz_quantize`` runs
at copy bandwidth. ``qgz_reduce_requantize`` does not reach the target: with INT4 sources it is
bound by the instruction issue rate (sm_90 SASS: ~20.5 instructions per output element with 4
sources, of which 3 per code and source -- LOP3, FADD, FFMA -- are the floor of this exact
decode-and-fma scheme, against ~24 that an H200 issues in the time of a copy), and with INT8
sources by the bytes in flight per SM (a program waits for its loads, then computes).
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
    _MAGIC4 = tl.constexpr(12582920.0)   # 1.5 * 2**23 + 8: INT4 codes in offset binary (code + 8)
    _E23 = tl.constexpr(0x4B000000)      # the bits of 2**23
    _TINY = tl.constexpr(2.0 ** -100)  # below this a scale * 2**-16 could be subnormal (inexact)

    # Tiles. A program owns BPP consecutive blocks of one piece. The unit of work is the "octet"
    # (8 consecutive elements: one int32 word of INT4 codes, two of INT8 codes), and a tile is
    # held as 8 "lanes" of shape [G, BPP, REP, U]: lane k of octet (g, r, j, u) is element
    # 8 * (j*G*U + g*U + u) + k of block r. Memory accesses use tensors whose last axis is one
    # thread's vector (up to 16 bytes) and whose other axes are [G, BPP, REP, U, ...]; Triton's
    # blocked layouts then all put G (then BPP) across the threads and everything else inside a
    # thread, so lanes, codes and values change shape without moving data (no shared memory),
    # and a block's absmax is an in-thread max over REP*U*8 elements plus log2(G) shuffles.
    # INT4 packing and unpacking are shifts and masks of whole words (nibble k = lane k). U = 2
    # (quantize, dequantize) keeps a warp's input loads within fewer lines per instruction than
    # U = 4 (measured: bf16 quantize 84% -> 100% of copy); the exception is the output of
    # qgz_dequantize_reduce (see _tl_dequant_tile).

    @triton.jit
    def _tl_nanmax(a, b):
        """max that propagates NaN (one FMNMX.NAN on sm_80+; the interpreter's max does too)."""
        return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)

    @triton.jit
    def _tl_octets(G: tl.constexpr, BPP: tl.constexpr, REP: tl.constexpr, U: tl.constexpr,
                   OB: tl.constexpr):
        """(octet index in the tile [G, BPP, REP, U], octet index in its block [G, 1, REP, U]);
        OB = octets per block (the in-block index runs to the next power of 2)."""
        o = ((tl.arange(0, G) * U)[:, None, None, None] + (tl.arange(0, REP) * (G * U))[None, None, :, None]
             + tl.arange(0, U)[None, None, None, :])
        return o + (tl.arange(0, BPP) * OB)[None, :, None, None], o

    @triton.jit
    def _tl_split8(x, G: tl.constexpr, BPP: tl.constexpr, REP: tl.constexpr, U: tl.constexpr):
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
    def _tl_join8(x0, x1, x2, x3, x4, x5, x6, x7, G: tl.constexpr, BPP: tl.constexpr,
                  REP: tl.constexpr, U: tl.constexpr):
        """Inverse of _tl_split8."""
        e = tl.join(tl.join(x0, x4), tl.join(x2, x6))
        o = tl.join(tl.join(x1, x5), tl.join(x3, x7))
        return tl.reshape(tl.join(e, o), (G, BPP, REP, U, 8))

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

    # ---- codes -> values ----------------------------------------------------------------

    @triton.jit
    def _tl_field(w, e23, POS: tl.constexpr, WIDTH: tl.constexpr):
        """Offset-binary field u = code + 2**(WIDTH-1) of WIDTH bits at bit POS of w (POS + WIDTH
        <= 23) -> float32 code * 2**POS, exactly, in two instructions: one LOP3 keeps the field
        and sets the exponent of 2**23 (``e23``, held in a register: LOP3 takes one immediate),
        giving 2**23 + u * 2**POS; one FADD removes the bias."""
        MASK: tl.constexpr = ((1 << WIDTH) - 1) << POS
        OFF: tl.constexpr = 8388608.0 + (1 << (WIDTH - 1 + POS))
        return ((w & MASK) | e23).to(tl.float32, bitcast=True) - OFF

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
    def _tl_code_words(w_ptr, wbase, oc, omask, BITS: tl.constexpr, G: tl.constexpr,
                       BPP: tl.constexpr, REP: tl.constexpr, U: tl.constexpr,
                       MASKED: tl.constexpr):
        """Code words of the tile's octets: INT4 -> w [G, BPP, REP, U] (one word per octet);
        INT8 -> (wa, wb), each [G, BPP, REP, U] (elements 0..3 and 4..7 of the octet). Masked
        octets read as 0 words (codes 0)."""
        if BITS == 4:
            if MASKED:
                w = tl.load(w_ptr + wbase + oc, mask=omask, other=0)
            else:
                w = tl.load(w_ptr + wbase + oc)
            wb = w
        else:  # two words per octet; 16-byte vectors = 2 octets: [G, BPP, REP, U // 2, 4]
            oc2 = tl.reshape(oc, (G, BPP, REP, U // 2, 2))
            oc2, _ = tl.split(oc2)                     # first octet of each pair
            idx = (2 * oc2)[:, :, :, :, None] + tl.arange(0, 4)[None, None, None, None, :]
            if MASKED:
                m2 = tl.reshape(omask, (G, BPP, REP, U // 2, 2))
                m2, _ = tl.split(m2)
                ww = tl.load(w_ptr + wbase + idx, mask=m2[:, :, :, :, None], other=0)
            else:
                ww = tl.load(w_ptr + wbase + idx)
            w, wb = tl.split(tl.reshape(ww, (G, BPP, REP, U, 2)))
        return w, wb

    @triton.jit
    def _tl_acc_source(a0, a1, a2, a3, a4, a5, a6, a7, w32_ptr, f32_ptr, base, oc, omask, b0,
                       blk, nb, BITS: tl.constexpr, B: tl.constexpr, G: tl.constexpr,
                       BPP: tl.constexpr, REP: tl.constexpr, U: tl.constexpr,
                       MASKED: tl.constexpr, FIRST: tl.constexpr, SLOW: tl.constexpr,
                       EMU: tl.constexpr):
        """Accumulate the piece at word offset ``base`` (the tile's blocks) into the 8 lanes; also
        returns which blocks need the slow path (inf marker, or a scale below 2**-100). Per
        code: one LOP3 + one FADD (exact code * 2**POS) + one FFMA; per word one XOR (sign bits
        flipped: offset binary) and one shift (INT4 nibbles 5..7, INT8 bytes 2, 3)."""
        Q: tl.constexpr = (1 << (BITS - 1)) - 1
        OB: tl.constexpr = B // 8
        cw = tl.cast(nb, tl.int64) * (B * BITS // 32)          # code words per piece
        wt = base + b0.to(tl.int64) * (OB * BITS // 4)          # the tile's first code word
        if MASKED:
            s1 = tl.load(f32_ptr + base + cw + blk, mask=blk < nb, other=0.0)
        else:
            s1 = tl.load(f32_ptr + base + cw + blk)
        slow = (s1 == _INF) | ((s1 > 0.0) & (s1 < _TINY))
        s = s1[None, :, None, None]
        si = s == _INF
        e23 = _E23 | (nb >> 31)      # nb >= 0: a run-time zero keeps 2**23's bits in a register
        w, wb = _tl_code_words(w32_ptr, wt, oc, omask, BITS, G, BPP, REP, U, MASKED)
        if BITS == 4:
            w = w ^ -2004318072                                 # 0x88888888
            h = w >> 12                                         # nibbles 5..7 at bits 8..19
            s4 = s * 0.0625
            s8 = s * 0.00390625
            s12 = s * 0.000244140625
            s16 = s * 1.52587890625e-05
            a0 = _tl_acc_lane(a0, _tl_field(w, e23, 0, 4), s, s, si, 0, Q, FIRST, SLOW, EMU)
            a1 = _tl_acc_lane(a1, _tl_field(w, e23, 4, 4), s, s4, si, 4, Q, FIRST, SLOW, EMU)
            a2 = _tl_acc_lane(a2, _tl_field(w, e23, 8, 4), s, s8, si, 8, Q, FIRST, SLOW, EMU)
            a3 = _tl_acc_lane(a3, _tl_field(w, e23, 12, 4), s, s12, si, 12, Q, FIRST, SLOW, EMU)
            a4 = _tl_acc_lane(a4, _tl_field(w, e23, 16, 4), s, s16, si, 16, Q, FIRST, SLOW, EMU)
            a5 = _tl_acc_lane(a5, _tl_field(h, e23, 8, 4), s, s8, si, 8, Q, FIRST, SLOW, EMU)
            a6 = _tl_acc_lane(a6, _tl_field(h, e23, 12, 4), s, s12, si, 12, Q, FIRST, SLOW, EMU)
            a7 = _tl_acc_lane(a7, _tl_field(h, e23, 16, 4), s, s16, si, 16, Q, FIRST, SLOW, EMU)
        else:
            w = w ^ -2139062144                                 # 0x80808080
            wb = wb ^ -2139062144
            ha = w >> 16                                        # bytes 2, 3 at bits 0..15
            hb = wb >> 16
            s8 = s * 0.00390625
            a0 = _tl_acc_lane(a0, _tl_field(w, e23, 0, 8), s, s, si, 0, Q, FIRST, SLOW, EMU)
            a1 = _tl_acc_lane(a1, _tl_field(w, e23, 8, 8), s, s8, si, 8, Q, FIRST, SLOW, EMU)
            a2 = _tl_acc_lane(a2, _tl_field(ha, e23, 0, 8), s, s, si, 0, Q, FIRST, SLOW, EMU)
            a3 = _tl_acc_lane(a3, _tl_field(ha, e23, 8, 8), s, s8, si, 8, Q, FIRST, SLOW, EMU)
            a4 = _tl_acc_lane(a4, _tl_field(wb, e23, 0, 8), s, s, si, 0, Q, FIRST, SLOW, EMU)
            a5 = _tl_acc_lane(a5, _tl_field(wb, e23, 8, 8), s, s8, si, 8, Q, FIRST, SLOW, EMU)
            a6 = _tl_acc_lane(a6, _tl_field(hb, e23, 0, 8), s, s, si, 0, Q, FIRST, SLOW, EMU)
            a7 = _tl_acc_lane(a7, _tl_field(hb, e23, 8, 8), s, s8, si, 8, Q, FIRST, SLOW, EMU)
        return a0, a1, a2, a3, a4, a5, a6, a7, slow

    @triton.jit
    def _tl_sum_sources(w32_ptr, f32_ptr, base0, stride, oc, omask, b0, blk, nb, K: tl.constexpr,
                        BITS: tl.constexpr, B: tl.constexpr, G: tl.constexpr,
                        BPP: tl.constexpr, REP: tl.constexpr, U: tl.constexpr,
                        MASKED: tl.constexpr, SLOW: tl.constexpr, EMU: tl.constexpr):
        """Sum, in source order, of the pieces at word offsets ``base0 + k * stride`` (k < K):
        acc = code_0 * s_0, then acc = fma(code_k, s_k, acc). Unrolled and branch-free, so that
        the loads of all sources can be in flight together. Also returns whether the tile needs
        the slow path (then the fast sum is garbage, and the caller does the tile again)."""
        z = tl.zeros((G, BPP, REP, U), tl.float32)
        a0, a1, a2, a3, a4, a5, a6, a7, slow = _tl_acc_source(
            z, z, z, z, z, z, z, z, w32_ptr, f32_ptr, base0, oc, omask, b0, blk, nb, BITS, B, G, BPP,
            REP, U, MASKED, True, SLOW, EMU)
        for k in tl.static_range(1, K):
            a0, a1, a2, a3, a4, a5, a6, a7, sk = _tl_acc_source(
                a0, a1, a2, a3, a4, a5, a6, a7, w32_ptr, f32_ptr, base0 + k * stride, oc, omask,
                b0, blk, nb, BITS, B, G, BPP, REP, U, MASKED, False, SLOW, EMU)
            slow = slow | sk
        return a0, a1, a2, a3, a4, a5, a6, a7, tl.max(slow.to(tl.int32), axis=0) > 0

    # ---- values -> codes ----------------------------------------------------------------

    @triton.jit
    def _tl_scales(x0, x1, x2, x3, x4, x5, x6, x7, Q: tl.constexpr):
        """Per block: (scale, inv, bad). absmax with NaN propagated (FMNMX.NAN, |.| operands:
        one instruction per element); a block is non-finite (bad) unless absmax < inf."""
        m = _tl_nanmax(_tl_nanmax(_tl_nanmax(tl.abs(x0), tl.abs(x1)), _tl_nanmax(tl.abs(x2), tl.abs(x3))),
                       _tl_nanmax(_tl_nanmax(tl.abs(x4), tl.abs(x5)), _tl_nanmax(tl.abs(x6), tl.abs(x7))))
        amax = tl.reduce(tl.reduce(tl.reduce(m, 3, _tl_nanmax), 2, _tl_nanmax), 0, _tl_nanmax)
        bad = ~(amax < _INF)
        qv = tl.full(amax.shape, Q * 1.0, tl.float32)
        scale = tl.where(bad, _INF, tl.math.div_rn(amax, qv))
        pos = (amax > 0.0) & ~bad
        inv = tl.where(pos, tl.minimum(tl.math.div_rn(qv, tl.where(pos, amax, 1.0)), _FLT_MAX), 0.0)
        return scale, inv, bad

    @triton.jit
    def _tl_code(x, inv, BITS: tl.constexpr, CHECK: tl.constexpr):
        """int32 whose low bits are the code of x: two's complement (INT8) or offset binary
        code + 8 (INT4), see _MAGIC. |x * inv| <= q (1 + 2**-24)**2 < q + 1/2: no clamp.
        CHECK: non-finite x (found only in blocks with inv = 0, whose finite values get code
        0) get NaN -> -(q+1), +inf -> q, -inf -> -q."""
        Q: tl.constexpr = (1 << (BITS - 1)) - 1
        OFF: tl.constexpr = 8 if BITS == 4 else 0
        if BITS == 4:
            c = (x * inv + _MAGIC4).to(tl.int32, bitcast=True)
        else:
            c = (x * inv + _MAGIC).to(tl.int32, bitcast=True)
        if CHECK:
            sp = tl.where(x != x, -Q - 1, tl.where(x > 0.0, Q, -Q)) + OFF
            c = tl.where(tl.abs(x) < _INF, c, sp)
        return c

    @triton.jit
    def _tl_quant_store(x0, x1, x2, x3, x4, x5, x6, x7, inv, w_ptr, wbase, oc, omask,
                        BITS: tl.constexpr, G: tl.constexpr, BPP: tl.constexpr,
                        REP: tl.constexpr, U: tl.constexpr, MASKED: tl.constexpr,
                        CHECK: tl.constexpr):
        """Codes of the 8 lanes (inv [1, BPP, 1, 1]) packed and stored at word wbase + ..."""
        c0 = _tl_code(x0, inv, BITS, CHECK)
        c1 = _tl_code(x1, inv, BITS, CHECK)
        c2 = _tl_code(x2, inv, BITS, CHECK)
        c3 = _tl_code(x3, inv, BITS, CHECK)
        c4 = _tl_code(x4, inv, BITS, CHECK)
        c5 = _tl_code(x5, inv, BITS, CHECK)
        c6 = _tl_code(x6, inv, BITS, CHECK)
        c7 = _tl_code(x7, inv, BITS, CHECK)
        if BITS == 4:
            # offset-binary nibbles have nothing above bit 3 (below bit 22), so shifted adds
            # (IMAD / LEA) pack four of them into 16 clean bits; one PRMT, one XOR per word
            lo = c0 + (c1 << 4) + (c2 << 8) + (c3 << 12)
            hi = c4 + (c5 << 4) + (c6 << 8) + (c7 << 12)
            w = ((lo & 0xFFFF) | (hi << 16)) ^ -2004318072    # 0x88888888: back to two's compl.
            if MASKED:
                tl.store(w_ptr + wbase + oc, w, mask=omask)
            else:
                tl.store(w_ptr + wbase + oc, w)
        else:
            wa = (c0 & 255) | ((c1 & 255) << 8) | ((c2 & 255) << 16) | (c3 << 24)
            wb = (c4 & 255) | ((c5 & 255) << 8) | ((c6 & 255) << 16) | (c7 << 24)
            ww = tl.reshape(tl.join(wa, wb), (G, BPP, REP, U // 2, 4))
            oc2, _ = tl.split(tl.reshape(oc, (G, BPP, REP, U // 2, 2)))
            idx = (2 * oc2)[:, :, :, :, None] + tl.arange(0, 4)[None, None, None, None, :]
            if MASKED:
                m2, _ = tl.split(tl.reshape(omask, (G, BPP, REP, U // 2, 2)))
                tl.store(w_ptr + wbase + idx, ww, mask=m2[:, :, :, :, None])
            else:
                tl.store(w_ptr + wbase + idx, ww)

    # ---- kernels --------------------------------------------------------------------------

    @triton.jit
    def _tl_load_grad(x_ptr, xb, oc, oin, lim, OB: tl.constexpr, G: tl.constexpr,
                      BPP: tl.constexpr, REP: tl.constexpr, U: tl.constexpr, V: tl.constexpr,
                      MODE: tl.constexpr, MASKED: tl.constexpr, PAD: tl.constexpr):
        """The tile's elements as 8 float32 lanes. xb: the tile's first element (int64); lim:
        elements of the tile inside the shard (masked loads read 0 past it, and in the padding
        octets of blocks whose octet count is no power of 2). MODE 0: float elements in V-element
        (16-byte) vectors; 1: bfloat16 elements read as int16 bits; 2: bfloat16 pairs read as
        int32 (one instruction per element to decode); 3: float16 pairs read as int32."""
        if MODE >= 2:   # [G, BPP, REP, U, 4] pairs; an octet is 4 pairs (16 bytes)
            idx = (oc * 4)[:, :, :, :, None] + tl.arange(0, 4)[None, None, None, None, :]
            if MASKED:
                msk = idx * 2 < lim
                if PAD:
                    msk = msk & (oin < OB)[:, :, :, :, None]
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
            idx = ((oc * 8)[:, :, :, :, None, None] + (tl.arange(0, 8 // V) * V)[None, None, None, None, :, None]
                   + tl.arange(0, V)[None, None, None, None, None, :])
            if MASKED:
                msk = idx < lim
                if PAD:
                    msk = msk & (oin < OB)[:, :, :, :, None, None]
                xi = tl.load(x_ptr + xb + idx, mask=msk, other=0)
            else:
                xi = tl.load(x_ptr + xb + idx)
            if MODE == 1:
                x = (xi.to(tl.int32) << 16).to(tl.float32, bitcast=True)
            else:
                x = xi.to(tl.float32)
            x = tl.reshape(x, (G, BPP, REP, U, 8))
        return _tl_split8(x, G, BPP, REP, U)

    @triton.jit
    def _qgz_quantize_kernel(x_ptr, w32_ptr, f32_ptr, S, nb, N, R, BITS: tl.constexpr,
                             B: tl.constexpr, BPP: tl.constexpr, G: tl.constexpr,
                             REP: tl.constexpr, U: tl.constexpr, V: tl.constexpr,
                             MODE: tl.constexpr, EVEN: tl.constexpr):
        Q: tl.constexpr = (1 << (BITS - 1)) - 1
        OB: tl.constexpr = B // 8
        PAD: tl.constexpr = (OB & (OB - 1)) != 0       # octets per block not a power of 2
        MASKED: tl.constexpr = (not EVEN) or PAD
        pid = tl.program_id(0)
        o = tl.program_id(1)            # output piece: destination local rank l outer, node m inner
        l = o // N
        mm = o % N
        shard = mm * R + l              # the reorder: read shard (m, l) of g viewed [N, R, S]
        blk = pid * BPP + tl.arange(0, BPP)
        oc, oin = _tl_octets(G, BPP, REP, U, OB)
        omask = (oin < OB) & (blk < nb)[None, :, None, None]      # codes to store
        t0 = pid.to(tl.int64) * (BPP * B)
        xb = shard.to(tl.int64) * S + t0
        lim = tl.minimum(S - t0, BPP * B).to(tl.int32)           # elements of the tile in the shard
        x0, x1, x2, x3, x4, x5, x6, x7 = _tl_load_grad(x_ptr, xb, oc, oin, lim, OB, G, BPP, REP, U,
                                                       V, MODE, MASKED, PAD)
        scale, inv, bad = _tl_scales(x0, x1, x2, x3, x4, x5, x6, x7, Q)
        inv4 = inv[None, :, None, None]
        pw = tl.cast(nb, tl.int64) * (B * BITS // 32 + 1)     # piece size in words
        wbase = o.to(tl.int64) * pw + pid.to(tl.int64) * (BPP * OB * BITS // 4)
        _tl_quant_store(x0, x1, x2, x3, x4, x5, x6, x7, inv4, w32_ptr, wbase, oc, omask, BITS, G,
                        BPP, REP, U, MASKED, False)
        sb = o.to(tl.int64) * pw + tl.cast(nb, tl.int64) * (B * BITS // 32)
        if MASKED:
            tl.store(f32_ptr + sb + blk, scale, mask=blk < nb)
        else:
            tl.store(f32_ptr + sb + blk, scale)
        if tl.max(bad.to(tl.int32), axis=0) > 0:    # RARE: non-finite values in this tile
            # Rewrite the tile's codes with the special ones, from the input read again (nothing
            # of the common path stays live for this branch). lim1 == lim in effect; a
            # different bound keeps the compiler from holding the first load's mask.
            lim1 = tl.minimum(S - t0, BPP * B + 16).to(tl.int32)
            x0, x1, x2, x3, x4, x5, x6, x7 = _tl_load_grad(x_ptr, xb, oc, oin, lim1, OB, G, BPP,
                                                           REP, U, V, MODE, MASKED, PAD)
            _tl_quant_store(x0, x1, x2, x3, x4, x5, x6, x7, inv4, w32_ptr, wbase, oc, omask, BITS,
                            G, BPP, REP, U, MASKED, True)

    @triton.jit
    def _tl_reduce_tile(in_w32, in_f32, out_w32, out_f32, base0, stride, obase, oc, omask, b0,
                        blk, nb, K: tl.constexpr, IN_BITS: tl.constexpr, OUT_BITS: tl.constexpr,
                        B: tl.constexpr, G: tl.constexpr, BPP: tl.constexpr, REP: tl.constexpr,
                        U: tl.constexpr, MASKED: tl.constexpr, SLOW: tl.constexpr,
                        CHECK: tl.constexpr, EMU: tl.constexpr):
        """Sum the sources over the tile, requantize, store; returns (some block non-finite,
        the tile needs the slow path)."""
        Q: tl.constexpr = (1 << (OUT_BITS - 1)) - 1
        OB: tl.constexpr = B // 8
        a0, a1, a2, a3, a4, a5, a6, a7, slow = _tl_sum_sources(
            in_w32, in_f32, base0, stride, oc, omask, b0, blk, nb, K, IN_BITS, B, G, BPP, REP, U,
            MASKED, SLOW, EMU)
        scale, inv, bad = _tl_scales(a0, a1, a2, a3, a4, a5, a6, a7, Q)
        wb = obase + b0.to(tl.int64) * (OB * OUT_BITS // 4)
        _tl_quant_store(a0, a1, a2, a3, a4, a5, a6, a7, inv[None, :, None, None], out_w32, wb, oc,
                        omask, OUT_BITS, G, BPP, REP, U, MASKED, CHECK)
        sb = obase + tl.cast(nb, tl.int64) * (B * OUT_BITS // 32)
        if MASKED:
            tl.store(out_f32 + sb + blk, scale, mask=blk < nb)
        else:
            tl.store(out_f32 + sb + blk, scale)
        return tl.max(bad.to(tl.int32), axis=0) > 0, slow

    @triton.jit
    def _qgz_reduce_requantize_kernel(in_w32, in_f32, out_w32, out_f32, P, nb, K: tl.constexpr,
                                      IN_BITS: tl.constexpr, OUT_BITS: tl.constexpr,
                                      B: tl.constexpr, BPP: tl.constexpr, G: tl.constexpr,
                                      REP: tl.constexpr, U: tl.constexpr, EVEN: tl.constexpr,
                                      EMU: tl.constexpr):
        OB: tl.constexpr = B // 8
        PAD: tl.constexpr = (OB & (OB - 1)) != 0
        MASKED: tl.constexpr = (not EVEN) or PAD
        pid = tl.program_id(0)
        p = tl.program_id(1)
        b0 = pid * BPP
        blk = b0 + tl.arange(0, BPP)
        oc, oin = _tl_octets(G, BPP, REP, U, OB)
        omask = (oin < OB) & (blk < nb)[None, :, None, None]
        pw_in = tl.cast(nb, tl.int64) * (B * IN_BITS // 32 + 1)      # piece size in words
        pw_out = tl.cast(nb, tl.int64) * (B * OUT_BITS // 32 + 1)
        # source k, piece p at word (k * P + p) * pw_in; every source read once
        base0 = p.to(tl.int64) * pw_in
        stride = P * pw_in
        obase = p.to(tl.int64) * pw_out
        # The fast path first, unconditionally (no wait for the scales before the codes are
        # loaded). Sums of finite products have no NaN; they may overflow to +-inf. Either rare
        # case (tile-uniform) does the tile again, overwriting what the fast path stored.
        bad, slow = _tl_reduce_tile(in_w32, in_f32, out_w32, out_f32, base0, stride, obase, oc,
                                    omask, b0, blk, nb, K, IN_BITS, OUT_BITS, B, G, BPP, REP, U,
                                    MASKED, False, False, EMU)
        if slow:     # RARE: inf markers or tiny scales
            _tl_reduce_tile(in_w32, in_f32, out_w32, out_f32, base0, stride, obase, oc, omask, b0,
                            blk, nb, K, IN_BITS, OUT_BITS, B, G, BPP, REP, U, MASKED, True, True,
                            EMU)
        elif bad:    # RARE: a sum overflowed
            _tl_reduce_tile(in_w32, in_f32, out_w32, out_f32, base0, stride, obase, oc, omask, b0,
                            blk, nb, K, IN_BITS, OUT_BITS, B, G, BPP, REP, U, MASKED, False, True,
                            EMU)

    @triton.jit
    def _tl_dequant_tile(in_w32, in_f32, out_ptr, pw, oc, omask, b0, blk, nb, lim, scale,
                         K: tl.constexpr, BITS: tl.constexpr, B: tl.constexpr, G: tl.constexpr,
                         BPP: tl.constexpr, REP: tl.constexpr, U: tl.constexpr,
                         MASKED: tl.constexpr, PAD: tl.constexpr, SLOW: tl.constexpr,
                         ENCODE_BF16: tl.constexpr, EMU: tl.constexpr):
        """Sum the sources over the tile, times ``scale``, stored in the output dtype; returns
        whether the tile needs the slow path."""
        a0, a1, a2, a3, a4, a5, a6, a7, slow = _tl_sum_sources(
            in_w32, in_f32, pw * 0, pw, oc, omask, b0, blk, nb, K, BITS, B, G, BPP, REP, U, MASKED,
            SLOW, EMU)
        y = _tl_join8(a0, a1, a2, a3, a4, a5, a6, a7, G, BPP, REP, U) * scale
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
    def _qgz_dequantize_reduce_kernel(in_w32, in_f32, out_ptr, S, nb, scale, K: tl.constexpr,
                                      BITS: tl.constexpr, B: tl.constexpr, BPP: tl.constexpr,
                                      G: tl.constexpr, REP: tl.constexpr, U: tl.constexpr,
                                      EVEN: tl.constexpr, ENCODE_BF16: tl.constexpr,
                                      EMU: tl.constexpr):
        OB: tl.constexpr = B // 8
        PAD: tl.constexpr = (OB & (OB - 1)) != 0
        MASKED: tl.constexpr = (not EVEN) or PAD
        pid = tl.program_id(0)
        b0 = pid * BPP
        blk = b0 + tl.arange(0, BPP)
        oc, oin = _tl_octets(G, BPP, REP, U, OB)
        omask = (oin < OB) & (blk < nb)[None, :, None, None]
        lim = tl.minimum(S - pid.to(tl.int64) * (BPP * B), BPP * B).to(tl.int32)
        pw = tl.cast(nb, tl.int64) * (B * BITS // 32 + 1)
        # Fast path unconditionally; a tile with inf markers or tiny scales (RARE, tile-uniform)
        # is done again, overwriting it.
        if _tl_dequant_tile(in_w32, in_f32, out_ptr, pw, oc, omask, b0, blk, nb, lim, scale, K,
                            BITS, B, G, BPP, REP, U, MASKED, PAD, False, ENCODE_BF16, EMU):
            _tl_dequant_tile(in_w32, in_f32, out_ptr, pw, oc, omask, b0, blk, nb, lim, scale, K,
                             BITS, B, G, BPP, REP, U, MASKED, PAD, True, ENCODE_BF16, EMU)


# Per kernel and input bits (dequantize_reduce: and bytes per output element): elements per
# program tile, warps per program, and U, the octets of one thread vector (see the tile comment
# above the kernels). A thread holds tile_elems / (32 * num_warps) elements. Chosen by sweeps of
# examples/bench_grad_kernels.py on an H200: INT8 sources reduce fastest with small tiles (more
# programs in flight per SM), INT4 sources with large ones (per-block work amortized: that
# kernel is instruction bound); INT4 -> bf16 dequantize_reduce ran at 88% of copy with
# U = 4 and 4096 elements against 83% with the fp32 output's choice (which got 79% with it).
TUNING = {
    "quantize": {4: dict(tile_elems=8192, num_warps=4, octets=2),
                 8: dict(tile_elems=8192, num_warps=4, octets=2)},
    "reduce_requantize": {4: dict(tile_elems=8192, num_warps=4, octets=4),
                          8: dict(tile_elems=2048, num_warps=4, octets=4)},
    "dequantize_reduce": {(4, 2): dict(tile_elems=4096, num_warps=4, octets=4),
                          (4, 4): dict(tile_elems=2048, num_warps=4, octets=2),
                          (8, 2): dict(tile_elems=2048, num_warps=4, octets=2),
                          (8, 4): dict(tile_elems=2048, num_warps=4, octets=2)},
}


def _tile(kernel: str, key, block_size: int, nb: int, tile_elems, num_warps):
    """(BPP blocks per program, G threads per block, REP octet vectors per thread per block, U,
    warps); ``key`` indexes TUNING[kernel]."""
    tune = TUNING[kernel][key]
    warps = num_warps or tune["num_warps"]
    opr = triton.next_power_of_2(block_size // 8)           # octets per block, padded
    U = tune["octets"]
    bpp = triton.next_power_of_2(max(1, (tile_elems or tune["tile_elems"]) // (8 * opr)))
    bpp = min(bpp, triton.next_power_of_2(nb))              # small inputs: no masked blocks
    per_thread = max(U, bpp * opr // (32 * warps))          # octets per thread in the tile
    per_row = min(opr, per_thread)                          # ... of one block
    return bpp, opr // per_row, per_row // U, U, warps


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


def triton_handles_block(block_size: int) -> bool:
    """The kernels pair 8-element octets into 16-byte accesses, which needs an even number of
    octets per block; the ops send other block sizes to the twins."""
    return block_size % 16 == 0


def _require_triton(block_size: int) -> None:
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed")
    if not triton_handles_block(block_size):
        raise ValueError(f"the Triton qgZ kernels need a block_size that is a multiple of 16, got {block_size}")


def _vec(esize: int) -> int:
    """Elements per 16-byte vector (at most the 8 of an octet)."""
    return min(8, 16 // esize)


def qgz_quantize_triton(grad, num_nodes, ranks_per_node, bits, block_size, *, tile_elems=None,
                        num_warps=None):
    """Triton launcher of ``zpp::qgz_quantize`` (CPU tensors work under TRITON_INTERPRET=1)."""
    _require_triton(block_size)
    S = _check_quantize_args(grad, num_nodes, ranks_per_node, bits, block_size)
    grad = grad.contiguous()
    nb = num_blocks(S, block_size)
    P = num_nodes * ranks_per_node
    out = torch.empty(P * piece_bytes(S, block_size, bits), dtype=torch.uint8, device=grad.device)
    bpp, G, rep, U, warps = _tile("quantize", bits, block_size, nb, tile_elems, num_warps)
    # 16-bit inputs are read as int32 pairs (exact, cheap decode) when shards keep pairs aligned
    pairs = grad.element_size() == 2 and S % 2 == 0 and grad.data_ptr() % 4 == 0
    if grad.dtype == torch.float32:
        mode, x = 0, grad
    elif pairs:
        mode, x = (2 if grad.dtype == torch.bfloat16 else 3), grad.view(torch.int32)
    elif grad.dtype == torch.bfloat16:
        mode, x = 1, grad.view(torch.int16)     # the interpreter has no bfloat16 loads
    else:
        mode, x = 0, grad
    even = S % (bpp * block_size) == 0
    with _LaunchCtx(grad):
        _qgz_quantize_kernel[(triton.cdiv(nb, bpp), P)](
            x, out.view(torch.int32), out.view(torch.float32), S, nb, num_nodes, ranks_per_node,
            BITS=bits, B=block_size, BPP=bpp, G=G, REP=rep, U=U, V=_vec(grad.element_size()),
            MODE=mode, EVEN=even, num_warps=warps, enable_fp_fusion=False)
    return out


def qgz_reduce_requantize_triton(recv, num_sources, num_pieces, shard_size, in_bits, out_bits,
                                 block_size, *, tile_elems=None, num_warps=None):
    """Triton launcher of ``zpp::qgz_reduce_requantize``."""
    _require_triton(block_size)
    _check_reduce_args(recv, num_sources, num_pieces, shard_size, in_bits, block_size)
    _check_bits(out_bits, "out_bits")
    recv = _aligned_u8(recv)
    nb = num_blocks(shard_size, block_size)
    out = torch.empty(num_pieces * piece_bytes(shard_size, block_size, out_bits),
                      dtype=torch.uint8, device=recv.device)
    bpp, G, rep, U, warps = _tile("reduce_requantize", in_bits, block_size, nb, tile_elems,
                                   num_warps)
    with _LaunchCtx(recv):
        _qgz_reduce_requantize_kernel[(triton.cdiv(nb, bpp), num_pieces)](
            recv.view(torch.int32), recv.view(torch.float32), out.view(torch.int32),
            out.view(torch.float32), num_pieces, nb, K=num_sources, IN_BITS=in_bits,
            OUT_BITS=out_bits, B=block_size, BPP=bpp, G=G, REP=rep, U=U, EVEN=(nb % bpp == 0),
            EMU=_interpreting(), num_warps=warps, enable_fp_fusion=False)
    return out


def qgz_dequantize_reduce_triton(recv, num_sources, shard_size, bits, block_size, dtype, scale,
                                 *, tile_elems=None, num_warps=None):
    """Triton launcher of ``zpp::qgz_dequantize_reduce``."""
    _require_triton(block_size)
    _check_reduce_args(recv, num_sources, 1, shard_size, bits, block_size)
    _check_dtype(dtype)
    recv = _aligned_u8(recv)
    nb = num_blocks(shard_size, block_size)
    out = torch.empty(shard_size, dtype=dtype, device=recv.device)
    bpp, G, rep, U, warps = _tile("dequantize_reduce", (bits, out.element_size()), block_size,
                                   nb, tile_elems, num_warps)
    encode = _interpreting() and dtype == torch.bfloat16
    with _LaunchCtx(recv):
        _qgz_dequantize_reduce_kernel[(triton.cdiv(nb, bpp),)](
            recv.view(torch.int32), recv.view(torch.float32),
            out.view(torch.int16) if encode else out, shard_size, nb, float(scale),
            K=num_sources, BITS=bits, B=block_size, BPP=bpp, G=G, REP=rep, U=U,
            EVEN=(shard_size % (bpp * block_size) == 0),
            ENCODE_BF16=encode, EMU=_interpreting(), num_warps=warps, enable_fp_fusion=False)
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
    # Other block sizes are only reachable by calling the ops directly (Config allows powers of 2).
    @qgz_quantize.register_kernel("cuda")
    def _(grad, num_nodes, ranks_per_node, bits, block_size):
        launch = qgz_quantize_triton if triton_handles_block(block_size) else qgz_quantize_ref
        return launch(grad, num_nodes, ranks_per_node, bits, block_size)

    @qgz_reduce_requantize.register_kernel("cuda")
    def _(recv, num_sources, num_pieces, shard_size, in_bits, out_bits, block_size):
        launch = qgz_reduce_requantize_triton if triton_handles_block(block_size) else qgz_reduce_requantize_ref
        return launch(recv, num_sources, num_pieces, shard_size, in_bits, out_bits, block_size)

    @qgz_dequantize_reduce.register_kernel("cuda")
    def _(recv, num_sources, shard_size, bits, block_size, dtype, scale):
        launch = qgz_dequantize_reduce_triton if triton_handles_block(block_size) else qgz_dequantize_reduce_ref
        return launch(recv, num_sources, shard_size, bits, block_size, dtype, scale)

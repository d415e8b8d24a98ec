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
    code    = rint(x * inv)                    of the exact product, rint = round half to even
    value   = code * scale                     float32 product

``|x * inv| <= q (1 + 2**-24) < q + 1/2``, so ``code`` never leaves ``[-q, q]`` (the twin
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
contraction), explicit ``tl.fma`` where the formula has one; divisions by ``tl.math.div_rn``; rint
and float->int via ``bitcast(t + 1.5 * 2**23)`` (exact round-half-even for ``|t| < 2**22``); codes
-> float via ``bitcast(field ^ E) - bias`` (``_tl_decode``), exact. Under the interpreter (whose fma
rounds twice and whose bf16 conversion truncates) the fma is emulated as in the twin and bf16 is
decoded / encoded with bit operations. The GPU path is checked against the twins by
``examples/bench_grad_kernels.py`` (column "exact").

Kernel design (memory bound; target >= 85% of copy bandwidth at >= 256 MB): a program works on 2-D
tiles of ``BPP`` whole blocks (``TUNING``, per kernel and input bits: 2K-8K elements) of one piece,
one tile per program except in ``qgz_reduce_requantize``. The tile lives in registers as 8 "lanes"
(lane k = elements 8i + k), so one int32 word of INT4 codes (or two of INT8) is one column of the
lanes: packing and unpacking are shifts and masks of whole words, with no conversion instructions
(the conversion unit runs at 1/8 of the FP32 rate on Hopper). Block absmax: elementwise max over the
lanes, then one row reduction. The reduction kernels sum the sources inside the program (each source
read once, all loads in flight together; accumulators in registers), always on the fast path; a tile
that needs more (rare, tile-uniform) is done again on the slow path, overwriting it: in
``qgz_dequantize_reduce`` one that holds an inf marker, in ``qgz_reduce_requantize`` one with a
block whose sum is not finite (an inf marker makes it so: code * inf is +-inf or NaN, and stays so).
``qgz_dequantize_reduce`` stores through a [block, element] view, so that consecutive threads write
consecutive 16-byte vectors (the compiler moves the values through shared memory); stored from the
lane layout, each warp instruction wrote half-sectors spread over 32 lines, far below copy bandwidth
for fp32 outputs. The slice reordering of ``qgz_quantize`` is only the address each program reads:
no transpose copy.

The two reduction kernels load and sum their sources alike (``_tl_load_tile``, ``_tl_sum_tile``).
The decode yields each code itself (``_tl_decode``), not code * 2**POS, so the FFMA takes the
block's scale as loaded (no scaled copies of it, no exactness condition on it: subnormal scales stay
on the fast path); INT8 codes are read as 16-byte vectors. ``qgz_reduce_requantize`` reads K sources
per output element: there instructions and load latency show. Its grid is persistent:
``programs_per_sm`` programs per SM, split over the pieces, all resident at once (the launcher caps
their registers to fit), walk the full tiles of their piece (unmasked), each issuing the next tile's
loads (all sources, 16-byte vectors) before the current tile's arithmetic, so that a program's loads
are in flight while it computes; a piece's partial last tile comes after the loop. A program is one
warp (TUNING): its blocks, their absmax and their scales stay within the warp, so the loop has no
shared memory and no barrier (sm_90 SASS); with 4 warps Triton split a tile's blocks over the warps,
and each tile took barriers to move the scales and the absmax between them. A thread holds
``elems_per_thread`` elements, so that the prefetched words fit in registers. With INT4 sources that
one tile in flight per program left the loads waiting on DRAM, so a program also asks L2 for the
tile after it (``prefetch.global.L2``, one line per thread: no registers). Block scales are loaded
and stored through a block index laid out as the tile (``_tl_block_ids``): laid out by its
contiguity, a [BPP] vector of scales went through shared memory, with two barriers per source and
tile (in one-warp programs the index keeps them in registers; with 4 warps the conversion remains).
Packing multiplies by a run-time 16 or 256 (IMAD chains): LLVM would distribute constant shifts over
the sums, costing more instructions.

With INT4 sources ``qgz_reduce_requantize`` is bound by instructions, not bytes: the exact
decode-and-fma (LOP3, FADD, FFMA per code and source, one shift per word) is most of what it
issues per output element. Tiles are assigned statically: claiming them from atomic counters made
the compiler issue the next tile's loads later in the loop. The measurements behind these choices
are in PERFORMANCE.md ("Kernel design: what was measured").
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
    "elems_per_thread",
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
    t = x0.double() * inv.double().unsqueeze(-1)         # exact: 24 + 24 significant bits
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
    # mantissa bits, two's complement (``_tl_code``); a field ORed or XORed into the mantissa of
    # a power of 2 reads back as that power plus the field (``_tl_decode``).
    _MAGIC = tl.constexpr(12582912.0)

    # Tiles. A tile is BPP consecutive blocks of one piece (a program does one, or in
    # qgz_reduce_requantize a sequence of them). The unit of work is the "octet"
    # (8 consecutive elements: one int32 word of INT4 codes, two of INT8 codes), and a tile is
    # held as 8 "lanes" of shape [G, BPP, REP, U]: lane k of octet (g, r, j, u) is element
    # 8 * (j*G*U + g*U + u) + k of block r. Memory accesses use tensors whose last axis is one
    # thread's vector (up to 16 bytes) and whose other axes are [G, BPP, REP, U, ...]; Triton's
    # blocked layouts then all put G (then BPP) across the threads and everything else inside a
    # thread, so lanes, codes and values change shape without moving data (no shared memory),
    # and a block's absmax is an in-thread max over REP*U*8 elements plus log2(G) shuffles.
    # INT4 packing and unpacking are shifts and masks of whole words (nibble k = lane k). U = 2
    # (quantize, dequantize) keeps a warp's input loads within fewer lines per instruction than
    # U = 4; the exception is the output of
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
    def _tl_code(x, inv, BITS: tl.constexpr, CHECK: tl.constexpr, EMU: tl.constexpr):
        """int32 whose low BITS bits are the code of x in offset binary (code + 2**(BITS-1)),
        with zeros above them up to bit 21: rint of the exact product x * inv in one FFMA with
        _MAGIC plus the offset (an even number: its ties go to even as the product's do), so
        that packing adds codes without masks or borrows. |x * inv| <= q (1 + 2**-24) < q + 1/2:
        no clamp.
        CHECK: non-finite x (found only in blocks with inv = 0, whose finite values get code
        0) get NaN -> -(q+1), +inf -> q, -inf -> -q."""
        Q: tl.constexpr = (1 << (BITS - 1)) - 1
        c = _tl_fma(x, inv, tl.zeros_like(x) + (_MAGIC + (Q + 1)), EMU).to(tl.int32, bitcast=True)
        if CHECK:
            sp = tl.where(x != x, -Q - 1, tl.where(x > 0.0, Q, -Q)) + (Q + 1)
            c = tl.where(tl.abs(x) < _INF, c, sp)
        return c

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
                             MODE: tl.constexpr, EVEN: tl.constexpr, EMU: tl.constexpr):
        Q: tl.constexpr = (1 << (BITS - 1)) - 1
        OB: tl.constexpr = B // 8
        PAD: tl.constexpr = (OB & (OB - 1)) != 0       # octets per block not a power of 2
        MASKED: tl.constexpr = (not EVEN) or PAD
        pid = tl.program_id(0)
        o = tl.program_id(1)            # output piece: destination local rank r outer, node m inner
        local = o // N
        mm = o % N
        shard = mm * R + local          # the reorder: read shard (m, r) of g viewed [N, R, S]
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
        zero = nb >> 31                                            # nb >= 0: a run-time 0
        _tl_quant_store(x0, x1, x2, x3, x4, x5, x6, x7, inv4, w32_ptr, wbase, oc, omask, blk, nb,
                        zero, BITS, G, BPP, REP, U, OB, MASKED, False, EMU)
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
            _tl_quant_store(x0, x1, x2, x3, x4, x5, x6, x7, inv4, w32_ptr, wbase, oc, omask, blk,
                            nb, zero, BITS, G, BPP, REP, U, OB, MASKED, True, EMU)

    # ---- codes -> values: the sources of the reduction kernels, loaded and summed ------

    @triton.jit
    def _tl_decode(w, zero, MASK: tl.constexpr, POS: tl.constexpr, WIDTH: tl.constexpr):
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
    def _tl_marker_value(c, Q: tl.constexpr):
        """What code c of a block whose scale is the inf marker stands for: -(q+1) -> NaN,
        q -> +inf, -q -> -inf, any other code -> 0."""
        v = tl.where(c == Q * 1.0, _INF, tl.where(c == -Q * 1.0, -_INF, 0.0))
        return tl.where(c == -Q - 1.0, _INF - _INF, v)        # inf - inf = NaN

    @triton.jit
    def _tl_acc_code(acc, c, s, Q: tl.constexpr, FIRST: tl.constexpr, SLOW: tl.constexpr,
                     EMU: tl.constexpr):
        """acc + c * s with one rounding (the first source: c * s). Slow path: blocks whose scale
        is the inf marker contribute ``_tl_marker_value``."""
        x = c
        y = s
        if SLOW:
            marker = s == _INF
            x = tl.where(marker, _tl_marker_value(c, Q), c)
            y = tl.where(marker, 1.0, s)
        if FIRST:
            r = x * y
        else:
            r = _tl_fma(x, y, acc, EMU)
        return r

    @triton.jit
    def _tl_pair_words(G: tl.constexpr, BPP: tl.constexpr, REP: tl.constexpr, U: tl.constexpr,
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
    def _tl_pair_mask(oin8, blk, nb, OB: tl.constexpr, MASKED: tl.constexpr):
        """Mask of the pair words (see _tl_pair_words), word by word."""
        if MASKED:
            m = (oin8 < OB) & (blk < nb)[None, :, None, None, None]
        else:
            m = oin8 < OB
        return m

    @triton.jit
    def _tl_octet_mask(oin, blk, nb, B: tl.constexpr, MASKED: tl.constexpr):
        """Octets inside the piece (and inside their block, when B / 8 is no power of 2)."""
        if MASKED:
            m = (oin < B // 8) & (blk < nb)[None, :, None, None]
        else:
            m = oin < B // 8
        return m

    @triton.jit
    def _tl_load_words(w_ptr, wbase, oc, omask, blk, nb, BITS: tl.constexpr, G: tl.constexpr,
                       BPP: tl.constexpr, REP: tl.constexpr, U: tl.constexpr, OB: tl.constexpr,
                       MASKED: tl.constexpr):
        """Code words of the tile's octets: INT4 -> (w, w), w [G, BPP, REP, U] one word per
        octet; INT8 -> (wa, wb), each [G, BPP, REP, U] (elements 0..3 and 4..7 of the octet),
        loaded as 16-byte vectors. Masked octets read as 0 words (codes 0)."""
        if BITS == 4:
            if MASKED:
                w = tl.load(w_ptr + wbase + oc, mask=omask, other=0)
            else:
                w = tl.load(w_ptr + wbase + oc)
            wb = w
        else:
            idx, oin8 = _tl_pair_words(G, BPP, REP, U, OB)
            if MASKED:
                ww = tl.load(w_ptr + wbase + idx, mask=_tl_pair_mask(oin8, blk, nb, OB, MASKED),
                             other=0)
            else:
                ww = tl.load(w_ptr + wbase + idx)
            w, wb = tl.split(tl.reshape(ww, (G, BPP, REP, U, 2)))
        return w, wb

    @triton.jit
    def _tl_block_ids(b0, nb, G: tl.constexpr, BPP: tl.constexpr):
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

    @triton.jit
    def _tl_load_source(w32_ptr, f32_ptr, base, cw, b0, blk, oc, omask, nb, BITS: tl.constexpr,
                        B: tl.constexpr, G: tl.constexpr, BPP: tl.constexpr, REP: tl.constexpr,
                        U: tl.constexpr, MASKED: tl.constexpr):
        """The tile's code words and block scales of the piece at word offset ``base`` (``cw``
        code words): (w, wb, scale [G, BPP, 1, 1])."""
        bid = _tl_block_ids(b0, nb, G, BPP)
        if MASKED:
            s = tl.load(f32_ptr + base + cw + bid, mask=bid < nb, other=0.0)
        else:
            s = tl.load(f32_ptr + base + cw + bid)
        wt = base + b0.to(tl.int64) * (B * BITS // 32)
        w, wb = _tl_load_words(w32_ptr, wt, oc, omask, blk, nb, BITS, G, BPP, REP, U, B // 8,
                               MASKED)
        return w, wb, s

    @triton.jit
    def _tl_load_tile(in_w32, in_f32, base0, stride, b0, oc, oin, nb, K: tl.constexpr,
                      BITS: tl.constexpr, B: tl.constexpr, G: tl.constexpr, BPP: tl.constexpr,
                      REP: tl.constexpr, U: tl.constexpr, MASKED: tl.constexpr):
        """All K sources of the tile of blocks [b0, b0 + BPP), the piece of source k at word
        offset ``base0 + k * stride``: a tuple (w, wb, scale) * K. The loads are independent,
        so all of them can be in flight together."""
        blk = b0 + tl.arange(0, BPP)
        omask = _tl_octet_mask(oin, blk, nb, B, MASKED)
        cw = tl.cast(nb, tl.int64) * (B * BITS // 32)          # code words per piece
        srcs = ()
        for k in tl.static_range(K):
            srcs = srcs + _tl_load_source(in_w32, in_f32, base0 + k * stride, cw, b0, blk, oc,
                                          omask, nb, BITS, B, G, BPP, REP, U, MASKED)
        return srcs

    @triton.jit
    def _tl_accumulate(a0, a1, a2, a3, a4, a5, a6, a7, w, wb, s, zero, BITS: tl.constexpr,
                       FIRST: tl.constexpr, SLOW: tl.constexpr, EMU: tl.constexpr):
        """Accumulate one source (its code words, scales [G, BPP, 1, 1]) into the 8 lanes. Per
        code LOP3 + FADD + FFMA; per word one shift (INT4 nibbles 5..7, INT8 bytes 2, 3 sit
        above bit 22)."""
        Q: tl.constexpr = (1 << (BITS - 1)) - 1
        if BITS == 4:
            h = w >> 12                                          # nibbles 5..7 at bits 8..19
            c0 = _tl_decode(w, zero, 0xF, 0, 4)
            c1 = _tl_decode(w, zero, 0xF0, 4, 4)
            c2 = _tl_decode(w, zero, 0xF00, 8, 4)
            c3 = _tl_decode(w, zero, 0xF000, 12, 4)
            c4 = _tl_decode(w, zero, 0xF0000, 16, 4)
            c5 = _tl_decode(h, zero, 0xF00, 8, 4)
            c6 = _tl_decode(h, zero, 0xF000, 12, 4)
            c7 = _tl_decode(h, zero, 0xF0000, 16, 4)
        else:
            # bytes 2, 3 at bits 0..15; a run-time shift count, else the compiler extracts
            # byte 2 with a PRMT and still needs the XOR (one more instruction per word)
            ha = w >> (16 + zero)
            hb = wb >> (16 + zero)
            c0 = _tl_decode(w, zero, 0xFF, 0, 8)
            c1 = _tl_decode(w, zero, 0xFF00, 8, 8)
            c2 = _tl_decode(ha, zero, 0xFF, 0, 8)
            c3 = _tl_decode(ha, zero, 0xFF00, 8, 8)
            c4 = _tl_decode(wb, zero, 0xFF, 0, 8)
            c5 = _tl_decode(wb, zero, 0xFF00, 8, 8)
            c6 = _tl_decode(hb, zero, 0xFF, 0, 8)
            c7 = _tl_decode(hb, zero, 0xFF00, 8, 8)
        a0 = _tl_acc_code(a0, c0, s, Q, FIRST, SLOW, EMU)
        a1 = _tl_acc_code(a1, c1, s, Q, FIRST, SLOW, EMU)
        a2 = _tl_acc_code(a2, c2, s, Q, FIRST, SLOW, EMU)
        a3 = _tl_acc_code(a3, c3, s, Q, FIRST, SLOW, EMU)
        a4 = _tl_acc_code(a4, c4, s, Q, FIRST, SLOW, EMU)
        a5 = _tl_acc_code(a5, c5, s, Q, FIRST, SLOW, EMU)
        a6 = _tl_acc_code(a6, c6, s, Q, FIRST, SLOW, EMU)
        a7 = _tl_acc_code(a7, c7, s, Q, FIRST, SLOW, EMU)
        return a0, a1, a2, a3, a4, a5, a6, a7

    @triton.jit
    def _tl_pack_bytes(c0, c1, c2, c3, k256):
        """Four offset-binary INT8 codes (``_tl_code``) -> one word, two's complement. Bits
        8..21 of a code are zero and its magic-number bits start at bit 22: only the low half
        needs a mask; those of c2, c3 leave the word. IMAD by a run-time 256 (constant shifts
        get distributed over the sums by LLVM: 7 instructions per word instead of 5)."""
        lo = (c1 * k256 + c0) & 0xFFFF
        hi = c3 * k256 + c2
        return (hi * (k256 * k256) + lo) ^ -2139062144            # 0x80808080

    @triton.jit
    def _tl_quant_store(x0, x1, x2, x3, x4, x5, x6, x7, inv, w_ptr, wbase, oc, omask, blk, nb,
                        zero, BITS: tl.constexpr, G: tl.constexpr, BPP: tl.constexpr,
                        REP: tl.constexpr, U: tl.constexpr, OB: tl.constexpr,
                        MASKED: tl.constexpr, CHECK: tl.constexpr, EMU: tl.constexpr):
        """Codes of the 8 lanes (inv [1, BPP, 1, 1]) packed and stored at word wbase + ...
        Offset-binary codes (``_tl_code``) have zeros between their field and bit 22, so the
        fields add up without carries. INT4: 7 IMAD, one mask, one XOR (two's complement) per
        8 codes; INT8: the same with bytes (``_tl_pack_bytes``), stored as 16-byte vectors."""
        c0 = _tl_code(x0, inv, BITS, CHECK, EMU)
        c1 = _tl_code(x1, inv, BITS, CHECK, EMU)
        c2 = _tl_code(x2, inv, BITS, CHECK, EMU)
        c3 = _tl_code(x3, inv, BITS, CHECK, EMU)
        c4 = _tl_code(x4, inv, BITS, CHECK, EMU)
        c5 = _tl_code(x5, inv, BITS, CHECK, EMU)
        c6 = _tl_code(x6, inv, BITS, CHECK, EMU)
        c7 = _tl_code(x7, inv, BITS, CHECK, EMU)
        if BITS == 4:
            # Horner steps by a run-time 16 (IMAD): with constant shifts LLVM distributes them
            # over the sums, 2 more instructions per word. Codes 0..2 carry the magic number's
            # bits from bit 22 up (masked); those of codes 3..7 leave the word in the shift by 12.
            k16 = 16 + zero
            hi = (((c7 * k16 + c6) * k16 + c5) * k16 + c4) * k16 + c3
            lo = ((c2 * k16 + c1) * k16 + c0) & 0xFFF
            w = (hi * (4096 + zero) + lo) ^ -2004318072         # 0x88888888: two's complement
            if MASKED:
                tl.store(w_ptr + wbase + oc, w, mask=omask)
            else:
                tl.store(w_ptr + wbase + oc, w)
        else:
            k256 = 256 + zero
            wa = _tl_pack_bytes(c0, c1, c2, c3, k256)
            wb = _tl_pack_bytes(c4, c5, c6, c7, k256)
            ww = tl.reshape(tl.join(wa, wb), (G, BPP, REP, U // 2, 4))
            idx, oin8 = _tl_pair_words(G, BPP, REP, U, OB)
            if MASKED:
                tl.store(w_ptr + wbase + idx, ww, mask=_tl_pair_mask(oin8, blk, nb, OB, MASKED))
            else:
                tl.store(w_ptr + wbase + idx, ww)

    @triton.jit
    def _tl_sum_tile(srcs, zero, K: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr,
                     BPP: tl.constexpr, REP: tl.constexpr, U: tl.constexpr, SLOW: tl.constexpr,
                     EMU: tl.constexpr):
        """The 8 lanes of the sum, in source order, of the loaded sources (``_tl_load_tile``):
        acc = code_0 * s_0, then acc = fma(code_k, s_k, acc)."""
        z = tl.zeros((G, BPP, REP, U), tl.float32)
        a0, a1, a2, a3, a4, a5, a6, a7 = _tl_accumulate(z, z, z, z, z, z, z, z, srcs[0], srcs[1],
                                                        srcs[2], zero, BITS, True, SLOW, EMU)
        for k in tl.static_range(1, K):
            a0, a1, a2, a3, a4, a5, a6, a7 = _tl_accumulate(
                a0, a1, a2, a3, a4, a5, a6, a7, srcs[3 * k], srcs[3 * k + 1], srcs[3 * k + 2],
                zero, BITS, False, SLOW, EMU)
        return a0, a1, a2, a3, a4, a5, a6, a7

    @triton.jit
    def _tl_sum_requant_store(srcs, out_w32, out_f32, obase, b0, oc, oin, nb, K: tl.constexpr,
                              IN_BITS: tl.constexpr, OUT_BITS: tl.constexpr, B: tl.constexpr,
                              G: tl.constexpr, BPP: tl.constexpr, REP: tl.constexpr,
                              U: tl.constexpr, MASKED: tl.constexpr, SLOW: tl.constexpr,
                              EMU: tl.constexpr):
        """Sum the loaded sources of the tile in source order, requantize, store; returns
        per block whether its sum is not finite (then the tile needs the slow path)."""
        Q: tl.constexpr = (1 << (OUT_BITS - 1)) - 1
        zero = nb >> 31                                            # nb >= 0: a run-time 0
        a0, a1, a2, a3, a4, a5, a6, a7 = _tl_sum_tile(srcs, zero, K, IN_BITS, G, BPP, REP, U, SLOW,
                                                      EMU)
        scale, inv, bad = _tl_scales(a0, a1, a2, a3, a4, a5, a6, a7, Q)
        blk = b0 + tl.arange(0, BPP)
        omask = _tl_octet_mask(oin, blk, nb, B, MASKED)
        wb = obase + b0.to(tl.int64) * (B * OUT_BITS // 32)
        _tl_quant_store(a0, a1, a2, a3, a4, a5, a6, a7, inv[None, :, None, None], out_w32, wb,
                        oc, omask, blk, nb, zero, OUT_BITS, G, BPP, REP, U, B // 8, MASKED, SLOW,
                        EMU)
        bid = _tl_block_ids(b0, nb, G, BPP)                  # the G threads of a block store alike
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
                 obase, oc, oin, nb, K: tl.constexpr, IN_BITS: tl.constexpr,
                 OUT_BITS: tl.constexpr, B: tl.constexpr, G: tl.constexpr, BPP: tl.constexpr,
                 REP: tl.constexpr, U: tl.constexpr, PAD: tl.constexpr, L2: tl.constexpr,
                 EMU: tl.constexpr):
        """Fast path over full tile t, whose loads ``nxt`` holds; returns (per block whether its
        sum is not finite: the tile needs the slow path, the next tile's loads). The next
        tile's loads are issued before this tile's arithmetic, so that they are in flight
        while the program computes (the last tile's "next" is itself again: read, never used);
        with L2, the tile after it is prefetched into L2."""
        cur = nxt
        nxt = _tl_load_tile(in_w32, in_f32, base0, stride,
                            tl.minimum(t + nprog, full_tiles - 1) * BPP, oc, oin, nb, K,
                            IN_BITS, B, G, BPP, REP, U, PAD)
        if L2:
            _tl_prefetch_l2(in_w32, in_f32, base0, stride, t + 2 * nprog, full_tiles, nb, K,
                            IN_BITS, B, BPP)
        bad = _tl_sum_requant_store(cur, out_w32, out_f32, obase, t * BPP, oc, oin, nb, K,
                                    IN_BITS, OUT_BITS, B, G, BPP, REP, U, PAD, False, EMU)
        return bad, nxt

    @triton.jit
    def _tl_slow_tiles(bad, t0, step, in_w32, in_f32, out_w32, out_f32, base0, stride, obase,
                       oc, oin, nb, K: tl.constexpr, IN_BITS: tl.constexpr,
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
                again = _tl_load_tile(in_w32, in_f32, base0, stride, t * BPP, oc, oin, nb, K,
                                      IN_BITS, B, G, BPP, REP, U, MASKED)
                _tl_sum_requant_store(again, out_w32, out_f32, obase, t * BPP, oc, oin, nb, K,
                                      IN_BITS, OUT_BITS, B, G, BPP, REP, U, MASKED, True, EMU)
            bad = bad >> 1
            t += step

    @triton.jit
    def _qgz_reduce_requantize_kernel(in_w32, in_f32, out_w32, out_f32, P, nb, full_tiles,
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
        oc, oin = _tl_octets(G, BPP, REP, U, B // 8)
        # source k, piece p at word (k * P + p) * pw_in; every source read once
        pw_in = tl.cast(nb, tl.int64) * (B * IN_BITS // 32 + 1)      # piece size in words
        pw_out = tl.cast(nb, tl.int64) * (B * OUT_BITS // 32 + 1)
        base0 = p.to(tl.int64) * pw_in
        stride = P * pw_in
        obase = p.to(tl.int64) * pw_out
        no_bits = tl.full((), 0, tl.uint32)
        if full_tiles > 0:   # then i < full_tiles (the launcher's grid)
            nxt = _tl_load_tile(in_w32, in_f32, base0, stride, i * BPP, oc, oin, nb, K,
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
                                         out_f32, base0, stride, obase, oc, oin, nb, K,
                                         IN_BITS, OUT_BITS, B, G, BPP, REP, U, PAD, L2, EMU)
                    bad = bad | tl.where(flag, bit, no_bits)
                    bit = bit << 1
                    t += nprog
                # one reduction across the program's threads per chunk, not per tile
                _tl_slow_tiles(tl.reduce(bad, 0, _tl_or), c, nprog, in_w32, in_f32, out_w32,
                               out_f32, base0, stride, obase, oc, oin, nb, K, IN_BITS, OUT_BITS, B,
                               G, BPP, REP, U, PAD, EMU)
                c += nprog * CHUNK
        if TAIL:   # the partial last tile (one per piece) goes through the slow path, masked
            if i == 0:
                _tl_slow_tiles(no_bits + 1, full_tiles, 1, in_w32, in_f32, out_w32, out_f32,
                               base0, stride, obase, oc, oin, nb, K, IN_BITS, OUT_BITS, B, G, BPP,
                               REP, U, True, EMU)

    @triton.jit
    def _tl_dequant_tile(in_w32, in_f32, out_ptr, pw, oc, oin, b0, nb, lim, scale,
                         K: tl.constexpr, BITS: tl.constexpr, B: tl.constexpr, G: tl.constexpr,
                         BPP: tl.constexpr, REP: tl.constexpr, U: tl.constexpr,
                         MASKED: tl.constexpr, PAD: tl.constexpr, SLOW: tl.constexpr,
                         ENCODE_BF16: tl.constexpr, EMU: tl.constexpr):
        """Sum the sources over the tile, times ``scale``, stored in the output dtype; returns
        whether the tile holds an inf-marker block (then it needs the slow path: the fast one
        read the marker as a scale)."""
        srcs = _tl_load_tile(in_w32, in_f32, pw * 0, pw, b0, oc, oin, nb, K, BITS, B, G, BPP, REP,
                             U, MASKED)
        a0, a1, a2, a3, a4, a5, a6, a7 = _tl_sum_tile(srcs, nb >> 31, K, BITS, G, BPP, REP, U,
                                                      SLOW, EMU)
        marker = srcs[2] == _INF
        for k in tl.static_range(1, K):
            marker = marker | (srcs[3 * k + 2] == _INF)
        # marker [G, BPP, 1, 1]: the G threads of a block hold it alike (a warp's shuffles)
        slow = tl.max(tl.reshape(tl.max(marker.to(tl.int32), 0), (BPP,)), 0) > 0
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
        oc, oin = _tl_octets(G, BPP, REP, U, OB)
        lim = tl.minimum(S - pid.to(tl.int64) * (BPP * B), BPP * B).to(tl.int32)
        pw = tl.cast(nb, tl.int64) * (B * BITS // 32 + 1)
        # Fast path unconditionally; a tile with inf markers (RARE, tile-uniform) is done again,
        # overwriting it.
        if _tl_dequant_tile(in_w32, in_f32, out_ptr, pw, oc, oin, b0, nb, lim, scale, K, BITS, B,
                            G, BPP, REP, U, MASKED, PAD, False, ENCODE_BF16, EMU):
            _tl_dequant_tile(in_w32, in_f32, out_ptr, pw, oc, oin, b0, nb, lim, scale, K, BITS, B,
                             G, BPP, REP, U, MASKED, PAD, True, ENCODE_BF16, EMU)


# Per kernel and input bits (dequantize_reduce: and bytes per output element): elements per
# program tile, warps per program, and U, the octets of one thread vector (see the tile comment
# above the kernels). A thread holds tile_elems / (32 * num_warps) elements; reduce_requantize
# sizes its tiles by elems_per_thread (from prefetch_words) and runs programs_per_sm persistent
# programs per SM, all resident at once: the launcher caps registers to fit them (a program
# that does not fit starts when another ends and finishes alone). Its programs are one warp
# each, as many per SM as the best sweep of 4-warp programs had warps, without a tile's blocks
# split over warps (module docstring). l2_prefetch: whether a program asks L2 for the tile after
# the one in its registers (it pays with INT4 sources, not with INT8). Chosen by sweeps of
# examples/bench_grad_kernels.py on an H200; the figures are in PERFORMANCE.md ("Kernel design:
# what was measured").
TUNING = {
    "quantize": {4: dict(tile_elems=8192, num_warps=4, octets=2),
                 8: dict(tile_elems=8192, num_warps=4, octets=2)},
    "reduce_requantize": {4: dict(prefetch_words=32, num_warps=1, octets=4, programs_per_sm=8,
                              l2_prefetch=True),
                          8: dict(prefetch_words=32, num_warps=1, octets=4, programs_per_sm=12,
                              l2_prefetch=False)},
    "dequantize_reduce": {(4, 2): dict(tile_elems=4096, num_warps=4, octets=4),
                          (4, 4): dict(tile_elems=2048, num_warps=4, octets=2),
                          (8, 2): dict(tile_elems=2048, num_warps=4, octets=2),
                          (8, 4): dict(tile_elems=2048, num_warps=4, octets=2)},
}


def _tile(kernel: str, key, block_size: int, nb: int, tile_elems, num_warps):
    """(BPP blocks per tile, G threads per block, REP octet vectors per thread per block, U,
    warps); ``key`` indexes TUNING[kernel]."""
    _check_tuning(num_warps=num_warps, tile_elems=tile_elems)
    tune = TUNING[kernel][key]
    warps = num_warps or tune["num_warps"]
    opr = triton.next_power_of_2(block_size // 8)           # octets per block, padded
    U = tune["octets"]
    bpp = triton.next_power_of_2(max(1, (tile_elems or tune["tile_elems"]) // (8 * opr)))
    bpp = min(bpp, triton.next_power_of_2(nb))              # small inputs: no masked blocks
    per_thread = max(U, bpp * opr // (32 * warps))          # octets per thread in the tile
    per_row = min(opr, per_thread)                          # ... of one block
    return bpp, opr // per_row, per_row // U, U, warps


def _check_tuning(num_warps=None, **counts) -> None:
    """Launcher tuning keywords: None (the default) or a positive int; warps a power of 2 up to
    16 (Triton's limit)."""
    if num_warps is not None and (not isinstance(num_warps, int) or not 1 <= num_warps <= 16
                                  or num_warps & (num_warps - 1)):
        raise ValueError(f"num_warps must be a power of 2 from 1 to 16, got {num_warps}")
    for name, n in counts.items():
        if n is not None and (not isinstance(n, int) or n < 1):
            raise ValueError(f"{name} must be a positive int, got {n}")


def elems_per_thread(num_sources: int, in_bits: int) -> int:
    """Elements per thread of a qgz_reduce_requantize tile: the largest power of 2 in [16, 64]
    whose code words for all sources (num_sources * elems * in_bits / 32, held in registers
    while the previous tile is computed) fit TUNING's ``prefetch_words``, 32: INT4 sources, 64
    elements up to 4 sources, 32 for 8 (64 spilled); INT8 sources, 64 for 1 source, 32 for 2
    to 4, 16 from 5 on. 16 is one 16-byte vector of INT8 codes per thread, the floor."""
    words = TUNING["reduce_requantize"][in_bits]["prefetch_words"]
    e = max(1, words * 32 // (num_sources * in_bits))
    return max(16, min(64, 1 << (e.bit_length() - 1)))


def _num_sms(device: torch.device) -> int:
    """Multiprocessors of a CUDA device; under the interpreter a small count, so that each
    persistent program walks several tiles (the loop the tests need to reach)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 3


def _register_cap(device: torch.device, programs_per_sm: int, warps: int) -> int:
    """Registers per thread that let ``programs_per_sm`` programs of ``warps`` warps be resident
    on one SM together (allocated in units of 8 per thread; at most 255)."""
    regs = 65536
    if device.type == "cuda":
        regs = getattr(torch.cuda.get_device_properties(device), "regs_per_multiprocessor", regs)
    return max(8, min(255, regs // (programs_per_sm * warps * 32) // 8 * 8))


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
            MODE=mode, EVEN=even, EMU=_interpreting(), num_warps=warps, enable_fp_fusion=False)
    return out


def qgz_reduce_requantize_triton(recv: torch.Tensor, num_sources: int, num_pieces: int,
                                 shard_size: int, in_bits: int, out_bits: int, block_size: int,
                                 *, tile_elems: int | None = None, num_warps: int | None = None,
                                 programs_per_sm: int | None = None, slow_chunk: int = 32,
                                 l2_prefetch: bool | None = None) -> torch.Tensor:
    """Triton launcher of ``zpp::qgz_reduce_requantize``. Tuning (defaults from TUNING):
    ``tile_elems`` (elems_per_thread * 32 * num_warps), ``num_warps``, ``programs_per_sm``
    (persistent programs per SM, split over the pieces, their registers capped so that all are
    resident at once); ``slow_chunk``: tiles a program runs between two looks for tiles that
    need the slow path (1 to 32); ``l2_prefetch``: whether a program asks L2 for the tile after
    the one its registers prefetch (GPU only)."""
    _require_triton(block_size)
    _check_reduce_args(recv, num_sources, num_pieces, shard_size, in_bits, block_size)
    _check_bits(out_bits, "out_bits")
    _check_tuning(num_warps=num_warps, programs_per_sm=programs_per_sm, slow_chunk=slow_chunk)
    if slow_chunk > 32:
        raise ValueError(f"slow_chunk must be at most 32 (one bit per tile), got {slow_chunk}")
    tune = TUNING["reduce_requantize"][in_bits]
    warps = num_warps or tune["num_warps"]
    if tile_elems is None:
        tile_elems = elems_per_thread(num_sources, in_bits) * 32 * warps
    recv = _aligned_u8(recv)
    nb = num_blocks(shard_size, block_size)
    out = torch.empty(num_pieces * piece_bytes(shard_size, block_size, out_bits),
                      dtype=torch.uint8, device=recv.device)
    bpp, G, rep, U, warps = _tile("reduce_requantize", in_bits, block_size, nb, tile_elems, warps)
    full_tiles = nb // bpp
    per_sm = programs_per_sm or tune["programs_per_sm"]
    programs = max(1, min(full_tiles, per_sm * _num_sms(recv.device) // num_pieces))
    # the interpreter has no cache to ask (nor inline assembly)
    l2 = (tune["l2_prefetch"] if l2_prefetch is None else bool(l2_prefetch)) and not _interpreting()
    ob = block_size // 8
    with _LaunchCtx(recv):
        _qgz_reduce_requantize_kernel[(programs, num_pieces)](
            recv.view(torch.int32), recv.view(torch.float32), out.view(torch.int32),
            out.view(torch.float32), num_pieces, nb, full_tiles, K=num_sources, IN_BITS=in_bits,
            OUT_BITS=out_bits, B=block_size, BPP=bpp, G=G, REP=rep, U=U,
            PAD=(ob & (ob - 1)) != 0, TAIL=(nb % bpp != 0), CHUNK=slow_chunk,
            L2=l2, EMU=_interpreting(), num_warps=warps,
            maxnreg=_register_cap(recv.device, per_sm, warps), enable_fp_fusion=False)
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

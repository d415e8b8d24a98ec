"""qgZ's packed format, its torch twins and the argument checks of its ops.

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

The twins below are the CPU implementation of the ``zpp::qgz_*`` ops (``grad_ops.py``) and the
oracle the Triton kernels (``grad_tiles.py``, ``grad_kernels.py``) match bit for bit.
"""
from __future__ import annotations

import math

import torch

from .triton_common import SUPPORTED_DTYPES

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "FLT_MAX",
    "SUPPORTED_BITS",
    "num_blocks",
    "piece_bytes",
    "unpack_pieces",
    "quantize_pieces_ref",
    "dequantize_pieces_ref",
    "qgz_quantize_ref",
    "qgz_reduce_requantize_ref",
    "qgz_dequantize_reduce_ref",
    "check_bits",
    "check_dtype",
    "check_quantize_args",
    "check_reduce_args",
]

DEFAULT_BLOCK_SIZE = 256
SUPPORTED_BITS = (4, 8)
FLT_MAX = 3.4028234663852886e38


def _qmax(bits: int) -> int:
    return (1 << (bits - 1)) - 1


def _check_block(block_size: int) -> None:
    if block_size < 32 or block_size % 8 != 0:
        raise ValueError(f"qgZ block_size must be a multiple of 8 and >= 32, got {block_size}")


def check_bits(bits: int, what: str = "bits") -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"qgZ {what} must be 4 or 8, got {bits}")


def num_blocks(shard_size: int, block_size: int) -> int:
    """Quantization blocks per piece: ceil(shard_size / block_size)."""
    return (shard_size + block_size - 1) // block_size


def piece_bytes(shard_size: int, block_size: int, bits: int) -> int:
    """Bytes of one packed piece of ``shard_size`` elements: codes then float32 scales."""
    check_bits(bits)
    _check_block(block_size)
    nb = num_blocks(shard_size, block_size)
    return nb * block_size * bits // 8 + 4 * nb


# ---------------------------------------------------------------------------------------------
# argument checks (shared by the twins and the Triton launchers)
# ---------------------------------------------------------------------------------------------

def check_dtype(dtype: torch.dtype) -> None:
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"qgZ supports float32, bfloat16 and float16, got {dtype}")


def check_quantize_args(grad: torch.Tensor, num_nodes: int, ranks_per_node: int, bits: int,
                        block_size: int) -> int:
    """Checks ``qgz_quantize``'s arguments; returns S, the shard size."""
    check_bits(bits)
    _check_block(block_size)
    check_dtype(grad.dtype)
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


def check_reduce_args(recv: torch.Tensor, num_sources: int, num_pieces: int, shard_size: int, bits: int,
                      block_size: int) -> None:
    """Checks a received buffer: ``num_sources`` x ``num_pieces`` packed pieces."""
    check_bits(bits)
    _check_block(block_size)
    if num_sources < 1 or num_pieces < 1 or shard_size < 1:
        raise ValueError(f"bad sizes: sources={num_sources} pieces={num_pieces} S={shard_size}")
    want = num_sources * num_pieces * piece_bytes(shard_size, block_size, bits)
    if recv.dtype != torch.uint8 or recv.dim() != 1 or recv.numel() != want:
        raise ValueError(f"expected uint8[{want}] ({num_sources} sources x {num_pieces} pieces of "
                         f"{shard_size} elements, {bits} bits, block {block_size}), got "
                         f"{recv.dtype}{list(recv.shape)}")


# ---------------------------------------------------------------------------------------------
# torch reference twins (CPU implementation of the ops; also valid on CUDA tensors)
# ---------------------------------------------------------------------------------------------

def _quantize_blocks(x: torch.Tensor, bits: int):
    """x float32 [..., nb, B] (padding zero) -> (codes int32 [..., nb, B], scales [..., nb])."""
    absmax = x.abs().amax(dim=-1)  # NaN or inf exactly where a block holds a non-finite value
    if bool(torch.isfinite(absmax).all()):
        return _quantize_finite_blocks(x, absmax, bits)
    return _quantize_nonfinite_blocks(x, bits)


def _quantize_finite_blocks(x: torch.Tensor, absmax: torch.Tensor, bits: int):
    """Codes and scales of blocks holding no inf or NaN, given each block's max |x|."""
    q = _qmax(bits)
    qt = torch.full_like(absmax, float(q))
    scale = absmax / qt                                   # IEEE division (tensor / tensor)
    inv = torch.where(absmax > 0, qt / absmax, torch.zeros_like(absmax)).clamp_max(FLT_MAX)
    t = x.double() * inv.double().unsqueeze(-1)          # exact: 24 + 24 significant bits
    return torch.round(t).clamp_(-q, q).to(torch.int32), scale  # round half to even


def _quantize_nonfinite_blocks(x: torch.Tensor, bits: int):
    """Blocks holding inf or NaN get the marker scale and special codes; the others as ever
    (this path costs several more passes over the data, so finite gradients skip it)."""
    q = _qmax(bits)
    finite = torch.isfinite(x)
    bad = ~finite.all(dim=-1)
    x0 = torch.where(finite, x, torch.zeros((), dtype=x.dtype, device=x.device))
    code, scale = _quantize_finite_blocks(x0, x0.abs().amax(dim=-1), bits)
    special = torch.where(
        torch.isnan(x), -(q + 1),
        torch.where(x == math.inf, q, torch.where(x == -math.inf, -q, 0))).to(torch.int32)
    code = torch.where(bad.unsqueeze(-1), special, code)
    scale = torch.where(bad, torch.full_like(scale, math.inf), scale)
    return code, scale


def _dequantize_blocks(code: torch.Tensor, scale: torch.Tensor, bits: int,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """codes int32 [..., nb, B], scales float32 [..., nb] -> code * scale in `dtype` [..., nb, B]
    (exact in float64: <= 8 + 24 significant bits); inf-marker blocks give their marker values."""
    s = scale.to(dtype).unsqueeze(-1)
    v = code.to(dtype) * s
    marked = torch.isinf(s) & (s > 0)
    if not bool(marked.any()):
        return v
    return torch.where(marked, _marker_values(code, torch.zeros((), dtype=dtype, device=code.device), bits), v)


def _marker_values(code: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """What the codes of an inf-marker block stand for: -(q+1) -> NaN, q -> +inf, -q -> -inf,
    any other code -> 0 (in `zero`'s dtype)."""
    q = _qmax(bits)
    return torch.where(code == q, zero + math.inf,
                       torch.where(code == -q, zero - math.inf,
                                   torch.where(code == -(q + 1), zero + math.nan, zero)))


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
    if bits == 4:
        raw = b[:, :cb].to(torch.int32)
        lo = ((raw & 15) ^ 8) - 8
        hi = ((raw >> 4) ^ 8) - 8
        code = torch.stack([lo, hi], dim=-1).reshape(num_pieces, nb, block_size)
    else:
        code = b[:, :cb].view(torch.int8).to(torch.int32).reshape(num_pieces, nb, block_size)
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


def _fma_f32(acc: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """float32(acc + p) with ONE rounding, for float32 ``acc`` and an exact float64 ``p``: the
    float64 sum rounded to odd (TwoSum error decides), then rounded to float32 -- correctly
    rounded because 53 >= 24 + 2 (Boldo & Melquiond). Equals the GPU's FFMA(code, scale, acc).
    Where every float64 sum is exact (the common case: the sources' scales of a block are
    close), rounding it once is already the answer."""
    c = acc.double()
    t = p + c
    bp = t - p
    err = (p - (t - bp)) + (c - bp)                       # t + err == p + c exactly
    inexact = err != 0                                    # also where t is not finite (err NaN)
    if not bool(inexact.any()):
        return t.to(torch.float32)
    bits = t.view(torch.int64)
    fix = inexact & torch.isfinite(t) & ((bits & 1) == 0)
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
        p = _dequantize_blocks(code, scale, bits, torch.float64).reshape(num_pieces, -1)  # exact
        acc = p.to(torch.float32) if acc is None else _fma_f32(acc, p)
    return acc


def qgz_quantize_ref(grad: torch.Tensor, num_nodes: int, ranks_per_node: int, bits: int,
                     block_size: int) -> torch.Tensor:
    S = check_quantize_args(grad, num_nodes, ranks_per_node, bits, block_size)
    x = grad.reshape(num_nodes, ranks_per_node, S).transpose(0, 1)   # [R, N, S]
    return quantize_pieces_ref(x.reshape(ranks_per_node * num_nodes, S), bits, block_size)


def qgz_reduce_requantize_ref(recv: torch.Tensor, num_sources: int, num_pieces: int,
                              shard_size: int, in_bits: int, out_bits: int,
                              block_size: int) -> torch.Tensor:
    check_reduce_args(recv, num_sources, num_pieces, shard_size, in_bits, block_size)
    check_bits(out_bits, "out_bits")
    acc = _sum_sources(recv, num_sources, num_pieces, shard_size, in_bits, block_size)
    nb = num_blocks(shard_size, block_size)
    code, scale = _quantize_blocks(acc.reshape(num_pieces, nb, block_size), out_bits)
    return _pack(code, scale, out_bits)


def qgz_dequantize_reduce_ref(recv: torch.Tensor, num_sources: int, shard_size: int, bits: int,
                              block_size: int, dtype: torch.dtype, scale: float) -> torch.Tensor:
    check_reduce_args(recv, num_sources, 1, shard_size, bits, block_size)
    check_dtype(dtype)
    acc = _sum_sources(recv, num_sources, 1, shard_size, bits, block_size)[0, :shard_size]
    st = torch.tensor(scale, dtype=torch.float32, device=acc.device)
    return (acc * st).to(dtype)

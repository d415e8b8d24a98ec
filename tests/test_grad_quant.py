"""qgZ gradient kernels (runtime/quantization/grad_*.py): packed format, Triton == torch twin bit for bit,
and a single-process simulation of the whole two-hop pipeline against float64 references.

The all-to-alls are emulated by slicing: one list entry per emulated rank ``r = m * R + l``.

Error bound used by the simulation tests (derived in the module docstring): one quantization
with block scale ``s`` moves an element by at most ``s * (0.5 + 4 q 2**-24)``; we allow
``C = 0.5 + 2**-12``. Shard element ``i`` of rank ``r`` went through

    hop 1: every rank j quantized g_j             (scale s1_j of the block holding i)
    hop 2: node m' requantized its partial sum    (scale s2_m', only when N > 1 and R > 1)

so ``|result - mean| <= (C * (sum_j s1_j + sum_m' s2_m') + F) / W + D``, where ``F`` covers the
float32 accumulations (``2**-20 * sum of q * scale``, loose) and ``D`` the final rounding to the
output dtype (half an ulp: ``2**-8 |x|`` for bf16, ``2**-11 |x| + 2**-25`` for fp16).
"""
import functools
import math
import os
import struct
from typing import Any

import pytest
import torch
from distributed import spread

from zpp_compile.runtime.quantization import grad_format as gq_format
from zpp_compile.runtime.quantization import grad_ops as gq

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
C_BOUND = 0.5 + 2.0 ** -12
U_OUT = {torch.float32: 0.0, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}

triton_ok = gq.HAS_TRITON and (torch.cuda.is_available()
                               or os.environ.get("TRITON_INTERPRET") == "1")
needs_triton = pytest.mark.skipif(not triton_ok, reason="needs triton (GPU or TRITON_INTERPRET=1)")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality, except that any NaN equals any NaN (payloads may differ)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        na, nb_ = torch.isnan(a), torch.isnan(b)
        if not torch.equal(na, nb_):
            return False
        ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16,
                torch.float16: torch.int16}[a.dtype]
        return torch.equal(a[~na].view(ints), b[~nb_].view(ints))
    return torch.equal(a, b)


# ------------------------------------------------------------------------------------------
# format, checked with an independent pure-Python decoder
# ------------------------------------------------------------------------------------------

def py_decode(buf: bytes, S: int, B: int, bits: int):
    """One packed piece -> (list of int codes [nb*B], list of float scales [nb])."""
    nb = -(-S // B)
    cb = nb * B * bits // 8
    codes = []
    for byte in buf[:cb]:
        if bits == 8:
            codes.append(byte - 256 if byte >= 128 else byte)
        else:
            for nib in (byte & 15, byte >> 4):
                codes.append(nib - 16 if nib >= 8 else nib)
    scales = list(struct.unpack(f"<{nb}f", buf[cb:cb + 4 * nb]))
    return codes, scales


def test_piece_bytes():
    assert gq.piece_bytes(1, 32, 4) == 16 + 4
    assert gq.piece_bytes(1, 32, 8) == 32 + 4
    assert gq.piece_bytes(4097, 256, 4) == 17 * 128 + 17 * 4
    assert gq.piece_bytes(4097, 256, 8) == 17 * 256 + 17 * 4
    assert gq.piece_bytes(100, 40, 4) == 3 * 20 + 12
    for S in (1, 7, 33, 4097):
        for B in (32, 40, 256):
            for bits in (4, 8):
                assert gq.piece_bytes(S, B, bits) % 4 == 0
    with pytest.raises(ValueError):
        gq.piece_bytes(10, 36, 4)     # not a multiple of 8
    with pytest.raises(ValueError):
        gq.piece_bytes(10, 24, 4)     # below 32
    with pytest.raises(ValueError):
        gq.piece_bytes(10, 32, 2)


@pytest.mark.parametrize("bits", [4, 8])
def test_packed_layout_by_hand(bits):
    q = 7 if bits == 4 else 127
    B, S = 32, 40                     # two blocks, the second one 8 elements long
    x = torch.zeros(S)
    x[0], x[1], x[2], x[3] = 2.0 * q, -2.0 * q, 2.0, -3.0   # absmax 2q -> scale 2 exactly
    x[4] = 5.0                        # 2.5 -> rint half to even -> 2
    x[5] = 7.0                        # 3.5 -> 4
    x[32:40] = torch.tensor([0.0, 1, 2, 3, 4, 5, 6, float(q)])  # block 2: scale 1
    buf = torch.ops.zpp.qgz_quantize(x, 1, 1, bits, B)
    assert buf.dtype == torch.uint8 and buf.numel() == gq.piece_bytes(S, B, bits)
    codes, scales = py_decode(bytes(buf.tolist()), S, B, bits)
    assert scales == [2.0, 1.0]
    assert codes[:6] == [q, -q, 1, -2, 2, 4]
    assert codes[6:32] == [0] * 26
    assert codes[32:40] == [0, 1, 2, 3, 4, 5, 6, q]
    assert codes[40:] == [0] * 24     # tail padding codes are 0
    if bits == 4:                     # element 2i in the low nibble, 2i+1 in the high nibble
        assert buf[0].item() == (q & 15) | ((-q & 15) << 4)


def test_nonfinite_and_zero_blocks_by_hand():
    B = 32
    x = torch.zeros(3 * B)
    x[0], x[1], x[2], x[3] = float("inf"), float("-inf"), float("nan"), 5.0
    x[B:2 * B] = 0.0                  # all-zero block
    x[2 * B] = 1.0
    for bits, q in ((4, 7), (8, 127)):
        buf = gq.qgz_quantize_ref(x, 1, 1, bits, B)
        codes, scales = py_decode(bytes(buf.tolist()), 3 * B, B, bits)
        assert scales[0] == math.inf and scales[1] == 0.0
        assert scales[2] == struct.unpack("<f", struct.pack("<f", 1.0 / q))[0]
        assert codes[:4] == [q, -q, -(q + 1), 0]
        assert codes[B:2 * B] == [0] * B
        back = gq.dequantize_pieces_ref(buf, 1, 3 * B, bits, B)[0]
        assert back[0] == math.inf and back[1] == -math.inf and math.isnan(back[2])
        assert torch.equal(back[3:2 * B], torch.zeros(2 * B - 3))   # no NaN from 0 * inf
        assert not torch.isnan(back[2 * B:]).any()
        assert abs(back[2 * B].item() - 1.0) <= (1.0 / q) * C_BOUND
        # normal blocks never emit -(q+1)
        y = torch.randn(64 * B) * 10
        c, _ = gq.unpack_pieces(gq.qgz_quantize_ref(y, 1, 1, bits, B), 1, 64 * B, bits, B)
        assert c.min() >= -q and c.max() <= q and (c.abs() == q).any()


def test_bf16_and_fp16_read_in_their_own_dtype():
    """The quantizer must upcast bf16 / fp16 exactly: same bytes as the float32 copy. Values
    beyond fp16's range in bf16 (and fp16 bit patterns) would quantize differently if misread."""
    g = torch.tensor([1e20, -3e-30, 2.5e10, 7.0] * 16 + [0.5] * 32).to(torch.bfloat16)
    h = (torch.randn(96) * 1000).to(torch.float16)
    for x in (g, h):
        for bits in (4, 8):
            ref = gq.qgz_quantize_ref(x.float(), 1, 1, bits, 32)
            assert torch.equal(torch.ops.zpp.qgz_quantize(x, 1, 1, bits, 32), ref)
            if triton_ok:
                assert torch.equal(gq.qgz_quantize_triton(x.to(DEV), 1, 1, bits, 32).cpu(), ref)
            back = gq.dequantize_pieces_ref(ref, 1, x.numel(), bits, 32)[0]
            _, sc = gq.unpack_pieces(ref, 1, x.numel(), bits, 32)
            err = (back.double() - x.double()).abs()
            assert (err <= sc.repeat_interleave(32).double() * C_BOUND).all()
    # misreading bf16 bits as fp16 gives other values: the check above can fail
    assert not torch.equal(g.view(torch.float16).float(), g.float())


def test_fma_emulation_is_correctly_rounded():
    """The twin's fused multiply-add (the GPU's FFMA) against exact rational arithmetic,
    including products that sit exactly on a float32 rounding midpoint."""
    from fractions import Fraction
    gen = torch.Generator().manual_seed(0)
    n = 3000
    code = torch.randint(-128, 128, (n,), generator=gen).double()
    scale = (torch.rand(n, generator=gen) * torch.exp2(torch.randint(-40, 40, (n,),
                                                                      generator=gen).float()))
    acc = torch.randn(n, generator=gen) * torch.exp2(torch.randint(-60, 60, (n,),
                                                                   generator=gen).float())
    code[:500], scale[:500] = 3.0, 1 + 2.0 ** -23       # 3 + 3 * 2**-23: a midpoint
    acc[:500] = torch.randn(500, generator=gen) * 1e-30  # tiny addend decides the rounding
    got = gq_format._fma_f32(acc, code * scale.double())

    def round_f32(fr):
        lo = torch.tensor(float(fr), dtype=torch.float32)
        cands = [lo, torch.nextafter(lo, torch.tensor(math.inf)),
                 torch.nextafter(lo, torch.tensor(-math.inf))]
        return min(cands, key=lambda v: (abs(Fraction(v.item()) - fr),
                                         int(v.view(torch.int32)) & 1)).item()

    for i in range(n):
        exact = Fraction(code[i].item()) * Fraction(scale[i].item()) + Fraction(acc[i].item())
        assert got[i].item() == round_f32(exact), i
    naive = (code.float() * scale + acc)                # two roundings: differs somewhere
    assert not torch.equal(naive, got)
    # Addends of close magnitude (scales in [1, 2), acc in [1, 2)): every float64 sum is exact.
    near_acc = torch.rand(1000, generator=gen) + 1
    near_product = code[500:1500] * (torch.rand(1000, generator=gen) + 1).double()
    got = gq_format._fma_f32(near_acc, near_product)
    for i in range(1000):
        exact = Fraction(near_acc[i].item()) + Fraction(near_product[i].item())
        assert got[i].item() == round_f32(exact), i


def test_finite_blocks_quantize_as_the_nonfinite_path_does():
    """Finite gradients skip the passes for inf and NaN; those passes give every finite block
    the same codes and scales (zero, tiny and large blocks, values on rounding midpoints)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(40, 64, generator=gen) * torch.exp2(torch.randint(-130, 120, (40, 1), generator=gen).float())
    x[0] = 0.0
    x[1, :8] = torch.arange(8) + 0.5    # rint on exact halves
    for bits in (4, 8):
        code, scale = gq_format._quantize_blocks(x, bits)
        general_code, general_scale = gq_format._quantize_nonfinite_blocks(x, bits)
        assert torch.equal(code, general_code) and torch.equal(scale, general_scale)


def test_bad_arguments():
    g = torch.randn(12)
    with pytest.raises(ValueError):
        torch.ops.zpp.qgz_quantize(g, 5, 1, 4, 32)          # 12 not divisible by 5
    with pytest.raises(ValueError):
        torch.ops.zpp.qgz_quantize(g, 2, 2, 3, 32)
    with pytest.raises(ValueError):
        torch.ops.zpp.qgz_quantize(g.to(torch.int32), 2, 2, 4, 32)
    with pytest.raises(ValueError):
        torch.ops.zpp.qgz_dequantize_reduce(torch.zeros(7, dtype=torch.uint8), 1, 3, 4, 32,
                                            torch.float32, 1.0)


@pytest.mark.parametrize("op", ["quantize", "reduce", "dequantize"])
def test_opcheck(op):
    S, B = 37, 32
    g = torch.randn(4 * S)
    buf = gq.qgz_quantize_ref(g, 2, 2, 8, B)
    if op == "quantize":
        torch.library.opcheck(torch.ops.zpp.qgz_quantize.default, (g, 2, 2, 4, B))
    elif op == "reduce":
        torch.library.opcheck(torch.ops.zpp.qgz_reduce_requantize.default,
                              (buf, 2, 2, S, 8, 4, B))
    else:
        torch.library.opcheck(torch.ops.zpp.qgz_dequantize_reduce.default,
                              (buf, 4, S, 8, B, torch.bfloat16, 0.25))


# ------------------------------------------------------------------------------------------
# Triton (interpreter on CPU) == torch twin, bit for bit
# ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def kernel_outputs(request) -> dict[str, Any]:
    """The kernel and twin outputs of every selected test of this module that reads `launched`,
    by test id: its `OUTPUTS` function called with its parameters. The Triton interpreter runs a
    kernel's programs one after another on one core, so all of them are computed up front, shared
    among the processes of the test ranks (`spread`); the tests compare them here."""
    items = [item for item in request.session.items
             if item.module is request.module and "launched" in item.fixturenames]
    calls = [(functools.partial(OUTPUTS[item.originalname], **item.callspec.params),) for item in items]
    return {item.nodeid: outputs for item, outputs in zip(items, spread(calls))}


@pytest.fixture
def launched(kernel_outputs, request) -> Any:
    """This test's outputs (see kernel_outputs)."""
    return kernel_outputs[request.node.nodeid]


def nasty(n: int, dtype, gen: torch.Generator) -> torch.Tensor:
    """Random values over many magnitudes, plus the special cases the kernels branch on."""
    x = torch.randn(n, generator=gen) * torch.exp2(torch.randint(-20, 20, (n,), generator=gen))
    x[: n // 16] = 0.0                                   # (mostly) all-zero blocks
    if n > 200:
        x[100], x[130], x[160] = float("inf"), float("-inf"), float("nan")
        x[n // 2: n // 2 + 40] *= 1e-36                  # tiny scales: slow dequant path
        x[n // 2 + 40: n // 2 + 50] = 3e-39 if dtype != torch.float16 else 0.0  # inv clamp
        x[n - 70: n - 60] = 3e38 if dtype == torch.float32 else 1e4   # sums may overflow
    return x.to(dtype)


# tile=None: the default tile (one program per piece at these sizes); tile=128: a few blocks per
# program, so that tiles with and without non-finite values / tiny scales (the kernels' fast and
# slow branches) occur in the same launch.
TILES = [None, 128]
BLOCK_TILE = [(32, 128), (96, None)]      # (block size, tile): B = 96 is not a power of two


def quantize_outputs(dtype, bits, B, tile) -> list[tuple]:
    """(problem, kernel output, twin output) for each problem of test_triton_quantize_matches_twin."""
    gen = torch.Generator().manual_seed(bits * 100 + B)
    outputs = []
    for (N, R), S in (((2, 2), 333), ((1, 3), 101), ((3, 1), 7)):
        g = nasty(N * R * S, dtype, gen)
        outputs.append(((N, R, S), gq.qgz_quantize_triton(g.to(DEV), N, R, bits, B, tile_elems=tile).cpu(),
                        gq.qgz_quantize_ref(g, N, R, bits, B)))
    return outputs


@pytest.mark.distributed
@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("B,tile", BLOCK_TILE)
def test_triton_quantize_matches_twin(dtype, bits, B, tile, launched):
    for problem, out, ref in launched:
        assert torch.equal(out, ref), problem


@pytest.mark.parametrize("bits", [4, 8])
def test_codes_round_the_exact_product(bits):
    """code = rint(x * inv) of the exact product, not of its float32 rounding: one block holds
    values whose float32 product x * inv rounds onto a half-integer that the exact product
    stays below or above (found next to every (k + 1/2) / inv). Reference: float64 products."""
    q = (1 << (bits - 1)) - 1
    a = torch.tensor(0.7390851, dtype=torch.float32)      # the block's absmax
    inv = torch.tensor(float(q), dtype=torch.float32) / a
    ties = []
    for k in range(q):
        near = torch.tensor((k + 0.5) / inv.double().item(), dtype=torch.float32).view(torch.int32)
        x = (near + torch.arange(-200, 201, dtype=torch.int32)).view(torch.float32)
        off = torch.round((x * inv).double()) != torch.round(x.double() * inv.double())
        ties.append(x[off])
    ties = torch.cat(ties)
    assert ties.numel() > 0
    B = 32 * (1 + ties.numel() // 32)
    x = torch.zeros(B)
    x[0] = a
    x[1:1 + ties.numel()] = ties
    want = torch.round(x.double() * inv.double()).to(torch.int32)
    want[0] = q
    ref = gq.qgz_quantize_ref(x, 1, 1, bits, B)
    assert torch.equal(gq.unpack_pieces(ref, 1, B, bits, B)[0].flatten(), want)
    if triton_ok:
        out = gq.qgz_quantize_triton(x.to(DEV), 1, 1, bits, B).cpu()
        assert torch.equal(out, ref)


def reduce_requantize_outputs(in_bits, out_bits, B, tile) -> list[tuple]:
    """(problem, kernel output, twin output) for each problem of
    test_triton_reduce_requantize_matches_twin."""
    gen = torch.Generator().manual_seed(in_bits * 10 + out_bits + B)
    outputs = []
    for K, P, S in ((3, 2, 301), (1, 1, 5)):
        recv = torch.cat([gq.qgz_quantize_ref(nasty(P * S, torch.float32, gen), P, 1, in_bits, B)
                          for _ in range(K)])
        out = gq.qgz_reduce_requantize_triton(recv.to(DEV), K, P, S, in_bits, out_bits, B, tile_elems=tile).cpu()
        outputs.append(((K, P, S), out, gq.qgz_reduce_requantize_ref(recv, K, P, S, in_bits, out_bits, B)))
    return outputs


@pytest.mark.distributed
@needs_triton
@pytest.mark.parametrize("in_bits,out_bits", [(4, 4), (8, 4), (4, 8), (8, 8)])
@pytest.mark.parametrize("B,tile", BLOCK_TILE)
def test_triton_reduce_requantize_matches_twin(in_bits, out_bits, B, tile, launched):
    for problem, out, ref in launched:
        assert torch.equal(out, ref), problem


@needs_triton
def test_triton_kernels_refuse_an_odd_number_of_octets_per_block():
    """B = 40 is 5 octets: a 16-byte pair of octets would cross into the next block, so the
    launchers refuse it (the ops run the twins for such sizes)."""
    g = torch.randn(4 * 80)
    recv = gq.qgz_quantize_ref(g, 2, 2, 8, 40)
    for launch in (lambda: gq.qgz_quantize_triton(g.to(DEV), 2, 2, 8, 40),
                   lambda: gq.qgz_reduce_requantize_triton(recv.to(DEV), 4, 1, 80, 8, 8, 40),
                   lambda: gq.qgz_dequantize_reduce_triton(recv.to(DEV), 4, 80, 8, 40, torch.float32, 1.0)):
        with pytest.raises(ValueError, match="multiple of 16, got 40"):
            launch()


@needs_triton
@pytest.mark.parametrize("bits", [4, 8])
def test_triton_reduce_overflow_without_markers(bits):
    """All inputs finite, but the float32 sum overflows: the kernels' NaN-free fast path must
    mark the block (scale inf) exactly as the twin does, and the inf must survive."""
    S, B = 200, 32
    gen = torch.Generator().manual_seed(3)
    srcs = []
    for _ in range(3):
        x = torch.randn(S, generator=gen)
        x[40:44] = 3e38
        srcs.append(x)
    recv = torch.cat([gq.qgz_quantize_ref(x, 1, 1, bits, B) for x in srcs])
    ref = gq.qgz_reduce_requantize_ref(recv, 3, 1, S, bits, bits, B)
    for tile in TILES:
        out = gq.qgz_reduce_requantize_triton(recv.to(DEV), 3, 1, S, bits, bits, B,
                                              tile_elems=tile).cpu()
        assert torch.equal(out, ref)
    back = gq.dequantize_pieces_ref(ref, 1, S, bits, B)[0]
    assert (back[40:44] == math.inf).all() and torch.isfinite(back[64:]).all()
    assert not torch.isnan(back).any()


def received(K: int, P: int, S: int, bits: int, B: int, seed: int, special: bool) -> torch.Tensor:
    """K sources x P pieces as qgz_reduce_requantize receives them (source-major), of values
    over many magnitudes; ``special``: nasty values, and in every piece a whole block of
    subnormal values (a subnormal scale)."""
    gen = torch.Generator().manual_seed(seed)
    srcs = []
    for _ in range(K):
        if special:
            x = nasty(P * S, torch.float32, gen).reshape(P, S)
            x[:, B:2 * B] = 3e-39
        else:
            x = torch.randn(P * S, generator=gen) * torch.exp2(
                torch.randint(-20, 20, (P * S,), generator=gen))
        srcs.append(gq.qgz_quantize_ref(x.flatten(), P, 1, bits, B))
    return torch.cat(srcs)


def persistent_loop_outputs(in_bits, out_bits, slow_chunk, l2_prefetch) -> tuple:
    """(input, kernel output, twin output) of test_triton_reduce_requantize_persistent_loop."""
    K, B, S = 2, 32, 25 * 32 + 5
    recv = received(K, 1, S, in_bits, B, seed=in_bits * 10 + out_bits, special=True)
    out = gq.qgz_reduce_requantize_triton(recv.to(DEV), K, 1, S, in_bits, out_bits, B,
                                          tile_elems=128, programs_per_sm=1,
                                          slow_chunk=slow_chunk, l2_prefetch=l2_prefetch).cpu()
    return recv, out, gq.qgz_reduce_requantize_ref(recv, K, 1, S, in_bits, out_bits, B)


@pytest.mark.distributed
@needs_triton
@pytest.mark.parametrize("in_bits,out_bits,slow_chunk,l2_prefetch", [
    (4, 4, 32, None), (8, 8, 32, True), (8, 4, 32, None), (4, 8, 32, False), (8, 4, 1, None)])
def test_triton_reduce_requantize_persistent_loop(in_bits, out_bits, slow_chunk, l2_prefetch, launched):
    """More full tiles than programs: 3 programs (the interpreter counts 3 SMs) walk 6 tiles of
    4 blocks, program i tiles i and i + 3 (the next tile's loads issued before the current
    tile's arithmetic; the tiles that need the slow path redone after both, or after each
    with slow_chunk=1), then the partial last tile (partial last block). The inputs hold what
    the kernel branches on (tile 4 none of it: its sum comes from the prefetched words), and
    the output keeps it visible. With and without the L2 prefetch (on the GPU; the
    interpreter has no cache to ask)."""
    B, S = 32, 25 * 32 + 5
    recv, out, ref = launched
    _, s_in = gq.unpack_pieces(recv[:gq.piece_bytes(S, B, in_bits)], 1, S, in_bits, B)
    assert (s_in == math.inf).any() and ((s_in > 0) & (s_in < 2.0 ** -126)).any()
    _, s_out = gq.unpack_pieces(ref, 1, S, out_bits, B)
    assert (s_out == math.inf).sum() > (s_in == math.inf).sum()    # finite sums overflowed
    assert torch.equal(out, ref)


def default_tiles_outputs(in_bits, out_bits, K, B) -> tuple:
    """(kernel output, twin output) of test_triton_reduce_requantize_default_tiles."""
    nb = gq.elems_per_thread(K, in_bits) * 128 // B + 1
    S = (nb - 1) * B + 77
    recv = received(K, 1, S, in_bits, B, seed=K + in_bits * 10 + out_bits, special=False)
    return (gq.qgz_reduce_requantize_triton(recv.to(DEV), K, 1, S, in_bits, out_bits, B).cpu(),
            gq.qgz_reduce_requantize_ref(recv, K, 1, S, in_bits, out_bits, B))


@pytest.mark.distributed
@needs_triton
@pytest.mark.parametrize("in_bits,out_bits,K,B", [
    (4, 4, 4, 256), (8, 8, 4, 256), (8, 4, 4, 256), (4, 8, 4, 256),   # 2 nodes x 4 ranks
    (4, 4, 8, 256), (8, 4, 8, 256), (8, 8, 1, 256),                   # 8 / 1 ranks per node
    (8, 8, 2, 2048), (4, 4, 2, 2048)])                                # 64 / 32 threads per block
def test_triton_reduce_requantize_default_tiles(in_bits, out_bits, K, B, launched):
    """The default tiles (elems_per_thread; 1 or 2 vectors of a block per thread at block
    256): one full tile, then a partial one of one partial block."""
    out, ref = launched
    assert torch.equal(out, ref)


def test_reduce_requantize_register_cap():
    """programs_per_sm programs of 4 warps share an SM's 65536 registers (in units of 8 per
    thread, at most 255 each): 2 -> 255, 3 -> 168, 4 -> 128; of one warp (the defaults, TUNING):
    8 -> 255, 12 -> 168, 16 -> 128."""
    cpu = torch.device("cpu")
    assert [gq._register_cap(cpu, n, 4) for n in (1, 2, 3, 4)] == [255, 255, 168, 128]
    assert [gq._register_cap(cpu, n, 1) for n in (8, 12, 16)] == [255, 168, 128]


def test_reduce_requantize_elements_per_thread():
    """The tile rule: the code words of all sources stay within 32 registers per thread, at
    least 16 elements."""
    assert [gq.elems_per_thread(k, 4) for k in (1, 2, 4, 8)] == [64, 64, 64, 32]
    assert [gq.elems_per_thread(k, 8) for k in (1, 2, 3, 4, 5, 8)] == [64, 64, 32, 32, 16, 16]
    assert gq.elems_per_thread(1000, 8) == 16


@needs_triton
def test_triton_reduce_requantize_bad_tuning():
    recv = gq.qgz_quantize_ref(torch.randn(64), 1, 1, 4, 32)
    for kw, what in ((dict(num_warps=3), "num_warps"), (dict(tile_elems=0), "tile_elems"),
                     (dict(programs_per_sm=0), "programs_per_sm"),
                     (dict(slow_chunk=0), "slow_chunk"), (dict(slow_chunk=33), "slow_chunk")):
        with pytest.raises(ValueError, match=what):
            gq.qgz_reduce_requantize_triton(recv.to(DEV), 1, 1, 64, 4, 4, 32, **kw)


def dequantize_reduce_outputs(dtype, bits, B, tile) -> list[tuple]:
    """(problem, kernel output, twin output) for each problem of
    test_triton_dequantize_reduce_matches_twin."""
    gen = torch.Generator().manual_seed(bits + B)
    outputs = []
    for K, S, scale in ((4, 333, 0.25), (1, 9, 1.0), (3, 250, 1 / 3)):
        recv = torch.cat([gq.qgz_quantize_ref(nasty(S, torch.float32, gen), 1, 1, bits, B)
                          for _ in range(K)])
        out = gq.qgz_dequantize_reduce_triton(recv.to(DEV), K, S, bits, B, dtype, scale, tile_elems=tile).cpu()
        outputs.append(((K, S), out, gq.qgz_dequantize_reduce_ref(recv, K, S, bits, B, dtype, scale)))
    return outputs


@pytest.mark.distributed
@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("B,tile", BLOCK_TILE)
def test_triton_dequantize_reduce_matches_twin(dtype, bits, B, tile, launched):
    for problem, out, ref in launched:
        assert out.dtype == dtype and same_bits(out, ref), problem


@needs_triton
def test_triton_unaligned_recv_view():
    """A recv that is a view at a non-multiple-of-4 offset still works (copied to align)."""
    S, B = 50, 32
    pb = gq.piece_bytes(S, B, 8)
    recv = gq.qgz_quantize_ref(torch.randn(2 * S), 2, 1, 8, B)
    big = torch.zeros(2 * pb + 1, dtype=torch.uint8)
    big[1:] = recv
    out = gq.qgz_dequantize_reduce_triton(big[1:].to(DEV), 2, S, 8, B, torch.float32, 0.5).cpu()
    assert same_bits(out, gq.qgz_dequantize_reduce_ref(recv, 2, S, 8, B, torch.float32, 0.5))


# ------------------------------------------------------------------------------------------
# the whole pipeline, single process, all-to-alls emulated by slicing
# ------------------------------------------------------------------------------------------

def _impl(name):
    if name == "op":
        return (torch.ops.zpp.qgz_quantize, torch.ops.zpp.qgz_reduce_requantize,
                torch.ops.zpp.qgz_dequantize_reduce)
    return (gq.qgz_quantize_triton, gq.qgz_reduce_requantize_triton,
            gq.qgz_dequantize_reduce_triton)


def simulate(grads, N, R, B, bits1, bits2, dtype, impl="op"):
    """Run qgZ for W = N * R emulated ranks. Returns (results per rank, bound per rank)."""
    quant, reduce_requant, dequant_reduce = _impl(impl)
    W = N * R
    S = grads[0].numel() // W
    pb1 = gq.piece_bytes(S, B, bits1)
    pb2 = gq.piece_bytes(S, B, bits2)
    q1, q2 = (1 << (bits1 - 1)) - 1, (1 << (bits2 - 1)) - 1
    sent = [quant(g, N, R, bits1, B).cpu() for g in grads]      # chunk l outer, node m inner

    def scales(buf, idx, pb, bits):
        _, sc = gq.unpack_pieces(buf[idx * pb:(idx + 1) * pb], 1, S, bits, B)
        return sc[0].double().repeat_interleave(B)[:S]

    results, bounds = [], []
    if N == 1 or R == 1:
        # one all-to-all (intra when N == 1, inter when R == 1): rank r gets, from every rank j
        # in order, the piece j holds for shard r: chunk local, node m -> index local * N + m
        for r in range(W):
            m, local = divmod(r, R)
            recv = torch.cat([sent[j][(local * N + m) * pb1:(local * N + m + 1) * pb1] for j in range(W)])
            results.append(dequant_reduce(recv.to(grads[0].device), W, S, bits1, B, dtype,
                                          1.0 / W).cpu())
            s1 = sum(scales(sent[j], local * N + m, pb1, bits1) for j in range(W))
            bounds.append((C_BOUND * s1 + 2.0 ** -20 * q1 * s1) / W)
        return results, bounds
    partial = []
    for r in range(W):                # intra-node all-to-all: chunk local of every local source
        m, local = divmod(r, R)
        recv1 = torch.cat([sent[m * R + k][local * N * pb1:(local + 1) * N * pb1] for k in range(R)])
        partial.append(reduce_requant(recv1.to(grads[0].device), R, N, S, bits1, bits2,
                                      B).cpu())
    for r in range(W):                # inter-node all-to-all: piece m from each node's rank local
        m, local = divmod(r, R)
        recv2 = torch.cat([partial[k * R + local][m * pb2:(m + 1) * pb2] for k in range(N)])
        results.append(dequant_reduce(recv2.to(grads[0].device), N, S, bits2, B, dtype,
                                      1.0 / W).cpu())
        s1 = sum(scales(sent[j], local * N + m, pb1, bits1) for j in range(W))
        s2 = sum(scales(partial[k * R + local], m, pb2, bits2) for k in range(N))
        bounds.append((C_BOUND * (s1 + s2) + 2.0 ** -20 * (q1 * s1 + q2 * s2)) / W)
    return results, bounds


def check_against_mean(grads, results, bounds, N, R, dtype):
    W = N * R
    S = grads[0].numel() // W
    mean = torch.stack([g.double().cpu() for g in grads]).sum(0) / W      # float64 reference
    worst = 0.0
    for r in range(W):
        ref = mean[r * S:(r + 1) * S]
        got = results[r]
        assert got.dtype == dtype and got.shape == (S,)
        bound = bounds[r] + U_OUT[dtype] * (ref.abs() + bounds[r])
        if dtype == torch.float16:
            bound = bound + 2.0 ** -25
        err = (got.double() - ref).abs()
        assert torch.isfinite(got).all()
        assert (err <= bound).all(), (r, (err - bound).max().item())
        worst = max(worst, (err / bound.clamp_min(1e-30)).max().item())
    return worst


TOPOLOGIES = [(2, 2), (2, 1), (1, 2), (1, 1)]
SIZES = {"S1": (1, 32), "S7": (7, 32), "S4097": (4097, 256), "weight33x17": (None, 96)}


def make_grads(W, S, dtype, seed, shape=None):
    gen = torch.Generator().manual_seed(seed)
    grads = []
    for j in range(W):
        if shape is not None:         # a 2-D weight's gradient, flattened and padded to W * S
            w = torch.randn(shape, generator=gen) * (j + 1)
            g = torch.zeros(W * S)
            g[:w.numel()] = w.flatten()
        else:                         # magnitudes vary over blocks, and over ranks
            g = torch.randn(W * S, generator=gen)
            g = g * torch.exp2(torch.randint(-6, 7, (W * S // 16 + 1,), generator=gen)
                               .repeat_interleave(16)[:W * S].float()) * (j + 1)
        grads.append(g.to(dtype))
    return grads


@pytest.mark.parametrize("N,R", TOPOLOGIES)
@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("bits1,bits2", [(8, 8), (4, 4), (8, 4)])
def test_pipeline_within_bound(N, R, size, dtype, bits1, bits2):
    W = N * R
    S, B = SIZES[size]
    shape = None
    if S is None:
        shape = (33, 17)
        S = -(-33 * 17 // W)
    grads = make_grads(W, S, dtype, seed=hash((N, R, size, bits1, bits2)) % 10000, shape=shape)
    results, bounds = simulate(grads, N, R, B, bits1, bits2, dtype)
    worst = check_against_mean(grads, results, bounds, N, R, dtype)
    if S >= 4097 and dtype == torch.float32:
        assert worst > 0.05           # the bound is not vacuous: errors come close to it
    if shape is not None:             # the shards reassemble into the mean weight gradient
        full = torch.cat(results)[:33 * 17].reshape(shape).double()
        mean = sum(g.double()[:33 * 17] for g in grads).reshape(shape) / W
        assert (full - mean).abs().max() <= max(b.max().item() for b in bounds) * 1.01 + 1e-2


def test_pipeline_bound_catches_a_wrong_mean():
    """The bound check fails for the sum / nodes mistake (DeepSpeed's qgZ): it can fail."""
    N, R = 2, 2
    grads = make_grads(4, 64, torch.float32, seed=1)
    results, bounds = simulate(grads, N, R, 32, 8, 8, torch.float32)
    check_against_mean(grads, results, bounds, N, R, torch.float32)
    wrong = [x * R for x in results]  # sum / N instead of sum / W
    with pytest.raises(AssertionError):
        check_against_mean(grads, wrong, bounds, N, R, torch.float32)


def pipeline_outputs(N, R) -> list[tuple]:
    """(the Triton kernels' results, the ops' results) of the simulated pipeline for each problem
    of test_pipeline_triton_equals_ops."""
    outputs = []
    for S, B, dtype, (b1, b2) in ((7, 32, torch.bfloat16, (4, 4)),
                                  (300, 64, torch.float16, (8, 4))):
        grads = make_grads(N * R, S, dtype, seed=S)
        want, _ = simulate(grads, N, R, B, b1, b2, dtype, impl="op")
        got, _ = simulate([g.to(DEV) for g in grads], N, R, B, b1, b2, dtype, impl="triton")
        outputs.append((got, want))
    return outputs


@pytest.mark.distributed
@needs_triton
@pytest.mark.parametrize("N,R", [(2, 2), (1, 2), (2, 1)])
def test_pipeline_triton_equals_ops(N, R, launched):
    for got, want in launched:
        assert len(got) == len(want) == N * R and all(same_bits(a, b) for a, b in zip(got, want))


# The function whose outputs each test that reads `launched` compares.
OUTPUTS = {
    "test_triton_quantize_matches_twin": quantize_outputs,
    "test_triton_reduce_requantize_matches_twin": reduce_requantize_outputs,
    "test_triton_reduce_requantize_persistent_loop": persistent_loop_outputs,
    "test_triton_reduce_requantize_default_tiles": default_tiles_outputs,
    "test_triton_dequantize_reduce_matches_twin": dequantize_reduce_outputs,
    "test_pipeline_triton_equals_ops": pipeline_outputs,
}


def exact_grads(N, R, S, B, dtype):
    """Gradients for which every hop is exact (INT8 both hops): in each block of each shard an
    anchor element equals 127 * 2**k on every rank (k distinct per (shard, block)), the other
    elements are 2**k * R * (j + 1) * f(e) with |f| <= 15, so that hop-1 scales are 2**k, node
    sums have scale R * 2**k, all codes are integers within [-127, 127], and the mean is exact
    in every output dtype."""
    W = N * R
    nb = -(-S // B)
    grads = []
    for j in range(W):
        g = torch.empty(W * S, dtype=torch.float64)
        for e in range(W * S):
            r, i = divmod(e, S)
            b, t = divmod(i, B)
            k = (r * nb + b) % 19 - 12
            f = (e * 7 + 3) % 31 - 15
            g[e] = 127 * 2.0 ** k if t == 0 else 2.0 ** k * R * (j + 1) * f
        grads.append(g.to(dtype))
        assert torch.equal(grads[-1].double(), g)            # representable exactly
    return grads


@pytest.mark.parametrize("N,R", TOPOLOGIES)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("S", [1, 70])
def test_slice_order_exact(N, R, dtype, S):
    """Every element lands in its owner's shard and the result is the mean, exactly."""
    W, B = N * R, 32
    grads = exact_grads(N, R, S, B, dtype)
    results, _ = simulate(grads, N, R, B, 8, 8, dtype)
    total = torch.stack([g.double() for g in grads]).sum(0)
    mean = (total / W).to(dtype)
    for r in range(W):
        assert torch.equal(results[r], mean[r * S:(r + 1) * S]), r
        if W > 1:                     # and not the sum, nor sum / R (nor sum / N)
            for wrong in (total, total / R, total / N):
                if not torch.equal(wrong, total / W):
                    assert not torch.equal(results[r].double(),
                                           wrong[r * S:(r + 1) * S]), r
    # the layout is what the design says: shard m*R + local sits in chunk local, node slot m
    pb = gq.piece_bytes(S, B, 8)
    for m in range(N):
        for local in range(R):
            shard = m * R + local
            piece = gq.qgz_quantize_ref(grads[0], N, R, 8, B)[(local * N + m) * pb:(local * N + m + 1) * pb]
            back = gq.dequantize_pieces_ref(piece, 1, S, 8, B)[0]
            assert torch.equal(back.double(), grads[0].double()[shard * S:(shard + 1) * S])


@pytest.mark.parametrize("N,R", TOPOLOGIES)
@pytest.mark.parametrize("bits1,bits2", [(4, 4), (8, 4)])
def test_inf_stays_visible(N, R, bits1, bits2):
    W, S, B = N * R, 70, 32
    grads = make_grads(W, S, torch.bfloat16, seed=5)
    e = 2 * S + 40 if W > 2 else S + 40          # an element of shard 2 (or 1)
    e = min(e, W * S - 1)
    owner, i = divmod(e, S)
    grads[W - 1][e] = float("inf")               # one rank overflowed
    results, _ = simulate(grads, N, R, B, bits1, bits2, torch.bfloat16)
    assert results[owner][i] == float("inf")     # visible, and not turned into NaN
    for r in range(W):
        assert not torch.isnan(results[r]).any()
        if r != owner:
            assert torch.isfinite(results[r]).all()
    blk = (i // B) * B
    others = torch.cat([results[owner][:blk], results[owner][blk + B:]])
    assert torch.isfinite(others).all()          # other blocks of the owner shard unaffected
    # +inf on one rank and -inf on another: NaN (non-finite) at that element only
    grads[0][e] = float("-inf")
    results, _ = simulate(grads, N, R, B, bits1, bits2, torch.bfloat16)
    assert not torch.isfinite(results[owner][i])
    # a NaN gradient stays NaN
    grads = make_grads(W, S, torch.float32, seed=6)
    grads[0][e] = float("nan")
    results, _ = simulate(grads, N, R, B, bits1, bits2, torch.float32)
    assert torch.isnan(results[owner][i])
    assert torch.isnan(results[owner]).sum() == 1


@pytest.mark.parametrize("N,R", TOPOLOGIES)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
def test_zero_gradients_give_exact_zeros(N, R, dtype):
    W, S = N * R, 45
    grads = [torch.zeros(W * S, dtype=dtype) for _ in range(W)]
    for bits1, bits2 in ((4, 4), (8, 4)):
        results, _ = simulate(grads, N, R, 32, bits1, bits2, dtype)
        for x in results:
            assert x.dtype == dtype and torch.equal(x, torch.zeros(S, dtype=dtype))
    # and a zero block next to non-zero ones stays exactly zero
    grads = make_grads(W, S, dtype, seed=9)
    for g in grads:
        g[:32] = 0.0
    results, _ = simulate(grads, N, R, 32, 4, 4, dtype)
    assert torch.equal(results[0][:32], torch.zeros(32, dtype=dtype))

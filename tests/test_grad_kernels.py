"""qgZ's Triton kernels (runtime/quantization/grad_kernels.py; the interpreter on CPU) equal
their torch twins bit for bit, alone and in the simulated two-hop pipeline."""

import functools
import math
from typing import Any

import pytest
import torch
from distributed import spread
from grad_quant_common import DEV, DTYPES, make_grads, needs_triton, same_bits, simulate, triton_ok

from zpp_compile.runtime.quantization import grad_ops as gq


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


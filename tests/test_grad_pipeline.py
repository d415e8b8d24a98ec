"""qgZ's whole two-hop pipeline in one process (the all-to-alls emulated by slicing) against
float64 references: within the error bound, exact where every hop is exact, infinities and zeros
kept."""


import pytest
import torch
from grad_quant_common import DTYPES, SIZES, TOPOLOGIES, check_against_mean, make_grads, simulate

from zpp_compile.runtime.quantization import grad_ops as gq


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

"""What the qgZ tests share: the dtypes, bitwise equality, and the single-process simulation of
the whole two-hop pipeline (the all-to-alls emulated by slicing: one list entry per emulated rank
``r = m * R + l``) with its check against the float64 mean.

Error bound used by the simulation (`check_against_mean`): one quantization with block scale ``s``
moves an element by at most ``s * (0.5 + 4 q 2**-24)``; we allow ``C = 0.5 + 2**-12``. Shard
element ``i`` of rank ``r`` went through

    hop 1: every rank j quantized g_j             (scale s1_j of the block holding i)
    hop 2: node m' requantized its partial sum    (scale s2_m', only when N > 1 and R > 1)

so ``|result - mean| <= (C * (sum_j s1_j + sum_m' s2_m') + F) / W + D``, where ``F`` covers the
float32 accumulations (``2**-20 * sum of q * scale``, loose) and ``D`` the final rounding to the
output dtype (half an ulp: ``2**-8 |x|`` for bf16, ``2**-11 |x| + 2**-25`` for fp16).
"""

import os

import pytest
import torch

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



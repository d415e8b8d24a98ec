"""qwZ: INT8 weight gathers, checked against a float64 model of the quantized weights."""

from __future__ import annotations

import pytest
import torch
from distributed import device, run_ranks
from models import TinyTransformer, batches
from training import needs_4_ranks, qwz_runs

import zpp_compile as zpp
from zpp_compile.reports.ledger import LEDGER

pytestmark = pytest.mark.distributed  # every test here starts processes


def test_qwz_world2():
    errors = run_ranks(qwz_runs, 2, 2)[0]
    print("largest relative update error:", max(errors.items(), key=lambda kv: kv[1]))
    # Measured 1.4e-2 (blocks.0.norm1.bias); a wrong scale or block layout gives errors near 1.
    assert max(errors.values()) < 5e-2, errors


@needs_4_ranks
def test_qwz_world4_two_nodes():
    errors = run_ranks(qwz_runs, 4, 2, None, ("aot",))[0]
    print("largest relative update error:", max(errors.items(), key=lambda kv: kv[1]))
    assert max(errors.values()) < 5e-2, errors


def gather_bytes(rank: int, world_size: int) -> dict:
    """Bytes of the forward and backward graphs' gathers with qwZ off and on (bf16 weights)."""
    out = {}
    for qwz in (False, True):
        torch.manual_seed(0)
        model = TinyTransformer(vocab=256, dim=256, heads=4, layers=2).to(device())
        zpp.shard(model, zpp.Config(quantized_weights=qwz, param_dtype="bf16"))
        compiled = torch.compile(model, backend="zeropp", options={"inductor": False})
        start = len(LEDGER.graphs)
        tokens, targets = batches(1, world_size, vocab=256)[0]
        compiled(tokens[:1].to(device()), targets[:1].to(device())).backward()
        for graph in LEDGER.graphs[start:]:
            gathers = [c for c in graph.collectives if c.op == "all_gather"]
            out[(qwz, graph.kind)] = sum(c.intra_bytes + c.inter_bytes for c in gathers)
    return out


def test_qwz_halves_gather_bytes():
    volume = run_ranks(gather_bytes, 2)[0]
    for kind in ("forward", "backward"):
        ratio = volume[(True, kind)] / volume[(False, kind)]
        assert 0.45 < ratio <= 0.51, (kind, ratio)

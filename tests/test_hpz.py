"""hpZ: backward weight gathers stay inside the node, from a secondary copy made in forward."""

from __future__ import annotations

import pytest
import torch

import zpp_compile as zpp
from distributed import device, run_ranks
from models import TinyTransformer, batches
from test_qwz import qwz_runs
from test_zero3 import PER_RANK, STEPS, needs_4_ranks, saved_tensor_shapes, train_sharded

TWO_NODES = {"ranks_per_node": 2, "hpz_partition_size": 2}


@needs_4_ranks
def test_hpz_two_nodes_matches_unsharded_reference():
    # 3 SGD steps: each forward after an optimizer step must build a fresh secondary copy.
    # (Inductor with hpZ: test_hpz_eval_and_gradient_accumulation.)
    run_ranks(train_sharded, 4, "aot", TWO_NODES)


@pytest.mark.parametrize("ranks_per_node", [1, 2])
def test_hpz_full_local_copy_matches_unsharded_reference(ranks_per_node):
    run_ranks(train_sharded, 2, "aot", {"hpz_partition_size": 1, "ranks_per_node": ranks_per_node})


def gathers_by_graph(rank: int, world_size: int, options: dict) -> dict:
    """Per graph kind: (group size, dtype, intra bytes, inter bytes) of every all-gather, and
    the secondary copy bytes."""
    torch.manual_seed(0)
    model = zpp.shard(TinyTransformer().to(device()), zpp.Config(**options))
    compiled = torch.compile(model, backend="zeropp", options={"inductor": False})
    start = len(zpp.REGISTRY.ledger)
    tokens, targets = batches(1, world_size)[0]
    compiled(tokens[:PER_RANK].to(device()), targets[:PER_RANK].to(device())).backward()
    graphs = zpp.REGISTRY.ledger[start:]
    out = {g.kind: [(c.group.size, str(c.dtype), c.intra_bytes, c.inter_bytes)
                    for c in g.collectives if c.op == "all_gather"] for g in graphs}
    out["secondary_bytes"] = zpp.secondary_copy_bytes()
    out["param_bytes"] = sum(p.numel() * 4 for p in model.parameters())
    return out


@needs_4_ranks
@pytest.mark.parametrize("qwz", [False, True])
def test_backward_weight_gathers_never_leave_the_node(qwz):
    result = run_ranks(gathers_by_graph, 4, {**TWO_NODES, "quantized_weights": qwz, "weight_block_size": 64})[0]
    assert result["forward"] and all(size == 4 for size, *_ in result["forward"])  # world gathers
    assert result["backward"], "backward gathers nothing: the copy would be a full weight"
    assert all(size == 2 and inter == 0 and intra > 0 for size, _, intra, inter in result["backward"])
    if qwz:  # the secondary copy is the INT8 blocks themselves, gathered as bytes
        assert any(dtype == "torch.uint8" for _, dtype, *_ in result["backward"])
    # Each rank keeps half of every gathered weight (INT8 with qwZ): at most half the fp32 bytes
    # of the whole model, about a quarter with INT8.
    assert 0 < result["secondary_bytes"] <= result["param_bytes"] / 2 / (2 if qwz else 1) * 1.1


def test_full_local_copy_gathers_nothing_in_backward():
    result = run_ranks(gathers_by_graph, 2, {"hpz_partition_size": 1})[0]
    assert result["forward"] and not result.get("backward")


def test_hpz_saves_no_gathered_weight():
    assert run_ranks(saved_tensor_shapes, 2, {"hpz_partition_size": 2}) == [[], []]


@needs_4_ranks
def test_hpz_with_qwz_stays_near_reference():
    errors = run_ranks(qwz_runs, 4, 2, {"hpz_partition_size": 2}, ("aot",))[0]
    assert max(errors.values()) < 5e-2, errors


def eval_and_accumulation(rank: int, world_size: int) -> None:
    """no_grad evaluation, and two micro-batches accumulated before one step, with hpZ."""
    data, mine = batches(STEPS, world_size, 2 * PER_RANK), slice(rank * 2 * PER_RANK, (rank + 1) * 2 * PER_RANK)
    torch.manual_seed(0)
    model = zpp.shard(TinyTransformer().to(device()), zpp.Config(hpz_partition_size=2))
    compiled = torch.compile(model, backend="zeropp")
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    for tokens, targets in data:
        tokens, targets = tokens[mine].to(device()), targets[mine].to(device())
        for half in (slice(0, PER_RANK), slice(PER_RANK, 2 * PER_RANK)):
            (compiled(tokens[half], targets[half]) / 2).backward()
        opt.step()
        opt.zero_grad()
        model.eval()
        with torch.no_grad():
            evaluated = compiled(tokens, targets)
        model.train()
        torch.testing.assert_close(evaluated, model(tokens, targets).detach(), rtol=1e-5, atol=0)
    torch.manual_seed(0)
    reference = TinyTransformer().to(device())
    train_opt = torch.optim.SGD(reference.parameters(), lr=0.2)
    for tokens, targets in data:
        reference(tokens.to(device()), targets.to(device())).backward()
        train_opt.step()
        train_opt.zero_grad()
    full = zpp.full_state_dict(model)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(full[key], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")


def test_hpz_eval_and_gradient_accumulation():
    run_ranks(eval_and_accumulation, 2)

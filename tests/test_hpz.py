"""hpZ: backward weight gathers stay inside the node, from a secondary copy made in forward.

The checks of each world size share one spawned group (`runs`): each test reads its own run's
result, and a run that fails fails the tests of its world size."""

from __future__ import annotations

import pytest
import torch
from distributed import device, in_turn, run_ranks
from models import TinyTransformer, batches
from training import PER_RANK, STEPS, needs_4_ranks, qwz_runs, saved_tensor_shapes, train, train_sharded

import zpp_compile as zpp
from zpp_compile.reports.ledger import LEDGER

pytestmark = pytest.mark.distributed  # every test here starts processes

TWO_NODES = {"ranks_per_node": 2, "hpz_partition_size": 2}
FULL_LOCAL_COPY = {"hpz_partition_size": 1}
SMALL_BLOCKS = {"weight_block_size": 64}  # small enough that the tiny model's weights are quantized


def runs(world_size: int) -> dict[str, tuple]:
    """The runs of the tests at `world_size`, by name: (rank function, its arguments)."""
    if world_size == 2:
        return {
            **{f"full local copy, ranks_per_node={n}": (trained_with_gathers, {**FULL_LOCAL_COPY, "ranks_per_node": n})
               for n in (1, 2)},
            "saved tensors": (saved_tensor_shapes, {"hpz_partition_size": 2}),
            "eval and accumulation": (eval_and_accumulation,),
            "copies against the INT8 copy": (copies_against_int8_copy, (
                FULL_LOCAL_COPY, {**FULL_LOCAL_COPY, "hpz_quantized_copy": False}, {"reshard_after_forward": False})),
        }
    return {
        "two nodes": (trained_with_gathers, TWO_NODES),
        "with qwz": (qwz_runs, 2, {"hpz_partition_size": 2}, ("aot",)),
        "two node copies against the INT8 copy": (copies_against_int8_copy, (
            TWO_NODES, {**TWO_NODES, "hpz_quantized_copy": False})),
    }


@pytest.fixture(scope="module")
def results():
    """results(world_size)[rank][name]: what each of `runs(world_size)` returned on each rank,
    from one spawned group per world size, run when a test first asks for it."""
    by_world: dict[int, list[dict]] = {}

    def of_world(world_size: int) -> list[dict]:
        if world_size not in by_world:
            calls = runs(world_size)
            by_world[world_size] = run_ranks(in_turn, world_size, calls)
        return by_world[world_size]

    return of_world


@needs_4_ranks
def test_hpz_two_nodes_matches_unsharded_reference(results):
    # 3 SGD steps: each forward after an optimizer step must build a fresh secondary copy.
    # (Inductor with hpZ: test_qgz's Inductor run.)
    results(4)  # "two nodes": train_sharded compares with the reference on each rank


@pytest.mark.parametrize("ranks_per_node", [1, 2])
def test_hpz_full_local_copy_matches_unsharded_reference(ranks_per_node, results):
    # train_sharded compares with the reference on each rank; each holds only its chunk.
    shapes = [returned[f"full local copy, ranks_per_node={ranks_per_node}"][0] for returned in results(2)]
    assert shapes[0]["embed.weight"] == (19, 24) and shapes[1]["embed.weight"] == (18, 24)


def weight_gathers(graphs: list, secondary_bytes: int) -> dict:
    """Per graph kind of `graphs` (the ledger's): (group size, dtype, intra bytes, inter bytes) of
    every weight all-gather; the secondary copy bytes and the model's float32 bytes."""
    out = {g.kind: [(c.group.size, str(c.dtype), c.intra_bytes, c.inter_bytes)
                    for c in g.collectives if c.op == "all_gather" and not c.of_gradient] for g in graphs}
    out["secondary_bytes"] = secondary_bytes
    out["param_bytes"] = sum(p.numel() * 4 for p in TinyTransformer().parameters())
    return out


def trained_with_gathers(rank: int, world_size: int, options: dict) -> tuple[dict, dict]:
    """train_sharded (debug mode, against the reference), then the weight gathers of its graphs."""
    shapes = train_sharded(rank, world_size, "aot", options)
    return shapes, weight_gathers(LEDGER.graphs, zpp.secondary_copy_bytes())


@needs_4_ranks
@pytest.mark.parametrize("copy", ["plain", "int8", "dequantized"])
def test_backward_weight_gathers_never_leave_the_node(copy, results):
    two_nodes = results(4)[0]
    int8, dequantized = two_nodes["two node copies against the INT8 copy"][2]
    result = {"plain": two_nodes["two nodes"][1], "int8": int8, "dequantized": dequantized}[copy]
    assert result["forward"] and all(size == 4 for size, *_ in result["forward"])  # world gathers
    assert result["backward"], "backward gathers nothing: the copy would be a full weight"
    assert all(size == 2 and inter == 0 and intra > 0 for size, _, intra, inter in result["backward"])
    # With qwZ the secondary copy is the INT8 blocks themselves, gathered as bytes, unless it holds
    # the dequantized weights.
    backward_dtypes = {dtype for _, dtype, *_ in result["backward"]}
    assert ("torch.uint8" in backward_dtypes) == (copy == "int8")
    # Each rank keeps half of every weight backward reads: about half the model's fp32 bytes, or in
    # INT8 codes and scales a quarter of that, plus the weights too small to quantize.
    half = result["param_bytes"] / 2
    low, high = (half / 4, half / 2) if copy == "int8" else (0.9 * half, 1.1 * half)
    assert low <= result["secondary_bytes"] <= high


def test_full_local_copy_gathers_nothing_in_backward(results):
    for ranks_per_node in (1, 2):
        result = results(2)[0][f"full local copy, ranks_per_node={ranks_per_node}"][1]
        assert result["forward"] and not result.get("backward"), ranks_per_node


def test_hpz_saves_no_gathered_weight(results):
    assert [returned["saved tensors"] for returned in results(2)] == [[], []]


@needs_4_ranks
def test_hpz_with_qwz_stays_near_reference(results):
    errors = results(4)[0]["with qwz"]
    assert max(errors.values()) < 5e-2, errors


def eval_and_accumulation(rank: int, world_size: int) -> None:
    """no_grad evaluation, and two micro-batches accumulated before one step, with hpZ."""
    data, mine = batches(STEPS, world_size, 2 * PER_RANK), slice(rank * 2 * PER_RANK, (rank + 1) * 2 * PER_RANK)
    torch.manual_seed(0)
    model = zpp.shard(TinyTransformer().to(device()), zpp.Config(hpz_partition_size=2))
    compiled = torch.compile(model, backend="zeropp", options={"inductor": False})
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


def test_hpz_eval_and_gradient_accumulation(results):
    results(2)  # "eval and accumulation" compares with the reference on each rank


def copies_against_int8_copy(rank: int, world_size: int, configs: tuple[dict, ...]
                             ) -> tuple[list[list[str]], list[bool], list[dict]]:
    """qwZ + qgZ trained with each of `configs`, the first hpZ's INT8 copy (dequantized again in
    backward), the others the dequantized weights as the copy (`hpz_quantized_copy=False`) or kept
    for backward without hpZ (`reshard_after_forward=False`): per run after the first, the
    parameters that end up different from the first's (backward sees the same weights every way);
    whether each run's forward saved INT8 codes for backward; each run's `weight_gathers`."""
    finals, saved_codes, gathers = [], [], []
    for options in configs:
        zpp.reset_comm_report()
        torch.manual_seed(0)
        config = zpp.Config(quantized_weights=True, quantized_gradients=True, **SMALL_BLOCKS,
                            **{"ranks_per_node": 1, **options})
        model = zpp.shard(TinyTransformer().to(device()), config)
        compiled = torch.compile(model, backend="zeropp", options={"inductor": False})
        dtypes = set()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: dtypes.add(t.dtype) or t, lambda t: t):
            train(model, batches(STEPS, world_size, PER_RANK), compiled, slice(rank * PER_RANK, (rank + 1) * PER_RANK))
        finals.append(zpp.full_state_dict(model))
        saved_codes.append(torch.uint8 in dtypes)
        gathers.append(weight_gathers(LEDGER.graphs, zpp.secondary_copy_bytes()))
    differing = [[key for key, value in final.items() if not torch.equal(value, finals[0][key])]
                 for final in finals[1:]]
    return differing, saved_codes, gathers


def test_dequantized_copies_train_exactly_as_the_int8_copy(results):
    # A full copy on each rank, against the dequantized copy and the kept weights: nothing differs,
    # and only the INT8 copy saves codes.
    expected = ([[], []], [True, False, False])
    assert [returned["copies against the INT8 copy"][:2] for returned in results(2)] == [expected] * 2


@needs_4_ranks
def test_dequantized_copy_gathered_in_the_node_trains_exactly_as_the_int8_copy(results):
    expected = ([[]], [True, False])
    assert [returned["two node copies against the INT8 copy"][:2] for returned in results(4)] == [expected] * 4

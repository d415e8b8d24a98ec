"""Warm restarts: zeropp's graphs come from Inductor's caches in a new process, with the same
ledger and bit-identical training; a changed config or topology misses the cache.

Two launches of 2 ranks share one fresh cache directory; in each, several small models are
sharded in the same order, so the same sharding ids (which Dynamo's graphs name) line up.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
from distributed import device, run_ranks
from torch._dynamo.utils import counters

import zpp_compile as zpp
from zpp_compile.compiler import compile_cache
from zpp_compile.compiler.compile_cache import PassCache, passes_key, to_local_as_method
from zpp_compile.compiler.pass_manager import PassManager
from zpp_compile.reports.ledger import LEDGER, CommReport, GraphComm, Ledger, ShardedModel
from zpp_compile.runtime import prefetch
from zpp_compile.runtime.registry import Registry, ShardingState
from zpp_compile.runtime.topology import Group, Topology

# All three techniques, 2 ranks as 2 emulated nodes: every zeropp op is in the cached graphs.
ALL_THREE = {"quantized_weights": True, "weight_block_size": 32, "hpz_partition_size": 1,
             "quantized_gradients": True, "gradient_block_size": 32, "ranks_per_node": 1}
# The same passes, another config: qgZ's inter-node hop in INT8 instead of INT4.
INT8_GRADIENTS = {**ALL_THREE, "gradient_bits": 8}


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 64), nn.GELU(), nn.Linear(64, 8))


def train(model: nn.Module, options: dict, rank: int, evaluate: bool = False) -> dict:
    """Two SGD steps of the compiled model, then with `evaluate` a forward under no_grad (the same
    frame compiled again, for inference); the ledger entries its graphs added, its final
    parameters and losses, and the cache counters it moved."""
    before = {**counters["aot_autograd"], **counters["inductor"]}
    start = len(LEDGER.graphs)
    step_fn = torch.compile(model, backend="zeropp", options=options)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(2):
        loss = step_fn(torch.randn(4, 8, generator=g).to(device())).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    if evaluate:
        with torch.no_grad():
            step_fn(torch.randn(4, 8, generator=g).to(device()))
    after = {**counters["aot_autograd"], **counters["inductor"]}
    moved = {k: after[k] - before.get(k, 0) for k in after if "cache" in k and after[k] != before.get(k, 0)}
    return {"graphs": LEDGER.graphs[start:], "losses": losses, "counters": moved,
            # As lists: tensors sent between processes would share memory with a rank that has exited.
            "params": {k: v.cpu().tolist() for k, v in zpp.full_state_dict(model).items()}}


def launch(rank: int, world_size: int, second: bool, dump_dir: str) -> dict:
    """Launch 1 trains m0 and m1 with ALL_THREE. Launch 2 trains m0 with INT8 gradients (the same
    Dynamo graph as launch 1's m0, another config), m1 as in launch 1, and m2 with a dump directory."""
    first_model = zpp.shard(mlp().to(device()), ALL_THREE)
    second_model = zpp.shard(mlp().to(device()), ALL_THREE)
    runs = {"m0": train(first_model, INT8_GRADIENTS if second else {}, rank)}
    if not second:
        # Another graph first (without Inductor: cheap), so that m1's graphs get other ids than in launch 2.
        with torch.no_grad():
            torch.compile(first_model, backend="zeropp", options={"inductor": False})(torch.randn(4, 8).to(device()))
    runs["m1"] = train(second_model, {}, rank, evaluate=True)
    if second:
        runs["m2"] = train(zpp.shard(mlp().to(device()), ALL_THREE), {"dump_dir": dump_dir}, rank)
    return runs


def without_ids(graphs: list[GraphComm]) -> dict:
    """The report of `graphs`, with graph names stripped of the graph id (which differs between launches)."""
    report = CommReport.from_graphs(graphs).to_dict()
    for row in report["collectives"]:
        row["graph"] = row["graph"].split(".")[1]
    return report


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> tuple[list[dict], list[dict], Path]:
    cache, dump = tmp_path_factory.mktemp("inductor_cache"), tmp_path_factory.mktemp("dump")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))  # the spawned ranks inherit it
        # Torch versions before 2.13 key AOTAutograd's cache on a per-process hash unless it is fixed
        # (docs/guide.md, "Warm restarts").
        env.setenv("PYTHONHASHSEED", "0")
        first = run_ranks(launch, 2, False, str(dump), fresh=True)
        second = run_ranks(launch, 2, True, str(dump), fresh=True)
    return first, second, dump


@pytest.mark.distributed
def test_a_new_process_hits_the_cache_with_the_same_ledger_and_results(launches):
    first, second, _ = launches
    for rank in (0, 1):
        cold, warm = first[rank]["m1"], second[rank]["m1"]
        # Training and evaluation graphs each saved, then served.
        assert cold["counters"].get("autograd_cache_saved") == 2, cold["counters"]
        assert warm["counters"] == {"autograd_cache_hit": 2, "fxgraph_cache_hit": 3}, warm["counters"]
        # The ledger is restored under this process's graph ids, with the same collectives; the
        # evaluation graph is a forward alone, not a second training step.
        assert [g.graph_name for g in warm["graphs"]] == ["g1.forward", "g1.backward", "g2.forward"]
        assert [g.graph_name for g in cold["graphs"]] == ["g2.forward", "g2.backward", "g3.forward"]
        assert without_ids(warm["graphs"]) == without_ids(cold["graphs"])
        report = without_ids(warm["graphs"])
        assert report["inter_bytes"] > 0 and report["secondary_bytes"] > 0  # the training step's, with hpZ
        assert {row["graph"] for row in report["collectives"]} == {"forward", "backward"}
        assert warm["losses"] == cold["losses"]
        assert warm["params"] == cold["params"]  # bit for bit: float32 values are exact in Python floats


@pytest.mark.distributed
def test_a_changed_config_misses_the_cache(launches):
    first, second, _ = launches
    for rank in (0, 1):
        assert second[rank]["m0"]["counters"].get("autograd_cache_hit", 0) == 0, second[rank]["m0"]["counters"]
        assert second[rank]["m0"]["counters"].get("autograd_cache_miss") == 1
        # Compiled afresh with INT8 gradients: twice the INT4 hop's bytes (plus the same scales).
        int4, int8 = (without_ids(run[rank]["m0"]["graphs"])["phases"]["gradient reduction"]["inter_bytes"]
                      for run in (first, second))
        assert int4 < int8 < 2 * int4, (int4, int8)


@pytest.mark.distributed
def test_a_dump_bypasses_the_cache_and_reports_what_a_cache_hit_does(launches):
    _, second, dump = launches
    for rank in (0, 1):
        dumped = second[rank]["m2"]
        assert not any(k.endswith(("_hit", "_saved")) for k in dumped["counters"]), dumped["counters"]
        # m2's graph id follows m0's (g0) and m1's training and evaluation graphs (g1, g2).
        files = sorted((dump / f"rank{rank}").glob("g3.*.comm.json"), key=lambda f: "backward" in f.name)
        from_files = [GraphComm.from_dict(json.loads(f.read_text())) for f in files]
        assert len(from_files) == 2 and any(dump.glob(f"rank{rank}/g3.*.schedule.txt"))
        assert without_ids(from_files) == without_ids(second[rank]["m1"]["graphs"])


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 32), nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


def layers_launch(rank: int, world_size: int) -> dict:
    """Three SGD steps of 3 blocks compiled once per distinct block (all three techniques): the
    cache counters they moved, each step's gathers taken from a prefetch and gathered anew, and
    the losses and trained parameters."""
    torch.manual_seed(0)
    model = zpp.shard(nn.Sequential(*(Block() for _ in range(3))).to(device()),
                      {**ALL_THREE, "compile_layers_once": True})
    before = {**counters["aot_autograd"], **counters["inductor"]}
    step_fn = torch.compile(model, backend="zeropp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    losses, prefetched = [], []
    for _ in range(3):
        counted = prefetch.counts()
        loss = step_fn(torch.randn(4, 8, generator=g).to(device())).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        now = prefetch.counts()
        prefetched.append((now.hits - counted.hits, now.misses - counted.misses))
    after = {**counters["aot_autograd"], **counters["inductor"]}
    moved = {k: after[k] - before.get(k, 0) for k in after if "cache" in k and after[k] != before.get(k, 0)}
    return {"counters": moved, "prefetched": prefetched, "losses": losses,
            "params": {k: v.cpu().tolist() for k, v in zpp.full_state_dict(model).items()}}


@pytest.mark.distributed
def test_layer_graphs_served_by_the_cache_prefetch_their_gathers_as_when_compiled(tmp_path):
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
        env.setenv("PYTHONHASHSEED", "0")
        cold = run_ranks(layers_launch, 2, fresh=True)
        warm = run_ranks(layers_launch, 2, fresh=True)
    for rank in (0, 1):
        assert "fxgraph_cache_hit" not in cold[rank]["counters"], cold[rank]["counters"]
        assert warm[rank]["counters"].get("fxgraph_cache_hit", 0) >= 4, warm[rank]["counters"]
        # From the second step on, the forward gathers of blocks 1 and 2 come from the one issued
        # during the block before (hpZ's backward, one rank per node, gathers nothing).
        assert cold[rank]["prefetched"] == warm[rank]["prefetched"] == [(0, 3), (2, 1), (2, 1)]
        assert warm[rank]["losses"] == cold[rank]["losses"] and warm[rank]["params"] == cold[rank]["params"]


def shard_again(rank: int, world_size: int) -> dict:
    """Trains a model, deletes it, and trains the same model built and sharded again in the same
    process; a twin sharded alongside stays alive, and a model of another config comes after."""
    first = zpp.shard(mlp().to(device()), ALL_THREE)
    twin = zpp.shard(mlp().to(device()), ALL_THREE)
    ids = {"first": zpp.REGISTRY.sharding_id(first), "twin": zpp.REGISTRY.sharding_id(twin)}
    before = train(first, {}, rank)
    del first
    torch._dynamo.reset()  # as between a benchmark's variants: Dynamo traces the new model afresh
    again = zpp.shard(mlp().to(device()), ALL_THREE)
    other = zpp.shard(mlp().to(device()), INT8_GRADIENTS)
    ids.update(again=zpp.REGISTRY.sharding_id(again), other=zpp.REGISTRY.sharding_id(other))
    after = train(again, {}, rank)
    return {"ids": ids, "before": before, "after": after, "reported": zpp.comm_report(again).to_dict()}


@pytest.mark.distributed
def test_a_model_sharded_again_in_the_same_process_takes_the_gone_ones_id_and_hits_the_cache(tmp_path):
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
        env.setenv("PYTHONHASHSEED", "0")
        results = run_ranks(shard_again, 2)
    for result in results:
        ids, before, after = result["ids"], result["before"], result["after"]
        # The gone model's id and graphs: served by the caches, with the same ledger and results.
        assert ids["again"] == ids["first"] and len({ids["first"], ids["twin"], ids["other"]}) == 3, ids
        assert after["counters"] == {"autograd_cache_hit": 1, "fxgraph_cache_hit": 2}, after["counters"]
        assert without_ids(after["graphs"]) == without_ids(before["graphs"])
        assert after["losses"] == before["losses"] and after["params"] == before["params"]
        # The new model's report counts its own step once, not the gone model's too.
        assert result["reported"]["inter_bytes"] == CommReport.from_graphs(before["graphs"]).inter_bytes > 0


def topology(rank: int = 0, world: int = 4, ranks_per_node: int = 2, hpz: int = 0) -> Topology:
    def group(name: str, ranks: range) -> Group:
        return Group(name, tuple(ranks))

    node = rank // ranks_per_node
    intra = group("1", range(node * ranks_per_node, (node + 1) * ranks_per_node))
    inter = group("2", range(rank % ranks_per_node, world, ranks_per_node))
    secondary = group("3", range(rank // hpz * hpz, (rank // hpz + 1) * hpz)) if hpz else None
    return Topology(rank, world, ranks_per_node, torch.device("cpu"), group("0", range(world)), intra, inter,
                    secondary, None)


def test_the_cache_key_covers_config_topology_and_rank_but_not_the_graph_id(tmp_path):
    def key(config: zpp.Config = zpp.Config(), graph_id: str = "g0", **where) -> str:
        return passes_key(PassManager(config, topology(**where), graph_id))

    base = key()
    assert key(graph_id="g7") == base
    assert key(zpp.Config(collective_timeout_s=5.0)) == base  # changes no graph
    changed = [key(zpp.Config(quantized_weights=True)), key(zpp.Config(prefetch=2)),
               key(zpp.Config(bucket_size=0)), key(zpp.Config(param_dtype="bf16")),
               key(zpp.Config(disable_passes=("schedule_overlap",))),
               key(ranks_per_node=1), key(world=8), key(hpz=2), key(rank=1)]
    assert len({base, *changed}) == len(changed) + 1
    # With a dump directory every pass must run: no cache key, so Inductor compiles afresh.
    dumping = PassManager(dataclasses.replace(zpp.Config(), dump_dir=str(tmp_path)), topology(), "g0")
    gm = torch.fx.symbolic_trace(nn.Linear(2, 2))
    assert PassCache.open(dumping, gm, [], {}) is None
    assert PassCache.open(PassManager(zpp.Config(), topology(), "g0"), gm, [], {"force_disable_caches": True}) is None


def test_a_restored_entry_gives_way_to_the_graph_compiled_after_all():
    # A backward restored with its forward from the record, then compiled at its first use (its
    # entry in Inductor's cache was gone): the ledger holds it once, as compiled.
    manager, start = PassManager(zpp.Config(), topology(), "g9"), len(LEDGER.graphs)
    restored, compiled = GraphComm("g9.backward", "backward", ()), GraphComm("g9.backward", "backward", (), 5)
    manager.record(GraphComm("g9.forward", "forward", ()), restored=True)
    manager.record(restored, restored=True)
    manager.record(compiled)
    manager.record(GraphComm("g9.backward", "backward", ()))  # e.g. a subgraph's: kept beside it
    assert [g.secondary_bytes for g in LEDGER.graphs[start:]] == [0, 5, 0]
    assert tuple(manager.graphs) == LEDGER.graphs[start:]
    LEDGER.clear()


def test_a_gone_models_id_is_taken_back_only_by_an_equal_state_and_with_its_graphs_gone():
    registry = Registry()
    state = ShardingState(zpp.Config(), topology(), 64, ("0",), 256)
    gone, other = registry.add_state(state), registry.add_state(dataclasses.replace(state, padded_numel=32))
    assert registry.reusable_id(dataclasses.replace(state, layer_nbytes=128)) is None  # no equal state
    live = nn.Linear(1, 1)
    registry.models[live] = registry.states[other]
    assert registry.reusable_id(dataclasses.replace(state, padded_numel=32)) is None  # its model lives
    assert registry.reusable_id(ShardingState(zpp.Config(), topology(), 64, ("0",), 256)) == gone
    ledger = Ledger()
    for i in (gone, other):
        ledger.enter(GraphComm(f"g{i}.forward", "forward", (), 0, ShardedModel(i, 64, 4, 2)))
    ledger.forget_model(gone)
    assert [g.graph_name for g in ledger.graphs] == [f"g{other}.forward"]


def test_a_job_served_graphs_that_another_job_compiled_meanwhile_enters_them_all(tmp_path, monkeypatch):
    # Two jobs share the cache directory. Job A compiles under a new token and records its forward;
    # job B opens the record then (A's token, the forward alone); A then records its backward, whose
    # compiled code Inductor serves B: B's ledger must hold both graphs.
    monkeypatch.setattr(compile_cache, "inductor_cache_dir", lambda: str(tmp_path))
    graph = torch.fx.symbolic_trace(nn.Linear(2, 2))
    job_a, job_b = (PassManager(zpp.Config(), topology(), graph_id) for graph_id in ("g1", "g4"))
    forward, backward = GraphComm("g1.forward", "forward", (), 7), GraphComm("g1.backward", "backward", ())
    a = PassCache.open(job_a, graph, [], {})
    a.save([forward])
    b = PassCache.open(job_b, graph, [], {})
    assert b.uuid == a.uuid and b.path == a.path
    a.save([forward, backward])
    b.restore(job_b)
    assert [(g.graph_name, g.secondary_bytes) for g in job_b.graphs] == [("g4.forward", 7), ("g4.backward", 0)]
    LEDGER.clear()
    # A third job that compiled the forward alone adds to the record; the backward stays.
    c = dataclasses.replace(a, uuid=a.uuid.rsplit("-", 1)[0] + "-0123456789abcdef")
    c.save([forward])
    assert sorted(entry["kind"] for entry in json.loads(a.path.read_text())["graphs"]) == ["backward", "forward"]


def _closure_as_dynamo_records_to_local(*args: Any, **kwargs: Any) -> Callable[[Any], Any]:
    """The callable some torch versions' Dynamo puts in the graph for `x.to_local(*args, **kwargs)`."""
    args_as_value, kwargs_as_value = list(args), dict(kwargs)

    def to_local_fn_with_prim_types(x: Any) -> Any:
        return x.to_local(*args_as_value, **kwargs_as_value)

    to_local_fn_with_prim_types.__name__ = "prim_to_local"
    return to_local_fn_with_prim_types


class _Local:
    def __init__(self, value: torch.Tensor) -> None:
        self.value = value

    def to_local(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.value * (2 if args or kwargs else 1)


def test_dynamo_to_local_closures_become_method_calls_that_the_autograd_cache_takes():
    graph = torch.fx.Graph()
    shard = graph.placeholder("shard")
    plain = graph.call_function(_closure_as_dynamo_records_to_local(), (shard,))
    with_arguments = graph.call_function(_closure_as_dynamo_records_to_local(grad_placements=("x",)), (shard,))
    graph.output((graph.call_function(torch.add, (plain, with_arguments)),))
    gm = torch.fx.GraphModule(nn.Module(), graph)
    value = torch.arange(3.0)
    expected = gm(_Local(value))

    to_local_as_method(gm)
    calls = [(n.op, n.target if n.op == "call_method" else n.target.__name__)
             for n in gm.graph.nodes if n.op in ("call_method", "call_function") and n.target is not torch.add]
    # The closure with arguments stays: the method call alone would drop them.
    assert calls == [("call_method", "to_local"), ("call_function", "prim_to_local")]
    torch.testing.assert_close(gm(_Local(value)), expected, rtol=0, atol=0)


def _restart_warnings(rank: int, world_size: int) -> dict[str, list[str]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from zpp_compile.compiler import compile_cache

    sharded = distribute_tensor(torch.ones(4), init_device_mesh("cpu", (world_size,)), [Shard(0)])
    cases = {"seed unset": ({}, [sharded], True), "seed fixed": ({"PYTHONHASHSEED": "0"}, [sharded], True),
             "no DTensor": ({}, [torch.ones(4)], True),
             "seed fixed, Python 3.11": ({"PYTHONHASHSEED": "0"}, [sharded], False)}
    seen = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(compile_cache, "dtensor_cache_keys_stable", lambda: False)  # as on torch 2.11
        for case, (env, inputs, none_hash_stable) in cases.items():
            patch.setattr(compile_cache, "_none_hash_stable", lambda stable=none_hash_stable: stable)
            patch.delenv("PYTHONHASHSEED", raising=False)
            for name, value in env.items():
                patch.setenv(name, value)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                compile_cache.warn_if_restarts_retrace(inputs)
            seen[case] = [str(w.message) for w in caught]
    return seen


@pytest.mark.distributed
def test_a_torch_whose_cache_keys_differ_per_process_warns_to_fix_the_hash_seed_or_the_python():
    seen = run_ranks(_restart_warnings, 1)[0]
    assert len(seen["seed unset"]) == 1 and "PYTHONHASHSEED=0" in seen["seed unset"][0]
    assert seen["seed fixed"] == [] and seen["no DTensor"] == []
    assert len(seen["seed fixed, Python 3.11"]) == 1 and "Python 3.12" in seen["seed fixed, Python 3.11"][0]

"""Bucketing and overlap scheduling: same results, fewer collectives, a bounded prefetch."""

from __future__ import annotations

import dataclasses
import functools
import re
import unittest.mock
from typing import Callable

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from distributed import device, in_turn, run_ranks
from models import Block, TinyTransformer, batches
from torch._subclasses.fake_tensor import FakeTensorMode
from training import PER_RANK, STEPS, train, train_sharded

import zpp_compile as zpp
from zpp_compile.compiler.backend import zeropp_backend
from zpp_compile.passes import PASSES, PassContext, fx_util, schedule_overlap
from zpp_compile.passes.bucket_collectives import bucket_collectives
from zpp_compile.passes.fx_util import ancestors
from zpp_compile.reports.ledger import LEDGER, PHASES, collectives_by_node, phase_of
from zpp_compile.runtime.collectives import ALL_GATHERS
from zpp_compile.runtime.topology import Group, Topology
from zpp_compile.sharding.shard import _layers

ALL_THREE = {"quantized_weights": True, "weight_block_size": 32, "hpz_partition_size": 1,
             "quantized_gradients": True, "gradient_block_size": 32, "ranks_per_node": 1}


def runs() -> dict[str, tuple]:
    """The runs of the tests on 2 ranks, by name: (rank function, its arguments). scheduled_graphs
    comes last: it wraps a pass in its process for good."""
    return {
        "bucketed training": (train_sharded, "aot", {"bucket_size": 4096}),
        "quantized buckets": (quantized_bucket_runs,),
        "blocks in a module dict": (moduledict_step_collectives,),
        "live gathers": (scheduled_graphs, list(SCHEDULED_CONFIGS.values())),
    }


@pytest.fixture(scope="module")
def results() -> list[dict]:
    """results[rank][name]: what each of `runs()` returned on each rank, all from one spawned
    group (a run that fails fails every test that reads this)."""
    calls = runs()
    return run_ranks(in_turn, 2, calls)


@pytest.mark.distributed
def test_bucketed_training_matches_reference(results):
    # Several buckets per layer (the other tests run with the default size: one bucket per direction).
    # train_sharded compares with the reference on each rank; each holds only its chunk.
    shapes = [returned["bucketed training"] for returned in results]
    assert shapes[0]["embed.weight"] == (19, 24) and shapes[1]["embed.weight"] == (18, 24)


def final_state(rank: int, world_size: int, options: dict, layers: int = 2,
                backend: Callable | str = "zeropp") -> tuple[dict, list]:
    """Parameters after training the model compiled by `backend` (debug mode) and the collectives it issues."""
    torch.manual_seed(0)
    model = zpp.shard(TinyTransformer(layers=layers).to(device()), zpp.Config(**options))
    step_fn = torch.compile(model, backend=backend, options={"inductor": False})
    history = train(model, batches(STEPS, world_size, PER_RANK), step_fn, slice(rank * PER_RANK, (rank + 1) * PER_RANK))
    collectives = [c for g in LEDGER.graphs for c in g.collectives]
    return {k: v.cpu() for k, v in zpp.full_state_dict(model).items()}, history, collectives


def compare_runs(rank: int, world_size: int, options: dict, other: dict,
                 other_backend: Callable | str = "zeropp") -> tuple[int, int]:
    """Trains under `options`, then under them updated by `other` (compiled by `other_backend`):
    the histories and parameters are equal to the bit; how many collectives each run issued."""
    first, first_history, first_collectives = final_state(rank, world_size, options)
    LEDGER.clear()
    torch._dynamo.reset()
    second, second_history, second_collectives = final_state(rank, world_size, {**options, **other},
                                                              backend=other_backend)
    assert first_history == second_history
    for key, value in first.items():
        assert torch.equal(value, second[key]), key
    return len(first_collectives), len(second_collectives)


def quantized_bucket_runs(rank: int, world_size: int) -> tuple[int, int, list, list[dict[str, int]]]:
    """qwZ + hpZ + qgZ trained unbucketed and in 1 MiB buckets (bit-identical, see compare_runs):
    the collectives' counts, the (op, dtype, of gradient) kinds of the bucketed run's, and per
    lowered graph of the bucketed run, how often each weight (de)quantization and bucket copy is
    called once every pass has run."""
    captured: list[fx.Graph] = []

    def capture(graph: fx.Graph, ctx) -> None:
        schedule_overlap(graph, ctx)
        captured.append(graph)

    passes = [dataclasses.replace(p, run=capture) if p.name == "schedule_overlap" else p for p in PASSES]
    unbucketed, bucketed = compare_runs(rank, world_size, {**ALL_THREE, "bucket_size": 0}, {"bucket_size": 1 << 20},
                                        functools.partial(zeropp_backend, passes=passes))
    kinds = sorted({(c.op, str(c.dtype), c.of_gradient) for g in LEDGER.graphs for c in g.collectives})
    ops = {"quantize_bucket": torch.ops.zpp.quantize_bucket.default,
           "quantize_weight": torch.ops.zpp.quantize_weight.default,
           "dequantize_bucket": torch.ops.zpp.dequantize_bucket.default,
           "dequantize_weight": torch.ops.zpp.dequantize_weight.default,
           "join_bucket": torch.ops.zpp.join_bucket.default,
           "split_bucket": torch.ops.zpp.split_bucket.default}
    calls = [{name: len(graph.find_nodes(op="call_function", target=op)) for name, op in ops.items()}
             for graph in captured]
    return unbucketed, bucketed, kinds, calls


@pytest.mark.distributed
def test_buckets_change_no_bit_of_the_quantized_result(results):
    # Buckets pad each member to whole quantization blocks, so every block and its scale are
    # those of the unbucketed graph: qwZ + hpZ + qgZ give bit-identical parameters.
    unbucketed, bucketed, _, _ = results[0]["quantized buckets"]
    assert bucketed * 4 < unbucketed, (bucketed, unbucketed)


@pytest.mark.distributed
def test_schedule_changes_no_bit_of_the_result(results):
    # The same buckets trained with the schedule's two prefetch depths and without the schedule.
    runs = {name: run for name, run in zip(SCHEDULED_CONFIGS, results[0]["live gathers"])}
    _, unscheduled_state, unscheduled_history, unscheduled_collectives = runs["unscheduled"]
    for name in ("prefetch 1", "prefetch 2"):
        _, state, history, collectives = runs[name]
        assert history == unscheduled_history and collectives == unscheduled_collectives, name
        assert all(torch.equal(value, unscheduled_state[key]) for key, value in state.items()), name


@pytest.mark.distributed
def test_buckets_of_small_members_stay_full_precision(results):
    _, _, kinds, _ = results[0]["quantized buckets"]
    # Quantized buckets (uint8 weight gathers and gradient exchanges: between two nodes, an
    # all-gather of the chunk for the other node), and full-precision ones for the norms, biases
    # and the 0-d gate, which are smaller than a block per rank.
    assert ("all_gather", "torch.uint8", False) in kinds and ("all_gather", "torch.float32", False) in kinds
    assert ("all_gather", "torch.uint8", True) in kinds and ("reduce_scatter", "torch.float32", True) in kinds


@pytest.mark.distributed
def test_quantized_buckets_are_quantized_and_dequantized_in_place(results):
    # Forward quantizes the one quantized bucket (the two blocks' matrices) from its shards in
    # place and dequantizes it into its weights; backward dequantizes hpZ's INT8 copy again, in
    # place too. The plain (de)quantizations are the embedding's, gathered on its own; the
    # full-precision buckets' joins and splits are lowered to copies.
    forward, backward = results[0]["quantized buckets"][3]
    assert forward == {"quantize_bucket": 1, "quantize_weight": 1, "dequantize_bucket": 1, "dequantize_weight": 1,
                       "join_bucket": 0, "split_bucket": 0}
    assert backward == {"quantize_bucket": 0, "quantize_weight": 0, "dequantize_bucket": 1, "dequantize_weight": 1,
                        "join_bucket": 0, "split_bucket": 0}


# ------------------------------------------------------------- layer boundaries, on a small graph


def gathers_by_bucket(sources: list[str | None], layers: tuple[str, ...]) -> list[list[str]]:
    """Bucketing (1 GiB buckets) of one gather per module path in `sources` (None: no module
    stack); returns the shards each resulting gather reads."""
    fake, gather = FakeTensorMode(), torch.ops.zpp.all_gather_param.default
    graph, outputs = fx.Graph(), []
    for i, source in enumerate(sources):
        shard = graph.placeholder(f"shard_{i}")
        shard.meta["val"] = fake.from_tensor(torch.empty(8))
        node = graph.call_function(gather, (shard, 8, 2, "0", torch.float32, torch.float32, 0))
        node.meta["val"] = fake.from_tensor(torch.empty(16))
        if source is not None:
            node.meta["nn_module_stack"] = {"module": (source, nn.Linear)}
        outputs.append(node)
    graph.output(tuple(outputs))
    bucket_collectives(graph, PassContext(zpp.Config(bucket_size=1 << 30), None, "g0.joint", "joint", layers))
    return [sorted(a.name for a in ancestors(n) if a.op == "placeholder")
            for n in graph.nodes if n.target is gather]


def test_a_bucket_never_spans_two_layers():
    # Dynamo writes module paths as L['self'].blocks.0.qkv (and, in older releases, blocks[0]).
    sources = ["L['self'].embed", "L['self'].blocks.0.qkv", "L['self'].blocks[0].proj",
               "L['self'].blocks.1.qkv", "L['self'].blocks.1.fc", None]
    buckets = gathers_by_bucket(sources, ("blocks.0", "blocks.1"))
    assert buckets == [["shard_0"], ["shard_1", "shard_2"], ["shard_3", "shard_4"], ["shard_5"]], buckets
    # The check can fail: without layers, all six fit in one bucket.
    assert gathers_by_bucket(sources, ()) == [[f"shard_{i}" for i in range(6)]]


class BlocksInModuleDict(TinyTransformer):
    """The test transformer with its blocks in an nn.ModuleDict, as torchtitan keeps them."""

    def __init__(self, layers: int = 2) -> None:
        super().__init__(layers=layers)
        self.blocks = nn.ModuleDict({str(i): block for i, block in enumerate(self.blocks)})

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks.values():
            x = block(x)
        return F.cross_entropy(self.head(self.norm(x)).flatten(0, 1), targets.flatten())


class BlocksAsAttributes(nn.Module):
    """Identical blocks held as plain attributes, next to a larger module that is not repeated."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(400, 24)
        self.first, self.second, self.third = Block(24, 2), Block(24, 2), Block(24, 2)


def test_layers_are_the_repeated_blocks_however_they_are_held():
    blocks = lambda: [Block(24, 2) for _ in range(3)]  # noqa: E731
    holders = {
        "ModuleList": nn.ModuleList(blocks()),
        "ModuleDict": nn.ModuleDict({f"b{i}": b for i, b in enumerate(blocks())}),
        "Sequential": nn.Sequential(*blocks()),
        # Of two stacks holding the same parameters, the one of more, smaller blocks.
        "ModuleList in a Sequential": nn.Sequential(nn.ModuleList(blocks())),
    }
    for kind, holder in holders.items():
        model = nn.Module()
        model.embed, model.stack, model.head = nn.Embedding(37, 24), holder, nn.Linear(24, 37)
        names = [name for name, module in model.named_modules() if isinstance(module, Block)]
        assert list(_layers(model)) == names, (kind, list(_layers(model)))
    assert list(_layers(BlocksAsAttributes())) == ["first", "second", "third"]
    assert list(_layers(BlocksInModuleDict())) == ["blocks.0", "blocks.1"]


def moduledict_step_collectives(rank: int, world_size: int) -> list[tuple[str, int]]:
    """(phase, bytes from the peer) of each collective of one compiled step of BlocksInModuleDict."""
    torch.manual_seed(0)
    model = zpp.shard(BlocksInModuleDict().to(device()))
    step_fn = torch.compile(model, backend="zeropp", options={"inductor": False})
    tokens, targets = batches(1, world_size, PER_RANK)[0]
    step_fn(tokens[:PER_RANK].to(device()), targets[:PER_RANK].to(device())).backward()
    return [(row.phase, row.intra_bytes) for row in zpp.comm_report().rows]


@pytest.mark.distributed
def test_blocks_in_a_module_dict_are_one_bucket_each(results):
    # Each block's weights (and gradients, in float32 as well) are exactly one bucket: 2 buckets of
    # one block's bytes per phase, and none larger (a bucket spanning two blocks would be).
    block_bytes = gathered_layer_nbytes() // 2  # what the other rank sends of one block
    rows = results[0]["blocks in a module dict"]
    for phase in PHASES:
        sizes = [nbytes for row_phase, nbytes in rows if row_phase == phase]
        assert sizes.count(block_bytes) == 2 and max(sizes) == block_bytes, (phase, sizes, block_bytes)


def test_identical_layers_are_traced_once_with_values_of_their_own():
    # Bucketing traces one helper per bucket; a layer like one already traced is copied from that
    # trace, with fresh fake values: the compile cost of a layer does not depend on depth.
    fake, gather = FakeTensorMode(), torch.ops.zpp.all_gather_param.default
    graph, outputs = fx.Graph(), []
    for layer in range(4):
        for name, rows in (("qkv", 24), ("proj", 8)):
            shard = graph.placeholder(f"{name}_{layer}")
            shard.meta["val"] = fake.from_tensor(torch.empty(rows * 8))
            node = graph.call_function(gather, (shard, rows * 8, 2, "0", torch.float32, torch.float32, 0))
            node.meta["val"] = fake.from_tensor(torch.empty(rows * 16))
            node.meta["nn_module_stack"] = {"module": (f"L['self'].blocks.{layer}.{name}", nn.Linear)}
            outputs.append(graph.call_function(torch.ops.aten.relu.default, (node,)))
            outputs[-1].meta["val"] = fake.from_tensor(torch.empty(rows * 16))
    graph.output(tuple(outputs))
    layers = tuple(f"blocks.{i}" for i in range(4))
    with unittest.mock.patch.object(fx_util, "make_fx", wraps=fx_util.make_fx) as tracer:
        bucket_collectives(graph, PassContext(zpp.Config(bucket_size=1 << 30), None, "g0.joint", "joint", layers))
    assert tracer.call_count == 1
    gathers = [n for n in graph.nodes if n.target is gather]
    assert len(gathers) == 4 and all(n.args[1] == 32 * 8 for n in gathers)
    values = [n.meta["val"] for n in graph.nodes if n.op == "call_function"]
    assert len({id(v) for v in values}) == len(values)  # no value shared between two nodes
    assert [tuple(out.args[0].meta["val"].shape) for out in outputs] == [(384,), (128,)] * 4
    graph.lint()


# ------------------------------------------------------- gradient all-gathers, on a small graph


def small_backward_graph() -> fx.Graph:
    """Two weight gathers (of graph inputs), then two gradient exchanges that are all-gathers too
    (as between two nodes), in the order a tracer emits them: each collective waited for at once."""
    c10d, aten = torch.ops._c10d_functional, torch.ops.aten
    graph = fx.Graph()
    shards = [graph.placeholder(f"primals_{i}") for i in (1, 2)]
    tangent = graph.placeholder("tangents_1")
    for node in (*shards, tangent):
        node.meta["val"] = torch.empty(4, 4)

    def exchange(x: fx.Node, name: str) -> fx.Node:
        issued = graph.call_function(c10d.all_gather_into_tensor.default, (x, 2, "0"), name=name)
        return graph.call_function(c10d.wait_tensor.default, (issued,), name=f"wait_{name}")

    def matmul(a: fx.Node, b: fx.Node, name: str) -> fx.Node:
        node = graph.call_function(aten.mm.default, (a, b), name=name)
        node.meta["val"] = torch.empty(4, 4)
        return node

    weight_1 = exchange(shards[0], "gather_1")
    hidden = matmul(tangent, weight_1, "hidden")
    weight_2 = exchange(shards[1], "gather_2")
    grad_2 = matmul(hidden, weight_2, "grad_2")
    reduced_2 = exchange(grad_2, "exchange_2")
    grad_1 = matmul(tangent, hidden, "grad_1")
    reduced_1 = exchange(grad_1, "exchange_1")
    graph.output((reduced_1, reduced_2))
    return graph


def test_gradient_all_gathers_are_scheduled_as_reductions():
    graph = small_backward_graph()
    schedule_overlap(graph, PassContext(zpp.Config(prefetch=1), None, "g0.backward", "backward"))
    order = [n.name for n in graph.nodes if n.op == "call_function"]
    position = order.index
    # The second weight gather is prefetched: issued before the first one is waited for.
    assert position("gather_2") < position("wait_gather_1")
    # The first gradient exchange is waited for only when the next one is issued, not before
    # the gradient that follows is computed; a weight gather's treatment (issue the next one
    # ahead of this one's wait) would put exchange_1 before wait_exchange_2.
    assert position("grad_1") < position("wait_exchange_2") < position("exchange_1")


def test_the_ledger_counts_gradient_all_gathers_as_gradient_reduction():
    world = Group("0", (0, 1))  # 2 nodes of 1 rank: every peer is on the other node
    topology = Topology(0, 2, 1, torch.device("cpu"), world, Group("1", (0,)), world, None, None)
    records = collectives_by_node(small_backward_graph(), topology)
    phases = {node.name: phase_of("backward", record) for node, record in records.items()}
    assert phases == {"gather_1": "backward weight gather", "gather_2": "backward weight gather",
                      "exchange_2": "gradient reduction", "exchange_1": "gradient reduction"}
    # Each peer sends its whole 16-float input: 64 bytes from the other node per collective.
    assert {(r.intra_bytes, r.inter_bytes) for r in records.values()} == {(0, 64)}


# ----------------------------------------------------------------------------- the memory bound


def live_gathers(graph: fx.Graph) -> tuple[int, int, list[int]]:
    """The most gathered buckets, and the most gathered bytes, alive at once in `graph`, and the
    bytes of each gather held across the others: a gather is alive from its collective until the
    last compute that reads a weight cut from it (the weights being what the graph computes from
    the gathered shards alone: the gathered buffer, its dequantized pieces). A gather alive for
    the whole life of another is held (a weight read in several places, gathered once), and
    counted apart: the schedule's bound is on the others."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    gathers = [n for n in graph.nodes if n.target in ALL_GATHERS]
    shards = {a for g in gathers for a in ancestors(g) if a.op == "placeholder"}
    from_shards: set[fx.Node] = set()
    for node in graph.nodes:
        if node in shards or (node.op == "call_function" and all(a in from_shards for a in node.all_input_nodes)):
            from_shards.add(node)
    intervals = []
    for gather in gathers:
        weights, todo = set(), [gather]
        while todo:
            current = todo.pop()
            weights.add(current)
            todo.extend(u for u in current.users if u in from_shards and u not in weights)
        last_read = max(order[u] for w in weights for u in w.users if u not in weights)
        intervals.append((order[gather], last_read, gather.meta["val"].nbytes))
    held = [(start, end, nbytes) for start, end, nbytes in intervals
            if any(start < other_start and other_end < end for other_start, other_end, _ in intervals)]
    alive = [[nbytes for start, end, nbytes in intervals if start <= i <= end and (start, end, nbytes) not in held]
             for i in range(len(order))]
    return max(len(a) for a in alive), max(sum(a) for a in alive), [nbytes for _, _, nbytes in held]


def scheduled_graphs(rank: int, world_size: int, configs: list[dict]) -> list[tuple]:
    """Trains a 4-layer model under each config; per config, for its forward and backward graph,
    the most gathered buckets and bytes alive at once and the held gathers' bytes (see
    `live_gathers`) in the graphs as finally lowered, then the final parameters, the training
    history and how many collectives the graphs issue."""
    captured: list[fx.Graph] = []

    def capture(graph: fx.Graph, ctx) -> None:
        original(graph, ctx)
        captured.append(graph)

    passes = list(PASSES)
    index = next(i for i, p in enumerate(passes) if p.name == "lower_collectives")
    original = passes[index].run
    passes[index] = dataclasses.replace(passes[index], run=capture)
    runs = []
    for options in configs:
        captured.clear()
        torch._dynamo.reset()
        zpp.reset_comm_report()
        state, history, collectives = final_state(
            rank, world_size, options, layers=4, backend=functools.partial(zeropp_backend, passes=passes))
        runs.append(([live_gathers(g) for g in captured], state, history, len(collectives)))
    return runs


def gathered_layer_nbytes() -> int:
    """One block's weights as gathered over 2 ranks: rows padded to an even count (0-d: one row)."""
    rows = [p.reshape(-1, *p.shape[1:]) for p in Block(24, 2).parameters()]
    return sum(-(-r.shape[0] // 2) * 2 * r[0].numel() * r.element_size() for r in rows)


ONE_LAYER_BUCKETS = {"bucket_size": 30_000}  # about one layer per bucket
SCHEDULED_CONFIGS = {
    "prefetch 1": {**ONE_LAYER_BUCKETS, "prefetch": 1},
    "prefetch 2": {**ONE_LAYER_BUCKETS, "prefetch": 2},
    "unscheduled": {**ONE_LAYER_BUCKETS, "disable_passes": ["schedule_overlap"]},
    "default": {},
    "two-layer buckets": {"bucket_size": 2 * gathered_layer_nbytes()},
}


@pytest.fixture(scope="module")
def alive_by_config(results) -> list[dict[str, list[tuple[int, int, list[int]]]]]:
    """Per rank, `scheduled_graphs` of each of SCHEDULED_CONFIGS, by name."""
    return [{name: run[0] for name, run in zip(SCHEDULED_CONFIGS, returned["live gathers"])} for returned in results]


@pytest.mark.distributed
def test_prefetch_respects_the_memory_bound(alive_by_config):
    for alive in alive_by_config:
        one, two, unscheduled = alive["prefetch 1"], alive["prefetch 2"], alive["unscheduled"]
        # forward and backward: prefetch + 1 buckets at most, and the prefetch did happen
        assert [n for n, _, _ in one] == [2, 2] and [n for n, _, _ in two] == [3, 3], (one, two)
        # The check can fail: without the schedule, each gather is used before the next is issued.
        assert [n for n, _, _ in unscheduled] == [1, 1]


@pytest.mark.distributed
def test_by_default_two_layers_of_gathered_weights_are_in_flight(alive_by_config):
    layer_nbytes = gathered_layer_nbytes()
    for forward, backward in (alive["default"] for alive in alive_by_config):
        for buckets, nbytes, _ in (forward, backward):
            # At most two layers' weights, and more than one: the next layer's gather is in flight.
            assert layer_nbytes < nbytes <= 2 * layer_nbytes and buckets == 2, (buckets, nbytes, layer_nbytes)
        # Besides: the embedding tied to the head (37 x 24 floats, rows padded to 38), gathered once
        # for both and held from one to the other in forward; backward reads it at the head only.
        assert forward[2] == [38 * 24 * 4] and backward[2] == [], (forward, backward)


@pytest.mark.distributed
def test_a_bucket_size_in_bytes_may_span_layers(alive_by_config):
    bucket_size = SCHEDULED_CONFIGS["two-layer buckets"]["bucket_size"]
    for forward, backward in (alive["two-layer buckets"] for alive in alive_by_config):
        for buckets, nbytes, _ in (forward, backward):
            # More than two layers in flight (buckets cut at each layer would hold one layer
            # each: two at most), and no more than (prefetch + 1) buckets' worth.
            assert bucket_size < nbytes <= 2 * bucket_size and buckets == 2, (buckets, nbytes, bucket_size)


def generated_issue_order(rank: int, world_size: int, configs: list[dict]) -> list[list[list[tuple[str, str]]]]:
    """Per config, (call, buffer) for each collective, wait and matrix product, in order, in the
    code Inductor generates for one training step (forward, then backward)."""
    from torch._inductor.utils import run_and_get_code

    call = re.compile(
        r"(\w+) = torch\.ops\._c10d_functional\.(\w+)\.default\(|_c10d_functional\.(wait_tensor)\.default\((\w+)\)"
        r"|extern_kernels\.(b?mm|addmm)\("
        r"|_c10d_functional\.(all_gather_into_tensor)_out\.default\(.*out=(\w+)\)"  # gloo's gathers (collectives.py)
    )
    tokens, targets = batches(1, world_size, PER_RANK)[0]
    orders = []
    for options in configs:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = zpp.shard(TinyTransformer(layers=3).to(device()), zpp.Config(**options))
        step_fn = torch.compile(model, backend="zeropp")
        _, codes = run_and_get_code(
            lambda: step_fn(tokens[:PER_RANK].to(device()), targets[:PER_RANK].to(device())).backward()
        )
        orders.append([[(m[2] or m[3] or m[6] or "matmul", m[1] or m[4] or m[7] or "") for m in call.finditer(c)]
                       for c in codes])
    return orders


def issued_ahead(events: list[tuple[str, str]], op: str) -> bool:
    """Whether each `op` collective but the last is waited for only after the next one is issued,
    from the first matrix product on. Those waited for before it have no compute to hide behind:
    the step's first gathers (the embedding, held for the head, and the bucket of the position
    table read with it, which Inductor's first kernel fuses and waits for together)."""
    position = {event: i for i, event in enumerate(events)}
    first_matmul = next(i for i, event in enumerate(events) if event[0] == "matmul")
    starts = [(name, buf) for name, buf in events if name == op]
    waits = [position[("wait_tensor", buf)] for _, buf in starts]
    checked = [k for k in range(len(starts) - 1) if waits[k] > first_matmul]
    return len(checked) > 1 and all(position[starts[k + 1]] < waits[k] for k in checked)


def overlapped_by_matmuls(events: list[tuple[str, str]], op: str) -> bool:
    """Whether each `op` collective issued before the last matrix product (the ones that have
    compute left to hide behind) has matrix products between its issue and its wait."""
    position = {event: i for i, event in enumerate(events) if event[0] != "matmul"}
    last_matmul = max(i for i, event in enumerate(events) if event[0] == "matmul")
    spans = [(position[(name, buf)], position[("wait_tensor", buf)]) for name, buf in events if name == op]
    spans = [(a, b) for a, b in spans if a < last_matmul]
    return len(spans) > 1 and all(any(e[0] == "matmul" for e in events[a:b]) for a, b in spans)


@pytest.mark.distributed
def test_inductor_keeps_the_schedule():
    forward, backward = run_ranks(generated_issue_order, 2, [{"bucket_size": 30_000}])[0][0]
    gather, reduce = "all_gather_into_tensor", "reduce_scatter_tensor"
    assert issued_ahead(forward, gather) and issued_ahead(backward, gather)
    assert overlapped_by_matmuls(backward, reduce)


def test_the_issue_order_checks_fail_without_overlap():
    # What the code of a step without the schedule looks like: each collective waited for before
    # the next is issued, a matrix product after each wait.
    serial = []
    for i in range(3):
        serial += [("all_gather_into_tensor", f"g{i}"), ("wait_tensor", f"g{i}"), ("matmul", ""),
                   ("reduce_scatter_tensor", f"r{i}"), ("wait_tensor", f"r{i}")]
    assert not issued_ahead(serial, "all_gather_into_tensor")
    assert not overlapped_by_matmuls(serial, "reduce_scatter_tensor")
    # And the same collectives, each issued one step ahead of its wait, pass both.
    ahead = [("all_gather_into_tensor", "g0")]
    for i in range(3):
        ahead += [("all_gather_into_tensor", f"g{i + 1}"), ("reduce_scatter_tensor", f"r{i}"), ("wait_tensor", f"g{i}"),
                  ("matmul", "")] + ([("wait_tensor", f"r{i - 1}")] if i else [])
    ahead += [("wait_tensor", "g3"), ("matmul", ""), ("wait_tensor", "r2")]
    assert issued_ahead(ahead, "all_gather_into_tensor")
    assert overlapped_by_matmuls(ahead, "reduce_scatter_tensor")



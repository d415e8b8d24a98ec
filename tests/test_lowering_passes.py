"""Each lowering pass (on the partitioned forward and backward graphs) run on its own over a small
graph (`pass_graphs`): what its docstring says it rewrites, into what. Tests are named
test_<pass>__<what it does>. Only qgZ traces `dist.get_rank()`: its test has a fake process group
of 4 ranks (collectives do nothing), torn down with this module."""

from __future__ import annotations

import dataclasses
import operator

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
from pass_graphs import (
    GATHER,
    REDUCE,
    WORLD,
    aten,
    c10d,
    calls,
    collectives,
    context,
    topology,
    two_blocks_joint,
    zpp_ops,
)
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore

from zpp_compile.passes.finish_reductions_later import finish_reductions_later
from zpp_compile.passes.lower_collectives import lower_collectives
from zpp_compile.passes.prefetch_across_layers import prefetch_across_layers
from zpp_compile.passes.quantize_gradients import quantize_gradients
from zpp_compile.passes.schedule_overlap import schedule_overlap
from zpp_compile.reports.ledger import collectives_in_graph
from zpp_compile.runtime.deferred_reductions import FINISH_REDUCTIONS_LATER
from zpp_compile.runtime.ops import (
    gather_prefetched_args,
    reduce_grad_args,
)
from zpp_compile.runtime.programs import program_function, run_program
from zpp_compile.runtime.quantization.grad_format import piece_bytes
from zpp_compile.runtime.topology import Group
from zpp_compile.torch_compat import USER_VISIBLE_OUTPUTS

# --------------------------------------------------------------------------------- lowering passes


@pytest.fixture(scope="module")
def rank_0_of_4():
    """A fake process group (collectives do nothing) in which this process is rank 0 of 4: qgZ's
    replacement asks torch.distributed for the rank while it is traced."""
    assert not dist.is_initialized(), "another test left a process group in this process"
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    yield
    dist.destroy_process_group()


def test_quantize_gradients__reductions_become_a_two_hop_quantized_all_to_all(rank_0_of_4):
    _, backward = two_blocks_joint().partition()
    config = context("backward", topology(0), quantized_gradients=True, gradient_block_size=32)

    quantize_gradients(backward, config)

    # The matrices' gradients (32 elements per rank: one block) leave the reductions; the norms'
    # (2 per rank) are still reduced in full precision.
    assert [reduce_grad_args(r).shard_numel for r in calls(backward, REDUCE)] == [2, 2]
    quantized = calls(backward, zpp_ops.qgz_quantize.default)
    requantized = calls(backward, zpp_ops.qgz_reduce_requantize.default)
    reduced = calls(backward, zpp_ops.qgz_dequantize_reduce.default)
    assert len(quantized) == len(requantized) == len(reduced) == 4
    # 2 nodes of 2 ranks; 8 bits within the node, 4 (intra_node_gradient_bits, gradient_bits) between.
    assert all(tuple(n.args[1:]) == (2, 2, 8, 32) for n in quantized)
    assert all(tuple(n.args[1:]) == (2, 2, 32, 8, 4, 32) for n in requantized)
    assert all(tuple(n.args[1:]) == (2, 32, 4, 32, torch.float32, 0.25) for n in reduced)  # the mean of 4

    lower_collectives(backward, config)
    issued = collectives(backward)
    # Per quantized gradient: an all-to-all of INT8 pieces within the node ("1"), then, between the
    # two nodes ("2"), an all-gather of the one INT4 piece for the other node; per norm, the plain
    # float32 reduce-scatter over the world.
    intra_hop = ("all_to_all_single", "1", 2, torch.uint8, 4 * piece_bytes(32, 32, 8))
    inter_hop = ("all_gather_into_tensor", "2", 2, torch.uint8, piece_bytes(32, 32, 4))
    plain = ("reduce_scatter_tensor", WORLD, 4, torch.float32, 8)
    assert sorted(issued, key=str) == sorted([intra_hop, inter_hop] * 4 + [plain] * 2, key=str)
    assert [c[0] for c in issued if c[0] != "reduce_scatter_tensor"] == ["all_to_all_single",
                                                                          "all_gather_into_tensor"] * 4


def hand_written_lowering_graph() -> fx.Graph:
    """The zpp ops lowering rewrites, with fake values: a parameter gather cast to bfloat16 (5
    elements per rank, padded to 6), read through hpZ's marker; a gather of packed bytes; a
    gradient reduction in float32."""
    fake, graph = FakeTensorMode(), fx.Graph()

    def node(made: fx.Node, value: torch.Tensor) -> fx.Node:
        made.meta["val"] = fake.from_tensor(value)
        return made

    shard = node(graph.placeholder("primals_1"), torch.empty(5))
    copy = node(graph.placeholder("primals_2"), torch.empty(12, dtype=torch.bfloat16))
    packed = node(graph.placeholder("primals_3"), torch.empty(36, dtype=torch.uint8))
    grad = node(graph.placeholder("tangents_1"), torch.empty(24, dtype=torch.bfloat16))
    weight = node(graph.call_function(GATHER, (shard, 6, 4, WORLD, torch.bfloat16, torch.float32, 0)),
                  torch.empty(24, dtype=torch.bfloat16))
    kept = node(graph.call_function(zpp_ops.with_secondary_copy.default, (weight, copy)),
                torch.empty(24, dtype=torch.bfloat16))
    used = node(graph.call_function(aten.neg.default, (kept,)), torch.empty(24, dtype=torch.bfloat16))
    flat = node(graph.call_function(zpp_ops.all_gather_flat.default, (packed, 4, WORLD)),
                torch.empty(144, dtype=torch.uint8))
    reduced = node(graph.call_function(REDUCE, (grad, 5, 4, WORLD, torch.float32)), torch.empty(5))
    graph.output((used, flat, reduced))
    return graph


def test_lower_collectives__zpp_ops_become_plain_zero3_functional_collectives():
    graph = hand_written_lowering_graph()
    used, flat, reduced = next(iter(graph.find_nodes(op="output"))).args[0]

    lower_collectives(graph, context("backward", topology(0)))

    assert not [n for n in graph.nodes if getattr(n.target, "namespace", None) == "zpp"], graph
    assert collectives(graph) == [("all_gather_into_tensor", WORLD, 4, torch.bfloat16, 6),
                                  ("all_gather_into_tensor", WORLD, 4, torch.uint8, 36),
                                  ("reduce_scatter_tensor", WORLD, 4, torch.float32, 24)]
    gather, flat_gather, scatter = [n for n in graph.nodes if n.target in (
        c10d.all_gather_into_tensor_out.default, c10d.reduce_scatter_tensor.default)]  # on CPU, gathers' out= form
    # The parameter: cast to bfloat16, padded from 5 to 6, gathered; hpZ's marker is gone, its user
    # reads the gathered weight (after the wait) directly.
    padded = gather.args[0]
    assert padded.target is aten.constant_pad_nd.default and list(padded.args[1]) == [0, 1]
    (cast,) = padded.all_input_nodes
    assert cast.meta["val"].dtype == torch.bfloat16 and cast.all_input_nodes[0].name == "primals_1"
    (waited,) = used.all_input_nodes
    assert waited.target is c10d.wait_tensor.default and waited.args[0] is gather
    assert tuple(waited.meta["val"].shape) == (24,) and waited.meta["val"].dtype == torch.bfloat16
    assert flat_gather.args[0].name == "primals_3"
    # The gradient: cast to float32, reduce-scattered (sum), divided by the group, cut to the shard.
    cut = next(iter(graph.find_nodes(op="output"))).args[0][2]
    assert cut.target is aten.slice.Tensor and tuple(cut.args[1:]) == (0, 0, 5)
    divided = cut.args[0]
    assert divided.target is aten.div.Tensor and divided.args[1] == 4
    assert divided.args[0].target is c10d.wait_tensor.default and divided.args[0].args[0] is scatter
    assert scatter.args[1] == "sum" and scatter.args[0].meta["val"].dtype == torch.float32
    graph.lint()


def test_prefetch_across_layers__a_layer_graphs_first_gather_becomes_one_op_holding_its_program():
    def lowered() -> fx.Graph:
        graph = hand_written_lowering_graph()
        lower_collectives(graph, context("backward", topology(0)))
        return graph

    graph = lowered()
    ledger = collectives_in_graph(graph, topology(0))
    first_wait = next(n for n in graph.nodes if n.target is c10d.wait_tensor.default)
    readers = list(first_wait.users)
    one_layer = dataclasses.replace(context("backward", topology(0)), one_layer=True)

    prefetch_across_layers(graph, one_layer)

    # The parameter's cast, padding, all-gather and wait are one op reading the shard; the second
    # gather (of packed bytes) and the reduction stay as they were.
    (prefetched,) = calls(graph, zpp_ops.gather_prefetched.default)
    args = gather_prefetched_args(prefetched)
    assert [n.name for n in args.inputs] == ["primals_1"] and list(prefetched.users) == readers
    assert (args.gathered_numel, args.dtype, args.backward, args.group_size, args.group_name) == (
        24, torch.bfloat16, True, 4, WORLD)
    assert collectives(graph) == [("all_gather_into_tensor", WORLD, 4, torch.uint8, 36),
                                  ("reduce_scatter_tensor", WORLD, 4, torch.float32, 24)]
    assert not calls(graph, aten.constant_pad_nd.default)
    # The program computes what the gather sends (the shard cast and padded); the op issues the
    # gather and waits for it. Its code is Python as it stands; Inductor compiles it where the graph
    # was compiled by Inductor.
    assert "all_gather" not in args.program and "wait_tensor" not in args.program and args.compiled
    shard = torch.randn(5)
    sent = run_program(args.program, [shard], compiled=False)
    assert sent.dtype == torch.bfloat16 and torch.equal(sent, torch.cat([shard.to(torch.bfloat16), sent.new_zeros(1)]))
    # The ledger counts the op's gather as the gather it replaced.
    assert collectives_in_graph(graph, topology(0)) == ledger
    graph.lint()
    # Overlap scheduling issues the graph's next gather before the op, which waits for its own.
    schedule_overlap(graph, one_layer)
    order = list(graph.nodes)
    (flat_gather,) = calls(graph, c10d.all_gather_into_tensor_out.default)
    assert order.index(flat_gather) < order.index(prefetched)
    # The step's own graph (not a layer's) and a world of one are left as they are.
    for ctx in (context("backward", topology(0)),
                dataclasses.replace(one_layer, topology=dataclasses.replace(topology(0), world=Group(WORLD, (0,))))):
        untouched = lowered()
        prefetch_across_layers(untouched, ctx)
        assert not calls(untouched, zpp_ops.gather_prefetched.default)


def test_finish_reductions_later__a_layer_graphs_last_reductions_end_in_one_op_returning_placeholders():
    def lowered() -> fx.Graph:
        graph = hand_written_lowering_graph()
        lower_collectives(graph, context("backward", topology(0)))
        next(iter(graph.find_nodes(op="output"))).meta[USER_VISIBLE_OUTPUTS] = [0, 1, 2]
        return graph

    graph = lowered()
    ledger = collectives_in_graph(graph, topology(0))
    (scatter,) = calls(graph, c10d.reduce_scatter_tensor.default)
    used, flat, _ = next(iter(graph.find_nodes(op="output"))).args[0]
    # A backward graph of a step split into graphs, whose third output is a local shard's gradient.
    one_layer = dataclasses.replace(context("backward", topology(0), compile_layers_once=True), one_layer=True,
                                    shard_inputs=(3, (2,)))

    finish_reductions_later(graph, one_layer)

    # The reduction's wait, its division by the group size and its cut to the shard are one op
    # reading the reduce-scatter's result; the output is its placeholder. The weight gathers (not
    # computed from the incoming gradient) keep their waits, every collective stays in the graph.
    (later,) = calls(graph, FINISH_REDUCTIONS_LATER)
    inputs, program, results, compiled = later.args
    assert inputs == [scatter] and results == "(('float32', (5,)),)" and compiled == one_layer.config.inductor
    output = next(iter(graph.find_nodes(op="output")))
    placeholder = output.args[0][2]
    assert output.args[0][:2] == (used, flat) and placeholder.args == (later, 0)
    assert placeholder.meta["val"].shape == (5,) and placeholder.meta["val"].stride() == (0,)
    assert len(calls(graph, c10d.wait_tensor.default)) == 2 and not calls(graph, aten.div.Tensor)
    assert collectives_in_graph(graph, topology(0)) == ledger
    # Inductor keeps the placeholder's strides (it would copy a user-visible output to the graph's
    # earlier ones); the program waits, then divides and cuts.
    assert output.meta[USER_VISIBLE_OUTPUTS] == [0, 1]
    summed = torch.arange(24.0)
    torch.testing.assert_close(program_function(program)(summed), summed[:5] / 4)
    graph.lint()
    # The whole step's graph, a forward, a world of one, a reduction that is not a local shard's
    # gradient, and a graph whose inputs are not all plain tensors are left as they are; a graph
    # around the layers' (the embedding's, the head's) is rewritten as a layer's is.
    world_of_one = dataclasses.replace(one_layer, topology=dataclasses.replace(topology(0), world=Group(WORLD, (0,))))
    for ctx in (context("backward", topology(0)), dataclasses.replace(one_layer, kind="forward"), world_of_one,
                dataclasses.replace(one_layer, shard_inputs=(3, ())),
                dataclasses.replace(one_layer, shard_inputs=None)):
        untouched = lowered()
        finish_reductions_later(untouched, ctx)
        assert not calls(untouched, FINISH_REDUCTIONS_LATER)
    around_layers = lowered()
    finish_reductions_later(around_layers, dataclasses.replace(one_layer, one_layer=False))
    assert len(calls(around_layers, FINISH_REDUCTIONS_LATER)) == 1


def test_finish_reductions_later__an_item_of_a_collective_in_the_tail_enters_the_program_as_an_input():
    """A reduction of two hops, the second a coalesced collective (a list of tensors): the
    collective stays in the graph, its item is the op's input (a list is no argument of the op's)."""
    graph = hand_written_lowering_graph()
    lower_collectives(graph, context("backward", topology(0)))
    output = next(iter(graph.find_nodes(op="output")))
    output.meta[USER_VISIBLE_OUTPUTS] = [0, 1, 2]
    (scatter,) = calls(graph, c10d.reduce_scatter_tensor.default)
    (first_wait,) = [n for n in scatter.users if n.target is c10d.wait_tensor.default]
    readers = list(first_wait.users)
    with graph.inserting_after(first_wait):
        hop = graph.call_function(c10d.all_reduce_coalesced.default, ([first_wait], "sum", WORLD))
    hop.meta["val"] = [first_wait.meta["val"] * 1]
    with graph.inserting_after(hop):
        item = graph.call_function(operator.getitem, (hop, 0))
    item.meta["val"] = hop.meta["val"][0]
    with graph.inserting_after(item):
        second_wait = graph.call_function(c10d.wait_tensor.default, (item,))
    second_wait.meta["val"] = item.meta["val"]
    for reader in readers:
        reader.replace_input_with(first_wait, second_wait)
    graph.lint()
    one_layer = dataclasses.replace(context("backward", topology(0), compile_layers_once=True), one_layer=True,
                                    shard_inputs=(3, (2,)))

    finish_reductions_later(graph, one_layer)

    (later,) = calls(graph, FINISH_REDUCTIONS_LATER)
    inputs, program, _, _ = later.args
    assert inputs == [item] and hop in graph.nodes and item in graph.nodes
    summed = torch.arange(24.0)
    torch.testing.assert_close(program_function(program)(summed), summed[:5] / 4)
    graph.lint()



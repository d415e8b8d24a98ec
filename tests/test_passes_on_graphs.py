"""Each compiler pass of `zpp_compile.passes.PASSES` run on its own over a small graph, in this
process, in seconds: what its docstring says it rewrites, into what.

Graphs are built two ways. Joint graphs are traced from tiny models whose modules call the zpp IR
op `zpp.all_gather_param` on a shard of their own, as sharding's do (4 ranks, world group "0"):
torch.compile hands the step to AOTAutograd, whose partition function receives the joint graph
(with Dynamo's module stacks), keeps it and stops the compilation, so nothing runs and no process
group is needed. The lowering passes get the forward and backward graphs the min-cut partitioner
makes of such a joint graph, or a graph written by hand with fake values. Topologies are made by
hand (world 4, 2 ranks per node). Only qgZ traces `dist.get_rank()`: its test has a fake process
group of 4 ranks (collectives do nothing), torn down with this module. Graphs holding collectives
are never run; the tests check their structure: which ops, over which groups, with which sizes and
dtypes, and the recompute tags the partitioner obeys.
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
from functorch.compile import min_cut_rematerialization_partition
from torch._dynamo.backends.common import aot_autograd
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils.checkpoint import CheckpointPolicy

import zpp_compile as zpp
from zpp_compile.ledger import collectives_in_graph
from zpp_compile.passes import PASSES, PassContext
from zpp_compile.passes.base import READ_REPEATEDLY, RECOMPUTED, SECONDARY_COPY, weight_gathers
from zpp_compile.passes.checkpoint_activations import checkpoint_activations
from zpp_compile.passes.finish_reductions_later import finish_reductions_later
from zpp_compile.passes.fx_util import ancestors, backward_nodes, layer_of, weight_chain
from zpp_compile.passes.gather_once import gather_once
from zpp_compile.passes.lower_collectives import lower_collectives
from zpp_compile.passes.partition_hierarchically import partition_hierarchically
from zpp_compile.passes.prefetch_across_layers import prefetch_across_layers
from zpp_compile.passes.quantize_gradients import quantize_gradients
from zpp_compile.passes.quantize_weights import quantize_weights
from zpp_compile.passes.reshard_after_forward import reshard_after_forward
from zpp_compile.passes.schedule_overlap import schedule_overlap
from zpp_compile.runtime.deferred_reductions import FINISH_REDUCTIONS_LATER
from zpp_compile.runtime.ops import (
    dequantize_weight_args,
    gather_flat_args,
    gather_param_args,
    gather_prefetched_args,
    quantize_weight_args,
    reduce_grad_args,
)
from zpp_compile.runtime.programs import program_function, run_program
from zpp_compile.runtime.quantization.grad_format import piece_bytes
from zpp_compile.runtime.topology import Group, Topology
from zpp_compile.torch_compat import C10D_FUNCTIONAL, RECOMPUTE, USER_VISIBLE_OUTPUTS

aten, zpp_ops, c10d = torch.ops.aten, torch.ops.zpp, C10D_FUNCTIONAL
GATHER, REDUCE = zpp_ops.all_gather_param.default, zpp_ops.reduce_grad.default
WORLD_SIZE, WORLD = 4, "0"  # the group every model below gathers over
LAYERS = ("blocks.0", "blocks.1")
MUST_RECOMPUTE, MUST_SAVE = CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.MUST_SAVE


# ------------------------------------------------------------------------------ tiny sharded models


def gathered(shard: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The flat weight of a shard, as a sharded module reads it."""
    return torch.ops.zpp.all_gather_param(shard, shard.numel(), WORLD_SIZE, WORLD, dtype, torch.float32, 0)


class Linear(nn.Module):
    def __init__(self, out_features: int, in_features: int) -> None:
        super().__init__()
        self.shape = (out_features, in_features)
        self.shard = nn.Parameter(torch.randn(out_features * in_features // WORLD_SIZE))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ gathered(self.shard).view(self.shape).t()


class Scale(nn.Module):
    """A norm's weight: smaller per rank than one quantization block."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.shard = nn.Parameter(torch.randn(features // WORLD_SIZE))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * gathered(self.shard)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2 = Scale(8), Linear(16, 8), Linear(8, 16)  # 32 elements per rank each

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class TwoBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.sum()


class ReadTwice(nn.Module):
    """One weight applied twice (as a tied embedding and head, or a layer shared by two blocks)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.fc(x))).sum()


class HeldForLaterGraph(nn.Module):
    """An embedding tied to a head in a later graph (Config.compile_layers_once): the graph reads
    the weight, gathered in bf16, and returns it for the head."""

    def __init__(self) -> None:
        super().__init__()
        self.shard = nn.Parameter(torch.randn(16))

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weight = gathered(self.shard, torch.bfloat16)
        return nn.functional.embedding(tokens, weight.view(8, 8)).float().sum(), weight


# ------------------------------------------------------------------------------ graphs and contexts


@dataclass
class Joint:
    """A joint graph as AOTAutograd hands it to the partitioner, with what the partitioner takes."""

    module: fx.GraphModule
    inputs: Any
    kwargs: dict

    @property
    def graph(self) -> fx.Graph:
        return self.module.graph

    def partition(self) -> tuple[fx.Graph, fx.Graph]:
        """(forward, backward) as the min-cut partitioner splits the joint graph, honouring its tags."""
        self.module.recompile()
        forward, backward = min_cut_rematerialization_partition(self.module, self.inputs, **self.kwargs)
        return forward.graph, backward.graph


class _Captured(Exception):
    pass


def capture_joint(model: nn.Module, *inputs: torch.Tensor) -> Joint:
    """The joint graph of `model(*inputs)`, without compiling or running anything."""
    captured = []

    def partition(joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any):
        captured.append(Joint(joint, joint_inputs, kwargs))
        raise _Captured

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=lambda gm, _: gm, partition_fn=partition)
    try:
        torch.compile(model, backend=backend, fullgraph=True)(*inputs)
    except Exception:
        if not captured:
            raise
    return captured[0]


def two_blocks_joint() -> Joint:
    torch.manual_seed(0)
    return capture_joint(TwoBlocks(), torch.randn(3, 8))


def topology(rank: int = 0, secondary: tuple[int, ...] | None = None) -> Topology:
    """Rank `rank` of 4 ranks on 2 nodes: groups "0" world, "1" its node, "2" its peers on the other
    node, "3" hpZ's secondary group (`secondary`)."""
    node, local = divmod(rank, 2)
    return Topology(rank, 4, 2, torch.device("cpu"), Group(WORLD, (0, 1, 2, 3)), Group("1", (2 * node, 2 * node + 1)),
                    Group("2", (local, local + 2)), Group("3", secondary) if secondary else None, None)


def context(kind: str = "joint", topology: Topology | None = None, layers: tuple[str, ...] = LAYERS,
            **config: Any) -> PassContext:
    return PassContext(zpp.Config(**config), topology, f"g0.{kind}", kind, layers)


def calls(graph: fx.Graph, op: Any) -> list[fx.Node]:
    return list(graph.find_nodes(op="call_function", target=op))


def collectives(graph: fx.Graph) -> list[tuple[str, str, int, torch.dtype, int]]:
    """(collective, group name, group size, input dtype, input elements) of each functional
    collective in `graph`, in graph order."""
    found = []
    for node in graph.nodes:
        if node.op != "call_function" or getattr(node.target, "namespace", None) != "_c10d_functional":
            continue
        name, x = node.target.overloadpacket.__name__, node.args[0].meta["val"]
        if name.startswith("all_gather_into_tensor"):
            group_size, group = node.args[1:3]
        elif name == "reduce_scatter_tensor":
            group_size, group = node.args[2:4]
        elif name == "all_to_all_single":
            group_size, group = len(node.args[1]), node.args[3]
        else:
            continue  # wait_tensor
        found.append((name.removesuffix("_out"), group, group_size, x.dtype, x.numel()))
    return found


def test_every_pass_has_a_graph_level_test_here_or_in_test_schedule():
    # Tests here are named test_<pass>__<what it does>; a pass added to PASSES needs one.
    here = {name.removeprefix("test_").split("__")[0] for name in globals() if name.startswith("test_")}
    in_test_schedule = {"bucket_collectives", "fold_bucket_copies", "realize_shared_values", "schedule_overlap"}
    assert {p.name for p in PASSES} <= here | in_test_schedule, {p.name for p in PASSES} - here - in_test_schedule


# ------------------------------------------------------------------------------------ joint passes


def test_gather_once__one_gather_and_one_reduction_for_a_weight_read_twice():
    joint = capture_joint(ReadTwice(), torch.randn(3, 8))
    assert len(calls(joint.graph, GATHER)) == 2 and len(calls(joint.graph, REDUCE)) == 2
    gradients = [reduce_grad_args(r).grad for r in calls(joint.graph, REDUCE)]

    gather_once(joint.graph, context(layers=()))

    (gather,) = calls(joint.graph, GATHER)
    assert gather.meta[READ_REPEATEDLY]
    # Both matrix products of forward read the one gathered weight.
    forward_mms = [n for n in calls(joint.graph, aten.mm.default) if n not in backward_nodes(joint.graph)]
    assert len(forward_mms) == 2 and all(gather in ancestors(mm) for mm in forward_mms)
    # One reduction, of the sum of both reads' gradients; the other read's result is zeros.
    (reduction,) = calls(joint.graph, REDUCE)
    summed = reduce_grad_args(reduction).grad
    assert summed.target is aten.add.Tensor and set(summed.args) == set(gradients)
    assert reduce_grad_args(reduction)[1:] == (16, WORLD_SIZE, WORLD, torch.float32)
    output = next(iter(joint.graph.find_nodes(op="output")))
    parameter_grad = output.args[0][1]
    assert reduction in ancestors(parameter_grad)
    (zeros,) = [n for n in ancestors(parameter_grad) if n.target in (aten.full.default, aten.zeros.default,
                                                                       aten.new_zeros.default)]
    assert tuple(zeros.meta["val"].shape) == (16,)
    joint.graph.lint()


def test_gather_once__a_weight_held_for_a_later_graph_sums_its_gradients_in_the_reduce_dtype():
    joint = capture_joint(HeldForLaterGraph(), torch.tensor([[1, 2, 2]]))
    (reduction,) = calls(joint.graph, REDUCE)
    assert reduce_grad_args(reduction).grad.meta["val"].dtype == torch.bfloat16  # autograd's sum of the two uses

    gather_once(joint.graph, context(layers=()))

    (gather,) = calls(joint.graph, GATHER)
    assert gather.meta[READ_REPEATEDLY]  # bucketed apart from the weights this graph alone reads
    # The later graph's gradient (a tangent) and the embedding's, each cast, then summed in float32.
    summed = reduce_grad_args(reduction).grad
    assert summed.target is aten.add.Tensor and summed.meta["val"].dtype == torch.float32
    cast = torch.ops.prims.convert_element_type.default
    assert [(term.target, term.args[0].meta["val"].dtype) for term in summed.args] == [(cast, torch.bfloat16)] * 2
    assert any(term.args[0].op == "placeholder" and term.args[0].target.startswith("tangents") for term in summed.args)
    assert calls(joint.graph, aten.add.Tensor) == [summed]  # autograd's sum in bf16 is gone
    joint.graph.lint()


def test_reshard_after_forward__gathered_weights_are_tagged_and_backward_gathers_again():
    joint = two_blocks_joint()
    gathers = calls(joint.graph, GATHER)
    weights = {n for g in gathers for n in weight_chain(g)}  # the gathers, and their views and transposes

    reshard_after_forward(joint.graph, context())

    tagged = {n for n in joint.graph.nodes if n.meta.get(RECOMPUTE) == MUST_RECOMPUTE}
    assert tagged == weights and len(gathers) == 6
    assert {n.target for n in tagged} == {GATHER, aten.view.default, aten.t.default}
    # The partitioner honours the tags: backward gathers again every weight it reads (all but the
    # first norm's, which only the model input's gradient would read), and forward saves none.
    forward, backward = joint.partition()
    assert len(calls(backward, GATHER)) == 5
    saved = set(next(iter(forward.find_nodes(op="output"))).args[0][1:])
    forward_weights = {n for g in calls(forward, GATHER) for n in weight_chain(g)}
    assert forward_weights and not saved & forward_weights, saved & forward_weights
    # It saves the input (primals_2) and the five shards backward gathers from.
    assert {n.name for n in saved if n.op == "placeholder"} == {f"primals_{i}" for i in range(2, 8)}
    # The check can fail: untagged, the partitioner saves the gathered weights instead.
    _, untagged_backward = two_blocks_joint().partition()
    assert calls(untagged_backward, GATHER) == []


def activations_read_outside_forward(joint: Joint) -> tuple[dict[fx.Node, list[fx.Node]], set[fx.Node]]:
    """For a joint graph of TwoBlocks: the layers' forward nodes that nodes outside forward read
    (backward's, or activation checkpointing's copies), with those readers; and the forward nodes
    saved for backward once the partitioner has split the graph, less the gathered weights."""
    graph = joint.graph
    output = next(iter(graph.find_nodes(op="output")))
    forward = ancestors(output.args[0][0])  # what the loss is computed from
    weights = {n for g in calls(graph, GATHER) for n in weight_chain(g)}
    read = {n: [u for u in n.users if u not in forward] for n in forward
            if n.op == "call_function" and n not in weights and layer_of(n, LAYERS)}
    forward_graph, _ = joint.partition()
    forward_weights = {n for g in calls(forward_graph, GATHER) for n in weight_chain(g)}
    saved = set(next(iter(forward_graph.find_nodes(op="output"))).args[0][1:]) - forward_weights
    return {n: users for n, users in read.items() if users}, saved


def copies_only(readers: dict[fx.Node, list[fx.Node]]) -> bool:
    """Whether every reader is an alias activation checkpointing made for its copies."""
    return all(u.target is aten.alias.default and u.meta.get(RECOMPUTED) for users in readers.values() for u in users)


def test_checkpoint_activations__full_backward_reads_copies_and_forward_keeps_layer_inputs():
    read_before, saved_before = activations_read_outside_forward(two_blocks_joint())
    assert {n.target for n in read_before} == {aten.relu.default, aten.mul.Tensor, aten.add.Tensor}
    assert {n.target for n in saved_before} >= {aten.relu.default, aten.mul.Tensor}
    joint = two_blocks_joint()

    checkpoint_activations(joint.graph, context(activation_checkpointing="full"))

    copies = [n for n in joint.graph.nodes if n.meta.get(RECOMPUTED)]
    # Copies of each layer's nodes, matrix products included, tagged as torch.utils.checkpoint tags
    # a region: the layer's index as its id.
    assert {n.target for n in copies} == {aten.alias.default, aten.mul.Tensor, aten.mm.default, aten.relu.default,
                                          aten.add.Tensor}
    assert all(n.meta[RECOMPUTE] == MUST_RECOMPUTE and n.meta["partitioner_tag"] == "is_backward" for n in copies)
    assert {n.meta["ac_graph_id"] for n in copies} == {0, 1}
    # Backward reads no node of a layer's forward: only block 1's input, through an alias, by the
    # copies of block 1.
    read, saved = activations_read_outside_forward(joint)
    assert [n.target for n in read] == [aten.add.Tensor] and copies_only(read), read
    # Forward keeps the residual stream only (8 wide): the input, and what block 0's output is
    # computed from with it; none of the 16-wide hidden activations, no norm output.
    assert len(saved) == 2 and all(tuple(n.meta["val"].shape) == (3, 8) for n in saved), saved
    assert aten.mul.Tensor not in {n.target for n in saved}
    joint.graph.lint()


def test_checkpoint_activations__selective_keeps_matrix_products_and_recomputes_the_rest():
    joint = two_blocks_joint()
    checkpoint_activations(joint.graph, context(activation_checkpointing="selective"))

    originals = [n for n in calls(joint.graph, aten.mm.default) if not n.meta.get(RECOMPUTED)]
    assert len(originals) == 4 + 8  # fc1 and fc2 of each block, and backward's
    assert [n.meta.get(RECOMPUTE) for n in originals if layer_of(n, LAYERS) and n not in backward_nodes(joint.graph)
            ] == [MUST_SAVE] * 4
    copies = [n for n in joint.graph.nodes if n.meta.get(RECOMPUTED)]
    assert {n.target for n in copies} == {aten.alias.default, aten.mul.Tensor, aten.relu.default, aten.add.Tensor}
    # Backward's copies read the matrix products (and block 1's input); forward saves those and the
    # input, nothing cheap (the norms' and relus' outputs).
    read, saved = activations_read_outside_forward(joint)
    assert {n.target for n in read} == {aten.mm.default, aten.add.Tensor} and copies_only(read), read
    assert {n.target for n in saved if n.op == "call_function"} == {aten.mm.default}, saved
    assert {n.name for n in saved if n.op == "placeholder"} == {"primals_2"}
    joint.graph.lint()


def test_quantize_weights__gathers_of_a_block_or_more_become_int8_quantize_gather_dequantize():
    joint = two_blocks_joint()
    config = context(quantized_weights=True, weight_block_size=32)
    reshard_after_forward(joint.graph, config)  # as in PASSES: its tags are inherited

    quantize_weights(joint.graph, config)

    # The matrices' shards (32 elements: one block) are quantized; the norms' (2 elements) are not.
    assert [(g.shard_size, g.block_size) for g in weight_gathers(joint.graph)] == [(2, 0), (32, 32), (32, 32)] * 2
    assert [gather_param_args(g).shard_size for g in calls(joint.graph, GATHER)] == [2, 2]
    packed = piece_bytes(32, 32, 8)  # 32 INT8 codes and one float32 scale
    for gather in weight_gathers(joint.graph):
        if not gather.block_size:
            continue
        dequantized, exchanged = dequantize_weight_args(gather.weight), gather_flat_args(gather.gathered)
        quantized = quantize_weight_args(exchanged.x)
        assert quantized.x.op == "placeholder" and quantized.block_size == 32  # the shard, as it is
        assert (exchanged.group_size, exchanged.group_name) == (WORLD_SIZE, WORLD)
        assert exchanged.x.meta["val"].dtype == torch.uint8 and exchanged.x.meta["val"].numel() == packed
        assert (dequantized.packed, dequantized.n, dequantized.block_size, dequantized.dtype) == (
            gather.gathered, 32, 32, torch.float32)
        assert gather.weight.meta["val"].shape == (128,)
        # Resharded after forward through INT8 as well: the replacement keeps the gather's tag.
        assert all(n.meta[RECOMPUTE] == MUST_RECOMPUTE for n in (exchanged.x, gather.gathered, gather.weight))
        assert {u.target for u in gather.weight.users} == {aten.view.default}
    joint.graph.lint()


def hpz_lowered(*joint_passes: Callable, group: tuple[int, ...] = (0, 1), **config: Any
                ) -> tuple[fx.Graph, fx.Graph, fx.Graph]:
    """(joint, forward, backward) of TwoBlocks after `joint_passes`, the partitioner and lowering,
    on rank 1 of 4, hpZ's secondary group being `group` (by default its node: it is member 1)."""
    joint = two_blocks_joint()
    rank = topology(1, group)
    for joint_pass in joint_passes:
        joint_pass(joint.graph, context(topology=rank, hpz_partition_size=len(group), **config))
    forward, backward = joint.partition()
    for graph, kind in ((forward, "forward"), (backward, "backward")):
        lower_collectives(graph, context(kind, rank, hpz_partition_size=len(group), **config))
    return joint.graph, forward, backward


def test_partition_hierarchically__backward_gathers_within_the_secondary_group_only():
    joint, forward, backward = hpz_lowered(reshard_after_forward, partition_hierarchically)

    # Forward keeps rank 1's half of each weight backward reads (not the first norm's) as its copy.
    copies = [n for n in joint.nodes if n.meta.get(SECONDARY_COPY)]
    assert len(copies) == 5 and all(n.meta[RECOMPUTE] == MUST_SAVE and n.target is aten.clone.default for n in copies)
    for copy in copies:
        (sliced,) = copy.all_input_nodes
        weight, *bounds = sliced.args
        part = weight.meta["val"].numel() // 2
        assert sliced.target is aten.slice.Tensor and bounds == [0, part, 2 * part] and weight.target is GATHER
    assert len(calls(joint, zpp_ops.with_secondary_copy.default)) == 5
    # Lowered: forward gathers over the world; backward gathers the copies within the secondary
    # group (half a weight from the other member) and nothing over the world.
    assert {c[:4] for c in collectives(forward)} == {("all_gather_into_tensor", WORLD, 4, torch.float32)}
    gathers = [c for c in collectives(backward) if c[0] == "all_gather_into_tensor"]
    assert sorted(gathers) == sorted([("all_gather_into_tensor", "3", 2, torch.float32, 64)] * 4 +
                                     [("all_gather_into_tensor", "3", 2, torch.float32, 4)])
    assert {c[:3] for c in collectives(backward) if c[0] != "all_gather_into_tensor"} == {
        ("reduce_scatter_tensor", WORLD, 4)}
    backward_inputs = {n.name for n in backward.find_nodes(op="placeholder")}
    assert {c.name for c in copies} <= backward_inputs
    assert not calls(forward, zpp_ops.with_secondary_copy.default)  # a marker, lowered away
    # The check can fail: without hpZ, backward gathers again over the world.
    _, _, plain_backward = hpz_lowered(reshard_after_forward)
    assert {c[:3] for c in collectives(plain_backward) if c[0] == "all_gather_into_tensor"} == {
        ("all_gather_into_tensor", WORLD, 4)}


def test_partition_hierarchically__after_qwz_the_copy_is_int8_and_backward_dequantizes_it():
    joint, forward, backward = hpz_lowered(reshard_after_forward, quantize_weights, partition_hierarchically,
                                           quantized_weights=True, weight_block_size=32)
    # The matrices' copies are half the gathered INT8 bytes; the norms' half their float weights.
    gathers = [c for c in collectives(backward) if c[0] == "all_gather_into_tensor"]
    half_packed = WORLD_SIZE * piece_bytes(32, 32, 8) // 2
    assert sorted(gathers, key=str) == sorted([("all_gather_into_tensor", "3", 2, torch.uint8, half_packed)] * 4 +
                                              [("all_gather_into_tensor", "3", 2, torch.float32, 4)], key=str)
    assert len(calls(backward, zpp_ops.dequantize_weight.default)) == 4
    assert {c[:4] for c in collectives(forward)} == {("all_gather_into_tensor", WORLD, 4, torch.uint8),
                                                     ("all_gather_into_tensor", WORLD, 4, torch.float32)}


def test_partition_hierarchically__a_weight_held_for_a_later_graph_gets_no_copy():
    # The graph returns the weight, and its backward reads none: nothing to keep a copy for.
    joint = capture_joint(HeldForLaterGraph(), torch.tensor([[1, 2, 2]]))
    partition_hierarchically(joint.graph, context(topology=topology(1, (0, 1)), hpz_partition_size=2))
    assert not [n for n in joint.graph.nodes if n.meta.get(SECONDARY_COPY)]
    (gather,) = calls(joint.graph, GATHER)
    output = next(iter(joint.graph.find_nodes(op="output")))
    assert output.args[0][1] is gather  # the gathered weight itself, not one rebuilt from a copy


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


def test_partition_hierarchically__a_group_of_one_keeps_the_whole_weight_and_backward_gathers_nothing():
    joint, _, backward = hpz_lowered(reshard_after_forward, partition_hierarchically, group=(1,))
    copies = [n for n in joint.nodes if n.meta.get(SECONDARY_COPY)]
    assert len(copies) == 5 and all(n.target is GATHER and n.meta[RECOMPUTE] == MUST_SAVE for n in copies)
    assert [c[0] for c in collectives(backward)] == ["reduce_scatter_tensor"] * 6

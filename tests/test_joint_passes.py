"""Each joint pass (on AOTAutograd's joint graph) run on its own over a small graph (`pass_graphs`):
what its docstring says it rewrites, into what. Tests are named test_<pass>__<what it does>."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx as fx
from pass_graphs import (
    GATHER,
    LAYERS,
    MUST_RECOMPUTE,
    MUST_SAVE,
    REDUCE,
    WORLD,
    WORLD_SIZE,
    HeldForLaterGraph,
    Joint,
    ReadTwice,
    aten,
    calls,
    capture_joint,
    collectives,
    context,
    topology,
    two_blocks_joint,
    zpp_ops,
)

from zpp_compile.passes.base import READ_REPEATEDLY, RECOMPUTED, SECONDARY_COPY, weight_gathers
from zpp_compile.passes.checkpoint_activations import checkpoint_activations
from zpp_compile.passes.fx_util import ancestors, backward_nodes, layer_of, weight_chain
from zpp_compile.passes.gather_once import gather_once
from zpp_compile.passes.lower_collectives import lower_collectives
from zpp_compile.passes.partition_hierarchically import partition_hierarchically
from zpp_compile.passes.quantize_weights import quantize_weights
from zpp_compile.passes.reshard_after_forward import reshard_after_forward
from zpp_compile.runtime.ops import (
    dequantize_weight_args,
    gather_flat_args,
    gather_param_args,
    quantize_weight_args,
    reduce_grad_args,
)
from zpp_compile.runtime.quantization.grad_format import piece_bytes
from zpp_compile.torch_compat import RECOMPUTE

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


def test_partition_hierarchically__a_group_of_one_keeps_the_whole_weight_and_backward_gathers_nothing():
    joint, _, backward = hpz_lowered(reshard_after_forward, partition_hierarchically, group=(1,))
    copies = [n for n in joint.nodes if n.meta.get(SECONDARY_COPY)]
    assert len(copies) == 5 and all(n.target is GATHER and n.meta[RECOMPUTE] == MUST_SAVE for n in copies)
    assert [c[0] for c in collectives(backward)] == ["reduce_scatter_tensor"] * 6

"""Activation checkpointing: backward recomputes each layer's activations instead of keeping them."""

from __future__ import annotations

import operator
from collections import defaultdict
from typing import Any

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from ..torch_compat import (
    AC_GRAPH_ID,
    IN_BACKWARD,
    PARTITIONER_TAG,
    RECOMPUTE,
    OpOverload,
    mutates_arguments,
    op_arguments,
)
from .base import RECOMPUTED, PassContext
from .fx_util import ancestors, backward_nodes, nodes_calling, weight_chain

aten = torch.ops.aten

# What "selective" keeps from forward: the outputs of matrix products and attention, the costly
# ops. Everything else in a layer (norms, activations, casts, residual adds, rotary embeddings)
# is cheap next to them and is recomputed.
_KEPT_BY_SELECTIVE = tuple(getattr(aten, name) for name in (
    "mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "convolution",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable", "_flash_attention_forward", "_efficient_attention_forward",
) if hasattr(aten, name))


def checkpoint_activations(graph: fx.Graph, ctx: PassContext) -> None:
    """Backward reads recomputed copies of each layer's forward nodes (activation checkpointing).

    Layers are the ones bucketing keeps to (the children of the model's largest ModuleList or
    Sequential), told apart by the module stack Dynamo records on each forward node. For every
    layer, each forward node that backward reads, and every node of the layer it is computed
    from, gets a copy placed before backward's first use, and backward's uses move to the copies
    (Config.activation_checkpointing):
    - "full" copies every node of the layer, so forward keeps the layer's input (the residual
      stream) and what the layer reads from outside it (rotary tables, masks);
    - "selective" copies all but matrix products and attention, whose outputs forward keeps
      (tagged MUST_SAVE).
    Ops that draw random numbers (dropout, attention with a dropout probability) and ops that
    mutate are never copied: backward reads the values forward made. Gathered weights keep the
    reshard pass's tags (re-gathered in backward with reshard_after_forward, kept without), and
    nodes that torch.utils.checkpoint in the model already tagged keep their tags.

    The copies are tagged MUST_RECOMPUTE with the layer's index as "ac_graph_id", as
    torch.utils.checkpoint tags its regions, so the min-cut partitioner computes them in backward,
    where its reordering runs each just before its first use. What a copy reads from outside its
    layer goes through an alias, so that the partitioner's common-subexpression elimination cannot
    fold the copies back into the originals. Copies rather than recompute tags on the layer's own
    nodes, for two reasons: a recompute tag on an op that may draw random numbers makes the
    partitioner pass RNG state from forward to backward, which torch's partitioner gets wrong with
    DTensor parameters (attention is such an op even at dropout 0); and hpZ must point recomputed
    matrix products at its secondary copy instead of a gather across nodes, which it can do only to
    nodes of backward (it takes the copies, marked RECOMPUTED, for such).
    """
    backward = backward_nodes(graph)
    gathers = nodes_calling(graph, torch.ops.zpp.all_gather_param.default)
    if not backward or not gathers:  # an inference graph, or one without parameters
        return

    weights = set().union(*(weight_chain(g) for g in gathers), *(ancestors(g) for g in gathers))
    forward = _forward_nodes(graph, backward)
    members: dict[str, list[fx.Node]] = defaultdict(list)
    for node in graph.nodes:
        if node in forward and node.op == "call_function" and node not in weights and RECOMPUTE not in node.meta:
            layer = ctx.layer_of(node)
            if layer is not None:
                members[layer].append(node)
    selective = ctx.config.activation_checkpointing == "selective"
    made: set[fx.Node] = set()
    for index, nodes in enumerate(members.values()):
        copied = _copied(nodes, selective)
        if selective:
            for node in nodes:
                if _target(node) in _KEPT_BY_SELECTIVE:
                    node.meta[RECOMPUTE] = CheckpointPolicy.MUST_SAVE
        _recompute_in_backward(graph, copied, forward, backward, weights, index, made)


def _forward_nodes(graph: fx.Graph, backward: set[fx.Node]) -> set[fx.Node]:
    """The nodes forward's outputs are computed from (the joint graph returns forward's outputs
    and the gradients, which alone depend on incoming gradients)."""
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    found: set[fx.Node] = set()
    todo = [n for n in output.all_input_nodes if n not in backward]
    while todo:
        node = todo.pop()
        if node not in found:
            found.add(node)
            todo.extend(node.all_input_nodes)
    return found


def _target(node: fx.Node) -> Any:
    return getattr(node.target, "overloadpacket", node.target)


def _copied(nodes: list[fx.Node], selective: bool) -> list[fx.Node]:
    """The nodes of a layer that backward recomputes, in graph order."""
    copied: dict[fx.Node, None] = {}  # ordered
    for node in nodes:
        if node.target is operator.getitem:
            recompute = node.args[0] in copied  # an output of a multi-output op: with the op
        else:
            recompute = (
                isinstance(node.target, OpOverload)
                and not _mutates(node)
                and _holds_tensors(node)
                and not _draws_random_numbers(node)
                and not (selective and _target(node) in _KEPT_BY_SELECTIVE)
            )
        if recompute:
            copied[node] = None
    return list(copied)


def _mutates(node: fx.Node) -> bool:
    return mutates_arguments(node.target)


def _holds_tensors(node: fx.Node) -> bool:
    """A tensor, or several of them (with sizes or seeds beside, as attention returns)."""
    value = node.meta.get("val")
    return any(isinstance(v, torch.Tensor) for v in (value if isinstance(value, (tuple, list)) else (value,)))


def _draws_random_numbers(node: fx.Node) -> bool:
    """Whether the op is random; attention counts as random only with a dropout probability."""
    op = node.target
    if torch.Tag.nondeterministic_seeded not in op.tags:
        return False
    arguments = op_arguments(op)
    names = [a.name for a in arguments]
    if "dropout_p" not in names:
        return True
    index = names.index("dropout_p")
    p = node.args[index] if index < len(node.args) else node.kwargs.get("dropout_p", arguments[index].default_value)
    return p != 0


def _recompute_in_backward(graph: fx.Graph, copied: list[fx.Node], forward: set[fx.Node], backward: set[fx.Node],
                           weights: set[fx.Node], ac_graph_id: int, made: set[fx.Node]) -> None:
    """Copies of the nodes of `copied` that backward reads (and of those they are computed from),
    placed before the first of their uses that depends on an incoming gradient; every use outside
    forward moves to the copies. `made` holds the nodes this pass added for earlier layers, and
    gets this layer's."""
    def in_backward(user: fx.Node) -> bool:  # a use outside forward (mutations of inputs stay in forward)
        return user.op != "output" and user not in forward and user not in made and not _mutates(user)

    region = set(copied)
    needed: set[fx.Node] = set()
    todo = [n for n in copied if any(in_backward(u) for u in n.users)]
    while todo:
        node = todo.pop()
        if node not in needed:
            needed.add(node)
            todo.extend(arg for arg in node.all_input_nodes if arg in region)
    if not needed:
        return
    users = {u for n in needed for u in n.users if u in backward}
    first_use = next(n for n in graph.nodes if n in users or (not users and n in backward and n.op != "placeholder"))
    copies: dict[fx.Node, fx.Node] = {}
    aliases: dict[fx.Node, fx.Node] = {}

    def tag(node: fx.Node) -> fx.Node:
        node.meta.update({RECOMPUTE: CheckpointPolicy.MUST_RECOMPUTE, AC_GRAPH_ID: ac_graph_id,
                          PARTITIONER_TAG: IN_BACKWARD})
        node.meta[RECOMPUTED] = True
        made.add(node)
        return node

    def source(arg: fx.Node) -> fx.Node:
        """What a copy reads in place of `arg`: its copy, an alias of an activation from outside
        the copies (which keeps the copies distinct from the originals), or `arg` itself."""
        if arg in copies:
            return copies[arg]
        if arg in weights or not isinstance(arg.meta.get("val"), torch.Tensor):
            return arg
        if arg not in aliases:
            aliases[arg] = tag(graph.call_function(aten.alias.default, (arg,)))
            aliases[arg].meta["val"] = aten.alias.default(arg.meta["val"])
        return aliases[arg]

    with graph.inserting_before(first_use):
        for node in copied:
            if node in needed:
                copies[node] = tag(graph.node_copy(node, source))
    for node, copy in copies.items():
        for user in list(node.users):
            if in_backward(user):
                user.replace_input_with(node, copy)
    # Uses that come before the copies (values autograd prepares for backward during forward,
    # such as detached attention outputs), and what is computed from them, move after them.
    first_copy, moved = next(iter(copies.values())), set(copies.values())
    for node in list(graph.nodes):
        if node is first_copy:
            break
        if any(arg in moved for arg in node.all_input_nodes):
            moved.add(node)
            first_use.prepend(node)

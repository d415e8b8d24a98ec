"""Region weights: a layer compiled once reads in backward the weights the outer graph gathers."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..torch_compat import INVOKE_SUBGRAPH

from .base import PassContext
from .fx_util import ancestors, nodes_calling, weight_chain


def region_weights(graph: fx.Graph, ctx: PassContext) -> None:
    """Feeds each backward call of a nested compile region the outer graph's gathered weights
    instead of the copies the forward call of the region saved for it.

    A layer compiled once (`torch.compiler.nested_compile_region`) is partitioned by AOTAutograd
    on its own, before the joint passes see the step: its forward returns what its backward needs,
    the weights it was given among them (as they are, or transposed, viewed, cast). Those
    outputs would keep every layer's gathered weights alive from forward to backward, out of
    reach of reshard after forward. This recomputes each such saved value in the outer graph,
    from the gathered weights the forward call was given, by the ops that computed it inside the
    region: backward then uses weights like any layer compiled inline, so reshard after forward
    re-gathers them there, and bucketing and the schedule see every use.
    """
    regions = nodes_calling(graph, INVOKE_SUBGRAPH)
    if not regions:
        return
    from_weights: set[fx.Node] = set()
    for gather in nodes_calling(graph, torch.ops.zpp.all_gather_param.default):
        from_weights.update(weight_chain(gather))
    for call in regions:
        copies: dict[tuple[fx.Node, fx.Node], fx.Node] = {}  # (forward call, its body's node) -> copy before `call`
        for index, arg in enumerate(call.args):
            saved = _saved_by_region(arg)
            if saved is None:
                continue
            forward_call, output_index = saved
            recomputed = _recompute(graph, call, forward_call, output_index, from_weights, copies)
            if recomputed is not None:
                call.update_arg(index, recomputed)
                if not arg.users:
                    graph.erase_node(arg)


def _saved_by_region(arg: object) -> tuple[fx.Node, int] | None:
    """(the region call, its output index) when `arg` is an output of a region call."""
    if not (isinstance(arg, fx.Node) and arg.op == "call_function" and arg.target is operator.getitem):
        return None
    source, index = arg.args
    if isinstance(source, fx.Node) and source.target is INVOKE_SUBGRAPH:
        return source, index
    return None


def _recompute(
    graph: fx.Graph,
    before: fx.Node,
    forward_call: fx.Node,
    output_index: int,
    from_weights: set[fx.Node],
    copies: dict[tuple[fx.Node, fx.Node], fx.Node],
) -> fx.Node | None:
    """Output `output_index` of `forward_call`, computed again before `before` from the region's
    inputs; None unless the region computes it from gathered weights alone (an activation is
    saved as usual)."""
    body: fx.GraphModule = getattr(graph.owning_module, forward_call.args[0].target)
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    inputs = dict(zip(placeholders, forward_call.args[2:]))
    value = next(n for n in body.graph.nodes if n.op == "output").args[0][output_index]
    found = ancestors(value)
    needed = [n for n in body.graph.nodes if n in found]
    if any(n.op not in ("placeholder", "call_function") for n in needed):
        return None
    if any(n.op == "placeholder" and inputs[n] not in from_weights for n in needed):
        return None
    env = {n: inputs[n] for n in needed if n.op == "placeholder"}
    with graph.inserting_before(before):
        for node in needed:
            if node.op == "call_function":
                if (forward_call, node) not in copies:
                    copies[(forward_call, node)] = graph.node_copy(node, lambda n: env[n])
                env[node] = copies[(forward_call, node)]
    return env[value]

"""Lowering of the zpp IR ops that no earlier pass rewrote into plain ZeRO-3 collectives."""

from __future__ import annotations

import torch
import torch.fx as fx

from ..runtime.collectives import all_gather
from ..runtime.ops import gather_flat_args, gather_param, gather_param_args, reduce_grad_args, reduce_grad_mean
from .base import PassContext
from .fx_util import nodes_calling, replace_with_traced


def lower_collectives(graph: fx.Graph, ctx: PassContext) -> None:
    """Lowers the remaining gathers and reductions to plain ZeRO-3 collectives.

    zpp.all_gather_param -> cast, pad, all_gather_into_tensor; zpp.all_gather_flat ->
    all_gather_into_tensor; zpp.reduce_grad -> cast, reduce_scatter_tensor (sum), divide by
    the group size, narrow to the local shard; zpp.with_secondary_copy -> its weight input.
    On CPU the all-gathers are their `out=` form (`runtime/collectives.gathers_into_given_output`).

    The replacements are traced from the same functions the ops run eagerly, so the compiled
    graph issues exactly the collectives of the eager reference.
    """
    for node in nodes_calling(graph, torch.ops.zpp.all_gather_param.default):
        gather = gather_param_args(node)
        replace_with_traced(graph, node, gather_param, gather.shard, gather.shard_size, gather.group_size,
                            gather.group_name, gather.dtype)
    for node in nodes_calling(graph, torch.ops.zpp.with_secondary_copy.default):
        node.replace_all_uses_with(node.args[0])  # a marker for the partitioner only
        graph.erase_node(node)
    for node in nodes_calling(graph, torch.ops.zpp.all_gather_flat.default):
        replace_with_traced(graph, node, all_gather, *gather_flat_args(node))
    for node in nodes_calling(graph, torch.ops.zpp.reduce_grad.default):
        replace_with_traced(graph, node, reduce_grad_mean, *reduce_grad_args(node))

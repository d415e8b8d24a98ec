"""Reshard after forward: gathered weights are re-gathered in backward, never saved."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from ..runtime.ops import gather_param_args
from ..torch_compat import RECOMPUTE
from .base import PassContext
from .fx_util import ancestors, nodes_calling, weight_chain


def reshard_after_forward(graph: fx.Graph, ctx: PassContext) -> None:
    """Tags each parameter gather, what it gathers from its shards (a bucket's concatenation) and
    all computed from gathered weights alone, MUST_RECOMPUTE.

    Rewrites nothing: the min-cut partitioner honours the tags by putting a second copy of the
    gather (with the padding and concatenation of the shards before it, and the casts, views and
    transposes after it) into the backward graph, so the forward graph saves only the local
    shards for backward, never a gathered weight nor a copy of the shards.
    """
    for gather in nodes_calling(graph, torch.ops.zpp.all_gather_param.default):
        shard_side = [n for n in ancestors(gather_param_args(gather).shard) if n.op == "call_function"]
        for node in shard_side + weight_chain(gather):
            node.meta[RECOMPUTE] = CheckpointPolicy.MUST_RECOMPUTE

"""Reshard after forward: gathered weights are re-gathered in backward, never saved."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from .base import PassContext
from .fx_util import nodes_calling, weight_chain


def reshard_after_forward(graph: fx.Graph, ctx: PassContext) -> None:
    """Tags each parameter gather, and all computed from gathered weights alone, MUST_RECOMPUTE.

    Rewrites nothing: the min-cut partitioner honours the tags by putting a second copy of the
    gather (and of the casts, views and transposes that follow it) into the backward graph, so the
    forward graph saves only the local shard for backward, never a gathered weight.
    """
    for gather in nodes_calling(graph, torch.ops.zpp.all_gather_param.default):
        for node in weight_chain(gather):
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE

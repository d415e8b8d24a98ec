"""qwZ: parameter all-gathers in block-quantized INT8."""

from __future__ import annotations

import torch
import torch.fx as fx

from ..runtime.ops import gather_param_args, quantize_and_gather
from ..torch_compat import RECOMPUTE
from .base import RECOMPUTED, PassContext, weight_block_size
from .fx_util import insert_traced, nodes_calling, replace_with_traced

# What a gather's replacement inherits from it: whether the partitioner recomputes it in backward
# (reshard after forward) and whether it is a copy activation checkpointing made for backward.
_INHERITED_META = (RECOMPUTE, RECOMPUTED)


def quantize_weights(graph: fx.Graph, ctx: PassContext) -> None:
    """Rewrites each parameter gather of the joint graph into quantize -> gather -> dequantize.

    zpp.all_gather_param -> zpp.quantize_weight of the padded shard, zpp.all_gather_flat of the
    packed bytes, zpp.dequantize_weight. Each rank quantizes its full-precision shard in blocks of
    `weight_block_size` with one float32 scale per block; codes and scales are packed into one byte
    buffer, so one collective moves both. The replacement inherits the gather's recompute tag, so
    a weight resharded after forward is re-gathered in backward through INT8 as well: quantizing
    the same shard gives the same codes, so backward differentiates exactly the weights forward
    used. A shard smaller than one block is gathered in full precision: quantizing it would not
    make it smaller. Later joint passes (hpZ) see the gathered bytes and the weight apart.
    """
    for node in nodes_calling(graph, torch.ops.zpp.all_gather_param.default):
        gather = gather_param_args(node)
        if block_size := weight_block_size(ctx.config, node):
            meta = {key: node.meta[key] for key in _INHERITED_META if key in node.meta}
            gathered = insert_traced(graph, node, quantize_and_gather, gather.shard, gather.shard_size,
                                     gather.group_size, gather.group_name, block_size, meta=meta)
            replace_with_traced(graph, node, torch.ops.zpp.dequantize_weight.default, gathered, gather.shard_size,
                                block_size, gather.dtype, meta=meta)

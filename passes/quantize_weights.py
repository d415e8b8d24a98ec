"""qwZ: parameter all-gathers in block-quantized INT8."""

from __future__ import annotations


import torch
import torch.fx as fx

from ..runtime.ops import gather_param_args, gather_param_quantized
from .base import PassContext, weight_block_size
from .fx_util import nodes_calling, replace_with_traced


def quantize_weights(graph: fx.Graph, ctx: PassContext) -> None:
    """Rewrites each parameter gather into quantize -> all-gather (INT8 + scales) -> dequantize.

    Each rank quantizes its full-precision shard in blocks of `weight_block_size` with one
    float32 scale per block; codes and scales are packed into one byte buffer, so one collective
    moves both. Backward re-gathers (when hpZ is off) are quantized too: quantizing the same shard
    gives the same codes, so backward differentiates exactly the weights forward used, and the
    backward gather also moves half the bytes. A shard smaller than one block is gathered in
    full precision: quantizing it would not make it smaller.
    """
    for node in nodes_calling(graph, torch.ops.zpp.all_gather_param.default):
        gather = gather_param_args(node)
        if block_size := weight_block_size(ctx.config, node):
            replace_with_traced(graph, node, gather_param_quantized, gather.shard, gather.shard_size,
                                gather.group_size, gather.group_name, gather.dtype, block_size)

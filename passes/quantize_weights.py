"""qwZ: parameter all-gathers in block-quantized INT8."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from ..runtime.ops import gather_param_args, gather_param_quantized
from .base import FULL_PRECISION, PassContext
from .fx_util import nodes_calling, replace_with_traced


def weight_block_size(config: Any, gather: fx.Node) -> int:
    """The qwZ block size for a parameter gather; 0 means gather it unquantized (qwZ off, a shard
    smaller than one block, which quantizing would not make smaller, or a bucket of such shards)."""
    block, shard_size = config.weight_block_size, gather_param_args(gather).shard_size
    wanted = config.quantized_weights and shard_size >= block and not gather.meta.get(FULL_PRECISION)
    return block if wanted else 0


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

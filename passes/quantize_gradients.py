"""qgZ: gradient reductions as a two-hop, block-quantized all-to-all."""

from __future__ import annotations

import torch
import torch.fx as fx

from ..runtime.ops import reduce_grad_args, reduce_grad_quantized
from .base import PassContext, gradient_block_size
from .fx_util import nodes_calling, replace_with_traced


def quantize_gradients(graph: fx.Graph, ctx: PassContext) -> None:
    """Rewrites each gradient reduce-scatter into a two-hop quantized all-to-all.

    quantize -> intra-node all-to-all -> reduce and requantize -> inter-node all-to-all ->
    dequantize and reduce: the mean, like the plain path.

    Slices are reordered inside the quantize kernel so each rank ends with exactly its ZeRO shard.
    The intra-node hop uses `intra_node_gradient_bits`, the inter-node hop `gradient_bits` (4
    by default, the paper's INT4). A shard smaller than one block, or a bucket of such shards, is
    reduced in full precision: its scales alone would outweigh the saving.
    """
    config, topology = ctx.config, ctx.topology
    for node in nodes_calling(graph, torch.ops.zpp.reduce_grad.default):
        reduction = reduce_grad_args(node)
        if block := gradient_block_size(config, node):
            replace_with_traced(
                graph, node, reduce_grad_quantized, reduction.grad, reduction.shard_numel, reduction.dtype,
                topology.num_nodes, topology.ranks_per_node, topology.node, topology.intra_node.name,
                topology.inter_node.name,
                config.intra_node_gradient_bits, config.gradient_bits, block,
            )

"""Lowering of a bucket's copies in and out (`zpp.join_bucket`, `zpp.split_bucket`)."""

from __future__ import annotations

import torch
import torch.fx as fx

from ..runtime.buckets import join_shards, side_by_side
from ..runtime.ops import (
    dequantize_weight_args,
    join_bucket_args,
    quantize_weight_args,
    split_bucket_args,
    split_bucket_reference,
)
from .base import PassContext
from .fx_util import nodes_calling, replace_with_traced


def fold_bucket_copies(graph: fx.Graph, ctx: PassContext) -> None:
    """Folds each bucket's copies into the quantization kernels beside them, or lowers them to copies.

    zpp.join_bucket -> zpp.quantize_weight, where the quantization is the join's only use -> one
    zpp.quantize_bucket, which quantizes each shard into its place: the joined shards are never
    written. zpp.dequantize_weight -> zpp.split_bucket, where the split is the dequantized
    values' only use -> one zpp.dequantize_bucket, which writes every member's weight where the
    split would have copied it: one pass over the weights instead of two, and no rank-major
    buffer. Any other join or split (a full-precision bucket, or dequantized values that hpZ
    keeps as its copy) -> its torch ops, for Inductor to generate: a split's slices and
    concatenation, a join's shards placed side by side in one elementwise expression
    (`buckets.side_by_side`: one kernel with the cast that follows; in debug mode, without
    Inductor, the concatenation that allocates only the result).
    """
    for node in nodes_calling(graph, torch.ops.zpp.join_bucket.default):
        _lower_join(graph, node, one_pass=ctx.config.inductor)
    for node in nodes_calling(graph, torch.ops.zpp.split_bucket.default):
        _lower_split(graph, node)


def _lower_join(graph: fx.Graph, node: fx.Node, one_pass: bool) -> None:
    join = join_bucket_args(node)
    users = list(node.users)
    if len(users) == 1 and users[0].target is torch.ops.zpp.quantize_weight.default:
        block_size = quantize_weight_args(users[0]).block_size
        replace_with_traced(graph, users[0], _quantize_bucket, tuple(join.segments), block_size, *join.shards)
        graph.erase_node(node)
    else:
        replace_with_traced(graph, node, _join, one_pass, tuple(join.segments), *join.shards)


def _lower_split(graph: fx.Graph, node: fx.Node) -> None:
    split = split_bucket_args(node)
    source = split.gathered
    if source.target is torch.ops.zpp.dequantize_weight.default and len(source.users) == 1:
        dequantize = dequantize_weight_args(source)
        replace_with_traced(graph, node, torch.ops.zpp.dequantize_bucket.default, dequantize.packed,
                            tuple(split.segments), tuple(split.sizes), dequantize.block_size, dequantize.dtype)
        graph.erase_node(source)
    else:
        replace_with_traced(graph, node, split_bucket_reference, split.gathered, split.group_size,
                            tuple(split.segments), tuple(split.sizes))


def _quantize_bucket(segments: tuple[int, ...], block_size: int, *shards: torch.Tensor) -> torch.Tensor:
    return torch.ops.zpp.quantize_bucket(list(shards), list(segments), block_size)


def _join(one_pass: bool, segments: tuple[int, ...], *shards: torch.Tensor) -> torch.Tensor:
    return (side_by_side if one_pass else join_shards)(list(shards), list(segments))

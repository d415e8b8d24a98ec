"""Bucketing: many parameter gathers (and gradient reductions) become one collective per bucket."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from ..runtime.buckets import join_shards, member_starts, side_by_side
from ..runtime.ops import gather_param_args, reduce_grad_args
from .base import FULL_PRECISION, READ_REPEATEDLY, PassContext, gradient_block_size, weight_block_size
from .fx_util import gathered_param, hoist, insert_traced, nodes_calling, sink_users


@dataclass
class _Bucket:
    key: tuple
    members: list[fx.Node] = field(default_factory=list)
    nbytes: int = 0


def bucket_collectives(graph: fx.Graph, ctx: PassContext) -> None:
    """Merges consecutive gathers, and consecutive reductions, into one per `bucket_size` bytes.
    With bucket_size="layer" (sized by the largest layer) a bucket never spans two of
    `ctx.layers`, so each layer is one bucket, as each block is one FSDP unit; a size in bytes
    may span layers.

    Each bucket becomes one `zpp.all_gather_param` or one `zpp.reduce_grad`. A gather bucket
    concatenates its members' shards (each padded to its own shard size), gathers them at once
    and cuts every member's weight out of the gathered rows; a reduction bucket lays
    its members' gradients side by side per destination rank, so one reduce-scatter hands each
    rank all of its shards. Buckets are still IR ops, so every later pass (reshard, hpZ, qwZ, qgZ)
    acts on whole buckets: one quantize kernel, one collective (codes and scales together) and
    one dequantize kernel per bucket. Where qwZ or qgZ is on, members of at least one block are
    padded to whole blocks (so each block's scale covers one parameter, exactly as without
    buckets) and smaller members are bucketed apart, in full precision. A parameter gathered twice
    in one bucket (tied weights) is gathered once. Gathers and reductions over a group of one rank
    stay apart: they issue no collective to save (`runtime/collectives.py`), and each cast to the
    compute dtype is made just before its weight's use (one bucket per layer, each weight a view
    of it, made the step slower, likely by casting weights out of cache before their matmuls:
    docs/performance.md).
    """
    size = ctx.config.bucket_size
    gathers = nodes_calling(graph, torch.ops.zpp.all_gather_param.default)
    layer_of_node = ctx.layer_of if ctx.buckets_within_layers else lambda n: None
    for bucket in _buckets(gathers, size, lambda n: _gather_key(n, ctx.config), layer_of_node):
        _merge_gathers(graph, bucket)
    reductions = nodes_calling(graph, torch.ops.zpp.reduce_grad.default)
    for bucket in _buckets(reductions, size, lambda n: _reduce_key(n, ctx.config), layer_of_node):
        _merge_reductions(graph, bucket, one_pass=ctx.config.inductor)


def _gather_key(node: fx.Node, config: Any) -> tuple | None:
    """What members of one bucket share, None for a gather over one rank (left alone); the last
    item is the qwZ block size (0: unquantized). A weight held across several reads (gather_once)
    shares a bucket only with such weights."""
    gather = gather_param_args(node)
    if gather.group_size == 1:
        return None
    return (gather.shard.meta["val"].dtype, gather.group_size, gather.group_name, gather.dtype, gather.reduce_dtype,
            gather.sharding_id, node.meta.get(READ_REPEATEDLY, False), weight_block_size(config, node))


def _reduce_key(node: fx.Node, config: Any) -> tuple | None:
    """What members of one bucket share, None for a reduction over one rank (left alone); the last
    item is the qgZ block size (0: unquantized)."""
    reduction = reduce_grad_args(node)
    if reduction.group_size == 1:
        return None
    return (reduction.grad.meta["val"].dtype, reduction.group_size, reduction.group_name, reduction.dtype,
            gradient_block_size(config, node))


def _nbytes(node: fx.Node) -> int:
    gather = node.target is torch.ops.zpp.all_gather_param.default
    value = node.meta["val"] if gather else reduce_grad_args(node).grad.meta["val"]
    return value.numel() * value.element_size()


def _buckets(nodes: list[fx.Node], size: int, key_of, layer_of) -> list[_Bucket]:
    """Groups `nodes` (in graph order) into buckets of equal key and layer and at most `size`
    bytes each (a node larger than `size` gets a bucket of its own). Buckets of one node, and
    nodes whose key is None, are left alone."""
    done: list[_Bucket] = []
    open_buckets: dict[tuple, _Bucket] = {}
    layer = None
    for node in nodes:
        if (key := key_of(node)) is None:
            continue
        if (node_layer := layer_of(node)) != layer:
            done.extend(open_buckets.values())
            open_buckets.clear()
            layer = node_layer
        nbytes = _nbytes(node)
        bucket = open_buckets.get(key)
        if bucket is not None and bucket.nbytes + nbytes > size:
            done.append(open_buckets.pop(key))
            bucket = None
        if bucket is None:
            bucket = open_buckets[key] = _Bucket(key)
        bucket.members.append(node)
        bucket.nbytes += nbytes
    done.extend(open_buckets.values())
    return [b for b in done if len(b.members) > 1]


def _padded(size: int, block: int) -> int:
    return -(-size // block) * block if block else size


def _merge_gathers(graph: fx.Graph, bucket: _Bucket) -> None:
    *_, block = bucket.key
    first = bucket.members[0]
    gather = gather_param_args(first)
    # A parameter used twice in the bucket (tied weights, with gather_once switched off) is gathered once.
    first_use: dict[tuple, fx.Node] = {}
    for node in bucket.members:
        first_use.setdefault(gathered_param(node), node)
    unique = list(first_use.values())
    sizes = tuple(gather_param_args(n).shard_size for n in unique)
    segments = tuple(_padded(s, block) for s in sizes)
    shards = [gather_param_args(n).shard for n in unique]
    hoist(shards, first)  # each shard is a view of a graph input, made just before its own gather
    weights = insert_traced(graph, first, _gather_bucket, sizes, segments, gather.group_size, gather.group_name,
                            gather.dtype, gather.reduce_dtype, gather.sharding_id, *shards)
    _upstream(weights[0], torch.ops.zpp.all_gather_param.default).meta[FULL_PRECISION] = not block
    weight_of = {gathered_param(n): w for n, w in zip(unique, weights)}
    _replace(graph, bucket.members, tuple(weight_of[gathered_param(n)] for n in bucket.members))


def _gather_bucket(sizes: tuple[int, ...], segments: tuple[int, ...], group_size: int, group_name: str,
                   dtype: torch.dtype, reduce_dtype: torch.dtype, sharding_id: int,
                   *shards: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """One gather of the shards side by side (`zpp.join_bucket`: each padded to its segment);
    every member's weight cut out of the gathered rows (`zpp.split_bucket`), as a view of one
    buffer."""
    flat = torch.ops.zpp.join_bucket(list(shards), list(segments))
    gathered = torch.ops.zpp.all_gather_param(flat, sum(segments), group_size, group_name, dtype, reduce_dtype,
                                              sharding_id)
    weights = torch.ops.zpp.split_bucket(gathered, group_size, list(segments), list(sizes))
    starts, _ = member_starts(group_size, sizes, weights.element_size())
    return tuple(weights[start:start + group_size * size] for start, size in zip(starts, sizes))


def _merge_reductions(graph: fx.Graph, bucket: _Bucket, one_pass: bool) -> None:
    *_, block = bucket.key
    last = bucket.members[-1]
    reductions = [reduce_grad_args(n) for n in bucket.members]
    group_size, group_name, dtype = reductions[-1].group_size, reductions[-1].group_name, reductions[-1].dtype
    sizes = tuple(r.grad.meta["val"].numel() // group_size for r in reductions)
    segments = tuple(_padded(s, block) for s in sizes)
    shard_numels = tuple(r.shard_numel for r in reductions)
    # Uses of the earlier members' results move past the bucket, which comes after every gradient.
    sink_users(bucket.members[:-1], last)
    shards = insert_traced(graph, last, _reduce_bucket, sizes, segments, shard_numels, group_size, group_name, dtype,
                           one_pass, *(r.grad for r in reductions))
    _upstream(shards[0], torch.ops.zpp.reduce_grad.default).meta[FULL_PRECISION] = not block
    _replace(graph, bucket.members, shards)


def _reduce_bucket(sizes: tuple[int, ...], segments: tuple[int, ...], shard_numels: tuple[int, ...], group_size: int,
                   group_name: str, dtype: torch.dtype, one_pass: bool,
                   *grads: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """One reduction of the gradients laid side by side per destination rank; every member's
    shard cut out of this rank's reduced row. Under Inductor (`one_pass`) the rows are one
    elementwise expression (`buckets.side_by_side`), which it generates as one kernel with the
    cast to the reduction's dtype; in debug mode a concatenation, which allocates only the rows."""
    pieces = [g.view(group_size, size) for g, size in zip(grads, sizes)]
    rows = (side_by_side if one_pass else join_shards)(pieces, list(segments))
    shards = torch.ops.zpp.reduce_grad(rows.reshape(-1), sum(segments), group_size, group_name, dtype)
    return tuple(piece[:numel] for piece, numel in zip(shards.split(segments), shard_numels))


def _upstream(node: fx.Node, target: Any) -> fx.Node:
    """The nearest node calling `target` that `node` is computed from."""
    todo, seen = [node], set()
    while todo:
        current = todo.pop(0)
        if current.target is target:
            return current
        seen.add(current)
        todo.extend(n for n in current.all_input_nodes if n not in seen)
    raise AssertionError(f"no {target} upstream of {node}")


def _replace(graph: fx.Graph, old: list[fx.Node], new: tuple[fx.Node, ...]) -> None:
    for node, replacement in zip(old, new):
        node.replace_all_uses_with(replacement)
        graph.erase_node(node)

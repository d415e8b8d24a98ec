"""The IR of zeropp: "gather this parameter" and "reduce this gradient" as torch.library ops.

Sharding makes every parameter access call `zpp::all_gather_param`; its autograd formula calls
`zpp::reduce_grad`. Traced by torch.compile, the joint graph therefore holds one gather per
parameter use in forward and one reduction per gradient in backward, found by op identity. Passes
rewrite them (quantized, hierarchical) or lower them to plain functional collectives; run eagerly,
they are plain ZeRO-3, the numerical reference.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, NamedTuple

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.operator_schemas import normalize_function

from ..torch_compat import OpOverload, cuda_graph_unsafe_tags
from . import prefetch, quantization  # noqa: F401  (registers the prefetch and quantization ops)
from .buckets import join_shards, member_starts, split_rows
from .collectives import all_gather, all_to_all, all_to_all_between_nodes, reduce_scatter_sum
from .job import warn_for_the_job
from .registry import REGISTRY


def gather_param(
    shard: torch.Tensor, shard_size: int, group_size: int, group_name: str, dtype: torch.dtype
) -> torch.Tensor:
    """Every rank's shard, cast to `dtype` and padded to `shard_size`, concatenated (flat)."""
    padded = F.pad(shard.to(dtype), (0, shard_size - shard.numel()))
    return all_gather(padded, group_size, group_name)


def reduce_grad_mean(
    grad: torch.Tensor, shard_numel: int, group_size: int, group_name: str, dtype: torch.dtype
) -> torch.Tensor:
    """This rank's shard (its first `shard_numel` elements) of the mean of `grad` over the group."""
    shard = reduce_scatter_sum(grad.to(dtype), group_size, group_name) / group_size
    return shard[:shard_numel]


def reduce_grad_quantized(
    grad: torch.Tensor,
    shard_numel: int,
    dtype: torch.dtype,
    num_nodes: int,
    ranks_per_node: int,
    node: int,
    intra_group: str,
    inter_group: str,
    intra_bits: int,
    inter_bits: int,
    block_size: int,
) -> torch.Tensor:
    """`reduce_grad_mean` as qgZ's two-hop quantized all-to-all (same meaning: the mean).

    The gradient is quantized with its slices reordered so that the intra-node all-to-all hands
    local rank l the parts of every node's shard l; those are summed and requantized, and the
    inter-node all-to-all hands each rank its own shard from every node. Only the second hop
    leaves the node, in `inter_bits` (between two nodes as an all-gather, see
    `all_to_all_between_nodes`). With one node, or one rank per node, the missing hop is
    skipped. Sums are in float32; the result is the mean in `dtype`.
    """
    nodes, local = num_nodes, ranks_per_node  # `node`: this rank's node, its index in its inter-node group
    shard_size = grad.numel() // (nodes * local)
    mean = 1.0 / (nodes * local)
    if nodes == 1 or local == 1:
        group, bits = (intra_group, intra_bits) if nodes == 1 else (inter_group, inter_bits)
        packed = torch.ops.zpp.qgz_quantize(grad, nodes, local, bits, block_size)
        if nodes == 1:
            received = all_to_all(packed, local, group)
        else:
            received = all_to_all_between_nodes(packed, nodes, group, node)
        shard = torch.ops.zpp.qgz_dequantize_reduce(received, nodes * local, shard_size, bits, block_size, dtype, mean)
        return shard[:shard_numel]
    packed = torch.ops.zpp.qgz_quantize(grad, nodes, local, intra_bits, block_size)
    received = all_to_all(packed, local, intra_group)
    partial = torch.ops.zpp.qgz_reduce_requantize(received, local, nodes, shard_size, intra_bits, inter_bits,
                                                  block_size)
    received = all_to_all_between_nodes(partial, nodes, inter_group, node)
    shard = torch.ops.zpp.qgz_dequantize_reduce(received, nodes, shard_size, inter_bits, block_size, dtype, mean)
    return shard[:shard_numel]


@contextlib.contextmanager
def naming_collective(op: str, group_size: int, group_name: str) -> Iterator[None]:
    """Re-raises a failed collective (a peer died, hung past the timeout, or issued another
    collective) with the op and group named: the backend's own text names neither."""
    try:
        yield
    except RuntimeError as error:
        raise RuntimeError(
            f"zeropp collective {op} over process group {group_name!r} ({group_size} ranks) failed: {error}. "
            "A peer rank died, hung past Config.collective_timeout_s, or ran a different collective; "
            "check the other ranks' logs"
        ) from error


@torch.library.custom_op("zpp::all_gather_flat", mutates_args=())
def all_gather_flat(x: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    """Every group member's `x`, concatenated: a gather with no autograd and no cast.

    Joint-graph passes use it where they add a gather of their own (hpZ): the partitioner would
    force-save a `_c10d_functional` collective, but treats this op like any other.
    """
    with naming_collective("zpp::all_gather_flat", group_size, group_name):
        gathered = all_gather(x, group_size, group_name)
    return gathered.clone() if gathered is x else gathered  # a group of one; an op's output may not be its input


@all_gather_flat.register_fake
def _(x, group_size, group_name):
    return x.new_empty(x.numel() * group_size)


def quantize_and_gather(
    shard: torch.Tensor, shard_size: int, group_size: int, group_name: str, block_size: int
) -> torch.Tensor:
    """The packed INT8 blocks and scales of every rank's shard, as one gathered byte buffer."""
    padded = F.pad(shard, (0, shard_size - shard.numel())) if shard.numel() < shard_size else shard
    packed = torch.ops.zpp.quantize_weight(padded, block_size)
    return torch.ops.zpp.all_gather_flat(packed, group_size, group_name)


def secondary_slice(gathered: torch.Tensor, member: int, members: int) -> torch.Tensor:
    """Member `member`'s part of a gathered buffer split over `members` ranks, as a copy (a view
    would keep the whole buffer alive)."""
    part = gathered.numel() // members
    return gathered[member * part:(member + 1) * part].clone()


def gather_secondary(
    copy: torch.Tensor, members: int, group_name: str, shard_size: int, block_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """The flat weight rebuilt from the secondary group's copies; `block_size` 0 means they hold
    weights, otherwise packed INT8 blocks and scales to dequantize."""
    gathered = torch.ops.zpp.all_gather_flat(copy, members, group_name) if members > 1 else copy
    if block_size:
        return torch.ops.zpp.dequantize_weight(gathered, shard_size, block_size, dtype)
    return gathered


@torch.library.custom_op("zpp::join_bucket", mutates_args=())
def join_bucket(shards: list[torch.Tensor], segments: list[int]) -> torch.Tensor:
    """A bucket's shards side by side, each padded to its segment: what one gather sends.

    Kept whole so that lowering can fold it into the quantization that reads it
    (`zpp::quantize_bucket`) or else hand it to Inductor as plain copies.
    """
    return join_shards(shards, segments)


@join_bucket.register_fake
def _(shards, segments):
    return shards[0].new_empty(sum(segments))


def split_bucket_reference(gathered: torch.Tensor, group_size: int, segments: list[int],
                           sizes: list[int]) -> torch.Tensor:
    """`zpp::split_bucket` in torch ops."""
    return split_rows(gathered.view(group_size, sum(segments)), segments, sizes)


@torch.library.custom_op("zpp::split_bucket", mutates_args=())
def split_bucket(gathered: torch.Tensor, group_size: int, segments: list[int], sizes: list[int]) -> torch.Tensor:
    """A gathered bucket's weights, each flat and whole, one after another (`runtime/buckets.py`).

    A bucket gather returns rank-major rows (every rank's shards of all members, side by side);
    a member's weight is its column range of every row. This op is that copy-out, kept whole so
    that lowering can fold it into the dequantization that produces the rows
    (`zpp::dequantize_bucket`) or else hand it to Inductor as plain copies.
    """
    return split_bucket_reference(gathered, group_size, segments, sizes)


@split_bucket.register_fake
def _(gathered, group_size, segments, sizes):
    return gathered.new_empty(member_starts(group_size, sizes, gathered.element_size())[1])


@torch.library.custom_op("zpp::with_secondary_copy", mutates_args=())
def with_secondary_copy(weight: torch.Tensor, copy: torch.Tensor) -> torch.Tensor:
    """`weight`, once `copy` exists: a joint-graph marker that makes forward depend on hpZ's copy.

    The min-cut partitioner keeps a MUST_SAVE tag only on values forward computes; a copy used
    by backward alone would be recomputed there, from a world gather. Routing forward's uses of
    the weight through this op makes the copy a forward value. Lowering removes it (the weight
    is used directly), so it costs nothing at run time; run eagerly it is a copy of `weight`.
    """
    return weight.clone()


@with_secondary_copy.register_fake
def _(weight, copy):
    return torch.empty_like(weight)


class _RunTimeGathers:
    """Who runs `zpp::all_gather_param` itself, rather than the collectives the backend lowers it to.

    An eager read of a parameter does (`parameter_reads.gather_shard`, inside `eager_read()`), and so does
    a graph zeropp compiled with the `lower_collectives` pass switched off (debug). Any other run
    is a graph compiled by another backend (`torch.compile(model)` with the backend forgotten):
    plain ZeRO-3, with qwZ, hpZ and qgZ silently off and nothing in the communication report. That
    gets one warning naming the fix."""

    def __init__(self) -> None:
        self.eager_reads = 0
        self.unlowered_graphs = False  # set by the backend, for good, once one is compiled
        self.warned = False

    def check(self) -> None:
        if self.eager_reads or self.unlowered_graphs or self.warned:
            return
        self.warned = True
        warn_for_the_job(
            "zeropp: a sharded model's parameter gather runs inside a graph compiled by another backend than "
            "zeropp's (torch.compile(model) without backend=\"zeropp\"?): it trains as plain ZeRO-3, with qwZ, hpZ "
            "and qgZ off and nothing in zpp.comm_report(). Compile with torch.compile(model, backend=\"zeropp\")",
            stacklevel=2)


RUN_TIME_GATHERS = _RunTimeGathers()


@contextlib.contextmanager
def eager_read() -> Iterator[None]:
    """A parameter read eagerly gathers inside (`_RunTimeGathers`)."""
    RUN_TIME_GATHERS.eager_reads += 1
    try:
        yield
    finally:
        RUN_TIME_GATHERS.eager_reads -= 1


@torch.library.custom_op("zpp::all_gather_param", mutates_args=())
def all_gather_param(
    shard: torch.Tensor,
    shard_size: int,
    group_size: int,
    group_name: str,
    dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    sharding_id: int,
) -> torch.Tensor:
    """Gathers a flat parameter from its shards; its gradient is reduced in `reduce_dtype`.

    `sharding_id` names the `shard` call the parameter belongs to, so the backend finds its
    settings, and Dynamo, which guards on it, recompiles for a model sharded differently.
    """
    RUN_TIME_GATHERS.check()
    with naming_collective("zpp::all_gather_param (parameter all-gather)", group_size, group_name):
        return gather_param(shard, shard_size, group_size, group_name, dtype)


@all_gather_param.register_fake
def _(shard, shard_size, group_size, group_name, dtype, reduce_dtype, sharding_id):
    return shard.new_empty(shard_size * group_size, dtype=dtype)


@torch.library.custom_op("zpp::reduce_grad", mutates_args=())
def reduce_grad(
    grad: torch.Tensor, shard_numel: int, group_size: int, group_name: str, dtype: torch.dtype
) -> torch.Tensor:
    """This rank's shard of the mean gradient over the group, computed in `dtype`."""
    with naming_collective("zpp::reduce_grad (gradient reduce-scatter)", group_size, group_name):
        return reduce_grad_mean(grad, shard_numel, group_size, group_name, dtype)


@reduce_grad.register_fake
def _(grad, shard_numel, group_size, group_name, dtype):
    return grad.new_empty(shard_numel, dtype=dtype)


def _setup_context(ctx, inputs, output):
    shard, _, group_size, group_name, _, reduce_dtype, _ = inputs
    ctx.shard_numel, ctx.shard_dtype = shard.numel(), shard.dtype
    ctx.group_size, ctx.group_name, ctx.reduce_dtype = group_size, group_name, reduce_dtype


def _backward(ctx, grad):
    shard_grad = reduce_grad(grad, ctx.shard_numel, ctx.group_size, ctx.group_name, ctx.reduce_dtype)
    return shard_grad.to(ctx.shard_dtype), None, None, None, None, None, None


all_gather_param.register_autograd(_backward, setup_context=_setup_context)


class KeepGradLocal(torch.autograd.Function):
    """`weight` in forward; in backward its gradient goes, unreduced, to `sink` instead.

    With gradient sync off, sharding gathers from a detached shard and routes the weight through
    this function: backward then holds no `zpp::reduce_grad` at all, and autograd accumulates the
    full gradient of every micro-step in `sink.grad` (a leaf, in `sink`'s dtype).
    """

    @staticmethod
    def forward(ctx, weight: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
        ctx.sink_dtype = sink.dtype
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        return None, grad.to(ctx.sink_dtype)


class FromEveryReplica(torch.autograd.Function):
    """The value of a replicated (0-d) parameter from its gather, in which every rank's copy
    arrives (all equal): forward takes the first; backward hands the gradient to every copy, so
    that the reduction gives each rank the mean gradient: every rank holds the whole parameter and
    updates it alike (a sharded parameter's rank needs only the gradient of the rows it holds)."""

    @staticmethod
    def forward(ctx, gathered: torch.Tensor) -> torch.Tensor:
        ctx.copies = gathered.numel()
        return gathered[0].clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.reshape(1).expand(ctx.copies).contiguous()


class AddKeptGrad(torch.autograd.Function):
    """`weight` in forward; in backward `zpp::add_kept_grad` adds to its gradient the gradient
    kept on this rank while sync was off (by the accumulator `token` names), before
    `zpp::reduce_grad` reduces it, so that an accumulation window costs one reduction.

    The kept gradient is taken when the backward runs, not when the weight is read: a read whose
    result the compute never uses (`module.weight.dtype`, as PEFT's LoRA layers do) has no backward
    and so cannot lose it, and of several reads (a tied weight, a recompute) the first backward
    takes it and the others find nothing, so it is added once. `token` is held by ctx, not saved
    for backward, as a recompute's read would otherwise save one tensor more than the forward did."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        ctx.token = token
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return add_kept_grad(grad, ctx.token), None


# Its result depends on Python state, not only on its inputs: a CUDA graph replaying it would
# replay the first call's gradient.
_NOT_IN_CUDA_GRAPHS = cuda_graph_unsafe_tags()


@torch.library.custom_op("zpp::add_kept_grad", mutates_args=(), tags=_NOT_IN_CUDA_GRAPHS)
def add_kept_grad(grad: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """`grad` plus the gradient kept by the accumulator whose key `token` (a CPU integer) holds,
    which gives it up (`AddKeptGrad`).

    An op of its own, opaque to the compilers, so that the taking runs as Python also inside a
    compiled backward graph. The key travels as a tensor, an input of the graph, not as a constant
    in it: a layer compiled once (Config.compile_layers_once) reuses its trace for every identical
    layer, each with its own accumulators. Being on the CPU also keeps CUDA graphs off the graph."""
    accumulator = REGISTRY.accumulators.get(int(token))
    kept = accumulator.take_pending() if accumulator is not None else None
    return grad + kept.to(grad.dtype) if kept is not None else grad.clone()


@add_kept_grad.register_fake
def _(grad, token):
    return torch.empty_like(grad)


# One typed view of each collective op's arguments, read by name from the op's schema, so that
# passes and reports never depend on argument positions.


class GatherParamArgs(NamedTuple):
    """The arguments of a `zpp::all_gather_param` node."""

    shard: fx.Node
    shard_size: int
    group_size: int
    group_name: str
    dtype: torch.dtype
    reduce_dtype: torch.dtype
    sharding_id: int


class ReduceGradArgs(NamedTuple):
    """The arguments of a `zpp::reduce_grad` node."""

    grad: fx.Node
    shard_numel: int
    group_size: int
    group_name: str
    dtype: torch.dtype


class GatherFlatArgs(NamedTuple):
    """The arguments of a `zpp::all_gather_flat` node."""

    x: fx.Node
    group_size: int
    group_name: str


class JoinBucketArgs(NamedTuple):
    """The arguments of a `zpp::join_bucket` node."""

    shards: list[fx.Node]
    segments: list[int]


class QuantizeWeightArgs(NamedTuple):
    """The arguments of a `zpp::quantize_weight` node."""

    x: fx.Node
    block_size: int


class SplitBucketArgs(NamedTuple):
    """The arguments of a `zpp::split_bucket` node."""

    gathered: fx.Node
    group_size: int
    segments: list[int]
    sizes: list[int]


class DequantizeWeightArgs(NamedTuple):
    """The arguments of a `zpp::dequantize_weight` node."""

    packed: fx.Node
    n: int
    block_size: int
    dtype: torch.dtype


class GatherPrefetchedArgs(NamedTuple):
    """The arguments of a `zpp::gather_prefetched` node."""

    inputs: list[fx.Node]
    program: str
    gathered_numel: int
    dtype: torch.dtype
    backward: bool
    group_size: int
    group_name: str
    compiled: bool


def param_gathers(graph: fx.Graph) -> list[fx.Node]:
    """The graph's calls of `zpp::all_gather_param`, in graph order (Dynamo's graphs call the op's
    packet, AOTAutograd's its overload)."""
    gather = torch.ops.zpp.all_gather_param
    return [n for n in graph.nodes if n.op == "call_function" and n.target in (gather, gather.default)]


def gather_param_args(node: fx.Node) -> GatherParamArgs:
    return GatherParamArgs(**_named_arguments(node, torch.ops.zpp.all_gather_param.default))


def reduce_grad_args(node: fx.Node) -> ReduceGradArgs:
    return ReduceGradArgs(**_named_arguments(node, torch.ops.zpp.reduce_grad.default))


def gather_flat_args(node: fx.Node) -> GatherFlatArgs:
    return GatherFlatArgs(**_named_arguments(node, torch.ops.zpp.all_gather_flat.default))


def join_bucket_args(node: fx.Node) -> JoinBucketArgs:
    return JoinBucketArgs(**_named_arguments(node, torch.ops.zpp.join_bucket.default))


def quantize_weight_args(node: fx.Node) -> QuantizeWeightArgs:
    return QuantizeWeightArgs(**_named_arguments(node, torch.ops.zpp.quantize_weight.default))


def split_bucket_args(node: fx.Node) -> SplitBucketArgs:
    return SplitBucketArgs(**_named_arguments(node, torch.ops.zpp.split_bucket.default))


def dequantize_weight_args(node: fx.Node) -> DequantizeWeightArgs:
    return DequantizeWeightArgs(**_named_arguments(node, torch.ops.zpp.dequantize_weight.default))


def gather_prefetched_args(node: fx.Node) -> GatherPrefetchedArgs:
    return GatherPrefetchedArgs(**_named_arguments(node, prefetch.GATHER_PREFETCHED))


def _named_arguments(node: fx.Node, op: OpOverload) -> dict[str, Any]:
    """`node`'s arguments by their names in `op`'s schema (Dynamo's graphs call the op's packet,
    the joint graph its overload)."""
    if node.target not in (op, op.overloadpacket):
        raise TypeError(f"expected a call of {op}, got {node.format_node()}")
    return normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True).kwargs

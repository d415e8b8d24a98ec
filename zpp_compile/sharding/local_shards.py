"""The compiled step takes this rank's shards as plain tensors, not the DTensor parameters.

Forward reads a sharded parameter only to gather it: `to_local()`, then `zpp::all_gather_param`.
Handed the DTensor parameters, AOTAutograd traces through DTensor's dispatch and collects the
graph's metadata twice (with the subclass and without), which costs about as much as the rest
of tracing the step and grows with the number of parameters. So the backend takes each
parameter the graph reads only through `to_local()` out of the graph's inputs and passes its
local shard instead (`local_shard_inputs`); the compiled step's caller makes the shards with one
autograd function for all of them (`LocalShards`), whose backward hands each shard's gradient to
its parameter as a DTensor of the parameter's sharding, as `to_local()`'s backward does.
"""

from __future__ import annotations

import copy
import functools
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor

from ..runtime.deferred_reductions import claim, is_placeholder
from ..torch_compat import EXAMPLE_VALUE, accumulates_into_grad, dtensor_parts, dtensor_with_spec, gradient_accumulators


def local_shard_inputs(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> tuple[list[Any], tuple[int, ...]]:
    """Rewrites `gm` to take, for each DTensor input read only through `to_local()` (as the method
    call: `compile_cache.to_local_as_method` first), that local tensor; the `to_local()` calls go.
    Returns the new example inputs and the positions changed."""
    inputs = list(example_inputs)
    positions = []
    for position, node in enumerate(gm.graph.find_nodes(op="placeholder")):
        reads = list(node.users)
        if not isinstance(inputs[position], DTensor) or not reads or not all(map(_is_to_local, reads)):
            continue
        # Dynamo's fake of the local tensor, from the fake mode AOTAutograd traces in, with
        # requires_grad as `LocalShards` gives it at run time.
        local = reads[0].meta[EXAMPLE_VALUE]
        for read in reads:
            read.replace_all_uses_with(node)
            gm.graph.erase_node(read)
        node.meta[EXAMPLE_VALUE] = inputs[position] = local
        positions.append(position)
    if positions:
        gm.recompile()
    return inputs, tuple(positions)


def reading_local_shards(compiled: Callable[..., Any], positions: tuple[int, ...]) -> Callable[..., Any]:
    """`compiled` (rewritten by `local_shard_inputs`), called with the DTensor parameters."""
    if not positions:
        return compiled

    def run(*args: Any) -> Any:
        args = list(args)
        for position, shard in zip(positions, LocalShards.apply(*(args[p] for p in positions))):
            args[position] = shard
        return compiled(*args)

    return run


class LocalShards(torch.autograd.Function):
    """`[p.to_local() for p in params]` as one autograd node: each gradient goes back to its
    parameter as a DTensor with the parameter's sharding.

    Each gradient is built on a copy of the parameter's spec, as `to_local()`'s backward builds it
    when the gradient is laid out as the shard, but without that backward's checks
    (`torch_compat.dtensor_with_spec`). A gradient whose reduction a graph left to finish
    later (`runtime.deferred_reductions`) is set on its parameter when it has finished, where
    autograd would only have accumulated it."""

    @staticmethod
    def forward(ctx: Any, *params: DTensor) -> tuple[torch.Tensor, ...]:
        ctx.params = params
        parts = [dtensor_parts(p) for p in params]
        ctx.specs = [spec for _, spec in parts]
        ctx.strides = [local.stride() for local, _ in parts]
        # A fresh tensor for each: autograd records its history on the object returned.
        shards = tuple(local.view_as(local) for local, _ in parts)
        ctx.mark_non_differentiable(*(s for s, p in zip(shards, params) if not p.requires_grad))
        ctx.set_materialize_grads(False)
        return shards

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[DTensor | None, ...]:
        handed = []
        accumulators = None  # read only for a placeholder: most backward passes hand none
        for index, (grad, param, spec, stride) in enumerate(zip(grads, ctx.params, ctx.specs, ctx.strides)):
            if grad is not None and is_placeholder(grad):
                accumulators = accumulators or gradient_accumulators(ctx)
                accumulates = accumulates_into_grad(param, accumulators[index])
                later = functools.partial(_accumulate, param, spec, stride) if accumulates else None
                grad = claim(grad, later)
            handed.append(None if grad is None else _as_gradient(grad, spec, stride))
        return tuple(handed)


def _as_gradient(grad: torch.Tensor, spec: Any, stride: tuple[int, ...]) -> DTensor:
    # A spec of its own for each gradient, as torch gives every DTensor it makes.
    return dtensor_with_spec(_laid_out(grad, stride), copy.copy(spec))


def _accumulate(param: DTensor, spec: Any, stride: tuple[int, ...], grad: torch.Tensor) -> None:
    """What autograd does with a leaf's gradient, for a gradient that arrives later."""
    grad = _as_gradient(grad, spec, stride)
    with torch.no_grad():
        if param.grad is None:
            param.grad = grad
        else:
            param.grad += grad


def _laid_out(grad: torch.Tensor, stride: tuple[int, ...]) -> torch.Tensor:
    """`grad` with the shard's strides, which the parameter's spec describes."""
    if grad.stride() == stride:
        return grad
    return torch.empty_strided(grad.shape, stride, dtype=grad.dtype, device=grad.device).copy_(grad)


def _is_to_local(node: fx.Node) -> bool:
    return node.op == "call_method" and node.target == "to_local" and len(node.args) == 1 and not node.kwargs

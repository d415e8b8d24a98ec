"""Leaf modules (`Config.leaf_modules`): a module whose parameters are gathered together on entry
and reduced together in backward, whatever its forward does with them.

Every rank must issue the same collectives in the same order. A module whose use of its weights
depends on the data breaks that: a mixture of experts that skips experts no token of this rank
chose (HF's eager experts loop), or reads an expert's weight once per token group, or a branch
on the input. For a leaf module, entering it gathers every parameter of it and of its
submodules, in one order on every rank, and each read inside returns those weights; leaving it
makes its output depend on all of them, so backward reduces every one of them, in that order,
zero gradients included. FSDP2 gets the same from gathering a wrapped block as a whole,
DeepSpeed from `set_z3_leaf_modules`.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .module_state import sharded_names
from .parameter_reads import gather_shard


def is_leaf(name: str, module: nn.Module, leaf_modules: tuple[str, ...]) -> bool:
    """Whether Config.leaf_modules names `module` (qualified name `name`): by its class's name
    (HF's `Qwen2MoeSparseMoeBlock`), its class's full name, or its own qualified name."""
    cls = type(module)
    return bool({cls.__name__, f"{cls.__module__}.{cls.__qualname__}", name} & set(leaf_modules))


def attach(leaf: nn.Module) -> None:
    """Gathers `leaf`'s parameters on entry (before the user's hooks, which may read them) and
    releases them on exit, also when its forward raises."""
    entries: list = []  # per entry (a module may be called inside itself): what it stashed
    leaf.register_forward_pre_hook(functools.partial(_enter, entries), prepend=True)
    leaf.register_forward_hook(functools.partial(_leave, entries), always_call=True)


def leaf_weight(module: nn.Module, name: str) -> torch.Tensor | None:
    """The weight a leaf module entered gathered for `module.<name>`, or None outside one."""
    return module._zpp.leaf_weights.get(name)


def _members(leaf: nn.Module) -> list[tuple[nn.Module, str]]:
    """The sharded parameters of `leaf` and its submodules, as (holder, name), in module order."""
    return [(holder, name) for _, holder in leaf.named_modules(remove_duplicate=False)
            for name in sharded_names(holder)]


def _enter(entries: list, leaf: nn.Module, _args: Any) -> None:
    gathered: dict[int, torch.Tensor] = {}  # by parameter: a weight tied within the leaf is gathered once
    stashed = []
    for holder, name in _members(leaf):
        shard = holder._parameters[name]
        # Already gathered by an enclosing leaf, or not a shard (a layer compiled once holds its weights).
        if name in holder._zpp.leaf_weights or not isinstance(shard, DTensor):
            continue
        if id(shard) not in gathered:
            gathered[id(shard)] = gather_shard(holder, name)
        stashed.append((holder, name, id(shard)))
    weights = dict(zip(gathered, _Together.apply(*gathered.values()))) if gathered else {}
    for holder, name, key in stashed:
        holder._zpp.leaf_weights[name] = weights[key]
    smallest = None  # the cheapest weight to pass a zero gradient to
    for weight in weights.values():
        if smallest is None or weight.numel() < smallest.numel():
            smallest = weight
    entries.append((stashed, smallest))


def _leave(entries: list, leaf: nn.Module, _args: Any, output: Any) -> Any:
    stashed, smallest = entries.pop()
    for holder, name, _ in stashed:
        del holder._zpp.leaf_weights[name]
    if smallest is None or not smallest.requires_grad:
        return None
    return _depending_on(output, smallest)


def _depending_on(output: Any, weight: torch.Tensor) -> Any:
    """`output` with its first tensor that requires grad made to pass a zero gradient to `weight`,
    so that backward reaches the leaf's gathers (and reduces) on every rank, used or not."""
    if isinstance(output, torch.Tensor):
        return _ZeroGradTo.apply(output, weight) if output.requires_grad else None
    if isinstance(output, (tuple, list)):
        for index, item in enumerate(output):
            replaced = _depending_on(item, weight)
            if replaced is not None:
                items = list(output)
                items[index] = replaced
                return type(output)(items) if type(output) in (tuple, list) else output.__class__(*items)
        return None
    if isinstance(output, dict):
        for key, item in output.items():
            replaced = _depending_on(item, weight)
            if replaced is not None:
                output[key] = replaced
                return output
    return None


class _Together(torch.autograd.Function):
    """The weights as they are in forward; in backward one node hands every weight its gradient
    (zeros where forward did not use it) at once, so their reductions run on every rank, in
    gather order."""

    @staticmethod
    def forward(ctx, *weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(w.view_as(w) for w in weights)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return grads


class _ZeroGradTo(torch.autograd.Function):
    """`output` as it is; in backward, besides its gradient, a zero gradient for `weight`."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.weight_shape, ctx.weight_dtype = weight.shape, weight.dtype
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, grad.new_zeros(ctx.weight_shape, dtype=ctx.weight_dtype)

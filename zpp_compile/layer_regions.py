"""Config.compile_layers_once: each layer's compute traced and compiled once for every identical
layer, its parameters gathered in the step's graph.

A layer's forward becomes two nested compile regions (`torch.compiler.nested_compile_region`):
one that gathers its parameters, which the backend copies back into the step's graph (where
bucketing, reshard after forward and the schedule act on each gather), and one that runs the
layer's own forward with the gathered weights in place of its shards, which stays one region
shared by identical layers.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
import torch.nn as nn

from .grad_sync import gather_local_shard, local_shard
from .module_state import sharded_names
from .torch_compat import regions_reuse_traces, reparametrize_module


def compile_layers_once(layers: Iterable[nn.Module]) -> None:
    """Gives each layer a forward that gathers the layer's parameters, then runs the layer's own
    forward with them through `_layer_compute`, one compile region for every identical layer."""
    region_classes: dict[tuple[type, tuple], type] = {}
    for layer in layers:
        # By path: a region reused for another layer reaches that layer's modules from it.
        holders = tuple((path, names) for path, module in layer.named_modules() if (names := sharded_names(module)))
        if not holders:
            continue
        cls = type(layer)
        if (cls, holders) not in region_classes:
            # The class keeps its name, which transformers and wrap policies match layers by.
            body = {"forward": _gather_then_compute, "_zpp_compute": cls.forward, "_zpp_region_holders": holders}
            region_classes[cls, holders] = type(cls.__name__, (cls,), body)
        layer.__class__ = region_classes[cls, holders]


# Identical layers whose forwards read different constants (an HF layer's layer_idx) get a trace
# each; torch's default cap on a region's traces (8) would stop deeper models with an error.
_REGION_TRACES = 1024


def _compile_region(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` as a nested compile region, with room for a trace per layer; `fn` itself on torch
    versions without region reuse, where Config refuses compile_layers_once (so this module still
    imports there)."""
    if not regions_reuse_traces():
        return fn
    return torch.compiler.nested_compile_region(max_reuse_entries=_REGION_TRACES)(fn)


def _gather_then_compute(layer: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A layer's forward under Config.compile_layers_once: its parameters are gathered in one
    compile region, which the backend puts back into the step's graph (where bucketing, reshard
    after forward and the schedule act on them), and its compute runs in another, which stays a
    region shared by identical layers."""
    shards = [local_shard(module, name) for module, names in _holders(layer) for name in names]
    weights = _gather_layer(layer, *shards)
    layout, values = _flatten_call(args, kwargs)
    return _layer_compute(layer, len(args), layout, *weights, *values)


def _holders(layer: nn.Module) -> tuple[tuple[nn.Module, tuple[str, ...]], ...]:
    """The modules of `layer` that hold shards, each with its sharded parameters' names."""
    return tuple((layer.get_submodule(path), names) for path, names in type(layer)._zpp_region_holders)


@_compile_region
def _gather_layer(layer: nn.Module, *shards: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`layer`'s parameters gathered from this rank's parts of their shards (plain tensors, which
    any torch's regions take), in `_holders` order. A region only so that Dynamo traces the gathers
    once for identical layers; the backend inlines it (`backend._inline_gathers`)."""
    names = [(module, name) for module, module_names in _holders(layer) for name in module_names]
    return tuple(gather_local_shard(module, name, local) for (module, name), local in zip(names, shards))


def _flatten_call(args: tuple, kwargs: dict[str, Any]) -> tuple[str, list[Any]]:
    """The layer's arguments as one list of values (a tuple argument's items in its place) and a
    string that puts them back (`_unflatten_call`): Dynamo compares a region's tensors and
    constants at each call directly, where any container costs it a traced pytree flatten."""
    keys, values = [], []
    for key, value in (*enumerate(args), *kwargs.items()):
        if type(value) is tuple:
            keys.append(f"{key}*{len(value)}")
            values.extend(value)
        else:
            keys.append(str(key))
            values.append(value)
    return ",".join(keys), values


def _unflatten_call(positional: int, layout: str, values: tuple) -> tuple[tuple, dict[str, Any]]:
    """The arguments `_flatten_call` gave as `layout` and `values`; the first `positional` are positional."""
    items, at = [], 0
    for key in layout.split(",") if layout else ():
        name, _, count = key.partition("*")
        if count:
            items.append((name, tuple(values[at:at + int(count)])))
            at += int(count)
        else:
            items.append((name, values[at]))
            at += 1
    return tuple(value for _, value in items[:positional]), dict(items[positional:])


@_compile_region
def _layer_compute(layer: nn.Module, positional: int, layout: str, *values: Any) -> Any:
    """`layer`'s own forward: `values` are its gathered weights (`_gather_layer`), in place of its
    shards, then its arguments (`_flatten_call`).

    A pure function of its tensors, so that Dynamo traces it for the first layer and reuses that
    trace for every identical one (it refuses reuse for a region with side effects, such as
    setting the weights on the modules): the weights are swapped in and back by
    `torch_compat.reparametrize_module` (torch.func.functional_call's, which Dynamo knows to restore; the
    public function would call the layer's hooks a second time), and the modules' gathering
    properties return them. Run eagerly it is a plain call."""
    holders = _holders(layer)
    count = sum(len(names) for _, names in holders)
    args, kwargs = _unflatten_call(positional, layout, values[count:])
    return _compute_with(layer, holders, values[:count], args, kwargs)


def _compute_with(
    layer: nn.Module, holders: tuple[tuple[nn.Module, tuple[str, ...]], ...], weights: tuple[torch.Tensor, ...],
    args: tuple, kwargs: dict,
) -> Any:
    """`layer`'s own forward with each module of `holders` holding its next `weights` in place of
    its shards. One module per `reparametrize_module`: Dynamo disregards the swap of the
    `_parameters` of the module it is given, not of that module's children."""
    if not holders:
        return type(layer)._zpp_compute(layer, *args, **kwargs)
    (module, names), rest = holders[0], holders[1:]
    with reparametrize_module(module, dict(zip(names, weights))):
        return _compute_with(layer, rest, weights[len(names):], args, kwargs)

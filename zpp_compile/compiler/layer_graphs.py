"""Config.compile_layers_once: each layer compiled as a graph of its own, once for every identical layer.

torch.compile traces a frame into a graph until it meets a function it must not trace
(`torch.compiler.disable(..., recursive=False)`); that function runs as Python, and the frames it
calls are traced and compiled as frames of their own. Each layer's class becomes a subclass whose
forward is such a function, calling the class's own forward: the step's graph breaks at every
layer, and Dynamo compiles the layer's forward, whose code identical layers share, for the first
layer and runs that compiled code for every other one (their parameters are the graph's inputs,
checked by guards, not constants in it). zeropp's backend compiles a layer's graph as any other:
the gathers of the layer's parameters in its forward, their reductions in its backward, every
pass on both. Compile time then no longer grows with depth, as with FSDP2's compile per block.
Layers whose forwards read something that differs by layer (an HF model's KV cache, while
`use_cache` is on in training) trace apart, each into a graph of its own; zeropp warns of it.

The communication report counts a layer's graph once for every layer that ran it last: the
forward makes its layer the running one (`runtime.layer_scope`) while it runs, and the compiled
graph records which layer ran it (`record_layer_run`; this module keeps the records).
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn as nn

from ..runtime.job import warn_for_the_job
from ..runtime.layer_scope import running, running_layer
from ..sharding.module_state import HeldShards, held_shards, layer_identity, mark_layer
from ..torch_compat import frame_recompile_limit, run_frames_as_python

if TYPE_CHECKING:
    from ..reports.dump import GraphDump


def compile_layers_once(layers: dict[str, nn.Module], sharding_id: int) -> None:
    """Gives each of `layers` (by qualified name) a forward that torch.compile compiles as a graph
    of its own, shared by identical layers."""
    subclasses: dict[type, type] = {}
    for name, layer in layers.items():
        if next(layer.parameters(), None) is None:
            continue  # nothing to gather: a graph break there would only split the step's graph
        cls = type(layer)
        if cls not in subclasses:
            # The class keeps its name, which transformers and wrap policies match layers by.
            subclasses[cls] = type(cls.__name__, (cls,), {"forward": _compiled_on_its_own(cls.forward)})
        layer.__class__ = subclasses[cls]
        mark_layer(layer, (sharding_id, name))


# Identical layers whose forwards read different constants (an HF layer's layer_idx) get a graph
# each; torch's default cap on a frame's compilations (8) would run deeper models' layers eagerly.
_LAYER_GRAPHS_PER_FRAME = 1024


def tie_across_graphs(model: nn.Module, layers: tuple[str, ...]) -> None:
    """Marks every parameter that several modules outside `layers` hold (an embedding tied to the
    output head) to be gathered at its first read in a forward and held for the others."""
    in_layers = {id(member) for layer in layers for member in model.get_submodule(layer).modules()}
    holders: dict[int, list[tuple[HeldShards, str]]] = {}
    for module in model.modules():
        held = held_shards(module)
        if held is None:
            continue
        held.tied = {}
        if id(module) in in_layers:
            continue
        for name in held.layouts:
            holders.setdefault(id(module._parameters[name]), []).append((held, name))
    for key, tied in holders.items():
        if len(tied) > 1:
            for held, name in tied:
                held.tied[name] = key


def _compiled_on_its_own(forward: Callable[..., Any]) -> Callable[..., Any]:
    """A layer's forward that the caller's graph does not trace: `forward`, compiled by
    torch.compile as a frame of its own when the caller is being compiled, run as it is otherwise."""

    raised_cap = frame_recompile_limit(_LAYER_GRAPHS_PER_FRAME)  # made once, not at every layer call (host time)

    def run_layer(layer: nn.Module, *args: Any, **kwargs: Any) -> Any:
        with running(layer_identity(layer)), raised_cap:
            return forward(layer, *args, **kwargs)

    # Dynamo would otherwise check at every layer call, anew, that this frame is not to be compiled.
    run_frames_as_python(run_layer)
    return torch.compiler.disable(run_layer, recursive=False)


# The graph id each layer (sharding id, qualified name) ran last in training: this module's own,
# written by `record_layer_run` and `forget_model` alone.
_RAN_LAST: dict[tuple[int, str], str] = {}


def record_layer_run(compiled: Callable[..., Any], graph_id: str, dump: GraphDump | None) -> Callable[..., Any]:
    """`compiled`, a layer's graph, recording on each training call which layer ran it (the report
    counts a graph once per layer whose latest training run it was; an evaluation under no_grad
    runs a graph of its own, which is not part of a training step), and writing the counts to
    `dump` when they change."""

    def run(*args: Any) -> Any:
        layer = running_layer()
        if layer is not None and torch.is_grad_enabled() and _RAN_LAST.get(layer) != graph_id:
            _RAN_LAST[layer] = graph_id
            _warn_if_layers_trace_apart(layer[0])
            if dump is not None:
                dump.write_layer_runs(layer_runs())
        return compiled(*args)

    return run


# More graphs than this among one model's layers: its layers trace apart (a first layer whose input
# needs no gradient, and two kinds of layers alternating, as local and global attention, stay below).
_LAYER_GRAPHS_EXPECTED = 4


def _warn_if_layers_trace_apart(sharding_id: int) -> None:
    """Warns as one model's layers come to run one graph more than `_LAYER_GRAPHS_EXPECTED`: their
    forwards read something that differs by layer, so compile time grows with depth."""
    layers = list(graphs_run_by(sharding_id).values())
    if len(set(layers)) == _LAYER_GRAPHS_EXPECTED + 1:
        warn_for_the_job(
            f"zeropp: Config.compile_layers_once has compiled {_LAYER_GRAPHS_EXPECTED + 1} graphs for "
            f"{len(layers)} layers: the layers' forwards read something that differs from layer to layer (a "
            "number, a flag, a cache), which Dynamo compiles as a constant, so compile time grows with depth. "
            "An HF model left with use_cache on hands every layer a KV cache, which each updates at its own "
            "index: set `model.config.use_cache = False` for training. TORCH_LOGS=recompiles names what differs",
            stacklevel=2)


def layer_runs() -> dict[str, int]:
    """How many layers ran each layer's graph last, by graph id."""
    return dict(Counter(_RAN_LAST.values()))


def graphs_run_by(sharding_id: int) -> dict[str, str]:
    """The graph id each layer of the model `sharding_id` ran last, by the layer's qualified name."""
    return {name: graph for (owner, name), graph in _RAN_LAST.items() if owner == sharding_id}


def forget_model(sharding_id: int) -> None:
    """Forgets which graphs a gone model's layers ran (`shard` gives its sharding id to a new one)."""
    for layer in [layer for layer in _RAN_LAST if layer[0] == sharding_id]:
        del _RAN_LAST[layer]

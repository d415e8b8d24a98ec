"""When reading `module.weight` gathers it: inside the sharded model's forward; elsewhere it is the shard.

Outside forward, a sharded model's parameters behave as FSDP2's: `module.weight` is the sharded
parameter (a DTensor of the original shape), the object the optimizer holds. Reading its shape,
dtype, values or `.grad` communicates nothing, and writing to it in place (`nn.init.*`, `.data`,
`mul_` under `no_grad`) changes the shards, so the next forward computes with the new values.
Inside forward each read gathers the weight, which is what the compute needs.

"Inside forward" is counted per sharded model (`ForwardScope`): by hooks on the model given to
`shard`, and by the forward of every module holding shards, so that a submodule called on its own
(`model.lm_head(h)`) gathers too. Backward counts as inside when run eagerly: an activation
checkpoint recomputes its forward there, outside any module's call.

Traced by Dynamo, every read gathers, as the traced code is the forward; the modules' forwards
then count nothing, since a compile region with a side effect (a counter changed) is not reused
for identical layers. The root's hooks still count under Dynamo, so that code Dynamo hands back
to Python (a frame it skips, a function marked `torch.compiler.disable`) is counted as eager
code is.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.nn as nn

from ..torch_compat import in_autograd_backward


class ForwardScope:
    """How many forwards of one sharded model are running now, and the tied weights they gathered."""

    def __init__(self) -> None:
        self.depth = 0
        # Compiled with Config.compile_layers_once: the weights of parameters tied across graphs,
        # gathered at their first read in this forward (`layer_graphs.tie_across_graphs`).
        self.tied_weights: dict[int, torch.Tensor] = {}

    def enter(self, *_: Any) -> None:
        if self.depth == 0:  # leave() cleared them, unless a forward ended without it: never hold a stale weight
            self.tied_weights.clear()
        self.depth += 1

    def leave(self, *_: Any) -> None:
        self.depth -= 1
        if self.depth == 0:
            self.tied_weights.clear()

    def gathers(self) -> bool:
        """Whether a parameter read now gathers the weight (else it is the shard)."""
        return torch.compiler.is_compiling() or self.depth > 0 or in_autograd_backward()


def attach_to_model(model: nn.Module, scope: ForwardScope) -> None:
    """Counts `model`'s forward in `scope`, around every other hook of the model's (so that a
    hook of the user's reading a weight gathers it), also when forward raises."""
    model.register_forward_pre_hook(scope.enter, prepend=True)
    model.register_forward_hook(scope.leave, always_call=True)


def counting_forward(forward: Callable[..., Any]) -> Callable[..., Any]:
    """`forward` of a module holding shards, counted in the module's scope (`module_state.HeldShards`) when run
    eagerly. Keeps `forward`'s signature for `inspect` (HF's Trainer picks dataset columns by it)."""

    @functools.wraps(forward)
    def counted(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return forward(self, *args, **kwargs)
        scope = self._zpp.scope
        scope.depth += 1
        try:
            return forward(self, *args, **kwargs)
        finally:
            scope.depth -= 1

    # Dynamo keeps compiled code, and caps how often it compiles it, per code object: a module
    # that torch.compile meets as a frame of its own (called from code it does not trace, as
    # between layers compiled on their own) gets a cap of its own, not one shared by every class.
    counted.__code__ = counted.__code__.replace(co_name=f"counted_{forward.__qualname__.replace('.', '_')}")
    return counted



"""What zeropp keeps on each module that holds shards: one `HeldShards` object, `module._zpp`; and
on each layer compiled as a graph of its own (Config.compile_layers_once), which layer it is,
`module._zpp_layer` (`mark_layer`, `layer_identity`). Nothing else of zeropp's sits on a module.

The gathering properties of such a module (`sharding._gathering_class`) read it at every use of
a parameter, eager or traced by Dynamo; what they read is kept in plain dicts and tuples, which
Dynamo reads at a fraction of the cost of an object's attributes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from .forward_scope import ForwardScope

# The class `shard` gives a module holding shards is named this, then the module's own class name.
SHARDED_CLASS_PREFIX = "Sharded"


def class_name(module: nn.Module) -> str:
    """The name of `module`'s class as the user wrote it (a sharded module's less the prefix)."""
    return type(module).__name__.removeprefix(SHARDED_CLASS_PREFIX)


# What gathering a parameter reads (`ParamLayout.gather_args`): its element count and shape, then
# the arguments of `zpp::all_gather_param` after the shard (shard_size, group_size, group_name,
# dtype, reduce_dtype, sharding_id).
GatherArgs = tuple[int, tuple[int, ...], int, int, str, torch.dtype, torch.dtype, int]


@dataclass(frozen=True)
class ParamLayout:
    """How one parameter is sharded and gathered back."""

    shape: torch.Size  # the original shape
    shard_size: int  # elements per rank after padding: ceil(rows / world) * row size
    group_size: int
    group_name: str
    dtype: torch.dtype  # compute dtype of the gathered weight
    reduce_dtype: torch.dtype
    sharding_id: int
    index: int  # the parameter's place among the model's (tied ones share one), equal on every rank

    @property
    def gather_args(self) -> GatherArgs:
        """What gathering the parameter reads, as `parameter_reads.gather_shard` takes it."""
        return (self.shape.numel(), tuple(self.shape), self.shard_size, self.group_size, self.group_name, self.dtype,
                self.reduce_dtype, self.sharding_id)


@dataclass(eq=False)
class HeldShards:
    """The sharded parameters of one module and what reading them needs."""

    sharding_id: int
    scope: ForwardScope  # the model's forwards running now (a read inside one gathers)
    layouts: dict[str, ParamLayout]  # by parameter name
    # parameter_reads.GradAccumulator by parameter name, while set_requires_gradient_sync has kept gradients.
    accumulators: dict[str, Any] = field(default_factory=dict)
    # Inside a leaf module (Config.leaf_modules): the weights it gathered on entry, by parameter name.
    leaf_weights: dict[str, torch.Tensor] | None = None
    # Config.compile_layers_once: the parameters this module shares with another module outside
    # the layers, by name, each with the key its weight is held under in a forward (`ForwardScope`).
    tied: dict[str, int] = field(default_factory=dict)
    gather_args: dict[str, GatherArgs] = field(init=False)

    def __post_init__(self) -> None:
        self.set_layouts(self.layouts)

    def set_layouts(self, layouts: dict[str, ParamLayout]) -> None:
        self.layouts = layouts
        self.gather_args = {name: layout.gather_args for name, layout in layouts.items()}


def held_shards(module: nn.Module) -> HeldShards | None:
    """What zeropp keeps on `module`; None for a module that holds no shards."""
    return module.__dict__.get("_zpp")


def mark_layer(module: nn.Module, layer: tuple[int, str]) -> None:
    """Records on `module` that it is `layer` (sharding id, qualified name) of its model."""
    module.__dict__["_zpp_layer"] = layer


def layer_identity(module: nn.Module) -> tuple[int, str]:
    """The layer `mark_layer` made `module`."""
    return module.__dict__["_zpp_layer"]


def sharded_names(module: nn.Module) -> tuple[str, ...]:
    """The names of `module`'s own sharded parameters (none for a module that holds no shards)."""
    held = held_shards(module)
    return tuple(held.layouts) if held is not None else ()

"""The sharding state: what `shard` decided, kept for the sharded models' lifetime (`REGISTRY`).

It remembers the process groups built for each topology (creating them is a collective and, on
NCCL, costly), which modules and parameters were sharded and with what settings, the module
classes that gather their parameters and those of the modules above them, the shards still
waiting for their initial values, and the accumulators of gradients kept while gradient sync is
off (found by key from inside compiled backward graphs).

The rest of zeropp's process-wide state lives with the code that changes it ([Note: state
owners] in docs/internals.md): the ledger (`zpp_compile.reports.ledger`), graph ids (`zpp_compile.compiler.backend`),
agreed schedules (`runtime.agreement`), the running layer (`runtime.layer_scope`) and what each
layer ran (`zpp_compile.compiler.layer_graphs`), the prefetch's predictions (`runtime.prefetch`), the
deferred reductions (`runtime.deferred_reductions`), the CUDA graphs' watch (`runtime.cuda_graphs`)
and the passes' traces (`passes.fx_util`).
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass, field
from typing import Any

from torch.utils.weak import WeakIdKeyDictionary

from .topology import Topology


@dataclass(frozen=True)
class ShardingState:
    """What `shard` decided for one model: its settings and where its ranks sit."""

    config: Any  # zpp_compile.Config
    topology: Topology
    padded_numel: int  # elements of its distinct parameters, padded to equal shards (the paper's M / 2)
    layers: tuple[str, ...]  # qualified names of its layers (buckets sized "layer" never span two)
    layer_nbytes: int  # gathered bytes of its largest layer (what Config.bucket_size="layer" means)


@dataclass
class Registry:
    topologies: dict[tuple, Topology] = field(default_factory=dict)  # by (default group, its settings)
    states: list[ShardingState] = field(default_factory=list)  # indexed by sharding id
    models: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)
    params: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)  # shard -> state
    gathering_classes: dict[tuple[type, frozenset[str], bool], type] = field(default_factory=dict)
    container_classes: dict[type, type] = field(default_factory=dict)  # modules holding no shard of their own
    # Shards and buffers allocated but not yet given values (NaN until then), by tensor -> state:
    # what to_empty() after shard left, or meta modules shard() had no init for.
    unset: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)
    # sharding.parameter_reads.GradAccumulator by key: what `zpp::add_kept_grad` takes the kept gradient from.
    accumulators: weakref.WeakValueDictionary = field(default_factory=weakref.WeakValueDictionary)
    accumulator_keys: itertools.count = field(default_factory=itertools.count)

    def add_state(self, state: ShardingState) -> int:
        """Registers the state of one `shard` call; returns its sharding id."""
        self.states.append(state)
        return len(self.states) - 1

    def sharding_id(self, model: Any) -> int:
        """The sharding id of `model`, a model given to `shard` (its state's index)."""
        return next(i for i, state in enumerate(self.states) if state is self.models[model])

    def state_of(self, model: Any) -> ShardingState | None:
        """The state of `model`: a model given to `shard`, or a module holding the shards of one
        (a PEFT wrapper around it, the model PEFT's `merge_and_unload` returns); None for a
        module holding no shards or those of several models."""
        if model in self.models:
            return self.models[model]
        states = {id(state): state for p in model.parameters() if (state := self.params.get(p)) is not None}
        return next(iter(states.values())) if len(states) == 1 else None

    def reusable_id(self, state: ShardingState) -> int | None:
        """The sharding id of a state equal to `state` whose model is gone, if there is one."""
        live = {id(known) for known in self.models.values()}
        return next((i for i, known in enumerate(self.states) if known == state and id(known) not in live), None)


REGISTRY = Registry()

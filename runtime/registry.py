"""The runtime registry: the process-wide mutable state of zeropp, kept explicit, in three parts.

`REGISTRY` (sharding state) remembers what `shard` decided and what outlives a single call for
the sharded models: the process groups built for each topology (creating them is a collective
and, on NCCL, costly), which modules and parameters were sharded and with what settings, the
module classes that gather their parameters and those of the modules above them, the shards
still waiting for their initial values, and the accumulators of gradients kept while gradient
sync is off (found by key from inside compiled backward graphs).

`COMPILATION` (compile state) remembers what compiling left: the collectives each compiled graph
issues (the communication ledger), the graph ids, the parameter gathers that every rank agreed
on (runtime.agreement), which layer ran which of the graphs compiled per layer, the thread that
watches Config.cuda_graphs' calls, and the passes' traced helper functions (reused by every
identical layer), which are kept with the fake mode of the compilation they serve and so go with
it (and with `torch.compiler.reset()`).

`PREFETCH` and `DEFERRED` (run state) remember, for the layer graphs of Config.compile_layers_once,
which weight gather followed which in the previous step and the one issued ahead of its call
(runtime.prefetch), and the gradient reductions whose ends wait for the next backward graph
(runtime.deferred_reductions).
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch.utils.weak import WeakIdKeyDictionary

from .topology import Topology

if TYPE_CHECKING:
    from ..ledger import GraphComm


@dataclass(frozen=True)
class ShardingState:
    """What `shard` decided for one model: its settings and where its ranks sit."""

    config: Any  # zpp_compile.Config
    topology: Topology
    padded_numel: int  # elements of its distinct parameters, padded to equal shards (the paper's M / 2)
    layers: tuple[str, ...]  # qualified names of its layers (buckets sized "layer" never span two)
    layer_nbytes: int  # gathered bytes of its largest layer (what Config.bucket_size="layer" means)


@dataclass
class CompilationRegistry:
    ledger: list[GraphComm] = field(default_factory=list)  # in compile order
    graph_ids: itertools.count = field(default_factory=itertools.count)
    cuda_graph_watch: Any = None  # runtime.cuda_graphs.CallWatch, made by the first graphed compilation
    # passes.fx_util.insert_traced's traces by call, by the fake mode of the compilation they serve.
    traces: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)
    agreed_schedules: set[tuple[frozenset[int], str]] = field(default_factory=set)  # (sharding ids, digest)
    # Config.compile_layers_once (zpp_compile.layer_graphs): the layer (sharding id, qualified name)
    # whose own graph runs or compiles now, and the graph id each layer ran last.
    running_layer: tuple[int, str] | None = None
    layer_graphs: dict[tuple[int, str], str] = field(default_factory=dict)

    def forget_model(self, sharding_id: int) -> None:
        """Takes a gone model's graphs out of the ledger (a new model that takes its sharding id
        would otherwise count them twice in its report)."""
        self.ledger[:] = [g for g in self.ledger if g.model is None or g.model.sharding_id != sharding_id]
        self.layer_graphs = {layer: graph for layer, graph in self.layer_graphs.items() if layer[0] != sharding_id}


@dataclass
class Registry:
    topologies: dict[tuple, Topology] = field(default_factory=dict)
    states: list[ShardingState] = field(default_factory=list)  # indexed by sharding id
    models: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)
    params: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)  # shard -> state
    gathering_classes: dict[tuple[type, frozenset[str], bool], type] = field(default_factory=dict)
    container_classes: dict[type, type] = field(default_factory=dict)  # modules holding no shard of their own
    # Shards and buffers allocated but not yet given values (NaN until then), by tensor -> state:
    # what to_empty() after shard left, or meta modules shard() had no init for.
    unset: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)
    # zpp_compile.grad_sync.GradAccumulator by key: what `zpp::add_kept_grad` takes the kept gradient from.
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


@dataclass
class PrefetchState:
    """What `runtime.prefetch` knows of the calls of `zpp::gather_prefetched`: the gather issued
    ahead (`prefetch.Issued`), the latest call, the call that followed each one in the previous
    step (with the memory of its shards), each shard a layer's forward read (weakly) with that
    layer, by memory, and each shard's parameter."""

    pending: Any = None
    previous: Any = None
    first: Any = None  # the first call since the sequence last started
    successors: dict[Any, tuple[Any, tuple]] = field(default_factory=dict)
    shards: dict[tuple, tuple[weakref.ref, tuple[int, str]]] = field(default_factory=dict)
    parameters: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)  # shard -> its parameter, weakly
    hits: int = 0  # calls that took a gather issued ahead
    misses: int = 0  # calls that gathered themselves
    dropped: int = 0  # gathers issued ahead for a call that did not come

    def reset(self) -> None:
        self.__dict__.update(vars(PrefetchState()))


@dataclass
class DeferredState:
    """What `runtime.deferred_reductions` holds: the reductions whose ends have not run yet (in
    issue order), the placeholder gradients they handed out (by id, with the reduction and its
    result's index), and the end callback of each backward pass that issued some (by graph task
    id, weakly: autograd holds it while the pass runs)."""

    unfinished: list[Any] = field(default_factory=list)
    placeholders: dict[int, tuple[Any, Any, int]] = field(default_factory=dict)
    backward_ends: dict[int, weakref.ref] = field(default_factory=dict)
    deferred: int = 0  # gradients set on their parameters when their reduction finished
    finished: int = 0  # reductions finished


REGISTRY = Registry()
COMPILATION = CompilationRegistry()
PREFETCH = PrefetchState()
DEFERRED = DeferredState()

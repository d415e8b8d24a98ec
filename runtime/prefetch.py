"""`zpp::gather_prefetched`: a layer graph's first weight gather, issued while the layer before computes.

A layer compiled as a graph of its own (Config.compile_layers_once) can start its first gather
only when it is called, after the previous layer's compute, so nothing hides that gather. This op
holds the gather's program (the casts, copies and quantization that build the buffer the ranks
exchange, compiled by Inductor as the graph's own code would have been: `runtime/programs.py`),
issues the collective on what the program computes, and does so one call ahead: when a graph
calls it, it issues the call that followed this one in the previous step, on the shards that call
read, so the collective runs on the network library's stream while this layer computes; the next
call takes the result.

A call is known by what is the same on every rank: the layer (`layer_graphs.running`; in backward,
the layer whose forward read the same shards), the program, and whether autograd's backward runs
it. A prediction is only a head start: a call takes a prefetched result only if it is that call
on the very shards it was issued for, their parameters unwritten since (their versions); anything
else (a layer skipped, the order changed, a weight written) drops it and gathers afresh, so a
wrong guess costs a gather, never a value. Predictions stay within the model whose layer is
running, whose shards are alive on every rank alike, so every rank issues the same collectives in
the same order. The sequence starts again at each step (a forward after backward, or its first
call again): a gather issued at a step's end would read weights the optimizer has yet to write.
One layer's gathered weights more are alive at a time, as with FSDP2's prefetch.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..torch_compat import (
    C10D_FUNCTIONAL,
    cuda_graph_unsafe_tags,
    dtensor_parts,
    in_autograd_backward,
    viewed_tensor,
    write_count,
)
from .collectives import issue_all_gather
from .layer_scope import running_layer
from .programs import run_program
from .registry import REGISTRY


class PrefetchCounts(NamedTuple):
    """Calls of `zpp::gather_prefetched` since the process began (`counts()`)."""

    hits: int = 0  # calls that took a gather issued ahead
    misses: int = 0  # calls that gathered themselves
    dropped: int = 0  # gathers issued ahead for a call that did not come


@dataclass
class PrefetchState:
    """What this module knows of the calls of `zpp::gather_prefetched`: the gather issued
    ahead (`prefetch.Issued`), the latest call, the call that followed each one in the previous
    step (with the memory of its shards), each shard a layer's forward read (weakly) with that
    layer, by memory, and each shard's parameter."""

    pending: Any = None
    previous: Any = None
    first: Any = None  # the first call since the sequence last started
    successors: dict[Any, tuple[Any, tuple]] = field(default_factory=dict)
    shards: dict[tuple, tuple[weakref.ref, tuple[int, str]]] = field(default_factory=dict)
    parameters: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)  # shard -> its parameter, weakly
    counts: PrefetchCounts = PrefetchCounts()  # not reset with the rest: totals of the process

    def reset(self) -> None:
        self.__dict__.update({**vars(PrefetchState()), "counts": self.counts})

    def count(self, **added: int) -> None:
        self.counts = self.counts._replace(**{key: getattr(self.counts, key) + n for key, n in added.items()})


_STATE = PrefetchState()  # this module's own: nothing else writes it


class Gather(NamedTuple):
    """What a call computes: `program` (an FX graph's source) on its inputs, all-gathered over
    `group_name` of `group_size` ranks; `compiled`: the program runs as Inductor's code."""

    program: str
    group_size: int
    group_name: str
    compiled: bool

    def issue(self, inputs: list[torch.Tensor]) -> torch.Tensor:
        """The gather, issued (its result valid after its wait)."""
        return issue_all_gather(run_program(self.program, inputs, self.compiled), self.group_size, self.group_name)


class GatherCall(NamedTuple):
    """A call of the op, as every rank knows it."""

    layer: tuple[int, str]  # (sharding id, qualified name)
    gather: Gather
    in_backward: bool
    grad_enabled: bool  # an evaluation's calls (under no_grad) are a sequence of their own


class Issued(NamedTuple):
    """A gather issued ahead: for which call, on the shards at which memory, at which parameter
    versions, and its result (valid after its wait)."""

    call: GatherCall
    memory: tuple
    versions: tuple[int, ...]
    result: torch.Tensor


def _memory(t: torch.Tensor) -> tuple:
    """Where a shard is: a compiled step reads it through tensors made for each call (views in
    forward, `local_shards`; saved copies of those in backward), which share it. Tensors that
    agree here read the same elements."""
    return (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device)


@torch.library.custom_op("zpp::gather_prefetched", mutates_args=(), tags=cuda_graph_unsafe_tags())
def gather_prefetched(inputs: list[torch.Tensor], program: str, gathered_numel: int, dtype: torch.dtype,
                      backward: bool, group_size: int, group_name: str, compiled: bool) -> torch.Tensor:
    """The all-gather over `group_name` of what `program` (an FX graph's source) computes from
    `inputs`, `gathered_numel` elements of `dtype`: taken from the gather issued ahead where that
    was this very call, else issued now; then the call that followed this one in the previous step
    is issued ahead. `backward`: the graph is a backward graph; `compiled`: the program runs as
    Inductor's code (else as FX's Python)."""
    memory = tuple(map(_memory, inputs))
    gather = Gather(program, group_size, group_name, compiled)
    call = _identify(inputs, memory, gather, backward or in_autograd_backward())
    pending, _STATE.pending = _STATE.pending, None
    if (pending is not None and (pending.call, pending.memory) == (call, memory)
            and pending.versions == _read_shards(memory)[1]):
        issued = pending.result
        _STATE.count(hits=1)
    else:
        if pending is not None:
            C10D_FUNCTIONAL.wait_tensor(pending.result)  # a wrong guess, issued on every rank: its buffer can go
            _STATE.count(dropped=1)
        issued = gather.issue(inputs)
        _STATE.count(misses=1)
    if call is not None:
        _issue_following(call)
    return C10D_FUNCTIONAL.wait_tensor(issued)


def _identify(inputs: list[torch.Tensor], memory: tuple, gather: Gather, in_backward: bool) -> GatherCall | None:
    """This call as every rank knows it, with what it read remembered for the next step's
    predictions; None for a call that reads something else than known shards (hpZ's copies,
    made each step), which ends the sequence a prediction follows."""
    running = running_layer()
    if running is not None:  # a layer's forward (or its recompute in backward) reads the layer's own shards
        for key, t in zip(memory, inputs):
            shard = viewed_tensor(t)
            known = _STATE.shards.get(key)
            if (known is None or known[0]() is not shard or known[1] != running) and _memory(shard) == key:
                _STATE.shards[key] = (weakref.ref(shard), running)
    layers = {_read_at(key)[1] for key in memory}
    layer = layers.pop() if len(layers) == 1 else None
    previous, _STATE.previous = _STATE.previous, None
    if layer is None:
        return None
    call = GatherCall(layer, gather, in_backward, torch.is_grad_enabled())
    # The sequence starts again at a forward after backward, and where its first call comes again
    # (the next step, where no gather of copies in backward ended it): a gather issued at the end
    # of a step would be of weights the optimizer has not yet updated.
    if previous is None or call == _STATE.first or (previous.in_backward and not in_backward):
        _STATE.first = call
    else:
        _STATE.successors[previous] = (call, memory)
    _STATE.previous = call
    return call


def _read_at(key: tuple) -> tuple[torch.Tensor, tuple[int, str]] | tuple[None, None]:
    """The shard a layer's forward read at `key`, and that layer, if the shard is alive and still there."""
    ref, layer = _STATE.shards.get(key, (lambda: None, None))
    shard = ref()
    return (shard, layer) if shard is not None and _memory(shard) == key else (None, None)


def _read_shards(memory: tuple) -> tuple[list[torch.Tensor], tuple[int, ...] | None]:
    """The shards a layer's forward read at `memory` and the versions of their parameters: what a
    write to a parameter (the optimizer's, or any other in place) changes; no versions where a
    shard is gone, moved, or no parameter's. The shard's own version does not change, as DTensor
    writes it below autograd."""
    shards, versions = [], []
    for key in memory:
        shard, _ = _read_at(key)
        if shard is None:
            return shards, None
        parameter = _parameter_of(shard)
        if parameter is None:
            for param in list(REGISTRY.params.keys()):  # a shard not seen yet (or made anew): index them again
                _STATE.parameters[dtensor_parts(param)[0]] = weakref.ref(param)
            parameter = _parameter_of(shard)
        if parameter is None:
            return shards, None
        shards.append(shard)
        versions.append(write_count(parameter))
    return shards, tuple(versions)


def _parameter_of(shard: torch.Tensor) -> torch.Tensor | None:
    """The parameter `shard` is the local shard of, as last indexed, if it still is."""
    ref = _STATE.parameters.get(shard)
    parameter = ref() if ref is not None else None
    return parameter if parameter is not None and dtensor_parts(parameter)[0] is shard else None


def _issue_following(call: GatherCall) -> None:
    """Issues the call that followed `call` in the previous step, if it reads shards of the same
    model (alive, then, on every rank)."""
    following, memory = _STATE.successors.get(call, (None, ()))
    if following is None or following.layer[0] != call.layer[0]:
        return
    shards, versions = _read_shards(memory)
    if versions is not None:
        _STATE.pending = Issued(following, memory, versions, following.gather.issue(shards))


def forget_calls() -> None:
    """Forgets every call (`shard` does, on every rank: a new model may take a gone one's sharding
    id and memory), waiting for a gather issued ahead."""
    if _STATE.pending is not None:
        C10D_FUNCTIONAL.wait_tensor(_STATE.pending.result)
    _STATE.reset()


def counts() -> PrefetchCounts:
    """The calls of `zpp::gather_prefetched` so far in this process: taken from a gather issued
    ahead, gathered by themselves, and the gathers issued ahead for nothing."""
    return _STATE.counts


@gather_prefetched.register_fake
def _(inputs, program, gathered_numel, dtype, backward, group_size, group_name, compiled):
    return inputs[0].new_empty(gathered_numel, dtype=dtype)


GATHER_PREFETCHED = torch.ops.zpp.gather_prefetched.default  # as graphs call it

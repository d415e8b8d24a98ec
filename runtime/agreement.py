"""Ranks about to issue different collectives, stopped with an error that says where.

Collectives must come in the same order, with the same shapes, on every rank. When they do not (a
branch that only one rank takes, one rank calling `full_state_dict` while another trains), gloo
aborts the process and NCCL hangs or mixes up data, neither naming the cause. Two checks come
first, each over a gloo group of its own (`Topology.agreement`), so that a rank busy elsewhere can
only make them time out, never pair with one of the model's collectives:

- each graph Dynamo hands the backend is compared across ranks before it is compiled: the
  parameters it gathers, in order, with each gather's size, dtypes and group, whether it needs the
  gradient (so backward reduces it), and the compile options that differ from the model's. Once per
  compilation, nothing per step, and the same with Inductor's caches warm or cold (they serve the
  compiled graph, never Dynamo's). A graph this rank has compared before for the same sharded model
  passes at once: a rank that recompiles on its own (for a new input shape, say) does not wait for
  ranks that are not compiling;
- `full_state_dict`, `save_checkpoint` and `load_checkpoint`, collective calls, check at every call
  that every rank is making it; a rank kept waiting there warns after a grace period which ranks
  have not arrived (`_Arrivals`), then waits on until the timeout;
- run eagerly, every parameter gather first compares which parameter each rank gathers (two
  integers per rank), so that a data-dependent branch raises on every rank instead of gloo
  aborting, NCCL hanging, or two parameters of one shape silently mixing. Compiled graphs do
  not pay this: their gathers were compared before they were compiled.
"""

from __future__ import annotations

import hashlib
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.distributed as dist
import torch.fx as fx

from ..torch_compat import EXAMPLE_VALUE, default_store
from .ops import gather_param_args, param_gathers
from .topology import Topology, one_process_world

# How long a collective call (check_same_call) waits for the other ranks before it warns which have
# not arrived: this, or a quarter of Config.collective_timeout_s if that is less. The usual cause,
# `if rank == 0: zpp.full_state_dict(model)`, would otherwise be silent for the whole timeout (600 s
# by default). A peer may be slow for good reasons (compiling a graph the others had cached, a
# longer step), so the call only warns and raises at the timeout as before. 30 s is well past the
# skew of ranks in step with each other, and early against the default timeout; the quarter keeps
# the warning well ahead of the error under a timeout made short.
_GRACE_S = 30.0

# The gather schedules this process's ranks agreed on, as (sharding ids, digest): this module's own.
_AGREED: set[tuple[frozenset[int], str]] = set()


class RankMismatchError(RuntimeError):
    """Ranks are about to issue different collectives (or some never arrived); the message says
    what each rank was doing and where their collectives first differ."""


def check_same_gathers(gm: fx.GraphModule, topology: Topology, options: Mapping[str, Any], graph_name: str) -> None:
    """Raises RankMismatchError on every rank if the ranks are compiling Dynamo graphs that would
    issue different collectives (see `gather_schedule`), `options` being the fields of this
    compilation's Config that differ from the sharded model's (`Config.compiled_apart_from`); a
    schedule this rank has compared before for the same sharded model passes at once."""
    schedule, sharding_ids = gather_schedule(gm, topology, options)
    digest = hashlib.sha256("\n".join(schedule).encode()).hexdigest()
    if topology.world_size == 1 or (sharding_ids, digest) in _AGREED:
        return
    gathers = len(schedule) - bool(options)
    _agree(topology, f"compiled graph {graph_name} ({gathers} parameter gather{'s' * (gathers != 1)})",
           digest, schedule)
    _AGREED.add((sharding_ids, digest))


def gather_schedule(
    gm: fx.GraphModule, topology: Topology, options: Mapping[str, Any]
) -> tuple[tuple[str, ...], frozenset[int]]:
    """What decides a Dynamo graph's collectives, in words equal across ranks exactly when the
    collectives match: `options` (compile options that differ from the sharded model's Config),
    then each parameter gather in order (groups by role: their names differ between nodes); and
    the sharding ids of the models gathered from."""
    roles = {topology.world.name: "world", topology.intra_node.name: "intra-node",
             topology.inter_node.name: "inter-node"}
    if topology.secondary is not None:
        roles[topology.secondary.name] = "hpZ secondary"
    schedule = [f"compile options {dict(sorted(options.items()))}"] if options else []
    sharding_ids = set()
    for node in param_gathers(gm.graph):
        args = gather_param_args(node)
        value = args.shard.meta.get(EXAMPLE_VALUE)
        reduced = torch.is_grad_enabled() and value is not None and value.requires_grad
        gradient = f", gradient reduced in {_name(args.reduce_dtype)}" if reduced else ", no gradient"
        schedule.append(f"{_parameter(args.shard)}: {_name(args.dtype)} gather of {args.shard_size} elements per "
                        f"rank over the {roles.get(str(args.group_name), 'other')} group ({args.group_size} ranks)"
                        f"{gradient}")
        sharding_ids.add(args.sharding_id)
    return tuple(schedule), frozenset(sharding_ids)


def check_same_eager_gather(topology: Topology, sharding_id: int, index: int, what: str) -> None:
    """Raises RankMismatchError on every rank unless every rank is about to gather parameter
    `index` of sharding `sharding_id` now (`what` names it, for the message)."""
    if topology.world_size > 1:
        digest = hashlib.sha256(f"gather {sharding_id} {index}".encode()).hexdigest()
        _agree(topology, f"is gathering {what}", digest, (what,), in_thread=False, advice=(
            "a module whose use of its weights depends on the data (a mixture of experts skipping experts no token "
            "chose, a branch on the input) belongs in Config.leaf_modules, which gathers its parameters together on "
            "entry; "))


def check_same_call(topology: Topology, call: str) -> None:
    """Raises RankMismatchError unless every rank is making the collective call `call` now. A rank
    left waiting warns, after a grace period (`_GRACE_S`), which ranks have not arrived."""
    if topology.world_size > 1:
        with _Arrivals.entering(topology, call) as arrivals:
            _agree(topology, f"called {call}", hashlib.sha256(call.encode()).hexdigest(), (call,), arrivals=arrivals)


@dataclass
class _Arrivals:
    """Which ranks are inside `check_same_call` now: one counter per rank in the default store
    (`torch_compat.default_store`), to which a rank adds 1 on entering and -1 on leaving, so a
    waiting rank reads every rank whose counter is 0 as missing. A rank's key serves each of its
    calls (world-size keys however long the run), and its value says where the rank is, not how
    many calls it made: a call that failed on some ranks leaves nothing to misalign the later ones.
    No rank leaves a call before the last one enters it (the digests' all-gather), so a counter at
    1 is a rank in this very call (or one that died in it). Two store round trips per call, only
    for the explicit collective calls, never per gather or step."""

    call: str
    rank: int
    keys: list[str]
    store: dist.Store
    grace_s: float
    since: float

    @classmethod
    @contextmanager
    def entering(cls, topology: Topology, call: str) -> Iterator[_Arrivals | None]:
        """This rank counted in `call` for as long as the context lasts; None where no store records
        it (a dry run over torch's fake group, whose collectives never wait, or a store gone)."""
        if topology.agreement is None or one_process_world(topology.agreement):
            yield None
            return
        store = default_store()
        keys = [f"zeropp/in_collective_call/{topology.agreement.group_name}/{r}" for r in range(topology.world_size)]
        grace_s = min(_GRACE_S, topology.timeout_s / 4) if topology.timeout_s else _GRACE_S
        arrivals = cls(call, topology.rank, keys, store, grace_s, time.monotonic())
        if not arrivals._add(1):
            yield None
            return
        try:
            yield arrivals
        finally:
            arrivals._add(-1)

    def _add(self, amount: int) -> bool:
        try:
            self.store.add(self.keys[self.rank], amount)
        except RuntimeError:  # the store's server (rank 0's process) is gone; the exchange will say so
            return False
        return True

    def missing(self) -> list[int] | None:
        """The ranks not in the call now (None if the store cannot be asked). add(key, 0) reads a
        counter without blocking, where get() would wait for the key of a rank that never came."""
        try:
            return [r for r, key in enumerate(self.keys) if self.store.add(key, 0) <= 0]
        except RuntimeError:
            return None

    def warn_missing(self) -> None:
        """Warns that this rank has waited, naming the ranks that have not arrived."""
        missing = self.missing()
        if missing == []:  # the last one arrived just now: the exchange is ending
            return
        who = f"{_ranks(missing)}, which {'has' if len(missing) == 1 else 'have'} not called it yet" \
            if missing else "the other ranks"
        warnings.warn(
            f"zeropp: rank {self.rank} has waited {time.monotonic() - self.since:.0f} s in {self.call} for {who}. "
            f"{self.call} is a collective: call it on every rank (not only under `if rank == 0:`). A rank that is "
            "only slow (still compiling, finishing a step) ends this wait when it calls it; otherwise this rank "
            "raises zpp.RankMismatchError when Config.collective_timeout_s has passed",
            stacklevel=1)  # raised inside the collective call, at a depth that varies with the API called

    def never_arrived(self) -> str:
        """For the error at the timeout: which ranks never made the call."""
        missing = self.missing()
        if not missing:
            return ""
        return f"{_ranks(missing).capitalize()} never called {self.call}, a collective: call it on every rank. "


def _agree(topology: Topology, doing: str, digest: str, schedule: tuple[str, ...], *, in_thread: bool = True,
           advice: str = "", arrivals: _Arrivals | None = None) -> None:
    """Compares `digest` (of `schedule`) across ranks; on a difference every rank raises, with
    what each rank is `doing`, where the schedules part, and `advice`, in the message.

    Every check exchanges one fixed-size digest first, so that two different checks meeting on the
    group (one rank gathering eagerly while another calls `full_state_dict`) compare digests and
    raise, rather than exchange buffers of different sizes, which gloo aborts the process for."""
    mine = torch.frombuffer(bytearray(bytes.fromhex(digest)), dtype=torch.uint8)
    digests = [torch.empty_like(mine) for _ in range(topology.world_size)]

    def exchange() -> None:
        dist.all_gather(digests, mine, group=topology.agreement)

    if in_thread:
        _in_thread(exchange, topology, doing, arrivals)
    else:
        _reraising_timeout(exchange, topology, doing)
    if any(not torch.equal(theirs, mine) for theirs in digests):
        # Every rank got the same digests, so every rank is here: what each does follows, for the message.
        everyone = _all_gather(topology, (doing, schedule), doing)
        raise RankMismatchError(_mismatch(topology.rank, [bytes(d.tolist()).hex() for d in digests], everyone, advice))


def _all_gather(topology: Topology, value: Any, doing: str) -> list[Any]:
    """Every rank's `value`, over the agreement group (`_in_thread`)."""
    gathered: list[Any] = [None] * topology.world_size
    _in_thread(lambda: dist.all_gather_object(gathered, value, group=topology.agreement), topology, doing)
    return gathered


def _in_thread(exchange: Callable[[], None], topology: Topology, doing: str, arrivals: _Arrivals | None = None) -> None:
    """Runs `exchange` in a thread of its own, outside the compiling thread's dispatch state: under a
    fake tensor mode or the Python dispatcher (which compilation may have on) a gloo collective waits
    for gloo's worker thread while holding the GIL, which the worker may need to free the previous
    collective's tensors (a deadlock). With `arrivals`, a wait past their grace period warns."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="zeropp-agreement") as pool:
        future = pool.submit(exchange)
        _reraising_timeout(lambda: _result(future, arrivals), topology, doing, arrivals)


def _result(future: Future, arrivals: _Arrivals | None) -> None:
    """The exchange's end; with `arrivals`, one warning if it has not ended within their grace period."""
    if arrivals is not None:
        try:
            return future.result(timeout=arrivals.grace_s)
        except FutureTimeoutError:
            arrivals.warn_missing()
    return future.result()


def _reraising_timeout(exchange: Callable[[], None], topology: Topology, doing: str,
                       arrivals: _Arrivals | None = None) -> None:
    """Runs `exchange`; the group's timeout or a peer gone becomes a RankMismatchError saying what this
    rank was `doing` (and, with `arrivals`, which ranks never made the call)."""
    try:
        exchange()
    except RuntimeError as error:  # the group's timeout (Config.collective_timeout_s), or a peer gone
        raise RankMismatchError(
            f"zeropp compares the collectives of what each rank does next across ranks, and rank "
            f"{topology.rank} ({doing}) waited in vain for the others: they are running other collectives "
            "(a graph compiled on some ranks only, or zpp.full_state_dict called on some ranks only), hung past "
            f"Config.collective_timeout_s, or died. {arrivals.never_arrived() if arrivals else ''}"
            f"Backend error: {error}"
        ) from error


def _mismatch(rank: int, digests: list[str], everyone: list[tuple[str, tuple[str, ...]]], advice: str) -> str:
    """What each group of ranks was doing, and where the first differing group's schedule parts
    from rank 0's."""
    groups: dict[str, list[int]] = {}
    for r, digest in enumerate(digests):
        groups.setdefault(digest, []).append(r)
    ranks = list(groups.values())
    doing = "; ".join(f"{_ranks(g)} {everyone[g[0]][0]}" for g in ranks[:4])
    first, other = everyone[ranks[0][0]][1], everyone[ranks[1][0]][1]
    index = next((i for i, (a, b) in enumerate(zip(first, other)) if a != b), min(len(first), len(other)))
    at = lambda schedule: schedule[index] if index < len(schedule) else "nothing (its schedule ends)"  # noqa: E731
    return (
        f"zeropp: the ranks are about to issue different collectives, which would hang or abort the backend: "
        f"{doing}. First difference: {_ranks(ranks[0])} {at(first)}; {_ranks(ranks[1])} {at(other)}. "
        "Every rank must gather the same parameters in the same order and make the same collective calls: "
        f"{advice}look for a branch that depends on the rank or on data only some ranks see (e.g. "
        "`if dist.get_rank() == 0:` around a layer), and call zpp.full_state_dict on every rank. "
        f"(This is rank {rank}.)"
    )


def _parameter(node: fx.Node) -> str:
    """The graph input a gathered shard comes from (Dynamo names it after the parameter)."""
    while node.op not in ("placeholder", "get_attr") and node.all_input_nodes:
        node = node.all_input_nodes[0]
    return node.name


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[:8]}{'...' if len(ranks) > 8 else ''}"

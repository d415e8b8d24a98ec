"""Runs a test function on N ranks, one process each, like torchrun would.

CPU runs use gloo. With ZPP_TEST_BACKEND=nccl (the GPU machine) each rank uses NCCL and GPU
`rank`, so the same tests run on both.

Starting a rank costs seconds (importing torch, Inductor and the model libraries), more than many
tests' work, so two things spare it. CPU ranks are forked from one server process that imported all
of that once (multiprocessing's forkserver), not started as new interpreters; GPU ranks are (a CUDA
runtime that an import in the server touched would not work after the fork). And the ranks of one
call stay up for the next call of the same world size: each call then starts from what a new
process would see (Dynamo's graphs and the communication ledger forgotten, the default random
generators reseeded). A call made under other environment variables than the server's starts new
interpreters (what is read at start, such as PYTHONHASHSEED, must take effect); a call that fails,
times out or waits only for some ranks, or asks for `fresh` processes (a test of what a new process
does), ends its ranks.

A rank that dies in native code (a segmentation fault in torch, gloo or a compiled kernel) writes
where it was to a file of its own (faulthandler). The call then runs once more on new processes:
a crash that comes back fails the test with both reports; one that does not is listed at the end
of the session (`NATIVE_CRASHES`, printed by conftest.py) with the stack it died on, so a crash is
never passed over in silence, and a rare one in a library does not fail a run whose checks pass.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import gc
import itertools
import os
import queue
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import zpp_compile as zpp
from zpp_compile.runtime import programs

BACKEND = os.environ.get("ZPP_TEST_BACKEND", "gloo")
# The test now running if it is not marked distributed (set by conftest.py), which may not start ranks.
UNMARKED_TEST: str | None = None


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if BACKEND == "nccl" else torch.device("cpu")


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 600,
              reporting: Iterable[int] | None = None, fresh: bool = False) -> list[Any]:
    """fn(rank, world_size, *args) on every rank; returns the ranks' results in rank order.

    A rank that raises fails the test with its traceback; ranks that do not finish within
    `timeout_s` are killed and the test fails. With `reporting`, only those ranks' results are
    awaited and returned (in rank order); the others (a rank made to die or hang) are then killed.
    With `fresh`, the ranks are new processes, ended after the call.
    """
    if UNMARKED_TEST is not None:
        raise AssertionError(f"{UNMARKED_TEST} starts ranks: mark it @pytest.mark.distributed (or its module, "
                             "pytestmark = pytest.mark.distributed), so that the fast tier leaves it out")
    awaited = sorted(set(range(world_size) if reporting is None else reporting))
    keep = reporting is None and not fresh
    ranks = _RANKS.take(world_size) if keep else _Ranks(world_size)
    outcome, crashes = _call(ranks, fn, args, awaited, timeout_s, keep)
    if crashes and reporting is None:  # a rank made to die is awaited by no one: `reporting` names the others
        first = _crash_report(fn, crashes)
        outcome, crashes = _call(_Ranks(world_size), fn, args, awaited, timeout_s, keep)
        if crashes:
            raise AssertionError(f"{first}\nand again on new processes:\n{_crash_report(fn, crashes)}")
        NATIVE_CRASHES.append(f"{os.environ.get('PYTEST_CURRENT_TEST', fn.__name__)}: {first}\n"
                              "(passed when run again on new processes)")
    errors = [f"rank {r}:\n{v}" for r, (s, v) in sorted(outcome.items()) if s == "error"]
    if errors:
        raise AssertionError("\n".join(errors))
    if set(awaited) - outcome.keys():
        raise AssertionError(f"ranks {sorted(set(awaited) - outcome.keys())} did not finish in {timeout_s}s")
    return [outcome[r][1] for r in awaited]


# The signals of a crash in native code (faulthandler's); a rank the harness kills gets SIGKILL.
_NATIVE_CRASH_SIGNALS = {signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL, signal.SIGABRT}
# Native crashes of ranks whose call passed when run again (`run_ranks`), for the session's summary.
NATIVE_CRASHES: list[str] = []


def _call(ranks: _Ranks, fn: Callable[..., Any], args: tuple, awaited: list[int], timeout_s: float,
          keep: bool) -> tuple[dict[int, tuple[str, Any]], dict[int, str]]:
    """One call on `ranks`, which are kept for the next call if `keep` and all went well, else ended:
    the outcome (`_Ranks.call`) and the native crashes of ranks that died during it (`_Ranks.crashes`)."""
    outcome = ranks.call(fn, args, awaited, timeout_s)
    failed = bool(set(awaited) - outcome.keys()) or any(status == "error" for status, _ in outcome.values())
    if keep and not failed:
        _RANKS.give_back(ranks)
        return outcome, {}
    ranks.end(answered=outcome.keys())
    return outcome, ranks.crashes()


def _crash_report(fn: Callable[..., Any], crashes: dict[int, str]) -> str:
    return "\n".join(f"rank {rank} died in native code while running {fn.__name__}:\n{where}"
                     for rank, where in sorted(crashes.items()))


def _crashing_thread(report: str) -> str:
    """Of a faulthandler report, the fatal error's line and the stack of the thread that raised it
    (the other threads' stacks are mostly idle pools)."""
    lines = report.splitlines()
    fatal = next((line for line in lines if line.startswith("Fatal Python error")), "a fatal error")
    start = next((i for i, line in enumerate(lines) if line.startswith("Current thread")), None)
    if start is None:
        return report.strip()
    end = next((i for i in range(start + 1, len(lines)) if not lines[i].startswith(" ")), len(lines))
    return "\n".join([fatal, *lines[start:end]])


class _Ranks:
    """`world_size` processes in one process group, each running the calls sent to it."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.environ = _environ()  # what the ranks read at start
        context = mp.get_context("forkserver" if forks_ranks() else "spawn")
        self.results = context.Queue()
        self.calls = [context.Queue() for _ in range(world_size)]
        self.call_ids = itertools.count()
        port = _free_port()
        self.crash_folder = tempfile.mkdtemp(prefix="zpp-test-ranks-")
        self._crashes: dict[int, str] = {}
        self.procs = [
            context.Process(target=_rank_main, args=(rank, world_size, port, self.calls[rank], self.results,
                                                     self.crash_file(rank)),
                            daemon=True)
            for rank in range(world_size)
        ]
        for p in self.procs:
            p.start()

    def call(self, fn: Callable[..., Any], args: tuple, awaited: list[int],
             timeout_s: float) -> dict[int, tuple[str, Any]]:
        """Runs fn on every rank; {rank: ("ok", result) or ("error", traceback)} for the awaited ranks
        that finished, up to the first error."""
        call_id = next(self.call_ids)
        for calls in self.calls:
            calls.put((call_id, fn, args))
        outcome: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout_s
        while not set(awaited) <= outcome.keys() and time.monotonic() < deadline:
            try:
                answered_id, rank, status, value = self.results.get(timeout=min(1.0, timeout_s))
            except queue.Empty:
                if any(not self.procs[r].is_alive() for r in set(awaited) - outcome.keys()):
                    break  # a rank died without answering (killed, or in native code): none will
                continue
            if answered_id in (call_id, None):  # None: the rank failed to join the group
                outcome[rank] = (status, value)
                if status == "error":
                    break
        return outcome

    def end(self, answered: Iterable[int]) -> None:
        """Stops the ranks: asked to, and killed unless they answered the last call and stop soon."""
        for calls in self.calls:
            calls.put(None)
        answered = set(answered)
        died = {}  # rank: the signal that ended it before it was asked to stop
        for rank, p in enumerate(self.procs):
            if not p.is_alive() and p.exitcode is not None and -p.exitcode in _NATIVE_CRASH_SIGNALS:
                died[rank] = signal.Signals(-p.exitcode).name
            p.join(timeout=30 if rank in answered else 1)
            if p.is_alive():
                p.kill()
                p.join()
        self._crashes = {}
        for rank in range(self.world_size):
            report = ""
            with contextlib.suppress(FileNotFoundError), open(self.crash_file(rank)) as f:
                report = f.read()
            if report.strip():
                self._crashes[rank] = _crashing_thread(report)
            elif rank in died:
                self._crashes[rank] = f"killed by {died[rank]} (faulthandler wrote nothing: its handler was replaced)"
        shutil.rmtree(self.crash_folder, ignore_errors=True)

    def crash_file(self, rank: int) -> str:
        """Where rank `rank`'s faulthandler writes if it dies in native code."""
        return os.path.join(self.crash_folder, f"rank{rank}.crash")

    def crashes(self) -> dict[int, str]:
        """Rank: where it died (`_crashing_thread`), for the ranks that died in native code (read by `end`)."""
        return self._crashes


class _KeptRanks:
    """The ranks kept between calls: a group per world size, so that tests alternating between
    world sizes do not start new ranks each time (idle ranks wait on their queues, using no CPU)."""

    def __init__(self) -> None:
        self.kept: dict[int, _Ranks] = {}
        atexit.register(self.end)

    def take(self, world_size: int) -> _Ranks:
        ranks = self.kept.pop(world_size, None)
        if ranks is not None and ranks.environ == _environ() and all(p.is_alive() for p in ranks.procs):
            return ranks
        if ranks is not None:
            ranks.end(answered=range(world_size))
        return _Ranks(world_size)

    def give_back(self, ranks: _Ranks) -> None:
        self.kept[ranks.world_size] = ranks

    def end(self) -> None:
        while self.kept:
            ranks = self.kept.popitem()[1]
            ranks.end(answered=range(ranks.world_size))


_RANKS = _KeptRanks()


def optimizer_steps(opt: torch.optim.Optimizer, step_fn: Callable[..., torch.Tensor], data: list,
                    rows: slice) -> list[torch.Tensor]:
    """One step of `opt` per (tokens, targets) batch of `data`, on this rank's `rows` of it; the losses."""
    losses = []
    for tokens, targets in data:
        loss = step_fn(tokens[rows].to(device()), targets[rows].to(device()))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def spread(calls: list[tuple], processes: int = 2) -> list[Any]:
    """fn(*args) for each (fn, *args) of `calls`, in order, the calls shared among the kept test
    ranks of `processes` processes (each takes every `processes`-th): single-process work, such as
    the Triton interpreter's, which runs on one core, then keeps every core busy. GPU runs make
    the calls here, one after another (they are quick there, and a GPU rank starts slowly)."""
    if BACKEND == "nccl":
        return [fn(*args) for fn, *args in calls]
    shares = run_ranks(_share, processes, calls)
    results: list[Any] = [None] * len(calls)
    for rank, share in enumerate(shares):
        results[rank::processes] = share
    return results


def _share(rank: int, world_size: int, calls: list[tuple]) -> list[Any]:
    return [fn(*args) for fn, *args in calls[rank::world_size]]


def in_turn(rank: int, world_size: int, calls: list[tuple] | dict[str, tuple]) -> list[Any] | dict[str, Any]:
    """fn(rank, world_size, *args) for each (fn, *args) of `calls` in turn, on one spawned group:
    several checks pay for one process start. Before each, Dynamo forgets the previous call's
    graphs and the ledger its collectives (what comm_report and secondary_copy_bytes read).

    `calls` is a list, or a dict of scenarios by name (then the results are too). A call that
    raises ends the group; the error names its scenario, which every test reading it shows."""
    named = calls if isinstance(calls, dict) else {f"call {i} ({c[0].__name__})": c for i, c in enumerate(calls)}
    results = {}
    for name, (fn, *args) in named.items():
        _forget_compiled()
        start = time.perf_counter()
        try:
            results[name] = fn(rank, world_size, *args)
        except Exception as error:
            raise ScenarioFailed(f"scenario {name!r} failed on rank {rank}") from error
        if rank == 0 and os.environ.get("ZPP_TEST_SCENARIO_SECONDS"):  # where a test's time goes (pytest -s)
            print(f"scenario {name!r}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    return results if isinstance(calls, dict) else list(results.values())


class ScenarioFailed(Exception):
    """One of `in_turn`'s scenarios raised (the cause, chained, says what)."""


def for_each_config(rank: int, world_size: int, fn: Callable[..., Any], configs: list[Any]) -> list[Any]:
    """fn(rank, world_size, config) for each config, in turn on one spawned group (`in_turn`)."""
    return in_turn(rank, world_size, [(fn, config) for config in configs])


def _rank_main(rank, world_size, port, calls, results, crash_file) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
    )
    # A rank that dies in native code says where, in its file (`_Ranks.crashes`); the file stays
    # open for the process's life, as faulthandler needs. Installed again before every call: torch's
    # elastic error handler (its `record`, which some tested code runs) points faulthandler elsewhere,
    # and a library's own handler of the crash signals may replace it.
    crash_report = open(crash_file, "w")
    faulthandler.enable(file=crash_report, all_threads=True)
    # What the rank starts with (torch, Inductor, the model libraries) lives as long as the rank.
    # Put out of the collector's reach, it is not walked again by every full collection
    # (zpp_compile.shard makes one, Python others as the heap grows): those walk only what the
    # tests made since.
    gc.freeze()
    torch.set_num_threads(1)
    if BACKEND == "nccl":
        torch.cuda.set_device(rank)
    try:
        dist.init_process_group(BACKEND, rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
    except BaseException:
        results.put((None, rank, "error", traceback.format_exc()))
        return
    seed = torch.initial_seed()
    while (call := calls.get()) is not None:
        call_id, fn, args = call
        faulthandler.disable()  # enable alone keeps whatever signal handler replaced faulthandler's
        faulthandler.enable(file=crash_report, all_threads=True)
        _forget_compiled()
        torch.manual_seed(seed)
        try:
            results.put((call_id, rank, "ok", fn(rank, world_size, *args)))
        except BaseException:  # report everything, including assertion failures, to the parent
            results.put((call_id, rank, "error", traceback.format_exc()))
    dist.destroy_process_group()


def _forget_compiled() -> None:
    """Dynamo forgets its graphs, zeropp the run-time programs Inductor compiled for them, and the
    ledger their collectives (what comm_report and secondary_copy_bytes read).

    Dynamo keeps each compiled function as a global of the module whose frame it compiled (for a
    sharded model, zpp_compile.sharding.forward_scope) past its reset: left there, every call's graphs and
    fake tensors would stay alive in a kept rank, and each later compile slows as the heap grows.
    Each is set to None, not deleted: Dynamo deletes the name itself once its code is collected."""
    torch.compiler.reset()
    programs.forget_compiled_programs()
    for module in list(sys.modules.values()):
        names = [name for name in getattr(module, "__dict__", {}) if name.startswith("__compiled_fn")]
        for name in names:
            setattr(module, name, None)
    zpp.reset_comm_report()


# Set by pytest for every test; by Inductor in any process that loads a compiled C++ module (a
# per-process address, which each rank sets for itself); by importing Lightning, which test modules
# do after this one is imported, and the server's preload does in every rank it forks: none says how
# a rank must start.
_NOT_STARTUP = ("PYTEST_CURRENT_TEST", "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR", "PYTORCH_NVML_BASED_CUDA_CHECK")


def _environ() -> dict[str, str]:
    """The environment variables a rank starts with, less those that change while tests run."""
    return {name: value for name, value in os.environ.items() if name not in _NOT_STARTUP}


def forks_ranks() -> bool:
    """Whether ranks started now are forked from the server (CPU ranks, under the environment it
    started with), not started as new interpreters."""
    return BACKEND == "gloo" and _environ() == _SERVER_ENVIRON


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What the forkserver imports once for every rank it forks: the harness (torch, zpp_compile's
# exports, which the package itself loads only at their first use, Inductor) and the model libraries
# that test modules import. It starts at the first rank, with the environment this module saw when
# imported (after conftest's settings).
SERVER_PRELOAD = ["distributed", "zpp_compile._api", "transformers", "transformers.models.llama.modeling_llama",
                  "peft", "lightning.fabric", "torchtitan.models.llama3"]
mp.set_forkserver_preload(SERVER_PRELOAD)
_SERVER_ENVIRON = _environ()

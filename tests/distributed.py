"""Runs a test function on N ranks, one process each, like torchrun would.

CPU runs use gloo. With ZPP_TEST_BACKEND=nccl (the GPU machine) each rank uses NCCL and GPU
`rank`, so the same tests run on both.
"""

from __future__ import annotations

import faulthandler
import os
import queue
import socket
import traceback
from datetime import timedelta
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import zpp_compile as zpp

BACKEND = os.environ.get("ZPP_TEST_BACKEND", "gloo")


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if BACKEND == "nccl" else torch.device("cpu")


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 600,
              reporting: Iterable[int] | None = None) -> list[Any]:
    """fn(rank, world_size, *args) on every rank; returns the ranks' results in rank order.

    A rank that raises fails the test with its traceback; ranks that do not finish within
    `timeout_s` are killed and the test fails. With `reporting`, only those ranks' results are
    awaited and returned (in rank order); the others (a rank made to die or hang) are then killed.
    """
    awaited = sorted(set(range(world_size) if reporting is None else reporting))
    context = mp.get_context("spawn")
    results = context.Queue()
    port = _free_port()
    procs = [
        context.Process(target=_rank_main, args=(fn, rank, world_size, port, results, args), daemon=True)
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    outcome: dict[int, tuple[str, Any]] = {}
    try:
        while not set(awaited) <= outcome.keys():
            rank, status, value = results.get(timeout=timeout_s)
            outcome[rank] = (status, value)
            if status == "error":
                break
    except queue.Empty:
        raise AssertionError(f"ranks {sorted(set(awaited) - set(outcome))} did not finish in {timeout_s}s")
    finally:
        for rank, p in enumerate(procs):
            p.join(timeout=30 if rank in outcome and set(awaited) <= outcome.keys() else 1)
            if p.is_alive():
                p.kill()
                p.join()
    errors = [f"rank {r}:\n{v}" for r, (s, v) in sorted(outcome.items()) if s == "error"]
    if errors:
        raise AssertionError("\n".join(errors))
    return [outcome[r][1] for r in awaited]


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


def in_turn(rank: int, world_size: int, calls: list[tuple]) -> list[Any]:
    """fn(rank, world_size, *args) for each (fn, *args) of `calls` in turn, on one spawned group:
    several checks pay for one process start. Before each, Dynamo forgets the previous call's
    graphs and the ledger its collectives (what comm_report and secondary_copy_bytes read)."""
    results = []
    for fn, *args in calls:
        torch.compiler.reset()
        zpp.reset_comm_report()
        results.append(fn(rank, world_size, *args))
    return results


def for_each_config(rank: int, world_size: int, fn: Callable[..., Any], configs: list[Any]) -> list[Any]:
    """fn(rank, world_size, config) for each config, in turn on one spawned group (`in_turn`)."""
    return in_turn(rank, world_size, [(fn, config) for config in configs])


def _rank_main(fn, rank, world_size, port, results, args) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
    )
    faulthandler.enable(all_threads=True)  # a rank that aborts in native code shows where, on stderr
    torch.set_num_threads(1)
    if BACKEND == "nccl":
        torch.cuda.set_device(rank)
    try:
        dist.init_process_group(BACKEND, rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
        results.put((rank, "ok", fn(rank, world_size, *args)))
    except BaseException:  # report everything, including assertion failures, to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

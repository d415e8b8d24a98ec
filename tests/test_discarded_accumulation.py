"""Gradients kept under `zpp.no_sync` go with `zero_grad`: a discarded accumulation window (a loop
that skips a step on a bad loss) never leaks into the next step, as in one process or under DDP.
Eager, compiled and with layers compiled once, against the unsharded model in float64."""

from __future__ import annotations

from typing import Callable

import pytest
import torch
import torch.nn as nn
from distributed import device, in_turn, run_ranks
from models import TinyTransformer, batches

import zpp_compile as zpp

PER_RANK = 2

# What the loop does between micro-batches: each entry a micro-batch's backward ("sync" or "keep",
# kept under no_sync) or a way of discarding the gradients so far.
DISCARDS: dict[str, Callable[[nn.Module, torch.optim.Optimizer], None]] = {
    "optimizer.zero_grad()": lambda model, opt: opt.zero_grad(),
    "optimizer.zero_grad(set_to_none=False)": lambda model, opt: opt.zero_grad(set_to_none=False),
    "model.zero_grad()": lambda model, opt: model.zero_grad(),
    "model.zero_grad(set_to_none=False)": lambda model, opt: model.zero_grad(set_to_none=False),
}
LOOPS = {
    "kept, then synced": ["keep", "sync"],
    "kept, discarded, synced": ["keep", "discard", "sync"],
    "kept, discarded inside the window, kept, synced": ["keep", "discard-inside", "keep", "sync"],
    "kept, synced, discarded, kept, synced": ["keep", "sync", "discard", "keep", "sync"],
}


def run_loop(model: nn.Module, step_fn: Callable, opt: torch.optim.Optimizer, loop: list[str], discard: Callable,
             data: list, rows: slice, sharded: bool) -> None:
    """Runs `loop`: one micro-batch of `data` per backward; no_sync windows only where `sharded`
    (the reference accumulates in .grad, which is what no_sync means in one process)."""
    batch = iter(data)
    window: list[str] = []

    def backward() -> None:
        tokens, targets = next(batch)
        step_fn(tokens[rows].to(device()), targets[rows].to(device())).backward()

    for action in loop:
        if action == "keep":
            window.append(action)
            if sharded:
                zpp.set_requires_gradient_sync(model, False)
            backward()
        elif action == "sync":
            if sharded:
                zpp.set_requires_gradient_sync(model, True)
            backward()
        else:  # inside a window the sync stays off; outside it was switched on again first
            if sharded and action == "discard":
                zpp.set_requires_gradient_sync(model, True)
            discard(model, opt)


def discarded_windows_run(rank: int, world_size: int, mode: str) -> None:
    """Every loop with every way of discarding, on one sharded model and one reference (no step
    is taken, so the weights stay; each loop starts with the gradients cleared)."""
    torch.manual_seed(0)
    model = zpp.shard(TinyTransformer().to(device()), zpp.Config(compile_layers_once=mode == "layers once"))
    step_fn = model if mode == "eager" else torch.compile(model, backend="zeropp", options={"inductor": False})
    torch.manual_seed(0)
    reference = TinyTransformer().double()
    rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    for loop_name, loop in LOOPS.items():
        for discard_name, discard in DISCARDS.items() if "discard" in " ".join(loop) else list(DISCARDS.items())[:1]:
            data = batches(len(loop), world_size, PER_RANK)
            for sharded, (net, step) in ((True, (model, step_fn)), (False, (reference, reference))):
                net.zero_grad()
                run_loop(net, step, torch.optim.SGD(net.parameters(), lr=0.1), loop, discard, data,
                         rows if sharded else slice(None), sharded)
            got = {name: p.grad.full_tensor() for name, p in model.named_parameters() if p.grad is not None}
            expected = {name: p.grad for name, p in reference.named_parameters() if p.grad is not None}
            where = f"{mode}, {loop_name}, {discard_name}"
            assert got.keys() == expected.keys(), f"{where}: {sorted(got.keys() ^ expected.keys())}"
            for name, value in expected.items():
                torch.testing.assert_close(got[name].cpu().double(), value, rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"{where}, {name}: {m}")


@pytest.mark.distributed
def test_zero_grad_drops_the_gradients_kept_under_no_sync():
    run_ranks(in_turn, 2, {mode: (discarded_windows_run, mode) for mode in ("eager", "compiled", "layers once")})

"""Errors and warnings that name the real cause: a module added after `shard` and run compiled (its
parameters named, not "call shard"), torch.compile's `mode` with CUDA graphs on a CPU model (run
without them, as Inductor does, rather than an error about a setting the user never made), and a
collective call made on one rank only (a warning naming the missing ranks long before the timeout)."""

from __future__ import annotations

import logging
import re
import time
import warnings

import pytest
import torch
import torch.nn as nn
from distributed import BACKEND, device, run_ranks

import zpp_compile as zpp

pytestmark = pytest.mark.distributed  # every test here starts processes


def compile_error(step, *args) -> str:
    """The error compiling and running `step(*args)` raised (Dynamo wraps the backend's), or ''."""
    try:
        step(*args)
    except Exception as error:
        return str(error)
    return ""


def added_after_shard_run(rank: int, world_size: int) -> dict[str, str]:
    """What the backend says about parameters shard() never saw, by scenario."""
    x = torch.randn(4, 32, device=device())
    messages = {}
    model = zpp.shard(nn.Sequential(nn.Linear(32, 32)).to(device()))
    model.adapter = nn.Linear(32, 32).to(device())  # a module attribute added after shard
    messages["attribute"] = compile_error(torch.compile(lambda t: model.adapter(model(t)), backend="zeropp",
                                                        options={"inductor": False}), x)
    model = zpp.shard(nn.Sequential(nn.Linear(32, 32)).to(device()))
    model.append(nn.Linear(32, 32).to(device()))  # a layer appended after shard
    messages["appended"] = compile_error(torch.compile(model, backend="zeropp", options={"inductor": False}), x)
    # Frozen, as the message advises, the added layer runs compiled as it does eagerly.
    model[1].requires_grad_(False)
    compiled = torch.compile(model, backend="zeropp", options={"inductor": False})(x).square().mean()
    torch.testing.assert_close(compiled, model(x).square().mean())
    compiled.backward()
    assert model[0].weight.grad is not None and model[1].weight.grad is None
    # A model never sharded keeps the message that says to shard it.
    messages["never sharded"] = compile_error(torch.compile(nn.Linear(32, 32).to(device()), backend="zeropp",
                                                            options={"inductor": False}), x)
    return messages


def test_parameters_added_after_shard_are_named_when_compiled():
    messages = run_ranks(added_after_shard_run, 1)[0]
    for scenario, name in (("attribute", "adapter.weight, adapter.bias"), ("appended", "1.weight, 1.bias")):
        message = messages[scenario]
        assert f"2 trainable parameter(s) read by this compiled step are not sharded: {name}." in message, message
        for advice in ("added after zpp_compile.shard", "Shard after adding them", "get_peft_model",
                       "requires_grad_(False)"):
            assert advice in message, (scenario, advice, message)
        assert "before torch.compile" not in message, message
    assert "call zpp_compile.shard(model, config) before torch.compile" in messages["never sharded"], messages


def mode_on_cpu_run(rank: int, world_size: int, mode: str) -> tuple[float, float, list[str]]:
    """The loss of a tiny model compiled with `mode` (its CUDA graphs skipped on CPU, with a log
    line), against the eager loss of the same model. (That the rest of a mode reaches Inductor,
    test_outside_forward checks.)"""
    torch.manual_seed(0)
    model = zpp.shard(nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)))
    x = torch.randn(8, 16)
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("zpp_compile.compiler.backend")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        compiled = torch.compile(model, backend="zeropp", mode=mode)(x).square().mean()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(logging.NOTSET)
    return compiled.item(), model(x).square().mean().item(), records


@pytest.mark.skipif(BACKEND != "gloo", reason="the model must be on CPU")
@pytest.mark.parametrize("mode", ["max-autotune", "reduce-overhead"])
def test_compile_mode_with_cuda_graphs_runs_without_them_on_cpu(mode):
    # On the CPU test ranks this model compiles as fast under max-autotune as under reduce-overhead
    # (measured with Inductor's caches off: about 1 s each once a rank is up).
    compiled, eager, records = run_ranks(mode_on_cpu_run, 1, mode)[0]
    assert compiled == pytest.approx(eager, rel=1e-6), (compiled, eager)
    assert any(f"mode={mode!r}: no CUDA graphs" in r and "['cpu']" in r for r in records), records


TIMEOUT_S = 5.0  # the warning comes after a quarter of it (agreement._GRACE_S, 30 s, being longer)


def one_rank_calls_full_state_dict(rank: int, world_size: int) -> tuple[list[tuple[float, str]], float, str]:
    """Rank 0 calls zpp.full_state_dict alone (rank 1 sleeps): the warnings it gives while it waits,
    with when, and when and how it fails."""
    model = zpp.shard(nn.Linear(8, 8).to(device()), zpp.Config(collective_timeout_s=TIMEOUT_S))
    if rank == 1:
        time.sleep(600)  # never arrives; the harness kills it
    seen: list[tuple[float, str]] = []
    start = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = lambda message, *_: seen.append((time.monotonic() - start, str(message)))
        with pytest.raises(zpp.RankMismatchError) as error:
            zpp.full_state_dict(model)
    return seen, time.monotonic() - start, str(error.value)


def test_a_collective_call_on_one_rank_warns_naming_the_missing_rank_before_the_timeout():
    seen, failed_after, message = run_ranks(one_rank_calls_full_state_dict, 2, timeout_s=60, reporting=[0])[0]
    assert len(seen) == 1, seen
    warned_after, warning = seen[0]
    assert TIMEOUT_S / 4 <= warned_after < TIMEOUT_S / 2, seen
    assert re.search(r"rank 0 has waited \d+ s in zpp.full_state_dict for rank 1, which has not called it yet",
                     warning), warning
    assert "call it on every rank" in warning, warning
    assert failed_after >= TIMEOUT_S - 0.5, failed_after
    assert "Rank 1 never called zpp.full_state_dict, a collective: call it on every rank" in message, message


def forgotten_backend(rank: int, world_size: int) -> list[str]:
    """torch.compile without backend="zeropp" (here torch's aot_eager, quick to compile, which keeps
    zeropp's gather as it is, as Inductor does): one warning, at the first step, naming the fix;
    none for an eager step or one compiled by zeropp."""
    from zpp_compile.runtime.ops import RUN_TIME_GATHERS

    RUN_TIME_GATHERS.warned = False  # a kept rank may have warned in an earlier test
    x = torch.randn(4, 8, device=device())
    messages = []
    for backend in (None, "zeropp", "aot_eager", "aot_eager"):
        model = zpp.shard(nn.Linear(8, 8).to(device()))
        step = model if backend is None else torch.compile(
            model, backend=backend, **({"options": {"inductor": False}} if backend == "zeropp" else {}))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step(x).sum().backward()
        messages.append(" | ".join(str(w.message) for w in caught if "another backend" in str(w.message)))
    return messages


@pytest.mark.distributed
def test_a_forgotten_backend_warns_once_with_the_fix():
    eager, zeropp, first, second = run_ranks(forgotten_backend, 1)[0]
    assert eager == zeropp == second == "", (eager, zeropp, second)
    assert "trains as plain ZeRO-3, with qwZ, hpZ and qgZ off" in first, first
    assert 'torch.compile(model, backend="zeropp")' in first, first


def wrapped_in_ddp(rank: int, world_size: int) -> tuple[str, bool, bool]:
    """What wrapping a sharded model in DDP says (accelerate's prepare and a plain HF Trainer do it),
    and whether zpp.is_sharded tells the sharded model from a plain one."""
    model = zpp.shard(nn.Sequential(nn.Linear(8, 8)).to(device()))
    sharded, plain = zpp.is_sharded(model), zpp.is_sharded(nn.Linear(8, 8))
    try:
        torch.nn.parallel.DistributedDataParallel(model)
    except zpp.ConfigError as error:
        return str(error), sharded, plain
    return "", sharded, plain


def test_a_sharded_model_wrapped_in_ddp_is_refused_with_the_fix():
    message, sharded, plain = run_ranks(wrapped_in_ddp, 2)[0]
    assert sharded and not plain
    assert "DistributedDataParallel is wrapping a model sharded by zpp.shard" in message
    assert "ZeroppTrainer instead of Trainer" in message

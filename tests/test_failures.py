"""Failure behaviour: dead and hanging ranks, configs and collectives that differ across ranks,
non-finite gradients under qgZ, out of memory while compiling, and wrong arguments to the public API."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import re
import time

import pytest
import torch
import torch.nn as nn
from distributed import BACKEND, SERVER_PRELOAD, device, forks_ranks, in_turn, run_ranks
from extras import needs

import zpp_compile as zpp
from zpp_compile.compiler.backend import zeropp_backend
from zpp_compile.passes import PASSES
from zpp_compile.reports.ledger import LEDGER

TIMEOUT_S = 4.0

nccl_aborts = pytest.mark.skipif(
    BACKEND == "nccl", reason="NCCL's watchdog aborts a rank whose collective times out instead of raising"
)


def step_with_failing_peer(rank: int, world_size: int, failure: str, compiled: bool) -> tuple[float, str]:
    """Rank 1 dies or hangs after sharding; rank 0 trains a step and reports how long it took to
    fail and with what message."""
    model = zpp.shard(nn.Linear(16, 16), zpp.Config(collective_timeout_s=TIMEOUT_S))
    step_fn = torch.compile(model, backend="zeropp", options={"inductor": False}) if compiled else model
    if rank == 1:
        if failure == "dies":
            os._exit(1)
        time.sleep(600)
    start = time.monotonic()
    with pytest.raises(Exception) as error:
        step_fn(torch.randn(4, 16)).sum().backward()
    return time.monotonic() - start, str(error.value)


@pytest.mark.distributed
@nccl_aborts
@pytest.mark.parametrize("failure", ["dies", "hangs"])
def test_failing_peer_makes_the_others_raise_within_the_timeout(failure):
    elapsed, message = run_ranks(step_with_failing_peer, 2, failure, False, timeout_s=120, reporting=[0])[0]
    assert elapsed < TIMEOUT_S + 10, elapsed
    # Run eagerly, each gather first checks that every rank gathers the same parameter.
    assert "rank 0 (is gathering Linear.weight (parameter 0, shape (16, 16))) waited in vain" in message, message
    assert "collective_timeout_s" in message
    if failure == "hangs":
        assert re.search("timed? ?out", message, re.IGNORECASE), message  # gloo's own words


@pytest.mark.distributed
@nccl_aborts
def test_hanging_peer_under_compile_raises_within_the_timeout():
    elapsed, message = run_ranks(step_with_failing_peer, 2, "hangs", True, timeout_s=120, reporting=[0])[0]
    assert elapsed < TIMEOUT_S + 60, elapsed  # includes compiling the step on a busy machine
    # Inside a compiled graph the error is gloo's own ("Timed out waiting 4000ms for send
    # operation", or "Application timeout caused pair closure"), without zeropp's op name.
    assert re.search("timed? ?out", message, re.IGNORECASE), message


class InjectInf(torch.autograd.Function):
    """Identity in forward; in backward, feature `index` of the gradient becomes +inf."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: int) -> torch.Tensor:
        ctx.index = index
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.index_fill(-1, torch.tensor([ctx.index], device=grad.device), float("inf")), None


class InfOnRank0(nn.Module):
    def __init__(self, rank: int) -> None:
        super().__init__()
        self.layer = nn.Linear(64, 64, bias=False)
        self.rank = rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.layer(x)
        return (InjectInf.apply(y, 5) if self.rank == 0 else y).square().mean()


def mismatch_and_nonfinite(rank: int, world_size: int) -> None:
    # Ranks must agree on the config and the model; each rank raises, naming what differs.
    with pytest.raises(zpp.ConfigError, match=r"quantized_weights: rank 0 False, rank 1 True"):
        zpp.shard(nn.Linear(4, 4), zpp.Config(quantized_weights=rank == 1))
    with pytest.raises(ValueError, match="different model on rank 1"):
        zpp.shard(nn.Linear(4, 4 + rank))

    # inf in one row of rank 0's weight gradient survives qgZ's INT4 reduction on every rank.
    torch.manual_seed(0)
    model = zpp.shard(InfOnRank0(rank).to(device()), zpp.Config(quantized_gradients=True, ranks_per_node=1))
    compiled = torch.compile(model, backend="zeropp", options={"inductor": False})
    compiled(torch.rand(8, 64, device=device()) + 0.5).backward()
    grad = model.layer._parameters["weight"].grad.full_tensor()
    assert not grad[5].isfinite().any(), grad[5]
    assert grad[32:].isfinite().all()  # other blocks stay finite
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    assert not torch.isfinite(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # a scaler skips


@pytest.mark.distributed
def test_mismatched_config_and_nonfinite_gradients():
    run_ranks(mismatch_and_nonfinite, 2)


class RankBranch(nn.Module):
    """Rank 0 applies one more layer than the others: its compiled graph gathers one more weight."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.first, self.extra = nn.Linear(16, 16), nn.Linear(16, 16)
        self.rank = rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.first(x)
        return (self.extra(x) if self.rank == 0 else x).square().mean()


def different_collectives(rank: int, world_size: int) -> int:
    """Ranks about to run different collectives raise, naming what differs, instead of aborting
    in gloo; a rank that recompiles alone, with collectives the others have, goes ahead."""
    config = zpp.Config(collective_timeout_s=60.0)  # ranks may finish compiling far apart on a busy machine
    compile_ = lambda model: torch.compile(model, backend="zeropp", options={"inductor": False})  # noqa: E731
    x = torch.randn(4, 16, device=device())

    # Rank 0 alone sees a new batch size and recompiles (graph and schedule checked once already).
    trained = zpp.shard(nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16)).to(device()), config)
    step = compile_(trained)
    step(x).sum().backward()
    forward_graphs = len([g for g in LEDGER.graphs if g.kind == "forward"])
    step(x[: 3 if rank == 0 else 4]).sum().backward()
    recompiled = len([g for g in LEDGER.graphs if g.kind == "forward"]) - forward_graphs

    # A branch only rank 0 takes: rank 0's graph gathers one more layer. Both ranks raise at compile.
    with pytest.raises(Exception) as error:
        compile_(zpp.shard(RankBranch(rank).to(device()), config))(x).backward()
    message = str(error.value)
    assert "RankMismatchError: zeropp: the ranks are about to issue different collectives" in message, message
    assert re.search(r"rank 0 compiled graph g\d+ \(4 parameter gathers\); rank 1 compiled graph g\d+ \(2 parameter "
                     r"gathers\)\. First difference: rank 0 l_self_modules_extra_parameters_weight_: float32 gather "
                     r"of 128 elements per rank over the world group \(2 ranks\), gradient reduced in float32; rank 1 "
                     r"nothing", message), message
    assert f"(This is rank {rank}.)" in message and "if dist.get_rank() == 0:" in message

    # Rank 0 evaluates (no gradients, so no reductions in backward) while rank 1 trains.
    step = compile_(zpp.shard(nn.Linear(16, 16).to(device()), config))
    with pytest.raises(Exception, match=r"First difference: rank 0 l_\w+_parameters_weight_: float32 gather of 128 "
                                        r"elements per rank over the world group \(2 ranks\), no gradient; rank 1 "
                                        r"l_\w+_parameters_weight_: .*, gradient reduced in float32"):
        with torch.set_grad_enabled(rank == 1):
            step(x).sum()

    # Rank 0 consolidates the weights while rank 1 compiles a step: both raise at once.
    model = zpp.shard(nn.Linear(16, 16).to(device()), config)
    with pytest.raises(Exception, match=r"rank 0 called zpp.full_state_dict; rank 1 compiled graph g\d+ "):
        zpp.full_state_dict(model) if rank == 0 else compile_(model)(x)

    # Rank 0 consolidates while rank 1 trains on eagerly: both raise at once.
    model = zpp.shard(nn.Linear(16, 16).to(device()), config)
    start = time.monotonic()
    with pytest.raises(zpp.RankMismatchError, match=r"rank 0 called zpp.full_state_dict; rank 1 is gathering "
                                                    r"Linear.weight \(parameter 0, shape \(16, 16\)\)"):
        zpp.full_state_dict(model) if rank == 0 else model(x).sum().backward()
    assert time.monotonic() - start < 30
    return recompiled


@pytest.mark.distributed
def test_ranks_about_to_run_different_collectives_raise_instead_of_aborting():
    assert run_ranks(different_collectives, 2, timeout_s=300) == [1, 0]


def out_of_memory_in_compile(rank: int, world_size: int) -> None:
    def exhaust(graph, ctx):
        raise torch.OutOfMemoryError("simulated: tried to allocate 80.00 GiB")

    # The lowering pass runs out of memory.
    passes = [dataclasses.replace(p, run=exhaust) if p.name == "lower_collectives" else p for p in PASSES]
    model = zpp.shard(nn.Linear(8, 8).to(device()))
    backend = functools.partial(zeropp_backend, passes=passes)
    compiled = torch.compile(model, backend=backend, options={"inductor": False})
    # Dynamo reports it as the backend's failure, with zeropp's message.
    with pytest.raises(Exception, match=r"OutOfMemoryError: zeropp ran out of memory compiling graph g\d+\.forward "
                       r"in pass 'lower_collectives': simulated.*smaller batch"):
        compiled(torch.randn(2, 8, device=device())).sum().backward()


@pytest.mark.distributed
def test_out_of_memory_while_compiling_names_the_stage():
    run_ranks(out_of_memory_in_compile, 1)


def test_bad_arguments_to_the_public_api():
    with pytest.raises(TypeError, match="expects an nn.Module, got str"):
        zpp.shard("model")
    with pytest.raises(zpp.ConfigError, match="expected a zpp_compile.Config, a dict or a JSON path, got int"):
        zpp.shard(nn.Linear(2, 2), 42)
    for not_sharded in (nn.Linear(2, 2), "model"):
        with pytest.raises(ValueError, match="needs a model sharded by zpp_compile.shard"):
            zpp.full_state_dict(not_sharded)
        with pytest.raises(ValueError, match="needs a model sharded by zpp_compile.shard"):
            zpp.set_requires_gradient_sync(not_sharded, False)
    with pytest.raises(TypeError, match="must be True or False"):
        zpp.set_requires_gradient_sync(nn.Linear(2, 2), 0)


def _returns_rank(rank: int, world_size: int) -> int:
    return rank


def _raises_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("the check this scenario makes failed")
    return rank


@pytest.mark.distributed
def test_a_failing_scenario_of_a_shared_group_is_named():
    # Module fixtures run many scenarios on one group of ranks (in_turn); a failure must say which.
    assert run_ranks(in_turn, 2, {"first": (_returns_rank,), "second": (_returns_rank,)}) == \
        [{"first": 0, "second": 0}, {"first": 1, "second": 1}]
    with pytest.raises(AssertionError) as failure:
        run_ranks(in_turn, 2, {"first": (_returns_rank,), "second": (_raises_on_rank_1,)})
    assert "ScenarioFailed: scenario 'second' failed on rank 1" in str(failure.value)
    assert "ValueError: the check this scenario makes failed" in str(failure.value)  # the cause, chained


@pytest.mark.skipif(BACKEND == "nccl", reason="GPU ranks always start as new interpreters")
@needs("transformers")
def test_importing_the_model_libraries_leaves_test_ranks_forked():
    # A rank started as a new interpreter costs seconds of imports; a variable that a library sets
    # when imported (Lightning sets one) must not make every later rank start that way. Test modules
    # import these libraries after the harness; the server imports them before it forks a rank.
    for name in SERVER_PRELOAD:
        importlib.import_module(name)
    assert forks_ranks()

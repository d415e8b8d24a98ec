"""Checkpoints at the edges of real runs: buffers that differ across ranks (BatchNorm's running
statistics), a save stopped at any point while overwriting an older checkpoint, a peer that hangs
before a save or a load, and another model's checkpoint."""

from __future__ import annotations

import copy
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from distributed import BACKEND, device, in_turn, run_ranks
from torch.distributed.checkpoint.filesystem import FileSystemWriter

import zpp_compile as zpp
import zpp_compile.checkpoint as checkpoint

TIMEOUT_S = 4.0
ROWS = 4  # samples per rank


def batch_norm_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def samples(world_size: int, step: int) -> torch.Tensor:
    """Every rank's samples of one step, rank-major, each rank's of another mean (so the ranks'
    batch statistics differ)."""
    generator = torch.Generator().manual_seed(step)
    return torch.cat([torch.randn(ROWS, 8, generator=generator) + r for r in range(world_size)])


def loss_of(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def reference_step(world_size: int) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    """One SGD step of the unsharded model in float64 on every rank's samples (each rank's batch
    normalized by its own statistics, the gradients averaged), and the buffers each rank's forward
    leaves (its own batch's running statistics)."""
    initial = batch_norm_net().double()
    x = samples(world_size, 0).double()
    model = copy.deepcopy(initial)
    loss = sum(loss_of(model(x[r * ROWS:(r + 1) * ROWS])) for r in range(world_size)) / world_size
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    params = {name: p.detach() for name, p in model.named_parameters()}
    buffers = []
    for r in range(world_size):
        alone = copy.deepcopy(initial)
        alone(x[r * ROWS:(r + 1) * ROWS])
        buffers.append(dict(alone.named_buffers()))
    return params, buffers


def assert_close_to(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], where: str) -> None:
    for name, value in expected.items():
        torch.testing.assert_close(got[name].detach().cpu().to(value.dtype), value, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{where}, {name}: {m}")


def buffers_run(rank: int, world_size: int, mode: str, path: str) -> None:
    """One step on ranks with different data, a save over the checkpoint the previous mode left,
    another step, a load: the checkpoint holds the reference's parameters and rank 0's buffers,
    and the load gives every rank those values."""
    model = zpp.shard(batch_norm_net().to(device()), zpp.Config(compile_layers_once=mode == "layers once"))
    step_fn = model if mode == "eager" else torch.compile(model, backend="zeropp", options={"inductor": False})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rows = slice(rank * ROWS, (rank + 1) * ROWS)
    params, buffers = reference_step(world_size)

    for step in range(2):
        loss_of(step_fn(samples(world_size, step)[rows].to(device()))).backward()
        opt.step()
        opt.zero_grad()
        if step == 0:
            # Each rank's buffers are its own batch's statistics; a checkpoint holds rank 0's.
            assert_close_to(zpp.full_state_dict(model), params | buffers[rank], f"{mode}, rank {rank}'s own state")
            zpp.save_checkpoint(model, opt, path)
    zpp.load_checkpoint(model, opt, path)
    assert_close_to(dict(model.named_buffers()), buffers[0], f"{mode}, rank {rank}'s buffers after the load")
    assert_close_to(zpp.full_state_dict(model), params | buffers[0], f"{mode}, after the load")


@pytest.mark.distributed
def test_buffers_that_differ_across_ranks_save_and_load_as_rank_0s(tmp_path):
    path = str(tmp_path / "checkpoint")
    run_ranks(in_turn, 2, {mode: (buffers_run, mode, path) for mode in ("eager", "compiled", "layers once")})


class Stopped(BaseException):
    """A save stopped here: raised where the process could be killed, it passes every handler of
    save_checkpoint's (which catches only `Exception`s, and cleans nothing up on the way out), so
    the files are left as a kill at that point leaves them."""


def stop_at(monkeypatch: pytest.MonkeyPatch, point: str) -> None:
    """Makes the next save stop at `point`."""
    def stop(*args, **kwargs):
        raise Stopped(point)

    moved = []  # the targets of save_checkpoint's moves so far

    def move(source: Path, target: Path) -> None:
        aside = target.name.endswith("previous")
        if point == ("moving the old checkpoint aside" if aside else "moving the new checkpoint in"):
            raise Stopped(point)
        os.replace(source, target)
        moved.append(target)

    real_rmtree = shutil.rmtree

    def rmtree(target, *args, **kwargs) -> None:
        if len(moved) == 2 and Path(target).name.endswith("previous"):  # the new one in place, the old removed
            next(f for f in Path(target).iterdir() if f.is_file()).unlink()  # one file gone, then stopped
            raise Stopped(point)
        real_rmtree(target, *args, **kwargs)

    if point == "writing the shards":
        monkeypatch.setattr(FileSystemWriter, "write_data", stop)
    elif point == "writing the checksums":
        monkeypatch.setattr(checkpoint, "_write_checksums", stop)
    monkeypatch.setattr(checkpoint, "_move", move)
    monkeypatch.setattr(shutil, "rmtree", rmtree if point == "removing the old checkpoint" else real_rmtree)


STOPS = ("writing the shards", "writing the checksums", "moving the old checkpoint aside",
         "moving the new checkpoint in", "removing the old checkpoint")


def interrupted_saves_run(rank: int, world_size: int, root: str) -> None:
    """For each point a save can stop at: a save completes, the model trains on, a save over it
    stops there, and a load (of a fresh model) gives the last completed save's values, or, once
    the new checkpoint is in place, the new one's."""
    torch.manual_seed(0)
    model = zpp.shard(nn.Linear(8, 8).to(device()))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)

    def step() -> dict[str, torch.Tensor]:
        model(torch.randn(4, 8, device=device())).square().mean().backward()
        opt.step()
        opt.zero_grad()
        return {name: value.clone() for name, value in zpp.full_state_dict(model).items()}

    for point in STOPS:
        path = f"{root}/{point.replace(' ', '-')}"
        completed = step()
        zpp.save_checkpoint(model, opt, path)
        newer = step()
        with pytest.MonkeyPatch.context() as monkeypatch:
            stop_at(monkeypatch, point)
            with pytest.raises((Stopped, zpp.CheckpointError), match=point if point != "writing the shards" else
                               "writing the shards|writing .* failed"):
                zpp.save_checkpoint(model, opt, path)
        fresh = zpp.shard(nn.Linear(8, 8).to(device()))
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
        zpp.load_checkpoint(fresh, fresh_opt, path)
        expected = newer if point == "removing the old checkpoint" else completed
        loaded = zpp.full_state_dict(fresh)
        for name, value in expected.items():
            assert torch.equal(loaded[name], value), f"stopped {point}: {name}"
        zpp.save_checkpoint(model, opt, path)  # the next save clears what the stopped one left
        assert sorted(p.name for p in Path(root).iterdir() if p.name.startswith(f".{Path(path).name}")) == [], point


@pytest.mark.distributed
def test_a_save_stopped_anywhere_leaves_the_last_completed_checkpoint(tmp_path):
    run_ranks(interrupted_saves_run, 1, str(tmp_path))


def killed_while_saving(rank: int, world_size: int, path: str) -> tuple[float, str]:
    """Both ranks save; then rank 1 dies while writing its shards of a second save over the first."""
    torch.manual_seed(0)
    model = zpp.shard(nn.Linear(8, 8).to(device()), zpp.Config(collective_timeout_s=TIMEOUT_S))
    zpp.save_checkpoint(model, None, path)
    with torch.no_grad():
        model.weight.mul_(2)
    if rank == 1:
        FileSystemWriter.write_data = lambda *args, **kwargs: os._exit(1)
    start = time.monotonic()
    with pytest.raises(zpp.CheckpointError) as error:
        zpp.save_checkpoint(model, None, path)
    return time.monotonic() - start, str(error.value)


def load_after_kill(rank: int, world_size: int, path: str) -> None:
    torch.manual_seed(0)
    model = zpp.shard(nn.Linear(8, 8).to(device()))
    expected = {name: value.clone() for name, value in zpp.full_state_dict(model).items()}
    with torch.no_grad():
        model.weight.zero_()
    zpp.load_checkpoint(model, None, path)
    for name, value in zpp.full_state_dict(model).items():
        assert torch.equal(value, expected[name]), name


@pytest.mark.distributed
@pytest.mark.skipif(BACKEND == "nccl", reason="NCCL's watchdog aborts a rank whose peer died instead of raising")
def test_a_rank_killed_while_overwriting_leaves_the_old_checkpoint(tmp_path):
    path = str(tmp_path / "checkpoint")
    elapsed, message = run_ranks(killed_while_saving, 2, path, timeout_s=120, reporting=[0])[0]
    assert elapsed < TIMEOUT_S + 10, elapsed
    assert f"zpp.save_checkpoint: writing {path} failed" in message, message
    assert f"{path} is as it was before this save" in message, message
    run_ranks(load_after_kill, 2, path)


def another_models_checkpoint(rank: int, world_size: int, path: str) -> None:
    zpp.save_checkpoint(zpp.shard(nn.Linear(8, 8).to(device())), None, path)
    wider = zpp.shard(nn.Linear(8, 16).to(device()))
    with pytest.raises(zpp.CheckpointError) as error:
        zpp.load_checkpoint(wider, None, path)
    message = str(error.value)
    assert "does not fit this model" in message and "Load a checkpoint of the same architecture" in message, message
    assert "model.weight (8, 8) in the checkpoint, (16, 8) here" in message, message
    assert "earlier checkpoint" not in message, message


@pytest.mark.distributed
def test_another_models_checkpoint_is_refused_for_what_it_is(tmp_path):
    run_ranks(another_models_checkpoint, 2, str(tmp_path / "checkpoint"))


def peer_hangs_before(rank: int, world_size: int, call: str, path: str) -> tuple[float, str]:
    """Rank 1 hangs before `call`; rank 0 makes it and reports how long it took to fail, and how."""
    model = zpp.shard(nn.Linear(8, 8).to(device()), zpp.Config(collective_timeout_s=TIMEOUT_S))
    if call == "load_checkpoint":
        zpp.save_checkpoint(model, None, path)
    if rank == 1:
        time.sleep(600)
    start = time.monotonic()
    with pytest.raises(zpp.CheckpointError) as error:
        getattr(zpp, call)(model, None, path)
    return time.monotonic() - start, str(error.value)


@pytest.mark.distributed
@pytest.mark.skipif(BACKEND == "nccl", reason="NCCL's watchdog aborts a rank whose collective times out")
@pytest.mark.parametrize("call", ["save_checkpoint", "load_checkpoint"])
def test_a_peer_hung_before_a_save_or_a_load_is_named_within_the_timeout(tmp_path, call):
    path = str(tmp_path / "checkpoint")
    elapsed, message = run_ranks(peer_hangs_before, 2, call, path, timeout_s=120, reporting=[0])[0]
    assert elapsed < TIMEOUT_S + 10, elapsed
    assert f"zpp.{call}({path!r}) did not start" in message, message
    assert f"Rank 1 never called zpp.{call}" in message, message

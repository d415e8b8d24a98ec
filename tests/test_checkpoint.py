"""Checkpoints through torch.distributed.checkpoint: save at one world size, load at another,
continue training exactly as an uninterrupted run; export a full state dict for inference.
zpp.save_checkpoint / load_checkpoint: a damaged checkpoint is an error that leaves the model and
optimizer untouched."""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from distributed import device, optimizer_steps, run_ranks
from models import TinyTransformer, batches
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    get_state_dict,
    set_state_dict,
)
from training import needs_4_ranks

import zpp_compile as zpp
from zpp_compile.checkpoint import _PRIME, CHECKSUM_FILE, _checksum

GLOBAL_BATCH, STEPS = 8, 4  # steps 0-1 at world 4, steps 2-3 at world 2


def global_losses(losses: list[torch.Tensor], world_size: int) -> list[float]:
    """The global-batch loss per step: the mean of the ranks' losses (equal sample counts)."""
    total = torch.stack(losses)
    torch.distributed.all_reduce(total)
    return (total / world_size).tolist()


def save_at_world4(rank: int, world_size: int, path: str) -> list[float]:
    torch.manual_seed(0)
    model = zpp.shard(TinyTransformer().to(device()))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    per_rank = GLOBAL_BATCH // world_size
    data = batches(STEPS, 1, GLOBAL_BATCH)[:2]
    losses = optimizer_steps(opt, model, data, slice(rank * per_rank, (rank + 1) * per_rank))
    model_state, optim_state = get_state_dict(model, opt)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
    return global_losses(losses, world_size)


def load_at_world2(rank: int, world_size: int, path: str) -> tuple[list[float], float]:
    """A fresh model (other seed), compiled with hpZ, trained one step so that secondary copies
    existed before the load, then loaded and trained on from the checkpoint."""
    torch.manual_seed(1)
    model = zpp.shard(TinyTransformer().to(device()), zpp.Config(hpz_partition_size=1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    compiled = torch.compile(model, backend="zeropp", options={"inductor": False})
    per_rank = GLOBAL_BATCH // world_size
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    data = batches(STEPS, 1, GLOBAL_BATCH)
    optimizer_steps(opt, compiled, data[:1], rows)  # state the load must replace

    model_state, optim_state = get_state_dict(model, opt)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    losses = optimizer_steps(opt, compiled, data[2:], rows)

    full = {k: v.cpu() for k, v in zpp.full_state_dict(model).items()}  # every rank takes part
    if rank == 0:
        torch.save(full, f"{path}.full.pt")  # the consolidated export
    tokens, targets = data[0]
    model.eval()
    with torch.no_grad():
        evaluated = float(model(tokens.to(device()), targets.to(device())))
    return global_losses(losses, world_size), evaluated


def reference() -> tuple[list[float], dict]:
    torch.manual_seed(0)
    model = TinyTransformer().to(device())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = optimizer_steps(opt, model, batches(STEPS, 1, GLOBAL_BATCH), slice(None))
    return [float(loss) for loss in losses], {k: v.cpu() for k, v in model.state_dict().items()}


@pytest.mark.distributed
@needs_4_ranks
def test_save_at_world4_load_at_world2_continues_like_uninterrupted_run(tmp_path):
    path = str(tmp_path / "checkpoint")
    before = run_ranks(save_at_world4, 4, path)[0]
    after, evaluated = run_ranks(load_at_world2, 2, path)[0]
    full = torch.load(f"{path}.full.pt")
    expected_losses, expected_state = reference()
    torch.testing.assert_close(before + after, expected_losses, rtol=1e-5, atol=0)
    for key, value in expected_state.items():
        torch.testing.assert_close(full[key], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")

    # The consolidated state dict serves an ordinary, unsharded model for inference.
    plain = TinyTransformer()
    plain.load_state_dict(full)
    plain.eval()
    tokens, targets = batches(STEPS, 1, GLOBAL_BATCH)[0]
    with torch.no_grad():
        assert abs(float(plain(tokens, targets)) - evaluated) <= 1e-5 * abs(evaluated)


def local_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Copies of this rank's parameter shards and optimizer state, by name."""
    names = {p: n for n, p in model.named_parameters()}
    out = {n: p.to_local().detach().clone() for n, p in model.named_parameters()}
    for param, values in opt.state.items():
        for key, value in values.items():
            out[f"{names[param]}.{key}"] = (value.to_local() if hasattr(value, "to_local") else value).detach().clone()
    return out


def assert_bit_identical(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], when: str) -> None:
    assert got.keys() == expected.keys(), f"{when}: {sorted(got.keys() ^ expected.keys())}"
    for key, value in expected.items():
        same = torch.equal(got[key].reshape(-1).view(torch.uint8), value.reshape(-1).view(torch.uint8))
        assert same, f"{when}: {key} changed"


def damaged_copies(path: str, exp_avg: torch.Tensor) -> dict[str, str]:
    """Damaged copies of the checkpoint at `path`, by kind of damage (rank 0 writes them)."""
    copies = {}
    for kind in ("truncated", "corrupted", "unreadable", "unfinished"):
        copies[kind] = shutil.copytree(path, f"{path}-{kind}")
    files = sorted(Path(copies["truncated"]).glob("*.distcp"), key=lambda f: f.stat().st_size)
    data = files[-1].read_bytes()
    files[-1].write_bytes(data[: len(data) // 2])  # the largest file cut in half
    noise = random.Random(0).randbytes(64)
    target = exp_avg.numpy().tobytes()  # 64 random bytes inside this tensor's stored values
    for file in Path(copies["corrupted"]).glob("*.distcp"):
        data = bytearray(file.read_bytes())
        if (at := data.find(target)) >= 0:
            data[at + 128: at + 192] = noise
            file.write_bytes(bytes(data))
            break
    else:
        raise AssertionError("the tensor's bytes were not found in the checkpoint")
    first = Path(copies["unreadable"]) / "__0_0.distcp"  # the first record's header: DCP itself fails
    first.write_bytes(noise + first.read_bytes()[64:])
    os.remove(Path(copies["unfinished"]) / CHECKSUM_FILE)
    return copies


def safe_checkpoint_world2(rank: int, world_size: int, path: str) -> None:
    torch.manual_seed(0)
    model = zpp.shard(TinyTransformer().to(device()))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rows = slice(rank * 2, (rank + 1) * 2)
    data = batches(3, 1, 4)
    optimizer_steps(opt, model, data[:1], rows)
    zpp.save_checkpoint(model, opt, path)
    saved = local_state(model, opt)
    full_model = {k: v.cpu() for k, v in zpp.full_state_dict(model).items()}
    full_optim = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    if rank == 0:
        torch.save({"model": full_model, "optim": full_optim["state"]}, f"{path}-reference.pt")
    optimizer_steps(opt, model, data[1:2], rows)  # moves on: a load must bring back `saved`
    before = local_state(model, opt)

    copies = [damaged_copies(path, saved["blocks.0.fc.weight.exp_avg"].cpu()) if rank == 0 else None]
    torch.distributed.broadcast_object_list(copies, src=0)
    expected_messages = {
        "truncated": r"__\d_0\.distcp is truncated .* Copy it again or load an earlier checkpoint",
        "corrupted": r"optim\.state\.blocks\.0\.fc\.weight\.exp_avg do not match the checksums .* Load an earlier",
        "unreadable": r"could not read .* cannot be read, the files are damaged: \S+ in \S+__0_0\.distcp",
        "unfinished": r"has no zeropp_checksums\.json: it was not written by zpp\.save_checkpoint, or that save",
    }
    for kind, damaged in copies[0].items():
        with pytest.raises(zpp.CheckpointError, match=expected_messages[kind]) as error:
            zpp.load_checkpoint(model, opt, damaged)
        assert "The model and optimizer are unchanged" in str(error.value)
        assert_bit_identical(local_state(model, opt), before, f"after the {kind} checkpoint")

    zpp.load_checkpoint(model, opt, path)
    assert_bit_identical(local_state(model, opt), saved, "after loading the good checkpoint")
    optimizer_steps(opt, model, data[1:2], rows)  # the same step again: the same state
    assert_bit_identical(local_state(model, opt), before, "after the step from the loaded checkpoint")


def safe_checkpoint_world1(rank: int, world_size: int, path: str) -> None:
    """Loads the world-2 checkpoint at world 1, into a fresh optimizer (no state yet)."""
    torch.manual_seed(1)
    model = zpp.shard(TinyTransformer().to(device()))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = local_state(model, opt)
    with pytest.raises(zpp.CheckpointError, match="truncated"):
        zpp.load_checkpoint(model, opt, f"{path}-truncated")
    assert not opt.state, "a failed load left optimizer state behind"
    assert_bit_identical(local_state(model, opt), before, "after the truncated checkpoint")
    deeper = zpp.shard(TinyTransformer(layers=3).to(device()))
    with pytest.raises(zpp.CheckpointError, match=r"does not fit .*missing from the checkpoint: model\.blocks\.2\."):
        zpp.load_checkpoint(deeper, None, path)

    zpp.load_checkpoint(model, opt, path)
    reference = torch.load(f"{path}-reference.pt")
    full_model = zpp.full_state_dict(model)
    full_optim = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))["state"]
    for key, value in reference["model"].items():
        assert torch.equal(full_model[key].cpu(), value.cpu()), key
    assert full_optim.keys() == reference["optim"].keys()
    for key, values in reference["optim"].items():
        for name, value in values.items():  # a replicated (0-d) parameter's state stays on its device
            assert torch.equal(full_optim[key][name].cpu(), value.cpu()), f"{key}.{name}"


@pytest.mark.distributed
def test_safe_checkpoint_load_is_all_or_nothing_and_reshards(tmp_path):
    path = str(tmp_path / "checkpoint")
    run_ranks(safe_checkpoint_world2, 2, path)
    run_ranks(safe_checkpoint_world1, 1, path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int8, torch.bool])
def test_checksum_of_a_tensor_is_the_sum_of_its_shards_at_any_split(dtype):
    tensor = (torch.randn(37, 5, generator=torch.Generator().manual_seed(0)) * 100).to(dtype)
    whole = _checksum(tensor)
    for starts in ([0, 19], [0, 10, 20, 30], [0, 37]):  # shards of 2 and 4 ranks (torch.chunk rows), one empty
        parts = [_checksum(tensor[a:b], a * 5) for a, b in zip(starts, [*starts[1:], 37])]
        assert tuple(sum(part[i] for part in parts) % _PRIME for i in range(2)) == whole
    damaged = tensor.clone()
    damaged.view(-1)[77] = ~damaged.view(-1)[77] if dtype == torch.bool else damaged.view(-1)[77] + 1
    assert _checksum(damaged) != whole
    moved = tensor.clone()
    moved[[3, 4]] = tensor[[4, 3]]
    assert torch.equal(moved, tensor) or _checksum(moved) != whole

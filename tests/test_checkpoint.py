"""Checkpoints through torch.distributed.checkpoint: save at one world size, load at another,
continue training exactly as an uninterrupted run; export a full state dict for inference."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import zpp_compile as zpp
from distributed import device, run_ranks
from models import TinyTransformer, batches
from test_zero3 import needs_4_ranks

GLOBAL_BATCH, STEPS = 8, 4  # steps 0-1 at world 4, steps 2-3 at world 2


def adamw_steps(model: nn.Module, opt: torch.optim.Optimizer, step_fn, data, rows: slice) -> list[torch.Tensor]:
    losses = []
    for tokens, targets in data:
        loss = step_fn(tokens[rows].to(device()), targets[rows].to(device()))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


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
    losses = adamw_steps(model, opt, model, data, slice(rank * per_rank, (rank + 1) * per_rank))
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
    adamw_steps(model, opt, compiled, data[:1], rows)  # state the load must replace

    model_state, optim_state = get_state_dict(model, opt)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    losses = adamw_steps(model, opt, compiled, data[2:], rows)

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
    losses = adamw_steps(model, opt, model, batches(STEPS, 1, GLOBAL_BATCH), slice(None))
    return [float(loss) for loss in losses], {k: v.cpu() for k, v in model.state_dict().items()}


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

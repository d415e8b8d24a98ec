"""An optimizer made before `zpp.shard` holds the parameters shard replaced: its first step is an
error naming the fix, never a run whose weights silently stay put. Made after, the same loop trains
as the unsharded model does (float64 reference). Eager, compiled and with layers compiled once."""

from __future__ import annotations

import pytest
import torch
from distributed import device, in_turn, run_ranks
from models import TinyTransformer, batches

import zpp_compile as zpp

PER_RANK = 2


def optimizer_before_shard_run(rank: int, world_size: int, mode: str) -> None:
    (tokens, targets), = batches(1, world_size, PER_RANK)
    rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    torch.manual_seed(0)
    model = TinyTransformer().to(device())
    too_early = torch.optim.SGD(model.parameters(), lr=0.5)
    zpp.shard(model, zpp.Config(compile_layers_once=mode == "layers once"))
    step_fn = model if mode == "eager" else torch.compile(model, backend="zeropp", options={"inductor": False})
    initial = {name: value.clone() for name, value in zpp.full_state_dict(model).items()}

    step_fn(tokens[rows].to(device()), targets[rows].to(device())).backward()
    with pytest.raises(RuntimeError, match=r"SGD holds 28 parameter\(s\) that zpp_compile.shard has replaced by "
                                           r"their shards \(pos, embed.weight, blocks.0.gate, .* and 20 more\): it was "
                                           r"made before shard\(\), so its steps would never change the model. Make "
                                           r"the optimizer after sharding"):
        too_early.step()
    for name, value in zpp.full_state_dict(model).items():
        assert torch.equal(value, initial[name]), f"{mode}: {name} changed"

    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    opt.step()  # the gradients of the backward above
    torch.manual_seed(0)
    reference = TinyTransformer().double()
    reference(tokens, targets).backward()
    torch.optim.SGD(reference.parameters(), lr=0.5).step()
    trained = zpp.full_state_dict(model)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(trained[name].cpu().double(), value, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{mode}, {name}: {m}")
    # A replaced parameter added to a checked optimizer later is found too.
    opt.add_param_group({"params": [next(iter(too_early.param_groups[0]["params"]))]})
    with pytest.raises(RuntimeError, match=r"SGD holds 1 parameter\(s\) .* \(pos\)"):
        opt.step()


@pytest.mark.distributed
def test_an_optimizer_made_before_shard_fails_at_its_first_step():
    run_ranks(in_turn, 2, {mode: (optimizer_before_shard_run, mode) for mode in ("eager", "compiled", "layers once")})

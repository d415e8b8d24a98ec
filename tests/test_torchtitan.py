"""torchtitan's Llama 3 (the `torchtitan` package, debug size) sharded by zeropp in FSDP2's order:
built on the meta device, `zpp.shard`, `to_empty()`, then torchtitan's own `init_weights()`, which
initializes the shards; then trained compiled, against the unsharded model started from the same
weights.

FlexAttention, torchtitan's attention for language models, has no backward on CPU: the test
model's attention is torchtitan's SDPA module instead, causal, as flex's mask is for unpacked
sequences."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("torchtitan")
from distributed import run_ranks  # noqa: E402
from torchtitan.models.common.attention import ScaledDotProductAttention  # noqa: E402
from torchtitan.models.llama3 import model_registry  # noqa: E402

import zpp_compile as zpp  # noqa: E402

pytestmark = pytest.mark.distributed  # every test here starts processes

STEPS, PER_RANK, SEQ = 3, 2, 32
# SGD, whose updates scale with the gradients: fp32 rounding of the sharded sums stays that small
# (Adam divides a tiny gradient by its own scale, which can turn rounding into a full-size step).
LR, SGD_FP32 = 0.5, dict(rtol=1e-5, atol=1e-6)


def llama3_debug_on_meta() -> torch.nn.Module:
    config = model_registry("debugmodel").model
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    with torch.device("meta"):
        return config.build()


def llama3_debug_initialized() -> torch.nn.Module:
    model = llama3_debug_on_meta()
    model.to_empty(device="cpu")
    model.init_weights(buffer_device=None)
    return model


def train(rank: int, world_size: int, options: dict) -> dict:
    """3 SGD steps of the sharded model, compiled; rank 0 also trains the unsharded model from
    the sharded one's initial weights on all ranks' samples."""
    model = llama3_debug_on_meta()
    zpp.shard(model, {"inductor": False, **options})
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)  # as torchtitan's trainer: nn.init.* on the shards
    initial = zpp.full_state_dict(model)
    step_model = torch.compile(model, backend="zeropp")
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    tokens = torch.randint(0, 2048, (STEPS, world_size * PER_RANK, SEQ + 1), generator=torch.Generator().manual_seed(3))
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    losses = []
    for x, y in zip(tokens[:, mine, :-1], tokens[:, mine, 1:]):
        loss = F.cross_entropy(step_model(x).flatten(0, 1), y.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    final = zpp.full_state_dict(model)
    if rank != 0:
        return {"losses": losses}
    reference = llama3_debug_initialized()
    reference.load_state_dict(initial)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    reference_losses = []
    for x, y in zip(tokens[:, :, :-1], tokens[:, :, 1:]):
        loss = F.cross_entropy(reference(x).flatten(0, 1), y.flatten())
        loss.backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        reference_losses.append(loss.detach())
    return {"losses": losses, "initial": initial, "final": final, "reference": reference.state_dict(),
            "reference_losses": reference_losses}


@pytest.fixture(scope="module", params=[{}, {"compile_layers_once": True}], ids=["whole step", "layers once"])
def run(request):
    return run_ranks(train, 2, request.param)


def test_init_weights_after_shard_initializes_the_shards_as_torchtitan_does(run):
    """Every tensor written (a forward would refuse unset ones), with the spread torchtitan's own
    initialization of the unsharded model gives it: ones for norms, truncated normals of the
    configured (depth-scaled) widths for the rest."""
    initial, unsharded = run[0]["initial"], llama3_debug_initialized().state_dict()
    assert initial.keys() == unsharded.keys()
    for name, value in unsharded.items():
        if value.is_complex():  # the rotary table, a buffer computed by init_weights
            torch.testing.assert_close(initial[name], value)
        elif name.endswith("norm.weight"):
            assert torch.equal(initial[name], value), name
        else:
            assert abs(initial[name].std() / value.std() - 1) < 0.05, name
            assert initial[name].abs().max() <= value.abs().max() * 1.5, name


def test_trains_as_the_unsharded_model_from_the_same_weights(run):
    sharded_losses = torch.stack([torch.stack(result["losses"]) for result in run]).mean(0)  # the ranks' halves
    torch.testing.assert_close(sharded_losses, torch.stack(run[0]["reference_losses"]), rtol=1e-5, atol=1e-6)
    final, reference = run[0]["final"], run[0]["reference"]
    assert final.keys() == reference.keys()
    for name, value in reference.items():
        torch.testing.assert_close(final[name], value, **SGD_FP32, msg=lambda m: f"{name}: {m}")
    moved = [name for name in reference if not torch.equal(run[0]["initial"][name], reference[name])]
    assert len(moved) > len(reference) // 2  # it trained

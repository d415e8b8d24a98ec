"""Training runs the tests share: the unsharded reference, sharded training checked against it,
qwZ's runs against a float64 model of the quantized weights, and what autograd saves."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from distributed import BACKEND, device
from models import TinyTransformer, batches

import zpp_compile as zpp

STEPS, PER_RANK = 3, 2
BLOCK = 64  # qwZ's block in qwz_runs: small, so that the tiny model's weights are quantized at world 2 and 4


needs_4_ranks = pytest.mark.skipif(
    BACKEND == "nccl" and torch.cuda.device_count() < 4, reason="NCCL needs a GPU per rank"
)


def train(model: nn.Module, data, step_fn=None, slice_=slice(None)) -> list[tuple[float, float]]:
    """SGD with momentum for len(data) steps; returns (loss, global gradient norm) per step.

    SGD, unlike Adam, is sensitive to the gradient's scale, so a sum-instead-of-mean bug shows in
    the parameters; the norm returned by clip_grad_norm_ shows a wrong or rank-local norm.
    """
    step_fn = model if step_fn is None else step_fn
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9, weight_decay=0.01)
    history = []
    for tokens, targets in data:
        loss = step_fn(tokens[slice_].to(device()), targets[slice_].to(device()))
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        opt.step()
        opt.zero_grad()
        history.append((loss.item(), float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)))
    return history


def reference(world_size: int) -> tuple[nn.Module, list[tuple[float, float]]]:
    torch.manual_seed(0)
    model = TinyTransformer().to(device())
    return model, train(model, batches(STEPS, world_size, PER_RANK))


def train_sharded(rank: int, world_size: int, mode: str, options: dict, model_class: type = TinyTransformer) -> dict:
    torch.manual_seed(0)
    model = model_class().to(device())
    frozen_before = model.pos.detach().clone()
    zpp.shard(model, zpp.Config(**options))
    step_fn = None
    if mode == "inductor":
        step_fn = torch.compile(model, backend="zeropp")
    elif mode == "aot":
        step_fn = torch.compile(model, backend="zeropp", options={"inductor": False})
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    history = train(model, batches(STEPS, world_size, PER_RANK), step_fn, mine)

    full = zpp.full_state_dict(model)
    ref_model, ref_history = reference(world_size)
    # Each rank's loss is over its own samples; their mean is the reference's global-batch loss.
    losses = torch.tensor([loss for loss, _ in history], device=device())
    torch.distributed.all_reduce(losses)
    expected = torch.tensor([loss for loss, _ in ref_history])
    torch.testing.assert_close(losses.cpu() / world_size, expected, rtol=1e-5, atol=0)
    torch.testing.assert_close([n for _, n in history], [n for _, n in ref_history], rtol=1e-5, atol=0)
    expected = ref_model.state_dict()
    assert full.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(full[key], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")
    assert model.head._parameters["weight"] is model.embed._parameters["weight"], "tied weights came apart"
    torch.testing.assert_close(full["pos"], frozen_before, rtol=0, atol=0)
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    return {name: tuple(p.to_local().shape) for name, p in model.named_parameters()}


def saved_tensor_shapes(rank: int, world_size: int, options: dict) -> list[tuple]:
    """Shapes of the gathered weights the compiled forward saves for backward: the saved tensors
    that hold a whole parameter's values, as used or as gathered (flat, padded). By value, not by
    shape: a bucket's concatenated shards may have a gathered weight's shape."""
    torch.manual_seed(0)
    model = zpp.shard(TinyTransformer().to(device()), zpp.Config(**options))
    compiled = torch.compile(model, backend="zeropp", options={"inductor": False})
    tokens, targets = batches(1, world_size)[0]
    # By value: a weight of zeros (a fresh LayerNorm's bias) cannot be told from other zeros.
    weights = [w.reshape(-1) for w in zpp.full_state_dict(model).values() if w.any()]
    saved = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = compiled(tokens[:PER_RANK].to(device()), targets[:PER_RANK].to(device()))
    loss.backward()

    # A rank's own shard may hold a whole small parameter (a 0-d one on rank 0); saving the shard
    # itself costs nothing: only copies count.
    shards = {p.to_local().untyped_storage().data_ptr() for p in model.parameters()}

    def is_weight(t: torch.Tensor) -> bool:  # a weight, then nothing or the zeros that pad it
        flat = t.detach().reshape(-1)
        # Gathers run on the parameters' device; what autograd saves elsewhere (a CPU scalar) is none.
        if t.untyped_storage().data_ptr() in shards or t.device != weights[0].device:
            return False
        return any(flat.numel() >= w.numel() and torch.equal(flat[:w.numel()], w) and not flat[w.numel():].any()
                   for w in weights)

    return [tuple(t.shape) for t in saved if is_weight(t)]


def quantized_like_qwz(weight: torch.Tensor, world_size: int, block: int) -> torch.Tensor:
    """The weight every rank sees after a qwZ gather, computed independently in float64:
    rank r's torch.chunk rows, padded to the shard size, rounded to block-wise INT8."""
    rows = weight.shape[0] if weight.dim() else 1
    shard = math.ceil(rows / world_size) * (weight[0].numel() if weight.dim() else 1)
    if shard < block:  # too small to shrink: gathered in full precision
        return weight
    blocks = math.ceil(shard / block)
    flat = F.pad(weight.double().reshape(-1), (0, world_size * shard - weight.numel())).view(world_size, shard)
    chunks = F.pad(flat, (0, blocks * block - shard)).view(world_size, blocks, block)
    scale = chunks.abs().amax(-1, keepdim=True) / 127
    codes = torch.where(scale > 0, torch.round(chunks / scale.clamp_min(1e-300)), 0.0)
    out = (codes * scale).view(world_size, -1)[:, :shard].reshape(-1)[: weight.numel()]
    return out.view(weight.shape).to(weight.dtype)


# Framework runs (a few AdamW steps) against the same framework run unsharded, in fp32.
# Parameters: Adam divides each gradient by its running scale, so an element whose gradients are
# tiny carries their fp32 rounding into its update at up to about lr x 1e-4 per step.
ADAM_FP32 = dict(rtol=1e-5, atol=1e-5)
# Logged losses and gradient norms: the norms sum every gradient element (a tied embedding's from
# two reads, in another order when sharded) after the updates above.
LOGGED_FP32 = dict(rtol=5e-5, atol=1e-6)


def assert_same_state(actual: dict, expected: dict, **tolerance) -> None:
    """Two state dicts: the same keys, each tensor close within `tolerance` (assert_close's)."""
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(actual[key], value, **tolerance, msg=lambda m: f"{key}: {m}")


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def qwz_runs(
    rank: int, world_size: int, ranks_per_node: int, options: dict | None = None, modes: tuple = ("aot", "inductor")
) -> dict:
    config = zpp.Config(quantized_weights=True, weight_block_size=BLOCK, ranks_per_node=ranks_per_node,
                        **(options or {}))
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    data = batches(STEPS, world_size, PER_RANK)

    # 1. The first forward equals the unsharded model run on independently quantized weights.
    torch.manual_seed(0)
    reference = TinyTransformer().to(device())
    quantized = TinyTransformer().to(device())
    quantized.load_state_dict({k: quantized_like_qwz(v, world_size, BLOCK) for k, v in reference.state_dict().items()})
    tokens, targets = data[0]
    expected_loss = quantized(tokens.to(device()), targets.to(device())).item()

    finals = {}
    for mode in modes:
        torch.manual_seed(0)
        model = zpp.shard(TinyTransformer().to(device()), config)
        compiled = torch.compile(model, backend="zeropp", options={"inductor": mode == "inductor"})
        history = train(model, data, compiled, mine)
        first = torch.tensor([history[0][0]], device=device())
        torch.distributed.all_reduce(first)
        torch.testing.assert_close(first.item() / world_size, expected_loss, rtol=1e-5, atol=0)
        finals[mode] = zpp.full_state_dict(model)

    # 2. Inductor and the op-by-op debug mode run the same rewritten graphs.
    if len(finals) == 2:
        for key, value in finals["aot"].items():
            assert relative_error(finals["inductor"][key], value) < 1e-5, key

    # 3. How far quantization moves training: the relative error of each parameter's update.
    initial = {k: v.clone() for k, v in reference.state_dict().items()}
    train(reference, data)
    return {
        key: relative_error(finals[modes[-1]][key] - initial[key], value - initial[key])
        for key, value in reference.state_dict().items()
        if key != "pos"  # frozen: no update
    }

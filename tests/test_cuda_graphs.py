"""CUDA graphs (Config.cuda_graphs): on GPUs, the same training as without and outputs that stay valid; on CPU, a clear error."""

from __future__ import annotations

import pytest
import torch

import zpp_compile as zpp
from distributed import BACKEND, device, run_ranks
from models import TinyTransformer, batches
from test_zero3 import PER_RANK
from zpp_compile.runtime.registry import REGISTRY

on_gpus = pytest.mark.skipif(BACKEND != "nccl", reason="CUDA graphs need GPUs (ZPP_TEST_BACKEND=nccl)")

WORLD = min(2, torch.cuda.device_count()) or 2  # NCCL needs a GPU per rank

ALL_THREE = {"quantized_weights": True, "weight_block_size": 32, "hpz_partition_size": 1,
             "quantized_gradients": True, "gradient_block_size": 32, "ranks_per_node": 1}


def train(rank: int, world_size: int, options: dict, steps: int = 4, accumulate: int = 1) -> tuple:
    """Losses (kept as tensors until the end: they must stay valid), final parameters, the
    gradients of the last step (cloned before the optimizer runs) and the graphs' replay count."""
    torch.manual_seed(0)
    model = zpp.shard(TinyTransformer().to(device()), zpp.Config(**options))
    step_fn = torch.compile(model, backend="zeropp", dynamic=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], []
    for tokens, targets in batches(steps * accumulate, world_size):
        mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        loss = step_fn(tokens[mine].to(device()), targets[mine].to(device()))
        loss.backward()
        losses.append(loss)
        if len(losses) % accumulate == 0:
            grads = [p.grad.to_local().clone() for p in model.parameters() if p.grad is not None]
            opt.step()
            opt.zero_grad(set_to_none=True)
    state = {k: v.cpu() for k, v in zpp.full_state_dict(model).items()}
    graphs = REGISTRY.cuda_graphs.graphs if REGISTRY.cuda_graphs is not None else ()
    replays = sorted(g.calls - 1 for g in graphs if g.graph is not None)
    zpp.release_cuda_graphs()  # before the process group goes (the harness destroys it)
    torch._dynamo.reset()
    return [l.item() for l in losses], state, [g.cpu() for g in grads], replays


def compare(rank: int, world_size: int, options: dict, accumulate: int) -> None:
    plain = train(rank, world_size, options, accumulate=accumulate)
    graphed = train(rank, world_size, {**options, "cuda_graphs": True}, accumulate=accumulate)
    steps = len(plain[0])
    # Every call after the first (warmup) runs the captured graph: forward and backward.
    assert plain[3] == [] and graphed[3] == [steps - 1, steps - 1], graphed[3]
    # The same kernels on the same data; the embedding's backward adds with atomics on CUDA, so
    # results agree to rounding rather than bitwise, in either mode alike.
    close = dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(graphed[0]), torch.tensor(plain[0]), **close)
    for key, value in plain[1].items():
        torch.testing.assert_close(graphed[1][key], value, **close, msg=lambda m: f"{key}: {m}")
    for a, b in zip(graphed[2], plain[2]):
        torch.testing.assert_close(a, b, **close)


@pytest.mark.parametrize("options", [{}, ALL_THREE], ids=["zero3", "all3"])
@on_gpus
def test_graphed_steps_equal_plain_steps(options):
    run_ranks(compare, WORLD, options, 1)


@on_gpus
def test_gradient_accumulation_through_graphs():
    # Two backward passes per step: the second must add to the first's gradient, which a replay
    # writing into the first's output memory would overwrite.
    run_ranks(compare, WORLD, {}, 2)


def forward_twice(rank: int, world_size: int) -> str:
    model = zpp.shard(TinyTransformer().to(device()), zpp.Config(cuda_graphs=True))
    step_fn = torch.compile(model, backend="zeropp", dynamic=False)
    (tokens, targets), = batches(1, world_size)
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    x, y = tokens[mine].to(device()), targets[mine].to(device())
    for _ in range(2):  # warmup, then capture
        step_fn(x, y).backward()
    step_fn(x, y)
    try:
        step_fn(x, y)  # the previous call's activations still await their backward
    except RuntimeError as error:
        message = str(error)
    else:
        message = ""
    zpp.release_cuda_graphs()
    return message


@on_gpus
def test_forward_again_before_backward_is_refused():
    for message in run_ranks(forward_twice, WORLD):
        assert "ran again before the backward" in message and "torch.no_grad()" in message


def compile_on_cpu(rank: int, world_size: int) -> str:
    model = zpp.shard(TinyTransformer(), zpp.Config(cuda_graphs=True))
    (tokens, targets), = batches(1, world_size)
    try:
        torch.compile(model, backend="zeropp")(tokens[:PER_RANK], targets[:PER_RANK])
    except Exception as error:  # Dynamo wraps backend errors
        return str(error)
    return ""


@pytest.mark.skipif(BACKEND != "gloo", reason="the model must be on CPU")
def test_cuda_graphs_on_a_cpu_model_is_an_error_at_compile():
    for message in run_ranks(compile_on_cpu, 2):
        assert "Config.cuda_graphs=True needs the model and its inputs on CUDA" in message, message

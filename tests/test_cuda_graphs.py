"""CUDA graphs (Config.cuda_graphs): on GPUs, the same training as without, replayed graphs and
outputs that stay valid; on CPU, a clear error."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from distributed import BACKEND, device, run_ranks
from models import TinyTransformer, batches
from torch.profiler import ProfilerActivity, profile
from training import PER_RANK

import zpp_compile as zpp

pytestmark = pytest.mark.distributed  # every test here starts processes

on_gpus = pytest.mark.skipif(BACKEND != "nccl", reason="CUDA graphs need GPUs (ZPP_TEST_BACKEND=nccl)")

WORLD = min(2, torch.cuda.device_count()) or 2  # NCCL needs a GPU per rank

ALL_THREE = {"quantized_weights": True, "weight_block_size": 32, "hpz_partition_size": 1,
             "quantized_gradients": True, "gradient_block_size": 32, "ranks_per_node": 1}


def train(rank: int, world_size: int, options: dict, accumulate: int, evaluate: bool, steps: int = 4) -> tuple:
    """Losses (kept as tensors until the end: they must stay valid), evaluation losses (a forward
    under no_grad after each step), final parameters, the gradients of the last step (cloned
    before the optimizer runs), and the CUDA runtime calls of the last step."""
    torch.manual_seed(0)
    model = zpp.shard(TinyTransformer().to(device()), zpp.Config(**options))
    step_fn = torch.compile(model, backend="zeropp", dynamic=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = batches(steps * accumulate + 1, world_size)
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    held_out = [t[mine].to(device()) for t in data.pop()]
    losses, eval_losses, grads = [], [], []
    for step in range(steps):
        last = step == steps - 1
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) if last else nullcontext() as prof:
            for tokens, targets in data[step * accumulate:(step + 1) * accumulate]:
                loss = step_fn(tokens[mine].to(device()), targets[mine].to(device()))
                loss.backward()
                losses.append(loss)
            grads = [p.grad.to_local().clone() for p in model.parameters() if p.grad is not None]
            opt.step()
            opt.zero_grad(set_to_none=True)
        if evaluate:
            with torch.no_grad():
                eval_losses.append(step_fn(*held_out))
    calls = {name: sum(e.count for e in prof.key_averages() if e.key.startswith(name))
             for name in ("cudaGraphLaunch", "cudaStreamBeginCapture")}
    state = {k: v.cpu() for k, v in zpp.full_state_dict(model).items()}
    zpp.release_cuda_graphs()  # before the process group goes (the harness destroys it)
    return ([loss.item() for loss in losses], [loss.item() for loss in eval_losses], state, [g.cpu() for g in grads],
            calls)


def compare(rank: int, world_size: int, options: dict, accumulate: int, evaluate: bool, replays: int = 2) -> None:
    """`replays`: the captured graphs a training step replays (the step's forward and backward,
    or with layers compiled on their own, one forward each for the embedding, the frozen position
    table read outside any module, each of the two blocks, the norm and the head, and a backward
    for each but the position table's: 11)."""
    plain = train(rank, world_size, options, accumulate, evaluate)
    graphed = train(rank, world_size, {**options, "cuda_graphs": True}, accumulate, evaluate)
    # The last step replays a captured graph for every forward and backward, and captures none.
    assert plain[4]["cudaGraphLaunch"] == 0, plain[4]
    assert graphed[4] == {"cudaGraphLaunch": replays * accumulate, "cudaStreamBeginCapture": 0}, graphed[4]
    # The same kernels on the same data; the embedding's backward adds with atomics on CUDA, so
    # results agree to rounding rather than bitwise, in either mode alike.
    close = dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(graphed[0]), torch.tensor(plain[0]), **close)
    torch.testing.assert_close(torch.tensor(graphed[1]), torch.tensor(plain[1]), **close)
    for key, value in plain[2].items():
        torch.testing.assert_close(graphed[2][key], value, **close, msg=lambda m: f"{key}: {m}")
    for a, b in zip(graphed[3], plain[3]):
        torch.testing.assert_close(a, b, **close)


@pytest.mark.parametrize("options, replays", [({}, 2), (ALL_THREE, 2), ({"compile_layers_once": True}, 11)],
                         ids=["zero3", "all3", "layers"])
@on_gpus
def test_graphed_steps_equal_plain_steps(options, replays):
    run_ranks(compare, WORLD, options, 1, False, replays)


@on_gpus
def test_gradient_accumulation_and_evaluation_through_graphs():
    # Two backward passes per step: the second must add to the first's gradient, which the next
    # replay would overwrite if it were still the graph's output. A forward under no_grad between
    # steps (evaluation) is a graph of its own.
    run_ranks(compare, WORLD, {}, 2, True)


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

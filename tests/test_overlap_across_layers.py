"""The overlap across layer graphs (Config.compile_layers_once): each layer graph's first gather
issued during the layer before (`prefetch_across_layers`) and its last reductions finished during
the next graph's backward (`finish_reductions_later`), training as without them, also where the
prefetch guesses wrong and where the step ends elsewhere."""

from __future__ import annotations

from typing import Callable

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint
from distributed import device, in_turn, run_ranks
from layer_stacks import ALL_THREE, LAYERS, PER_RANK, VOCAB, MlpLayer, llama
from models import batches

import zpp_compile as zpp
from zpp_compile.runtime import deferred_reductions, prefetch

NO_PREFETCH = ("prefetch_across_layers",)


class SkippingStack(nn.Module):
    """MLP layers, of which layer 1 is left out while `skip` is set."""

    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MlpLayer(8) for _ in range(layers))
        self.skip = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for index, layer in enumerate(self.layers):
            if not (index == 1 and self.skip):
                x = layer(x)
        return x


def prefetched_steps(rank: int, world_size: int, build: Callable[[], nn.Module], loss_of: Callable, options: dict,
                     steps: int = 3, inductor: bool = False, write_at: int | None = None,
                     skip_at: int | None = None) -> tuple:
    """`steps` SGD steps of `build()` with layers compiled once: each step's loss, the gathers
    each step took from a prefetch, gathered itself and dropped, the step's collectives
    (`comm_report`), and the trained weights. With `write_at`, that step writes to the last
    layer's weights between forward and backward; with `skip_at`, that step skips a layer."""
    torch.manual_seed(0)
    model = zpp.shard(build().to(device()), zpp.Config(compile_layers_once=True, **options))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = torch.compile(model, backend="zeropp", options={"inductor": inductor})
    zpp.reset_comm_report()
    losses, counts = [], []
    for index in range(steps):
        before = prefetch.counts()
        if skip_at is not None:
            model.skip = index == skip_at
        loss = loss_of(step, rank, world_size, index)
        if index == write_at:
            with torch.no_grad():
                last = list(model.modules())[-1]
                last.weight.mul_(0.5)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
        counts.append(tuple(after - first for after, first in zip(prefetch.counts(), before)))
    return losses, counts, zpp.comm_report().by_phase(), zpp.full_state_dict(model)


def llama_loss(step: Callable, rank: int, world_size: int, index: int) -> torch.Tensor:
    tokens = batches(index + 1, world_size, PER_RANK, vocab=VOCAB)[index][0].to(device())
    mine = tokens[rank * PER_RANK:(rank + 1) * PER_RANK]
    return step(input_ids=mine, labels=mine).loss


def stack_loss(step: Callable, rank: int, world_size: int, index: int) -> torch.Tensor:
    x = torch.randn(2 * world_size, 8, generator=torch.Generator().manual_seed(index)).to(device())
    return step(x[rank * 2:(rank + 1) * 2]).pow(2).mean()


def assert_same_training(with_prefetch: tuple, without: tuple, exact: bool = True) -> None:
    """The same losses, collectives and weights with and without the pass."""
    losses, _, report, weights = with_prefetch
    other_losses, _, other_report, other_weights = without
    assert report == other_report
    tolerance = {"rtol": 0, "atol": 0} if exact else {"rtol": 1e-6, "atol": 1e-7}
    torch.testing.assert_close(torch.stack(losses), torch.stack(other_losses), **tolerance)
    for key, value in weights.items():
        torch.testing.assert_close(value, other_weights[key], **tolerance, msg=lambda m: f"{key}: {m}")


FINISHED_IN_GRAPH = ("finish_reductions_later",)


def overlap_across_layers_run(rank: int, world_size: int) -> None:
    """An HF Llama's layer graphs, plain ZeRO-3 and all three, with both passes that overlap
    communication across graphs, and with each switched off. Each layer graph's first gather is
    taken from the one issued during the previous layer's graph: every gather of a step but the
    first layer's forward (plain ZeRO-3), every forward gather but the first (all three, whose
    backward gathers nothing across ranks with one rank per node) in the second step, with nothing
    issued in vain. Each backward graph's last reductions end during the next graph or at the end
    of backward: every gradient of both steps, the layers' and those of the graphs around them (the
    embedding's, the head's), set on its parameter then. The training is the same to the bit,
    collectives included, with either pass switched off."""
    transformers = pytest.importorskip("transformers")
    build = lambda: llama(transformers)  # noqa: E731
    every_gradient = 2 * len(list(build().parameters()))
    for options, taken in (({}, 2 * LAYERS - 1), (ALL_THREE, LAYERS - 1)):
        prefetched = [(0, taken + 1, 0), (taken, 1, 0)]
        # Three models stay well under Dynamo's cap of graphs per frame (8); a reset before each
        # would have each compile from nothing, which takes longer.
        torch.compiler.reset()
        runs = {}
        for disabled, expected_prefetch, expected_deferred in (((), prefetched, every_gradient),
                                                               (NO_PREFETCH, [(0, 0, 0)] * 2, every_gradient),
                                                               (FINISHED_IN_GRAPH, prefetched, 0)):
            before = deferred_reductions.counts()
            runs[disabled] = prefetched_steps(rank, world_size, build, llama_loss,
                                              {**options, "disable_passes": disabled}, steps=2)
            assert runs[disabled][1] == expected_prefetch, (options, disabled, runs[disabled][1])
            after = deferred_reductions.counts()
            assert after.deferred - before.deferred == expected_deferred, (options, disabled, after, before)
            assert after.unfinished == after.placeholders == after.backward_ends == 0, after
        assert_same_training(runs[()], runs[NO_PREFETCH])
        assert_same_training(runs[()], runs[FINISHED_IN_GRAPH])


def prefetch_misguessed_run(rank: int, world_size: int) -> None:
    """A weight written between forward and backward, and a step that skips a layer: the gathers
    issued for them go unused (and are waited for, on every rank alike), and the training is the
    same as without the pass; under Inductor too, to fp32 rounding."""
    for inductor in (False, True):
        runs = [prefetched_steps(rank, world_size, SkippingStack, stack_loss, {"disable_passes": disabled},
                                 steps=4, inductor=inductor, write_at=1, skip_at=2)
                for disabled in ((), NO_PREFETCH)]
        assert_same_training(*runs, exact=not inductor)
        # 4 layers, 8 gathers a step, all but the first layer's forward taken once the order is
        # known; but step 1 writes the last layer's weight after forward, so its backward gathers
        # the new weight afresh. Step 2 skips layer 1: the gathers issued for it in forward and
        # backward go unused, and layers 2 and 0 gather themselves; step 3 runs layer 1 again,
        # which layers 0 and 2 did not issue (step 2 came between), then finds its order again.
        assert runs[0][1] == [(0, 8, 0), (6, 2, 1), (3, 3, 2), (5, 3, 2)], (inductor, runs[0][1])


def reductions_finished_later_inductor_run(rank: int, world_size: int) -> None:
    """Under Inductor, a stack of MLP layers whose backward graphs finish their last reductions
    later trains as with the pass switched off, to fp32 rounding, every gradient of both steps set
    on its parameter when its reduction ended."""
    before = deferred_reductions.counts()
    later = prefetched_steps(rank, world_size, SkippingStack, stack_loss, {}, steps=2, inductor=True)
    after = deferred_reductions.counts()
    assert after.deferred - before.deferred == 2 * len(list(SkippingStack().parameters()))
    assert after.unfinished == after.placeholders == after.backward_ends == 0, after
    in_graph = prefetched_steps(rank, world_size, SkippingStack, stack_loss, {"disable_passes": FINISHED_IN_GRAPH},
                                steps=2, inductor=True)
    assert_same_training(later, in_graph, exact=False)


def stack_gradients(rank: int, world_size: int, options: dict, use: Callable[[nn.Module, Callable], None]) -> dict:
    """The gradients `use(model, step)` leaves on a sharded stack of MLP layers compiled once."""
    torch.manual_seed(0)
    model = zpp.shard(SkippingStack().to(device()), zpp.Config(compile_layers_once=True, **options))
    use(model, torch.compile(model, backend="zeropp", options={"inductor": False}))
    return {name: p.grad.full_tensor() if p.grad is not None else None for name, p in model.named_parameters()}


def reductions_finished_later_elsewhere_run(rank: int, world_size: int) -> None:
    """Where autograd does more than accumulate a gradient into `.grad`, the gradient is handed on
    as without the pass: two backwards accumulate, torch.autograd.grad returns every gradient, a
    hook on a parameter sees its gradient; a backward that fails midway leaves no gradient to come
    after the user has cleared them."""
    def loss(step: Callable, index: int) -> torch.Tensor:
        return stack_loss(step, rank, world_size, index)

    def accumulate(model: nn.Module, step: Callable) -> None:
        loss(step, 0).backward()
        loss(step, 1).backward()

    def hand_back(model: nn.Module, step: Callable) -> None:
        params = list(model.parameters())
        for param, grad in zip(params, torch.autograd.grad(loss(step, 0), params)):
            param.grad = grad

    def hooked(model: nn.Module, step: Callable) -> None:
        seen = []
        model.layers[2].fc2.weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.full_tensor()))
        loss(step, 0).backward()
        torch.testing.assert_close(seen[0], model.layers[2].fc2.weight.grad.full_tensor(), rtol=0, atol=0)

    def failed_then_cleared(model: nn.Module, step: Callable) -> None:
        # Computed, not a leaf: its hook runs after the first layer's gradients reached LocalShards.
        x = torch.randn(2, 8, generator=torch.Generator().manual_seed(rank)).to(device()).requires_grad_() * 1
        out = step(x)
        x.register_hook(lambda grad: (_ for _ in ()).throw(RuntimeError("stopped in backward")))
        with pytest.raises(RuntimeError, match="stopped in backward"):
            out.pow(2).mean().backward()
        model.zero_grad()
        loss(step, 0).backward()

    for use in (accumulate, hand_back, hooked, failed_then_cleared):
        torch.compiler.reset()  # eight models in all would reach Dynamo's cap of graphs per frame
        before = deferred_reductions.counts()
        later = stack_gradients(rank, world_size, {}, use)
        # the graphs did leave their reductions to finish later
        assert deferred_reductions.counts().finished > before.finished, use.__name__
        in_graph = stack_gradients(rank, world_size, {"disable_passes": FINISHED_IN_GRAPH}, use)
        for name, grad in later.items():
            torch.testing.assert_close(grad, in_graph[name], rtol=0, atol=0,
                                       msg=lambda m: f"{use.__name__} {name}: {m}")
        held = deferred_reductions.counts()
        assert held.unfinished == held.placeholders == 0, (use.__name__, held)


@pytest.mark.distributed
def test_overlap_across_layer_graphs_trains_as_without_it():
    run_ranks(in_turn, 2, {"overlap across layers": (overlap_across_layers_run,)})


@pytest.mark.distributed
def test_a_misguessed_prefetch_and_reductions_finished_elsewhere_train_as_without_overlap():
    run_ranks(in_turn, 2, {"prefetch misguessed": (prefetch_misguessed_run,),
                           "reductions finished later, inductor": (reductions_finished_later_inductor_run,),
                           "reductions finished later, elsewhere": (reductions_finished_later_elsewhere_run,)})


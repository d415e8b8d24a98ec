"""Config.compile_layers_once: every decoder layer of an HF Llama runs one compiled region, its
weights gathered outside it, with the unsharded model's gradients and backward's re-gathers."""

from __future__ import annotations

from collections import Counter
from typing import Callable

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint
from torch._dynamo.utils import compile_times

import zpp_compile as zpp
from distributed import device, run_ranks
from models import batches
from test_composability import no_sync_run
from zpp_compile.backend import zeropp_backend
from zpp_compile import config as config_module
from zpp_compile.config import ConfigError
from zpp_compile.torch_compat import regions_reuse_traces
from zpp_compile.layer_regions import _flatten_call, _unflatten_call

LAYERS = 3
PER_RANK = 2
VOCAB = 61


def llama(transformers) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=72, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, use_cache=False,
    )
    return transformers.LlamaForCausalLM(config).to(device())


def sharded_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's full gradient, by the unsharded model's parameter names."""
    grads = {}
    for name, module in model.named_modules():
        for leaf, param in module._parameters.items():
            if param is not None:
                grads[f"{name}.{leaf}".lstrip(".")] = param.grad.full_tensor().reshape(module._zpp.layouts[leaf].shape)
    return grads


def region_traces() -> int:
    """How many times Dynamo has traced the body of a nested compile region in this process."""
    names, values = compile_times(repr="csv")
    times = dict(zip(names, values)).get("invoke_subgraph_trace")
    return len(times.split(",")) if times else 0


def compile_once_run(rank: int, world_size: int) -> None:
    transformers = pytest.importorskip("transformers")
    tokens = batches(1, world_size, PER_RANK, vocab=VOCAB)[0][0].to(device())
    mine = tokens[rank * PER_RANK:(rank + 1) * PER_RANK]
    reference = llama(transformers)
    reference(input_ids=tokens, labels=tokens).loss.backward()
    expected = {name: p.grad for name, p in reference.named_parameters()}

    model = zpp.shard(llama(transformers), zpp.Config(compile_layers_once=True))
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return zeropp_backend(gm, example_inputs, {"inductor": False})

    step = torch.compile(model, backend=backend)
    traced_before = region_traces()
    step(input_ids=mine, labels=mine).loss.backward()
    # Dynamo traced the first layer's gathers and compute, one region each, and reused both
    # traces for the other layers.
    assert region_traces() - traced_before == 2
    for name, grad in sharded_grads(model).items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")

    # One subgraph, called by every layer.
    (graph,) = graphs
    regions = [n for n in graph.graph.nodes if n.target is torch.ops.higher_order.invoke_subgraph]
    assert len(regions) == LAYERS and len({n.args[0].target for n in regions}) == 1

    # Reshard after forward: backward gathers every layer's weights again. Forward gathers the
    # embedding, each layer (one bucket each) and the final norm with the head; backward all but
    # the embedding, whose gradient needs no weight.
    gathers = Counter(row.phase for row in zpp.comm_report().rows)
    assert (gathers["forward weight gather"], gathers["backward weight gather"]) == (LAYERS + 2, LAYERS + 1)

    # Run eagerly, the layers compute with the weights gathered before them just the same.
    model.zero_grad()
    model(input_ids=mine, labels=mine).loss.backward()
    for name, grad in sharded_grads(model).items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


class NumberedLayer(nn.Module):
    """A layer whose forward reads a number of its own, as an HF layer may read its layer_idx:
    the same parameters as its siblings, a trace of its own."""

    def __init__(self, dim: int, number: int) -> None:
        super().__init__()
        self.number = number
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(x) / (self.number + 1)


def stack_matches_unsharded_run(rank: int, world_size: int, layers: Callable[[], list[nn.Module]], seed: int) -> None:
    """A stack of `layers()` compiled once per layer gives the unsharded stack's gradients."""
    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(*layers()).to(device())

    x = torch.randn(2 * world_size, 8, generator=torch.Generator().manual_seed(seed)).to(device())
    reference = build()
    reference(x).pow(2).mean().backward()
    model = zpp.shard(build(), zpp.Config(compile_layers_once=True))
    mine = x[rank * 2:(rank + 1) * 2]
    torch.compile(model, backend="zeropp", options={"inductor": False})(mine).pow(2).mean().backward()
    for name, grad in sharded_grads(model).items():
        torch.testing.assert_close(grad, dict(reference.named_parameters())[name].grad, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{name}: {m}")


def numbered_layers_run(rank: int, world_size: int) -> None:
    """More layers of distinct traces than torch's default cap on a region's traces (8)."""
    stack_matches_unsharded_run(rank, world_size, lambda: [NumberedLayer(8, number) for number in range(12)], seed=1)


def same_collectives_run(rank: int, world_size: int) -> None:
    """All three techniques, 2 ranks as 2 nodes: the step runs the same collectives with and
    without regions (each layer's gathers keep to that layer's bucket) and reports the same hpZ
    copy (the regions' bodies, which hold no collectives, are left out of the ledger)."""
    transformers = pytest.importorskip("transformers")
    tokens = batches(1, world_size, PER_RANK, vocab=VOCAB)[0][0].to(device())
    mine = tokens[rank * PER_RANK:(rank + 1) * PER_RANK]
    reports = []
    for once in (False, True):
        config = zpp.Config(compile_layers_once=once, quantized_weights=True, weight_block_size=32,
                            hpz_partition_size=1, quantized_gradients=True, gradient_block_size=32, ranks_per_node=1)
        model = zpp.shard(llama(transformers), config)
        zpp.reset_comm_report()
        torch.compile(model, backend="zeropp", options={"inductor": False})(input_ids=mine, labels=mine).loss.backward()
        report = zpp.comm_report()
        rows = sorted((row.phase, row.op, row.dtype, row.intra_bytes, row.inter_bytes) for row in report.rows)
        reports.append((rows, report.secondary_bytes))
    assert reports[0][1] > 0
    assert reports[1] == reports[0]


class CheckpointingLayer(nn.Module):
    """A layer that checkpoints part of its own forward: its region's body holds a region of its own."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.utils.checkpoint.checkpoint(lambda y: torch.relu(self.fc1(y)), x, use_reentrant=False)
        return x + self.fc2(hidden)


def checkpointing_layers_run(rank: int, world_size: int) -> None:
    stack_matches_unsharded_run(rank, world_size, lambda: [CheckpointingLayer(8) for _ in range(3)], seed=2)


def compile_once_runs(rank: int, world_size: int) -> None:
    compile_once_run(rank, world_size)
    numbered_layers_run(rank, world_size)
    checkpointing_layers_run(rank, world_size)
    same_collectives_run(rank, world_size)
    # Gradient accumulation without sync: the gathers in the layers' regions keep or add the
    # gradients, as inline ones do.
    zpp.reset_comm_report()  # no_sync_run reads the graphs of its own model
    no_sync_run(rank, world_size, compiled=True, config=zpp.Config(compile_layers_once=True))


needs_region_reuse = pytest.mark.skipif(not regions_reuse_traces(), reason="this torch's regions trace every call")


@pytest.mark.distributed
@needs_region_reuse
def test_layers_compiled_once_match_unsharded_model_and_regather_in_backward():
    run_ranks(compile_once_runs, 2)


def test_a_torch_whose_regions_trace_every_call_is_refused(monkeypatch):
    monkeypatch.setattr(config_module, "regions_reuse_traces", lambda: False)
    with pytest.raises(ConfigError, match="compile_layers_once=True needs a torch whose .* traces a region once"):
        zpp.Config(compile_layers_once=True)
    zpp.Config(compile_layers_once=False)


@needs_region_reuse
def test_activation_checkpointing_is_refused_with_layers_compiled_once():
    # Checkpointing would silently keep every activation: the layers are partitioned in their regions.
    with pytest.raises(ConfigError, match="compile_layers_once=True does not combine with activation_checkpointing"):
        zpp.Config(compile_layers_once=True, activation_checkpointing="full")
    with pytest.raises(ConfigError, match="activation_checkpointing='selective'"):
        zpp.Config(compile_layers_once=True).updated({"activation_checkpointing": "selective"})


def test_layer_arguments_come_back_from_the_flat_region_call():
    a, b, c = torch.ones(2), torch.zeros(3), torch.arange(4)
    calls = [
        ((), {}),
        ((a,), {"mask": None, "rope": (b, c), "cache": None, "use_cache": False}),
        ((a, (b, c), ()), {"nested": (a, (b,)), "listed": [c], "mapped": {"k": a}, "n": 3}),
    ]
    for args, kwargs in calls:
        layout, values = _flatten_call(args, kwargs)
        assert _unflatten_call(len(args), layout, tuple(values)) == (args, kwargs)
    # Tuples are opened in place, so Dynamo sees only tensors and constants.
    assert _flatten_call(*calls[1]) == ("0,mask,rope*2,cache,use_cache", [a, None, b, c, None, False])

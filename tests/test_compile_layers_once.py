"""Config.compile_layers_once: every decoder layer of an HF Llama runs one compiled graph of its
own, with the unsharded model's gradients, the same collectives as the whole-step graph, and
backward's re-gathers."""

from __future__ import annotations

import warnings
from collections import Counter
from typing import Callable

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint
from distributed import device, in_turn, run_ranks
from layer_stacks import ALL_THREE, LAYERS, PER_RANK, VOCAB, MlpLayer, llama
from models import batches
from test_composability import no_sync_run

import zpp_compile as zpp
from zpp_compile.compiler.backend import zeropp_backend
from zpp_compile.compiler.layer_graphs import graphs_run_by
from zpp_compile.passes import PASSES, GraphPass
from zpp_compile.passes.lower_collectives import lower_collectives
from zpp_compile.reports.dump import read_layer_runs
from zpp_compile.reports.ledger import CollectiveRecord, CommReport, GraphComm
from zpp_compile.runtime import programs
from zpp_compile.runtime.layer_scope import running_layer
from zpp_compile.runtime.quantization.weight_format import packed_weight_bytes
from zpp_compile.runtime.topology import Group
from zpp_compile.torch_compat import ListedWithoutDynamoWalks


def sharded_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's full gradient, by the unsharded model's parameter names."""
    grads = {}
    for name, module in model.named_modules():
        for leaf, param in module._parameters.items():
            if param is not None:
                grads[f"{name}.{leaf}".lstrip(".")] = param.grad.full_tensor().reshape(module._zpp.layouts[leaf].shape)
    return grads


def counting_backend(graphs: list, options: dict, lowered: list | None = None) -> Callable:
    """zeropp's backend, keeping each graph Dynamo hands it and whether it is a layer's own, and in
    `lowered` each partitioned graph as lowering gets it, with its PassContext."""
    def keeping(graph, ctx):
        lowered.append((graph, ctx))
        lower_collectives(graph, ctx)

    passes = [GraphPass(p.name, p.stage, keeping) if p.name == "lower_collectives" and lowered is not None else p
              for p in PASSES]

    def backend(gm, example_inputs):
        graphs.append((gm, running_layer() is not None))
        return zeropp_backend(gm, example_inputs, options, passes=passes)
    return backend


def compile_once_run(rank: int, world_size: int) -> None:
    transformers = pytest.importorskip("transformers")
    tokens = batches(1, world_size, PER_RANK, vocab=VOCAB)[0][0].to(device())
    mine = tokens[rank * PER_RANK:(rank + 1) * PER_RANK]
    reference = llama(transformers, tied=True)
    reference(input_ids=tokens, labels=tokens).loss.backward()
    expected = {name: p.grad for name, p in reference.named_parameters(remove_duplicate=False)}

    grads, reports = {}, {}
    for once in (False, True):
        model = zpp.shard(llama(transformers, tied=True), zpp.Config(compile_layers_once=once))
        graphs: list = []
        zpp.reset_comm_report()
        step = torch.compile(model, backend=counting_backend(graphs, {"inductor": False}))
        step(input_ids=mine, labels=mine).loss.backward()
        grads[once] = sharded_grads(model)
        reports[once] = report = zpp.comm_report()
        # A second step, on the weights the first one trained: its gradients too are the same.
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        optimizer.step()
        optimizer.zero_grad()
        step(input_ids=mine, labels=mine).loss.backward()
        grads[once, "trained"] = sharded_grads(model)
        if once:
            # At its visits of the model's modules Dynamo walks none of their parameters (what that
            # skips: test_torch_compat); the classes keep the names transformers matches them by.
            assert all(isinstance(m, ListedWithoutDynamoWalks) for m in model.modules()
                       if next(m.parameters(), None) is not None)
            assert [type(m).__name__ for m in (model, model.model, model.model.layers[0])] == [
                "LlamaForCausalLM", "LlamaModel", "LlamaDecoderLayer"]
            # Dynamo compiled the first layer's forward, a graph of its own, and ran it for the others.
            assert [len(gm.graph.find_nodes(op="call_function", target=torch.ops.zpp.all_gather_param))
                    for gm, one_layer in graphs if one_layer] == [len(list(model.model.layers[0].parameters()))]
            sharding_id = zpp.REGISTRY.sharding_id(model)
            ran = graphs_run_by(sharding_id)
            assert sorted(ran) == [f"model.layers.{i}" for i in range(LAYERS)] and len(set(ran.values())) == 1
            # Reshard after forward: backward gathers every layer's weights again. Forward gathers
            # the embedding, each layer (one bucket each) and the final norm (each in a graph of its
            # own: the step's graph breaks at the layers); the head, tied to the embedding, takes
            # the embedding's weight, held from that graph's gather, and keeps it for its backward.
            # Backward gathers the layers and the norm: the embedding's gradient needs no weight.
            gathers = Counter(row.phase for row in report.rows)
            assert (gathers["forward weight gather"], gathers["backward weight gather"]) == (LAYERS + 2, LAYERS + 1)
            # An evaluation between steps runs graphs of its own, not the training step's.
            with torch.no_grad():
                torch.compile(model, backend="zeropp", options={"inductor": False})(input_ids=mine)
            assert zpp.comm_report() == report
    # The whole-step graph's collectives but one: it gathers the tied weight again for the head's backward.
    whole, once = reports[False].by_phase(), reports[True].by_phase()
    regather = "backward weight gather"
    assert {k: v for k, v in once.items() if k != regather} == {k: v for k, v in whole.items() if k != regather}
    tied_bytes = model.lm_head._zpp.layouts["weight"].shard_size * 4 * (world_size - 1)  # what the others send
    assert sum(once[regather]) == sum(whole[regather]) - tied_bytes
    # The same ops in the same order: the same gradients, to the bit, in both steps.
    for key in (False, (False, "trained")):
        other = (True, "trained") if key else True
        for name, grad in grads[other].items():
            assert torch.equal(grad, grads[key][name]), (key, name)
    for name, grad in grads[True].items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")

    # Run eagerly (on the trained weights), the layers compute just the same.
    model.zero_grad()
    model(input_ids=mine, labels=mine).loss.backward()
    for name, grad in sharded_grads(model).items():
        torch.testing.assert_close(grad, grads[True, "trained"][name], rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{name}: {m}")

    # Untied and tied again after sharding (as HF's tie_weights() assigns), the weights held
    # across graphs follow.
    head, embedding = model.lm_head, model.model.embed_tokens
    assert head._zpp.tied == embedding._zpp.tied != {}
    head.weight = nn.Parameter(torch.zeros(VOCAB, 32, device=device()))
    assert head._zpp.tied == embedding._zpp.tied == {}
    head.weight = embedding.weight
    assert head._zpp.tied == embedding._zpp.tied != {}


class NumberedLayer(nn.Module):
    """A layer whose forward reads a number of its own, as an HF layer may read its layer_idx:
    the same parameters as its siblings, a trace of its own."""

    def __init__(self, dim: int, number: int) -> None:
        super().__init__()
        self.number = number
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(x) / (self.number + 1)


def stack_matches_unsharded_run(rank: int, world_size: int, layers: Callable[[], list[nn.Module]], seed: int,
                                config: zpp.Config = zpp.Config(compile_layers_once=True),
                                lowered: list | None = None, inductor: bool = False) -> tuple[list, nn.Module]:
    """A stack of `layers()` compiled once per distinct layer gives the unsharded stack's
    gradients; returns the graphs Dynamo handed the backend, each with whether it is a layer's own
    (and keeps the partitioned graphs in `lowered`), and the sharded stack."""
    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(*layers()).to(device())

    x = torch.randn(2 * world_size, 8, generator=torch.Generator().manual_seed(seed)).to(device())
    reference = build()
    reference(x).pow(2).mean().backward()
    model = zpp.shard(build(), config)
    mine = x[rank * 2:(rank + 1) * 2]
    graphs: list = []
    step = torch.compile(model, backend=counting_backend(graphs, {"inductor": inductor}, lowered))
    step(mine).pow(2).mean().backward()
    for name, grad in sharded_grads(model).items():
        torch.testing.assert_close(grad, dict(reference.named_parameters())[name].grad, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{name}: {m}")
    return graphs, model


def numbered_layers_run(rank: int, world_size: int) -> None:
    """More layers of distinct graphs than torch's default cap on a frame's compilations (8): each
    still runs a compiled graph, none falls back to running eagerly."""
    layers = lambda: [NumberedLayer(8, n) for n in range(12)]  # noqa: E731
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graphs, model = stack_matches_unsharded_run(rank, world_size, layers, seed=1)
    assert sum(one_layer for _, one_layer in graphs) == 12
    # Once per job (rank 0), as the fifth graph comes: the layers trace apart, and compile time grows.
    apart = [str(w.message) for w in caught if "differs from layer to layer" in str(w.message)]
    assert len(apart) == (rank == 0) and all("compiled 5 graphs for 5 layers" in m for m in apart), apart
    sharding_id = zpp.REGISTRY.sharding_id(model)
    assert len(set(graphs_run_by(sharding_id).values())) == 12


def kv_cache_run(rank: int, world_size: int) -> None:
    """An HF model left with `use_cache` on hands its layers a KV cache in training, which each layer
    updates at its own index: every layer traces apart, and the warning says what to set."""
    transformers = pytest.importorskip("transformers")
    tokens = batches(1, world_size, PER_RANK, vocab=VOCAB)[0][0].to(device())
    model = zpp.shard(llama(transformers, layers=5, use_cache=True), zpp.Config(compile_layers_once=True))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.compile(model, backend="zeropp", options={"inductor": False})(input_ids=tokens, labels=tokens)
    apart = [str(w.message) for w in caught if "differs from layer to layer" in str(w.message)]
    assert len(apart) == (rank == 0) and all("model.config.use_cache = False" in m for m in apart), apart


def same_collectives_run(rank: int, world_size: int) -> None:
    """All three techniques, 2 ranks as 2 nodes, an HF Llama whose embedding is tied to its head:
    the step moves the same bytes over each link in each phase with and without layers compiled
    on their own (a layer's graph counts once per layer that ran it), and gives the same gradients
    to the bit. The layer graphs hold one hpZ copy fewer: the head's graph keeps the tied weight
    itself for its backward, where the whole-step graph keeps a copy to gather it from again. (The
    final norm and the head are a bucket of the step's graph, and a graph of their own when the
    step's graph breaks at the layers.)"""
    transformers = pytest.importorskip("transformers")
    tokens = batches(1, world_size, PER_RANK, vocab=VOCAB)[0][0].to(device())
    mine = tokens[rank * PER_RANK:(rank + 1) * PER_RANK]
    reports, grads = [], []
    for once in (False, True):
        config = zpp.Config(compile_layers_once=once, **ALL_THREE)
        model = zpp.shard(llama(transformers, tied=True), config)
        zpp.reset_comm_report()
        torch.compile(model, backend="zeropp", options={"inductor": False})(input_ids=mine, labels=mine).loss.backward()
        report = zpp.comm_report()
        reports.append((report.by_phase(), report.secondary_bytes))
        grads.append(sharded_grads(model))
    tied = model.lm_head._zpp.layouts["weight"]
    tied_copy = world_size * packed_weight_bytes(tied.shard_size, ALL_THREE["weight_block_size"])
    assert reports[1] == (reports[0][0], reports[0][1] - tied_copy)
    for name, grad in grads[1].items():
        assert torch.equal(grad, grads[0][name]), name


class CheckpointingLayer(nn.Module):
    """A layer that checkpoints part of its own forward with torch.utils.checkpoint."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.utils.checkpoint.checkpoint(lambda y: torch.relu(self.fc1(y)), x, use_reentrant=False)
        return x + self.fc2(hidden)




def saved_by_layer_forward(lowered: list) -> list[str]:
    """What the forwards of the layers' graphs compute and save for backward: their outputs that
    are not their inputs, less the layer's own output (the first). The first layer has a graph of
    its own, since its input needs no gradient."""
    forwards = [graph for graph, ctx in lowered if ctx.one_layer and ctx.kind == "forward"]
    assert len(forwards) == 2
    outputs = [value for forward in forwards for value in forward.find_nodes(op="output")[0].args[0][1:]]
    return [str(value) for value in outputs if getattr(value, "op", None) != "placeholder"]


def checkpointing_layers_run(rank: int, world_size: int) -> None:
    """torch.utils.checkpoint inside a layer, and Config.activation_checkpointing over the
    layers: the unsharded model's gradients; with "full", the forward of a layer's graph saves
    nothing it computed (backward recomputes it from the layer's input)."""
    stack_matches_unsharded_run(rank, world_size, lambda: [CheckpointingLayer(8) for _ in range(3)], seed=2)
    saved = {}
    for checkpointing in ("none", "selective", "full"):
        config = zpp.Config(compile_layers_once=True, activation_checkpointing=checkpointing)
        lowered: list = []
        stack_matches_unsharded_run(rank, world_size, lambda: [MlpLayer(8) for _ in range(3)], 3, config, lowered)
        saved[checkpointing] = saved_by_layer_forward(lowered)
    assert saved["full"] == [] and len(saved["none"]) > len(saved["selective"]) > 0, saved


def inductor_run(rank: int, world_size: int) -> None:
    """Under Inductor, the layers' graphs give the unsharded stack's gradients to fp32 rounding,
    the first gather of each layer graph computed, and each backward graph's last reductions
    finished, by the programs Inductor compiled for them."""
    compiled_before = len(programs.compiled_programs())
    graphs, _ = stack_matches_unsharded_run(rank, world_size, lambda: [MlpLayer(8) for _ in range(3)], seed=4,
                                            inductor=True)
    assert sum(one_layer for _, one_layer in graphs) == 2  # the first layer's and the others'
    compiled = programs.compiled_programs()[compiled_before:]
    # The prefetched gathers' programs (what each sends: no collective, no wait) and the deferred
    # reductions' ends (each waits for its reduce-scatter, then divides and cuts).
    issues = ("_c10d_functional.all_gather", "_c10d_functional.reduce_scatter")
    assert any("wait_tensor" not in program and not any(map(program.__contains__, issues)) for program in compiled)
    assert any("wait_tensor" in program and not any(map(program.__contains__, issues)) for program in compiled)


def no_sync_layers_run(rank: int, world_size: int) -> None:
    """Gradient accumulation without sync: the gathers in the layers' graphs keep or add the
    gradients, as the step's do."""
    zpp.reset_comm_report()  # no_sync_run reads the graphs of its own model
    no_sync_run(rank, world_size, compiled=True, config=zpp.Config(compile_layers_once=True))



def test_a_layers_graph_counts_once_per_layer_that_ran_it_last():
    gather = CollectiveRecord("all_gather", Group("0", (0, 1)), torch.bfloat16, 10, 0, False)
    reduce = CollectiveRecord("reduce_scatter", Group("0", (0, 1)), torch.float32, 20, 0, True)
    graphs = [GraphComm("g0.forward", "forward", (gather,), 3), GraphComm("g0.backward", "backward", (reduce,)),
              GraphComm("g1.forward", "forward", (gather,), 7, one_layer=True),
              GraphComm("g1.backward", "backward", (gather, reduce), one_layer=True),
              # A layer's graph no layer runs any more (recompiled, say): not part of the step.
              GraphComm("g2.forward", "forward", (gather,), one_layer=True),
              GraphComm("g2.backward", "backward", (reduce,), one_layer=True)]
    report = CommReport.from_graphs(graphs, {"g1": 4, "g2": 0})
    assert Counter(row.graph for row in report.rows) == {"g0.forward": 1, "g0.backward": 1, "g1.forward": 4,
                                                          "g1.backward": 8}
    assert report.secondary_bytes == 3 + 4 * 7
    # Read back from a dump, a layer's graph keeps what it is.
    assert [GraphComm.from_dict(g.to_dict()) for g in graphs] == graphs
    with pytest.raises(ValueError, match="'one_layer' must be true or false"):
        GraphComm.from_dict({**graphs[2].to_dict(), "one_layer": 1})
    with pytest.raises(ValueError, match="graph ids with layer counts"):
        read_layer_runs({"g1": -1})


@pytest.mark.distributed
def test_layers_compiled_once_match_unsharded_model_and_regather_in_backward():
    run_ranks(in_turn, 2, {"hf llama": (compile_once_run,), "numbered layers": (numbered_layers_run,),
                           "checkpointing": (checkpointing_layers_run,), "all three": (same_collectives_run,),
                           "inductor": (inductor_run,)})


@pytest.mark.distributed
def test_layers_compiled_once_with_kv_cache_and_accumulation_without_sync():
    run_ranks(in_turn, 2, {"kv cache": (kv_cache_run,), "no sync": (no_sync_layers_run,)})


"""Config.activation_checkpointing: the compiled step recomputes each layer's activations in
backward, gives the unsharded model's loss and gradients, and forward saves less for backward.

The models use scaled_dot_product_attention with DTensor parameters, the case where
torch.utils.checkpoint fails under torch.compile on torch 2.13 (see test_composability).
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from distributed import device, run_ranks
from extras import needs, optional

import zpp_compile as zpp
from zpp_compile.reports.ledger import LEDGER

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt import GPT, GPTConfig  # noqa: E402

transformers = optional("transformers")
MODES = ("none", "full", "selective")
PER_RANK, SEQ = 2, 16
GPT_CONFIG = GPTConfig(seq=SEQ, dim=32, heads=2, layers=2)


def llama() -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=61, hidden_size=32, intermediate_size=72, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=True, attn_implementation="sdpa",
    )
    return transformers.LlamaForCausalLM(config)


def gpt_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model(tokens[:, :-1], tokens[:, 1:])


def llama_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model(input_ids=tokens, labels=tokens).loss


def one_step(rank: int, world_size: int, build, loss_of, options: dict) -> tuple[float, dict, list[tuple]]:
    """One compiled forward and backward on this rank's rows: (the global mean loss, the full
    gradients, the shape of every tensor forward saved for backward)."""
    vocab = 61 if loss_of is llama_loss else 256
    tokens = torch.randint(0, vocab, (world_size * PER_RANK, SEQ + 1), generator=torch.Generator().manual_seed(1))
    mine = tokens[rank * PER_RANK:(rank + 1) * PER_RANK].to(device())
    torch.manual_seed(0)
    model = zpp.shard(build().to(device()), zpp.Config(**options))
    compiled = torch.compile(model, backend="zeropp", options={"inductor": False})
    saved: list[tuple] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        loss = loss_of(compiled, mine)
    loss.backward()
    loss = loss.detach().clone()
    torch.distributed.all_reduce(loss)
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters() if p.grad is not None}
    return float(loss) / world_size, grads, saved


def reference(build, loss_of, world_size: int) -> tuple[float, dict]:
    """The unsharded model, one process, the global batch."""
    vocab = 61 if loss_of is llama_loss else 256
    tokens = torch.randint(0, vocab, (world_size * PER_RANK, SEQ + 1), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    model = build().to(device())
    loss = loss_of(model, tokens.to(device()))
    loss.backward()
    return float(loss), {name: p.grad.reshape(-1) for name, p in model.named_parameters() if p.grad is not None}


def assert_matches(result: tuple[float, dict, list], expected: tuple[float, dict], mode: str) -> None:
    loss, grads, _ = result
    expected_loss, expected_grads = expected
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=0)
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad.reshape(-1).cpu(), expected_grads[name].cpu(), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{mode}, {name}: {m}")


def numel(shapes: list[tuple]) -> int:
    return sum(torch.Size(s).numel() for s in shapes)


def every_mode(rank: int, world_size: int) -> dict:
    """GPT and the HF Llama in each mode against their references; the saved shapes per mode."""
    out = {}
    for name, build, loss_of in (("gpt", lambda: GPT(GPT_CONFIG), gpt_loss), ("llama", llama, llama_loss)):
        expected = reference(build, loss_of, world_size)
        for mode in MODES:
            result = one_step(rank, world_size, build, loss_of, {"activation_checkpointing": mode})
            assert_matches(result, expected, f"{name} {mode}")
            out[name, mode] = result[2]
    return out


@pytest.fixture(scope="module")
def saved_shapes() -> dict:
    return run_ranks(every_mode, 2)[0]


@pytest.mark.distributed
@needs("transformers")  # the fixture runs the HF Llama too
def test_gpt_saves_layer_inputs_only_with_full(saved_shapes):
    b, t, d, heads, layers = PER_RANK, SEQ, GPT_CONFIG.dim, GPT_CONFIG.heads, GPT_CONFIG.layers
    residual, mlp, attention = (b, t, d), (b * t, 4 * d), (b, heads, t, d // heads)
    count = {mode: Counter(saved_shapes["gpt", mode]) for mode in MODES}
    # Without checkpointing forward keeps the MLP's matmul and GELU outputs and attention's
    # inputs and output; selective keeps the matmul outputs and attention's output (the GELU
    # and the norms are recomputed); full keeps each layer's input and nothing from inside.
    assert count["none"][mlp] == 2 * layers and count["none"][attention] >= 2 * layers, count["none"]
    assert count["selective"][mlp] == layers and count["selective"][attention] == layers, count["selective"]
    assert count["full"][mlp] == 0 and count["full"][attention] == 0, count["full"]
    assert count["full"][residual] == layers, count["full"]
    full, selective, none = (numel(saved_shapes["gpt", mode]) for mode in ("full", "selective", "none"))
    assert full < selective < none


@pytest.mark.distributed
@needs("transformers")
def test_llama_saves_less_with_checkpointing(saved_shapes):
    b, t, intermediate = PER_RANK, SEQ + 1, 72
    mlp = (b * t, intermediate)
    count = {mode: Counter(saved_shapes["llama", mode]) for mode in MODES}
    assert count["none"][mlp] >= 3 * 2 and count["selective"][mlp] == 2 * 2 and count["full"][mlp] == 0, count
    assert numel(saved_shapes["llama", "full"]) < numel(saved_shapes["llama", "selective"])
    assert numel(saved_shapes["llama", "selective"]) < numel(saved_shapes["llama", "none"])


def hpz_backward(rank: int, world_size: int) -> list:
    """With hpZ keeping a full copy on each rank (2 emulated nodes of one rank), backward's
    recomputed matmuls read the copy: backward gathers nothing. Returns backward's all-gathers."""
    options = {"hpz_partition_size": 1, "ranks_per_node": 1, "quantized_weights": True, "weight_block_size": 64}
    build = lambda: GPT(GPT_CONFIG)  # noqa: E731
    plain = one_step(rank, world_size, build, gpt_loss, options)
    start = len(LEDGER.graphs)
    checkpointed = one_step(rank, world_size, build, gpt_loss, {**options, "activation_checkpointing": "full"})
    # Recomputing changes no bit: the same ops on the same values.
    assert checkpointed[0] == plain[0]
    for name, grad in plain[1].items():
        torch.testing.assert_close(checkpointed[1][name], grad, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    assert numel(checkpointed[2]) < numel(plain[2])
    backward = [g for g in LEDGER.graphs[start:] if g.kind == "backward"]
    assert backward and any(c.op == "all_gather" for g in LEDGER.graphs[start:] for c in g.collectives)
    return [c for g in backward for c in g.collectives if c.op == "all_gather"]


@pytest.mark.distributed
def test_hpz_copy_feeds_the_recomputation():
    assert run_ranks(hpz_backward, 2) == [[], []]


def test_a_bad_value_is_a_clear_error():
    with pytest.raises(zpp.ConfigError, match=r"activation_checkpointing='ful'.*\['none', 'full', 'selective'\]"):
        zpp.Config(activation_checkpointing="ful")
    assert zpp.Config.from_dict({"activation_checkpointing": "selective"}).activation_checkpointing == "selective"

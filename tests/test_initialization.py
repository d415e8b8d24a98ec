"""Initial values of sharded models: a model built on the meta device is materialized shard by
shard and initialized exactly as the unsharded model, within a shard's worth of memory; buffers
take rank 0's values; a full state dict (HF Llama's) loads into the sharded model."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from distributed import device, run_ranks
from extras import needs, optional
from models import TinyTransformer
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

import zpp_compile as zpp

transformers = optional("transformers")


class ScaledBlock(nn.Module):
    """Parameters of its own, a 0-d one among them, and a random buffer, all set by its
    reset_parameters() (called last in __init__, as torch's layers do)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(dim), nn.Linear(dim, 2 * dim + 1)
        self.out = nn.Linear(2 * dim + 1, dim)
        self.scale, self.gate = nn.Parameter(torch.empty(dim)), nn.Parameter(torch.empty(()))
        self.register_buffer("noise", torch.empty(5))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.scale)
        nn.init.uniform_(self.gate)
        nn.init.uniform_(self.noise)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gate * self.out(torch.relu(self.fc(self.norm(x)))) * self.scale + self.noise.mean()


class InitModel(nn.Module):
    def __init__(self, tied: bool = True, vocab: int = 37, dim: int = 24) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(ScaledBlock(dim) for _ in range(2))
        self.head = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def small_init(module: nn.Module) -> None:
    """A GPT-2 style init of one module's own parameters and buffers."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
    if isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)
    if isinstance(module, ScaledBlock):
        nn.init.normal_(module.scale, std=0.5)
        nn.init.constant_(module.gate, 0.25)
        nn.init.normal_(module.noise)


def assert_same_state(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(got[key].cpu(), value.cpu()), f"{key} differs from the unsharded model's"


def peak_memory_growth(run) -> int:
    """Bytes by which the peak memory of the device holding the shards exceeds its memory before
    `run()`: the process's resident memory on CPU, allocated GPU memory on a GPU."""
    if device().type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        run()
        return torch.cuda.max_memory_allocated() - before

    def status(field: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))

    try:  # reset the peak to the current resident size; without it the measure is an upper bound
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    before = status("VmRSS:")
    run()
    return status("VmHWM:") - before


class Wide(nn.Module):
    """24 layers of 2048 x 2048: 403 MB in float32."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(2048, 2048, bias=False) for _ in range(24))


class LazyStateDict(dict):
    """Makes each tensor when it is read, as a reader of safetensors files does."""

    def __getitem__(self, key: str) -> torch.Tensor:
        return torch.full((2048, 2048), float(super().__getitem__(key)))


def meta_init_run(rank: int, world_size: int) -> dict[str, int]:
    # reset_parameters(), the default: equal to the model built on a real device with the same
    # seed. Rank 0's random stream is the one used; the other ranks' are left where they were.
    torch.manual_seed(0)
    with torch.device(device()):
        reference = InitModel()
    next_draw = torch.randn(4)
    torch.manual_seed(0 if rank == 0 else 7)
    with torch.device("meta"):
        model = InitModel()
    zpp.shard(model)
    assert_same_state(zpp.full_state_dict(model), reference.state_dict())
    draw = torch.randn(4)
    if rank != 0:
        torch.manual_seed(7)
        next_draw = torch.randn(4)
    assert torch.equal(draw, next_draw), "shard() moved the random stream unlike an unsharded build"
    assert model.head._parameters["weight"] is model.embed._parameters["weight"], "tied weights came apart"
    tokens = torch.randint(0, 37, (2, 5), generator=torch.Generator().manual_seed(0)).to(device())
    torch.testing.assert_close(model(tokens), reference(tokens), rtol=1e-6, atol=1e-7)

    # A function of one module, for a model with its own init scheme: as model.apply(fn) on the
    # unsharded model.
    torch.manual_seed(0)
    with torch.device(device()):
        reference = InitModel(tied=False)
    torch.manual_seed(1)
    reference.apply(small_init)
    with torch.device("meta"):
        model = InitModel(tied=False)
    torch.manual_seed(1)
    zpp.shard(model, init=small_init)
    assert_same_state(zpp.full_state_dict(model), reference.state_dict())

    # Buffers take rank 0's values (ranks need not share a seed).
    torch.manual_seed(rank)
    model = InitModel().to(device())
    rank0_noise = [model.blocks[0].noise.cpu()]
    dist.broadcast_object_list(rank0_noise, src=0)
    zpp.shard(model)
    assert torch.equal(model.blocks[0].noise.cpu(), rank0_noise[0])

    # An init that misses a tensor: the same clear error on every rank.
    with torch.device("meta"):
        model = InitModel()
    with pytest.raises(ValueError, match=r"init\(module\) left scale, gate, noise of module 'blocks\.0' unset"):
        zpp.shard(model, init=lambda m: None if isinstance(m, ScaledBlock) else small_init(m))
    with pytest.raises(ValueError, match="this model has none"):
        zpp.shard(InitModel(), init=small_init)

    # Memory: the model is larger than any rank's growth in peak memory. A full state dict then
    # loads from rank 0 one tensor at a time (each made as it is read): a chunk or tensor's worth.
    full_bytes = 24 * 2048 * 2048 * 4
    wide: list[nn.Module] = []

    def build() -> None:
        with torch.device("meta"):
            wide.append(Wide())
        zpp.shard(wide[0])

    init_growth = peak_memory_growth(build)
    full = LazyStateDict({f"layers.{i}.weight": i for i in range(24)})
    load_growth = peak_memory_growth(lambda: zpp.load_full_state_dict(wide[0], full if rank == 0 else None))
    layer = wide[0].layers[5]._parameters["weight"].to_local()
    assert torch.equal(layer, torch.full_like(layer, 5.0))
    return {"init": init_growth, "load": load_growth, "full": full_bytes}


def llama_run(rank: int, world_size: int) -> None:
    config = transformers.LlamaConfig(
        vocab_size=61, hidden_size=32, intermediate_size=72, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(config).to(device()).eval()
    tokens = torch.randint(0, 61, (2, 7), generator=torch.Generator().manual_seed(0)).to(device())
    with torch.no_grad():
        expected = reference(input_ids=tokens).logits
    full = reference.state_dict()

    def check(model: nn.Module) -> None:
        with torch.no_grad():
            torch.testing.assert_close(model.eval()(input_ids=tokens).logits, expected, rtol=1e-6, atol=1e-6)

    # Built on the meta device, initialized by HF's own per-module init, then the "pretrained"
    # weights sent from rank 0 (without lm_head.weight, tied to the embedding, as HF stores it).
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    zpp.shard(model, init=model._init_weights)
    pretrained = {k: v for k, v in full.items() if k != "lm_head.weight"}
    zpp.load_full_state_dict(model, pretrained if rank == 0 else None)
    check(model)

    # torch's API for FSDP2 (broadcasts every tensor from rank 0), and a plain load_state_dict
    # with the full state dict on every rank.
    torch.manual_seed(1)
    model = zpp.shard(transformers.LlamaForCausalLM(config).to(device()))
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, dict(full) if rank == 0 else {}, options=options)
    check(model)
    torch.manual_seed(2)
    model = zpp.shard(transformers.LlamaForCausalLM(config).to(device()))
    model.load_state_dict(full)
    check(model)

    # A state dict that does not fit: the same error on every rank, before anything is sent.
    wrong = dict(pretrained, **{"model.norm.weight": torch.ones(33)})
    del wrong["model.layers.0.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"shapes differ: model\.norm\.weight \(model \(32,\), given \(33,\)\); "
                                         r"missing: model\.layers\.0\.mlp\.up_proj\.weight"):
        zpp.load_full_state_dict(model, wrong if rank == 0 else None)
    check(model)


def initial_values_run(rank: int, world_size: int) -> dict[str, int]:
    llama_run(rank, world_size)
    return meta_init_run(rank, world_size)


@pytest.mark.distributed
@needs("transformers")
def test_meta_init_buffers_and_full_state_dicts_match_the_unsharded_model(monkeypatch):
    # glibc raises its mmap threshold as large blocks are freed, and then keeps freed blocks
    # resident, well above the memory alive. A fixed threshold returns freed blocks to the system,
    # so resident memory tracks what is alive.
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    for growth in run_ranks(initial_values_run, 2):
        # A rank holds half of the model; the rest is one layer (16 MB) at a time.
        assert growth["init"] < 0.6 * growth["full"], growth
        # Loading: a few layers' worth at most (the tensor read, its padded copy, the chunk being
        # scattered), never the model: measured 2.5 layers with allocator noise between runs.
        layer = growth["full"] // 24
        assert growth["load"] < 3 * layer, growth


def fsdp2_order_run(rank: int, world_size: int) -> None:
    tokens = torch.randint(0, 37, (2, 5), generator=torch.Generator().manual_seed(0)).to(device())
    # FSDP2's order: shard the meta model, to_empty() (device named as torchtitan names it, without
    # an index), then the model's own init on the sharded parameters. Until every shard is
    # written, a forward is an error naming what is unset, on every rank, also when the one unset
    # tensor has no rows on a rank (the embedding's one row: rank 1 holds none).
    with torch.device("meta"):
        model = InitModel(tied=False, vocab=1)
    zpp.shard(model)
    model.to_empty(device=device().type)
    with pytest.raises(RuntimeError, match=r"zeropp: embed\.weight, blocks\.0\.scale, .* hold no values yet"):
        model(tokens % 1)
    model.apply(lambda m: None if isinstance(m, (nn.LayerNorm, nn.Embedding)) else small_init(m))
    with pytest.raises(RuntimeError, match=r"zeropp: embed\.weight, blocks\.0\.norm\.weight, blocks\.0\.norm\.bias, "
                                           r"blocks\.1\.norm\.weight, blocks\.1\.norm\.bias hold no values yet"):
        model(tokens % 1)
    model.apply(lambda m: small_init(m) if isinstance(m, nn.LayerNorm) else None)
    with pytest.raises(RuntimeError, match=r"zeropp: embed\.weight holds no values yet"):
        model(tokens % 1)
    model.apply(lambda m: small_init(m) if isinstance(m, nn.Embedding) else None)
    full = zpp.full_state_dict(model)
    for name in ("blocks.0.norm.weight", "blocks.1.norm.bias", "blocks.0.gate"):
        expected = {"weight": 1.0, "bias": 0.0, "gate": 0.25}[name.rsplit(".", 1)[1]]
        assert torch.equal(full[name], torch.full_like(full[name], expected)), name
    for name in ("blocks.0.fc.weight", "blocks.1.out.weight"):  # drawn on each rank's shard
        assert abs(full[name].std().item() / 0.02 - 1) < 0.25, (name, full[name].std())
    assert all(bool(t.isfinite().all()) for t in full.values())
    if device().type == "cuda":  # DTensor's RNG tracker: each shard takes its own part of the stream
        fc = full["blocks.0.fc.weight"]
        assert not torch.equal(fc[:24], fc[25:49]), "the ranks drew the same values for their shards"
    reference = InitModel(tied=False, vocab=1).to(device())
    reference.load_state_dict(full)
    torch.testing.assert_close(model(tokens % 1), reference(tokens % 1), rtol=1e-6, atol=1e-7)

    # Modules with no reset_parameters() and no init= (the 0-d gates, the root's pos) are left
    # for the model's own init in the same way; the rest is initialized by shard().
    with torch.device("meta"):
        model = TinyTransformer()
    zpp.shard(model)
    with pytest.raises(RuntimeError, match=r"zeropp: pos, blocks\.0\.gate, blocks\.1\.gate hold no values yet"):
        model(tokens, tokens)
    with torch.no_grad():
        model.pos.normal_()
        for block in model.blocks:
            nn.init.constant_(block.gate, 0.5)
    assert torch.isfinite(model(tokens, tokens))

    # A compiled step checks too, also when it was compiled before to_empty().
    model = zpp.shard(InitModel().to(device()), zpp.Config(inductor=False))
    step = torch.compile(model, backend="zeropp")
    step(tokens)
    model.to_empty(device=device())
    with pytest.raises(RuntimeError, match=r"zeropp: embed\.weight, blocks\.0\.scale, .* hold no values yet"):
        step(tokens)
    model.apply(small_init)
    torch.testing.assert_close(step(tokens), model(tokens))


@pytest.mark.distributed
def test_fsdp2_order_to_empty_then_the_models_own_init():
    run_ranks(fsdp2_order_run, 2)


class FusedPair(nn.Module):
    """One weight stored as two in state dicts, as torchtitan's fused QKV projection does: a
    state-dict hook splits it into keys no parameter holds."""

    def __init__(self) -> None:
        super().__init__()
        self.both = nn.Linear(4, 7, bias=False)
        self.register_state_dict_post_hook(self._split)

    @staticmethod
    def _split(module: nn.Module, state: dict, prefix: str, _local: dict) -> None:
        first, second = state.pop(prefix + "both.weight").split([3, 4])
        state[prefix + "first.weight"], state[prefix + "second.weight"] = first, second


def renamed_keys_run(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    reference = FusedPair().to(device())
    torch.manual_seed(0)
    model = zpp.shard(FusedPair().to(device()))
    assert_same_state(zpp.full_state_dict(model), reference.state_dict())


@pytest.mark.distributed
def test_full_state_dict_takes_keys_a_module_renames():
    run_ranks(renamed_keys_run, 2)


def test_bad_arguments_are_clear_errors():
    with pytest.raises(TypeError, match="init must be a function of one module, got int"):
        zpp.shard(nn.Linear(2, 2), init=5)
    with pytest.raises(ValueError, match="load_full_state_dict needs a model sharded by zpp_compile.shard"):
        zpp.load_full_state_dict(nn.Linear(2, 2), {})
    for function in (zpp.save_checkpoint, zpp.load_checkpoint):
        with pytest.raises(ValueError, match=f"zpp.{function.__name__} needs a model sharded by zpp_compile.shard"):
            function(nn.Linear(2, 2), None, "checkpoint")

"""examples/bench.py: a CPU smoke run (2 gloo ranks as 2 emulated nodes of 1 rank, tiny GPT,
debug compile) whose JSON must hold every variant, and whose communication bytes must match what
the model's shapes imply; a run of a small HF Llama with activation checkpointing; the simulated
world, the options and their errors, rounds and charts."""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
import unittest.mock
from pathlib import Path
from typing import Any

import pytest
import torch
from extras import needs, optional

transformers, matplotlib = optional("transformers"), optional("matplotlib")
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

import bench  # noqa: E402
from bench import (  # noqa: E402
    LLAMA_SHAPES,
    all_variants,
    compute_time,
    default_variants,
    exposed_communication,
    kernel_breakdown,
    llama,
    median_round,
    parse_args,
    variant_of,
    variant_specs,
)
from distributed import run_ranks  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402

WORLD, DIM, LAYERS, HEADS, SEQ = 2, 64, 2, 2, 32
BLOCK = 256  # zeropp's default weight_block_size


SHORT_RUN = ["--compile-mode", "debug", "--seq", str(SEQ), "--batch", "2", "--steps", "2", "--warmup", "1"]


def run_bench(out: Path, *args: str) -> dict:
    """examples/bench.py launched by torchrun, as a user runs it."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}",
           str(EXAMPLES / "bench.py"), *SHORT_RUN, "--json", str(out), "--png", str(out.with_suffix(".png")), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert out.with_suffix(".png").stat().st_size > 0
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def bench_json(tmp_path_factory) -> dict:
    return run_bench(tmp_path_factory.mktemp("bench") / "bench.json", "--dim", str(DIM), "--layers", str(LAYERS),
                     "--heads", str(HEADS), "--data-bytes", "200000")


def shard_sizes() -> list[int]:
    """Elements of each parameter's shard (rows padded to a multiple of the world), tied once."""
    with torch.device("meta"):
        model = GPT(GPTConfig(seq=SEQ, dim=DIM, heads=HEADS, layers=LAYERS))
    return [math.ceil(p.shape[0] / WORLD) * (p.numel() // p.shape[0]) for p in model.parameters()]


def qwz_gather_bytes(s: int) -> int:
    """Bytes of one qwZ-gathered shard (docs/internals.md, qwZ): INT8 codes padded to whole blocks
    plus one float32 scale per block; a shard smaller than a block travels in bf16."""
    blocks = math.ceil(s / BLOCK)
    return blocks * BLOCK + 4 * blocks if s >= BLOCK else 2 * s


@pytest.mark.distributed
def test_every_variant_ran(bench_json):
    results = {r["name"]: r for r in bench_json["variants"]}
    on_gpu = bench_json["setup"]["device"] != "cpu"  # the CUDA-graph and DeepSpeed variants need GPUs
    assert tuple(results) == tuple(default_variants(on_gpu, cuda_graphs=on_gpu))
    for r in results.values():
        assert r["tokens_per_s"] > 0 and r["tflops_per_gpu"] > 0 and r["ms_per_step"] > 0, r
        assert 0 < r["first_step_s"] <= r["warmup_s"], r
        if bench_json["setup"]["device"] == "cpu":
            assert r["exposed_comm_fraction"] is None and r["peer_wait_fraction"] is None  # GPU-only figures
            assert r["gpu_busy_fraction"] is None
            assert r["peak_memory_bytes"] is None and r["mfu"] is None
        else:
            assert 0 <= r["exposed_comm_fraction"] <= 1 and 0 <= r["peer_wait_fraction"] <= 1, r
            assert 0 < r["gpu_busy_fraction"] <= 1.1, r  # profiled kernels against timed steps
            assert r["peak_memory_bytes"] > 0, r
        assert 0 < r["host_ms_per_step"] <= r["ms_per_step"] * 1.05, r
    assert bench_json["setup"]["ranks_per_node"] == 1 and bench_json["setup"]["hpz_partition_size"] == 1
    # Speed ratios are relative to the reference actually run.
    assert results["fsdp2"]["vs_fsdp2_default"] == 1 and results["zero3"]["vs_zero3"] == 1
    assert results["all3"]["fsdp2_equal_memory"] in ("fsdp2", "fsdp2_bf16_reduce", "fsdp2_no_reshard")
    assert results["qwz"]["fsdp2_equal_memory"] in ("fsdp2", "fsdp2_bf16_reduce")


@pytest.mark.distributed
def test_fsdp2_bytes_follow_its_collectives(bench_json):
    # One peer on the other node; per peer and step: forward gather bf16 (2 B/element), backward
    # gather bf16 unless the weights are kept, reduce-scatter in the reduce dtype.
    total = sum(shard_sizes())
    expected = {"fsdp2": (2 + 2 + 4) * total, "fsdp2_bf16_reduce": 6 * total, "fsdp2_no_reshard": 4 * total}
    for r in bench_json["variants"]:
        if r["name"] in expected:
            assert (r["bytes_source"], r["intra_bytes"], r["inter_bytes"]) == ("analytic", 0, expected[r["name"]])
            assert r["inter_ratio"] == pytest.approx(expected[r["name"]] / (6 * total))


@pytest.mark.distributed
def test_zeropp_ledger_matches_the_shapes(bench_json):
    results = {r["name"]: r for r in bench_json["variants"]}
    sizes = shard_sizes()
    bf16_gather, qwz_gather = 2 * sum(sizes), sum(qwz_gather_bytes(s) for s in sizes)
    phase = lambda name, which: results[name]["phases"][which]["inter_bytes"]  # noqa: E731
    forward, backward, gradient = "forward weight gather", "backward weight gather", "gradient reduction"
    for name in ("zero3", "qwz", "hpz", "qgz", "all3", "all3_bf16_copy"):
        assert results[name]["bytes_source"] == "ledger" and results[name]["intra_bytes"] == 0  # 1 rank per node
    # Forward gathers every parameter once, the embedding tied to the head included (gather_once):
    # bf16, or INT8 blocks + scales under qwZ.
    for name in ("zero3", "hpz", "qgz"):
        assert phase(name, forward) == bf16_gather
    assert phase("qwz", forward) == phase("all3", forward) == phase("all3_bf16_copy", forward) == qwz_gather
    # Every gradient is reduced once, the tied embedding's too: the other rank sends its part of each shard.
    itemsize = torch.empty((), dtype=getattr(torch, results["zero3"]["reduce_dtype"])).element_size()
    assert phase("zero3", gradient) == itemsize * sum(sizes)
    # hpZ of 1 rank keeps a full copy (INT8 or bf16): backward gathers nothing across nodes.
    assert phase("hpz", backward) == phase("all3", backward) == phase("all3_bf16_copy", backward) == 0
    assert 0 < phase("zero3", backward) <= bf16_gather and 0 < phase("qwz", backward) <= qwz_gather
    # qgZ's INT4 all-to-all moves less than a bf16 reduce-scatter.
    assert phase("qgz", gradient) < phase("zero3", gradient)
    assert phase("all3", gradient) == phase("all3_bf16_copy", gradient) == phase("qgz", gradient)

    # Plain ZeRO-3 against the paper's 3M: Linear weights follow it exactly; embeddings and 1-D
    # parameters may skip the backward gather (their gradient does not read them): at most one
    # gather each, either way.
    with torch.device("meta"):
        model = GPT(GPTConfig(seq=SEQ, dim=DIM, heads=HEADS, layers=LAYERS))
    linear = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)} - {id(model.embed.weight)}
    others = sum(s for s, p in zip(sizes, model.parameters()) if id(p) not in linear)
    assert abs(results["zero3"]["inter_ratio"] - 1) <= (2 + 2) * others / (6 * sum(sizes))
    for name in ("qwz", "hpz", "qgz"):
        assert results["all3"]["inter_ratio"] < results[name]["inter_ratio"] < results["zero3"]["inter_ratio"]


def bench_main(rank: int, world_size: int, args: list[str]) -> None:
    """bench.main(args) on a test rank, whose process group stays up for the next test's call."""
    import bench

    with unittest.mock.patch.object(bench.dist, "destroy_process_group", lambda: None):
        bench.main(args)


@pytest.fixture(scope="module")
def llama_json(tmp_path_factory) -> dict:
    """bench.main on the test ranks (the launch through torchrun is `bench_json`'s)."""
    path = tmp_path_factory.mktemp("bench") / "llama.json"
    run_ranks(bench_main, WORLD, [*SHORT_RUN, "--json", str(path), "--model", "llama-tiny", "--variants", "fsdp2,zero3",
                                  "--activation-checkpointing", "selective", "--peak-tflops", "1"])
    return json.loads(path.read_text())


@pytest.mark.distributed
@needs("transformers")
def test_llama_runs_with_activation_checkpointing(llama_json):
    shape = LLAMA_SHAPES["llama-tiny"]
    setup = llama_json["setup"]
    assert setup["model"]["name"] == "llama-tiny" and setup["activation_checkpointing"] == "selective"
    assert setup["peak_tflops_per_gpu"] == 1.0
    # The parameters HF counts for the same config (tied embeddings once), and the FLOPs per
    # token they imply, 6 N + 12 L d T.
    config = transformers.LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.dim, intermediate_size=shape.ffn,
                                      num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                                      num_key_value_heads=shape.kv_heads, tie_word_embeddings=shape.tied)
    with torch.device("meta"):
        n_params = transformers.LlamaForCausalLM(config).num_parameters()
    flops_per_token = 6 * n_params + 12 * shape.layers * shape.dim * SEQ
    assert [r["name"] for r in llama_json["variants"]] == ["fsdp2", "zero3"]
    for r in llama_json["variants"]:
        assert r["parameters"] == n_params and r["first_step_s"] > 0, r
        assert r["tflops_per_gpu"] == pytest.approx(flops_per_token * r["tokens_per_s"] / WORLD / 1e12)
        assert r["mfu"] == pytest.approx(r["tflops_per_gpu"] / 1.0)


@needs("transformers")
def test_benchmark_llama_attention_matches_transformers_sdpa():
    # bench.llama's attention (SDPA with is_causal, no mask tensor) computes what transformers' own
    # "sdpa" computes for whole, unpadded sequences, forward and backward.
    shape = LLAMA_SHAPES["llama-tiny"]
    torch.manual_seed(0)
    ours = llama(shape, shape.layers, SEQ)
    config = copy.deepcopy(ours.config)
    config._attn_implementation = "sdpa"
    reference = transformers.LlamaForCausalLM(config)
    reference.load_state_dict(ours.state_dict())
    ids = torch.randint(0, shape.vocab, (2, SEQ), generator=torch.Generator().manual_seed(1))
    got, expected = ours(input_ids=ids, labels=ids), reference(input_ids=ids, labels=ids)
    torch.testing.assert_close(got.logits, expected.logits, rtol=1e-5, atol=1e-5)
    got.loss.backward()
    expected.loss.backward()
    for (name, a), b in zip(ours.named_parameters(), reference.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
    assert ours.config._attn_implementation != reference.config._attn_implementation


def test_bad_model_options_are_clear_errors(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--model", "llama-1b", "--dim", "64"])
    assert "--dim and --heads shape the GPT" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--warmup", "0"])
    assert "--warmup 0" in capsys.readouterr().err


def test_a_simulated_world_benchmarks_rank_0_alone_with_the_models_parameters_recorded(tmp_path, capsys):
    """One process, no torchrun: rank 0 of 8 (2 nodes of 4) over a slow modeled network. The run is
    marked as simulated, the JSON keeps the model's parameters with the override, and each variant's
    exposed communication is time its collectives were charged (never more than they were)."""
    path = tmp_path / "simulated.json"
    try:
        bench.main([*SHORT_RUN, "--dim", str(DIM), "--layers", str(LAYERS), "--heads", str(HEADS),
                    "--data-bytes", "200000", "--variants", "fsdp2,zero3,all3", "--simulate-network", "ib-100g",
                    "--world", "8", "--ranks-per-node", "4", "--network-override", "inter_busbw_gbyte_per_s=0.05",
                    "--json", str(path), *(["--png", str(tmp_path / "simulated.png")] if matplotlib else [])])
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    out = capsys.readouterr().out
    assert "SIMULATED: rank 0 of 8 runs alone" in out and "SIMULATED network (ib-100g), rank 0 of 8:" in out
    record = json.loads(path.read_text())
    setup = record["setup"]
    assert setup["world"] == 8 and setup["ranks_per_node"] == 4 and setup["link"] == "simulated: ib-100g"
    network = setup["simulated_network"]
    assert network["preset"] == "ib-100g" and network["overrides"] == "inter_busbw_gbyte_per_s=0.05"
    assert network["inter_busbw_gbyte_per_s"] == 0.05 and network["ranks_per_node"] == 4
    assert network["intra_busbw_gbyte_per_s"] == 245.0
    assert matplotlib is None or (tmp_path / "simulated.png").stat().st_size > 0
    for r in record["variants"]:
        modeled, exposed = r["simulated_comm_ms_per_step"], r["exposed_comm_fraction"] * r["ms_per_step"]
        assert modeled > 0 and 0 <= exposed <= modeled * 1.05 + 0.5, (r["name"], modeled, exposed)
        assert r["peer_wait_fraction"] is None  # one rank: no peer to wait for
    by_name = {r["name"]: r for r in record["variants"]}
    # qwZ and qgZ send a fraction of ZeRO-3's bytes over the slow link: far less modeled time
    assert by_name["all3"]["simulated_comm_ms_per_step"] < 0.5 * by_name["zero3"]["simulated_comm_ms_per_step"]


def test_simulated_world_options_are_clear_errors(capsys):
    cases = [
        (["--world", "8"], "give --simulate-network PRESET too"),
        (["--simulate-network", "ib-100g"], "--simulate-network needs --world N"),
        (["--simulate-network", "ib-100g", "--world", "8", "--slow-link"], "models that link"),
        (["--simulate-network", "ib-100g", "--world", "8", "--variants", "zero3_graphs"],
         "run these over a real world"),
        (["--simulate-network", "ib-100g", "--world", "8", "--ranks-per-node", "3"], "does not divide"),
        (["--simulate-network", "ib-100g", "--world", "8", "--network-override", "inter_speed=3"],
         "unknown network override 'inter_speed'"),
        (["--simulate-network", "nvlink-h100", "--world", "8", "--network-override", "inter_latency_us=3"],
         "it has no inter-node link"),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert message in capsys.readouterr().err, argv


def test_a_simulated_collectives_kernel_counts_as_communication():
    spin = "void at::cuda::(anonymous namespace)::spin_kernel(long)"
    kernels = [("gemm", 0.0, 10.0), (spin, 5.0, 20.0), ("copy", 25.0, 30.0)]
    assert exposed_communication(kernels) == 10.0
    assert compute_time(kernels) == 15.0
    assert kernel_breakdown(kernels, 1)["nccl"] == 15.0e-3


def test_zpp_options_read_json_or_python_values():
    args = parse_args(["--zpp-option", "hpz_quantized_copy=False", "--zpp-option", "cuda_graphs=true",
                       "--zpp-option", "weight_block_size=512"])
    assert args.zpp_option == {"hpz_quantized_copy": False, "cuda_graphs": True, "weight_block_size": 512}


def test_a_variant_spec_adds_config_fields_to_its_variant(capsys):
    cats = '{"max_pointwise_cat_inputs":16,"max_complex_pointwise_cat_inputs":16}'
    args = parse_args(["--variants",
                       f"zero3,zero3_layers@bucket_size=67108864@prefetch=2,zero3@inductor_options={cats}"])
    specs = variant_specs(args.variants)
    assert specs == ["zero3", "zero3_layers@bucket_size=67108864@prefetch=2", f"zero3@inductor_options={cats}"]
    variants = all_variants(1, torch.bfloat16)
    assert variant_of("zero3", variants) is variants["zero3"]
    split = variant_of(specs[1], variants)
    assert split.name == "zero3_layers@bucket_size=67108864@prefetch=2"
    assert split.zpp_options == {"compile_layers_once": True, "bucket_size": 67108864, "prefetch": 2}
    for spec, message in (("zero3@bucket=1", "unknown config key 'bucket'"),
                          ("fsdp2@bucket_size=1", "for zeropp's variants"), ("zero3@prefetch", "is not KEY=VALUE")):
        with pytest.raises(SystemExit):
            parse_args(["--variants", spec])
        assert message in capsys.readouterr().err, spec


def released_deepspeed_engine_frees(rank: int, world_size: int) -> dict:
    """A DeepSpeed ZeRO-3 engine trained one step, then ended by `engine.destroy()` alone or by the
    benchmark's `release_deepspeed`: is its model (and optimizer) still alive, and is
    `torch.nn.functional.linear` still DeepSpeed's? And where something else keeps the model alive
    (with ZeRO++'s quantized paths, DeepSpeed's hooks do), do its parameters still hold their
    partitions?"""
    import gc
    import weakref

    import deepspeed
    from bench import release_deepspeed

    alive = {}
    torch_linear = torch.nn.functional.linear
    for how in ("destroy", "release_deepspeed"):
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
        config = {"train_batch_size": 2 * world_size, "train_micro_batch_size_per_gpu": 2,
                  "zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        engine.backward(engine(torch.randn(2, 8)).square().mean())
        engine.step()
        refs = weakref.ref(model), weakref.ref(engine.optimizer)
        if how == "destroy":
            engine.destroy()
        else:
            release_deepspeed(engine)
        del model, engine, _
        gc.collect()
        alive[how] = [ref() is not None for ref in refs] + [torch.nn.functional.linear is not torch_linear]
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    partitions = [weakref.ref(param.ds_tensor) for param in model.parameters()]
    release_deepspeed(engine)
    del engine, _
    gc.collect()
    alive["partitions of a model kept alive"] = [ref() is not None for ref in partitions]
    return alive


@pytest.mark.distributed
def test_a_released_deepspeed_engine_frees_its_model_and_optimizer():
    pytest.importorskip("deepspeed")
    for alive in run_ranks(released_deepspeed_engine_frees, WORLD):
        # destroy() alone leaves both on DeepSpeed's module stack (what the later variants ran short of),
        # and its linear in torch's place (what later variants then ran).
        assert alive == {"destroy": [True, True, True], "release_deepspeed": [False, False, False],
                         "partitions of a model kept alive": [False] * 4}, alive


def launch_stopped_in_its_second_round(rank: int, world_size: int, path: str) -> dict | None:
    """bench.main with --rounds 3, stopped by an error when the second round begins."""
    import bench

    measure = bench.run_variant

    def run_variant(variant: Any, args: Any, data: Any, env: Any, label: str) -> dict:
        if label.endswith("round1"):
            raise RuntimeError("stopped")
        return measure(variant, args, data, env, label)

    bench.run_variant = run_variant
    with pytest.raises(RuntimeError, match="stopped"):
        bench.main(["--compile-mode", "debug", "--variants", "zero3,fsdp2", "--rounds", "3", "--dim", str(DIM),
                    "--layers", str(LAYERS), "--heads", str(HEADS), "--seq", str(SEQ), "--steps", "1",
                    "--warmup", "1", "--data-bytes", "200000", "--json", path])
    return json.loads(Path(path).read_text()) if rank == 0 else None


def test_a_variant_is_not_measured_on_a_replaced_linear(monkeypatch):
    from bench import require_torch_linear

    require_torch_linear("zero3")
    monkeypatch.setattr(torch.nn.functional, "linear", lambda x, w, b=None: x @ w.t())
    with pytest.raises(RuntimeError, match="zero3: torch.nn.functional.linear is .* not torch's own"):
        require_torch_linear("zero3")


@pytest.mark.distributed
def test_a_stopped_launch_keeps_its_finished_rounds(tmp_path):
    kept = run_ranks(launch_stopped_in_its_second_round, WORLD, str(tmp_path / "bench.json"))[0]
    assert kept["setup"]["rounds"] == 3 and kept["setup"]["rounds_finished"] == 1
    assert [(r["name"], len(r["ms_per_step_rounds"])) for r in kept["variants"]] == [("zero3", 1), ("fsdp2", 1)]
    assert kept["variants"][0]["vs_fsdp2_default"] > 0  # compared as a finished launch's table is


def test_the_median_round_is_reported_with_every_round_and_the_first_rounds_compilation():
    runs = [{"name": "all3", "ms_per_step": ms, "first_step_s": first, "warmup_s": first + 1}
            for ms, first in ((140.0, 3.0), (120.0, 90.0), (180.0, 4.0))]
    runs = [runs[1], runs[0], runs[2]]  # the first round compiles
    assert median_round(runs) == {"name": "all3", "ms_per_step": 140.0, "first_step_s": 90.0, "warmup_s": 91.0,
                                  "ms_per_step_rounds": [120.0, 140.0, 180.0]}
    # Of an even count, the slower of the two middle runs.
    assert median_round(runs[:2])["ms_per_step"] == 140.0


def test_the_triton_copy_of_the_kernel_benchmark_copies_every_element():
    """The kernel benchmark's copy reference (the faster of memcpy and this copy) must copy
    all of its input, a partial last program included."""
    pytest.importorskip("triton")
    import bench_grad_kernels
    src = torch.arange(3 * 1024 + 5, dtype=torch.int32)
    dst = torch.zeros_like(src)
    bench_grad_kernels.triton_copy(src, dst)
    assert torch.equal(dst, src)


@needs("matplotlib")
def test_a_chart_labels_each_bar_and_draws_none_for_a_value_not_measured(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    results = [{"name": "fsdp2", "label": "FSDP2 reshard", "system": "fsdp2", "tokens_per_s": 1000.0,
                "inter_bytes": 2e6, "peak_memory_bytes": None},
               {"name": "deepspeed_zeropp", "label": "DeepSpeed ZeRO++", "system": "deepspeed", "tokens_per_s": 500.0,
                "inter_bytes": None, "peak_memory_bytes": None}]
    bench.plot(results, "title", str(tmp_path / "chart.png"))
    (figure,) = figures
    tokens, received = figure.axes  # no memory panel: nothing measured it
    assert [t.get_text() for t in tokens.texts] == ["1,000", "500"]
    assert [bar.get_visible() for bar in received.patches] == [True, False]  # no bar of 0 for DeepSpeed's bytes
    assert [t.get_text() for t in received.texts] == ["2", "not\nmeasured"]
    assert [t.get_text() for t in tokens.get_xticklabels()] == ["FSDP2 reshard", "DeepSpeed ZeRO++"]
    assert (tmp_path / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _profiled_helper(n: int) -> int:
    return sum(range(n))


def test_the_host_profile_counts_each_call_of_the_profiled_steps(tmp_path):
    import pstats

    bench.profile_host(lambda: [_profiled_helper(10) for _ in range(3)], str(tmp_path / "p" / "zero3"),
                       torch.device("cpu"))
    stats = pstats.Stats(str(tmp_path / "p" / "zero3.pstats")).stats
    calls = {name: counts[1] for (_, _, name), counts in stats.items()}
    assert calls["_profiled_helper"] == 3
    assert "_profiled_helper" in (tmp_path / "p" / "zero3.txt").read_text()

"""FSDP2, DeepSpeed and zeropp side by side: one launch, one process group, the same model and data.

    torchrun --nproc_per_node=2 examples/bench.py                    # GPUs: the 607M-parameter GPT
    torchrun --nproc_per_node=2 examples/bench.py --slow-link        # NCCL without NVLink/SHM
    torchrun --nproc_per_node=2 examples/bench.py --variants zero3,all3 --steps 5
    torchrun --nproc_per_node=2 examples/bench.py --model llama-3b --seq 4096 --batch 1 --rounds 3
    torchrun --nproc_per_node=2 examples/bench.py --model llama-8b --seq 4096 --batch 1 --activation-checkpointing full

Models (--model): "gpt", the byte-level GPT of examples/gpt.py trained on the standard library's
source (--dim, --heads, --layers); or HF transformers' LlamaForCausalLM built from a config with the
shapes of Llama-3.2-1B ("llama-1b": width 2048, 16 layers, 32 heads, 8 key/value heads, MLP 8192,
tied embeddings), Llama-3.2-3B ("llama-3b": 3072, 28, 24, 8, 8192, tied) or Llama-3.1-8B
("llama-8b": 4096, 32, 32, 8, 14336, untied), vocabulary 128256, rope_theta 500000 (without Llama
3's long-context frequency scaling, which costs nothing), causal SDPA attention without a mask
tensor (`causal_sdpa`), trained on random token ids; "llama-tiny" is the same architecture at
CPU-test size (--layers overrides the depth of any). transformers is needed for the Llama models
only, DeepSpeed for its variants only.

Variants (each a fresh model from the same seed, trained on the same batches):

    fsdp2              FSDP2 default: reshard after forward, fp32 gradient reduction
    fsdp2_bf16_reduce  FSDP2, reshard after forward, bf16 reduction
    fsdp2_no_reshard   FSDP2, weights kept from forward to backward, bf16 reduction
    zero3 qwz hpz qgz all3   zeropp: plain ZeRO-3, each technique alone, all three
    all3_bf16_copy     all3 with hpZ's copy holding the dequantized bf16 weights instead of the
                       INT8 blocks (Config.hpz_quantized_copy=False): nothing to dequantize in
                       backward, for twice the copy's memory
    zero3_graphs all3_graphs zero3 and all3 with Config.cuda_graphs (GPUs only)
    zero3_layers all3_layers zero3 and all3 with Config.compile_layers_once (each layer a graph of
                       its own, compiled once for every identical layer); run only when named
    deepspeed_zero3    DeepSpeed ZeRO-3, bf16, its fused AdamW (when deepspeed is installed)
    deepspeed_zeropp   DeepSpeed ZeRO++: zero_quantized_weights, zero_hpz_partition_size = ranks
                       per emulated node (DeepSpeed reads 1 as off), zero_quantized_gradients

A zeropp variant named NAME@KEY=VALUE (repeatable: zero3_layers@bucket_size=67108864) runs with
that Config field on top of its own, beside the same variant without it in one launch.

FSDP2 is `fully_shard` per block and on the root, bf16 parameters, each block compiled (as
torchtitan does); zeropp is `zpp_compile.shard` with bf16 parameters and the whole step under
`torch.compile(backend="zeropp")`. DeepSpeed runs eagerly, as its users run it, from a config
written from its documented keys (stage 3, bf16, overlap_comm, contiguous_gradients, its
"AdamW" optimizer, which it runs as its fused Adam in AdamW mode). zeropp reduces gradients in
bf16 by default (`--zpp-reduce-dtype`), like FSDP2's bf16 settings and DeepSpeed's ZeRO-3. hpZ's
secondary group is one emulated node (`--ranks-per-node`, default half the ranks: 2 GPUs are 2
nodes of 1 rank, so hpZ keeps a full copy, as "no reshard" does).

Each variant is compared with FSDP2 at equal memory: zeropp without hpZ against the best FSDP2
setting that reshards after forward, zeropp with hpZ against the best FSDP2 setting of all (no
reshard keeps at least as much as hpZ does). --activation-checkpointing applies to every system:
zeropp's Config.activation_checkpointing, torch.utils.checkpoint around every layer for FSDP2 and
DeepSpeed ("selective": torch's selective checkpointing keeping matmul and attention outputs).
A step is forward + backward + AdamW (fused on GPUs, as torchtitan runs it). With --rounds N
every variant runs N times, the variants taking turns, and its median round is reported: a link
whose speed drifts during a launch (the slow link does, by tens of percent) then weighs on every
variant alike.

    tokens/s         all ranks' tokens per step / the slowest rank's step time
    TFLOP/s per GPU  (6 N + 12 L d T) x tokens/s / GPUs: N parameters, L layers, width d,
                     sequence T (PaLM's formula; the causal mask's saved half is not subtracted)
    MFU              TFLOP/s per GPU over the GPU's peak: 989 TFLOP/s (bf16 dense, H100 and H200
                     SXM), or --peak-tflops
    1st s            seconds of the first step, compilation included (cold caches; the process
                     has compiled one small function first, so that its one-time costs fall on no
                     variant), the slowest rank's
    inter-node B     bytes one rank receives per step from other (emulated) nodes: zeropp's from
                     the compiled graphs' ledger (also per phase), FSDP2's analytic (its gathers
                     in bf16, its reduce-scatter in its reduce dtype, shards padded as FSDP2 pads
                     them); "inter x" is that over plain ZeRO-3 in bf16 (3 gathers' worth)
    exposed comm     (GPU) share of step time in which a NCCL kernel moves data and no other
                     kernel runs, from a torch.profiler trace of --profile-steps steps. A NCCL
                     kernel starts when its rank issues the collective and ends when the data has
                     arrived, so its time on the rank that issued it first includes waiting for
                     the others: a collective's transfer time is its shortest kernel over ranks
                     (the last rank to join waits for no one)
    peer wait        (GPU) the share of step time in which a NCCL kernel waits for another rank to
                     issue the same collective and no other kernel runs (ranks whose hosts run
                     at different speeds); exposed + peer wait is all time in NCCL alone
    GPU busy         (GPU) time per step in which some kernel other than NCCL's runs (from the
                     profiled steps), over the timed ms/step: near 100%, the GPU's own work sets
                     the pace, and neither the host nor the link can win time back
    host ms/step     the time the host takes to issue a step; close to ms/step when the host,
                     not the GPU, sets the pace (--trace-dir keeps the traces to see where)
    allocator retries (GPU, printed when not 0) how often the CUDA caching allocator freed its
                     cache to retry an allocation during the timed steps, on the rank with most:
                     each retry synchronizes the device, so the host waits on the GPU
    kernel ms/step   (GPU, a second table) rank 0's kernel time per step by kind: matrix products,
                     attention, zeropp's quantization kernels, Inductor's generated kernels, the
                     optimizer's, eager copies and casts, NCCL's, other (`KERNEL_KINDS`), so that
                     two variants' GPU work compares kind by kind
"""

from __future__ import annotations

import argparse
import gc
import gzip
import importlib
import importlib.util
import inspect
import json
import os
import sys
import tempfile
import textwrap
import time
import warnings
import weakref
from collections import defaultdict
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
from gpt import GPT, GPTConfig, batch, emulated_ranks_per_node, init_distributed, stdlib_bytes  # examples/gpt.py
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import zpp_compile as zpp
from zpp_compile.config import field_setting
from zpp_compile.reports import text_table
from zpp_compile.runtime.network_model import PRESETS, Network, network_from_preset
from zpp_compile.runtime.simulated_group import COLLECTIVE_KERNEL, SimulatedWorld, init_simulated_world
from zpp_compile.runtime.topology import world_received_bytes
from zpp_compile.sharding import padding

SLOW_LINK_ENV = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0}  # bf16 dense, SXM
ACTIVATION_CHECKPOINTING = ("none", "full", "selective")


@dataclass(frozen=True)
class LlamaShape:
    vocab: int
    dim: int
    layers: int
    heads: int
    kv_heads: int  # grouped-query attention
    ffn: int
    tied: bool  # input and output embeddings


LLAMA_SHAPES = {
    "llama-1b": LlamaShape(128256, 2048, 16, 32, 8, 8192, True),  # Llama-3.2-1B
    "llama-3b": LlamaShape(128256, 3072, 28, 24, 8, 8192, True),  # Llama-3.2-3B
    "llama-8b": LlamaShape(128256, 4096, 32, 32, 8, 14336, False),  # Llama-3.1-8B
    "llama-tiny": LlamaShape(512, 64, 2, 4, 2, 128, True),  # the same architecture, for CPU tests
}
MODELS = ("gpt", *LLAMA_SHAPES)


@dataclass(frozen=True)
class Variant:
    name: str
    label: str
    system: str  # "fsdp2", "zeropp" or "deepspeed"
    keeps_weights: bool  # gathered weights (or an hpZ copy) live from forward to backward
    reduce_dtype: torch.dtype
    # zeropp Config fields, or DeepSpeed's zero_optimization keys
    zpp_options: dict[str, Any] = field(default_factory=dict)


def all_variants(hpz_size: int, zpp_reduce: torch.dtype, ranks_per_node: int = 1) -> dict[str, Variant]:
    bf16, fp32 = torch.bfloat16, torch.float32
    qwz, hpz, qgz = {"quantized_weights": True}, {"hpz_partition_size": hpz_size}, {"quantized_gradients": True}
    graphs, layers = {"cuda_graphs": True}, {"compile_layers_once": True}
    variants = [
        Variant("fsdp2", "FSDP2 reshard, fp32 reduce (default)", "fsdp2", False, fp32),
        Variant("fsdp2_bf16_reduce", "FSDP2 reshard, bf16 reduce", "fsdp2", False, bf16),
        Variant("fsdp2_no_reshard", "FSDP2 no reshard, bf16 reduce", "fsdp2", True, bf16),
        Variant("zero3", "zeropp ZeRO-3", "zeropp", False, zpp_reduce),
        Variant("qwz", "zeropp qwZ", "zeropp", False, zpp_reduce, qwz),
        Variant("hpz", f"zeropp hpZ={hpz_size}", "zeropp", True, zpp_reduce, hpz),
        Variant("qgz", "zeropp qgZ", "zeropp", False, zpp_reduce, qgz),
        Variant("all3", f"zeropp qwZ+hpZ={hpz_size}+qgZ", "zeropp", True, zpp_reduce, {**qwz, **hpz, **qgz}),
        Variant("all3_bf16_copy", f"zeropp qwZ+hpZ={hpz_size}+qgZ, bf16 copy", "zeropp", True, zpp_reduce,
                {**qwz, **hpz, **qgz, "hpz_quantized_copy": False}),
        Variant("zero3_graphs", "zeropp ZeRO-3, CUDA graphs", "zeropp", False, zpp_reduce, graphs),
        Variant("all3_graphs", f"zeropp qwZ+hpZ={hpz_size}+qgZ, CUDA graphs", "zeropp", True, zpp_reduce,
                {**qwz, **hpz, **qgz, **graphs}),
        Variant("zero3_layers", "zeropp ZeRO-3, layers compiled once", "zeropp", False, zpp_reduce, layers),
        Variant("all3_layers", f"zeropp qwZ+hpZ={hpz_size}+qgZ, layers compiled once", "zeropp", True, zpp_reduce,
                {**qwz, **hpz, **qgz, **layers}),
        # DeepSpeed's secondary partition spans ranks_per_node ranks; 1 means none.
        Variant("deepspeed_zero3", "DeepSpeed ZeRO-3", "deepspeed", False, bf16),
        Variant("deepspeed_zeropp", f"DeepSpeed ZeRO++ qwZ+hpZ={ranks_per_node}+qgZ", "deepspeed", ranks_per_node > 1,
                bf16, {"zero_quantized_weights": True, "zero_hpz_partition_size": ranks_per_node,
                       "zero_quantized_gradients": True}),
    ]
    return {v.name: v for v in variants}


VARIANT_NAMES = tuple(all_variants(1, torch.bfloat16))


def default_variants(on_gpu: bool, cuda_graphs: bool, deepspeed: bool = True) -> list[str]:
    """Every variant this launch can run but the `_layers` ones (named when wanted): CUDA graphs
    need GPUs and Inductor, DeepSpeed's variants need deepspeed (and GPUs: its CPU accelerator is
    not what anyone benchmarks) and a real world."""
    deepspeed = deepspeed and on_gpu and importlib.util.find_spec("deepspeed") is not None
    return [n for n in VARIANT_NAMES if (cuda_graphs or not n.endswith("_graphs")) and not n.endswith("_layers")
            and (deepspeed or not n.startswith("deepspeed"))]


def variant_specs(text: str) -> list[str]:
    """--variants split at its commas outside brackets (a value may be a dict or a list)."""
    specs, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += (char in "{[(") - (char in "}])")
        if char == "," and depth == 0:
            specs.append(text[start:i])
            start = i + 1
    return [*specs, text[start:]]


def variant_name(spec: str) -> str:
    """The variant a spec `NAME@KEY=VALUE@...` names."""
    return spec.split("@")[0]


def variant_options(spec: str) -> dict[str, Any]:
    """The zeropp Config fields a variant spec `NAME@KEY=VALUE@...` adds to its variant."""
    return dict(field_setting(text) for text in spec.split("@")[1:])


def variant_spec_error(spec: str, systems: dict[str, str]) -> str | None:
    """What is wrong with a variant spec, given each variant's system by name; None if nothing."""
    name = variant_name(spec)
    if name not in systems:
        return f"{name!r} is not one of {list(systems)}"
    try:
        options = variant_options(spec)
        if options and systems[name] != "zeropp":
            return "options after @ are zeropp Config fields, for zeropp's variants"
        zpp.Config(**options)
    except (argparse.ArgumentTypeError, zpp.ConfigError, TypeError) as error:
        return str(error)
    return None


def variant_of(spec: str, variants: dict[str, Variant]) -> Variant:
    """The variant a spec names, with the spec's Config fields (under the spec as its name)."""
    variant = variants[variant_name(spec)]
    options = variant_options(spec)
    if not options:
        return variant
    label = variant.label + ", " + ", ".join(f"{k}={v}" for k, v in options.items())
    return replace(variant, name=spec, label=label, zpp_options={**variant.zpp_options, **options})


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", help=f"comma-separated subset of {VARIANT_NAMES} (default: all this launch can run: "
                                      "CUDA graphs need GPUs and Inductor, DeepSpeed's need deepspeed and GPUs); "
                                      "NAME@KEY=VALUE runs a zeropp variant with that Config field too")
    p.add_argument("--model", choices=MODELS, default="gpt", help="the GPT of examples/gpt.py, or a HF Llama shape")
    p.add_argument("--dim", type=int, help="GPT width (default 2048 on GPUs, 64 on CPU)")
    p.add_argument("--layers", type=int, help="blocks (GPT: default 12 on GPUs, 2 on CPU; Llama: the shape's)")
    p.add_argument("--heads", type=int, help="GPT attention heads (default 16 on GPUs, 2 on CPU)")
    p.add_argument("--activation-checkpointing", choices=ACTIVATION_CHECKPOINTING, default="none",
                   help="recompute each layer's activations in backward, in every system")
    p.add_argument("--peak-tflops", type=float,
                   help="peak TFLOP/s per GPU for MFU (default: 989, bf16 dense, on H100 and H200; none elsewhere)")
    p.add_argument("--seq", type=int, help="sequence length (default 1024 on GPUs, 64 on CPU)")
    p.add_argument("--batch", type=int, help="sequences per GPU per step (default 2)")
    p.add_argument("--steps", type=int, help="timed steps per variant (default 10 on GPUs, 2 on CPU)")
    p.add_argument("--warmup", type=int, help="untimed steps first, compilation included (default 3, 1 on CPU)")
    p.add_argument("--rounds", type=int, default=1, help="runs of each variant, taking turns; the median is reported")
    p.add_argument("--profile-steps", type=int, default=3,
                   help="steps profiled for exposed communication (GPU; 0: off)")
    p.add_argument("--trace-dir", help="keep each variant's profiler trace (host and GPU) and op table here (GPU)")
    p.add_argument("--host-profile", metavar="DIR",
                   help="run --profile-steps more steps of each variant under Python's cProfile after the timed "
                        "ones and write DIR/<variant>.pstats and its costliest functions (.txt): "
                        "where the host's time goes in a step the host sets the pace of")
    p.add_argument("--ranks-per-node", type=int, help="ranks per emulated node (default: half the ranks)")
    p.add_argument("--zpp-reduce-dtype", choices=sorted(DTYPES), default="bf16", help="zeropp's gradient reduce dtype")
    p.add_argument("--slow-link", action="store_true",
                   help="set NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 (NCCL over its network transport)")
    p.add_argument("--simulate-network", choices=sorted(PRESETS), metavar="PRESET",
                   help=f"run rank 0 of a --world of ranks alone, its collectives timed by the network model "
                        f"(runtime/network_model.py), on one GPU or the CPU; presets: {', '.join(sorted(PRESETS))}")
    p.add_argument("--world", type=int, help="ranks of the simulated world (with --simulate-network)")
    p.add_argument("--network-override", default="", metavar="KEY=VALUE,...",
                   help="network model parameters replacing the preset's, e.g. inter_busbw_gbyte_per_s=20")
    p.add_argument("--compile-mode", choices=("inductor", "debug"), default="inductor",
                   help="debug: zeropp with inductor=False, FSDP2 blocks with backend='aot_eager'")
    p.add_argument("--zpp-option", type=field_setting, action="append", default=[], metavar="KEY=VALUE",
                   help="a zeropp Config field for every zeropp variant, e.g. bucket_size=33554432 (repeatable)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-bytes", type=int, default=8_000_000)
    p.add_argument("--json", help="write the results here (rank 0)")
    p.add_argument("--png", help="write a bar chart here (rank 0; needs matplotlib)")
    p.add_argument("--chart-from", metavar="JSON", help="draw --png from a recorded run's --json file, running nothing")
    args = p.parse_args(argv)
    specs = variant_specs(args.variants) if args.variants else []
    systems = {name: variant.system for name, variant in all_variants(1, torch.bfloat16).items()}
    for spec in specs:
        if (error := variant_spec_error(spec, systems)) is not None:
            p.error(f"--variants {spec}: {error}")
    if args.chart_from and not args.png:
        p.error(f"--chart-from {args.chart_from}: give --png PATH, where the chart goes")
    if args.rounds < 1:
        p.error(f"--rounds {args.rounds}: give 1 or more")
    if args.warmup is not None and args.warmup < 1:
        p.error(f"--warmup {args.warmup}: give 1 or more (the first step compiles)")
    if args.model != "gpt" and (args.dim or args.heads):
        p.error(f"--dim and --heads shape the GPT; {args.model} has its own (use --model llama-tiny for a small Llama, "
                "--layers for fewer layers)")
    if args.model != "gpt" and importlib.util.find_spec("transformers") is None:
        p.error(f"--model {args.model} needs HF transformers: pip install transformers")
    if any(n.startswith("deepspeed") for n in specs) and importlib.util.find_spec("deepspeed") is None:
        p.error("the deepspeed_* variants need DeepSpeed: pip install deepspeed")
    args.zpp_option = dict(args.zpp_option)
    try:
        zpp.Config(**args.zpp_option)
    except (zpp.ConfigError, TypeError) as error:
        p.error(f"--zpp-option: {error}")
    args.network = simulated_network(p, args, specs)
    return args


def simulated_network(p: argparse.ArgumentParser, args: argparse.Namespace, specs: list[str]) -> Network | None:
    """The network model --simulate-network asks for (None without it), its options checked."""
    if args.simulate_network is None:
        if args.world is not None or args.network_override:
            p.error("--world and --network-override describe a simulated world: give --simulate-network PRESET too "
                    "(a real world's size is torchrun's --nproc_per_node)")
        return None
    if args.world is None or args.world < 1:
        p.error("--simulate-network needs --world N, the ranks of the world whose rank 0 this process runs")
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        p.error("--simulate-network runs rank 0 alone in one process: launch it with python, not torchrun")
    if args.slow_link:
        p.error("--slow-link sets NCCL's transport; a simulated world has no NCCL: --simulate-network slow-link "
                "models that link")
    unsimulated = [n for n in specs if n.startswith("deepspeed") or variant_name(n).endswith("_graphs")]
    if unsimulated:
        p.error(f"--variants {','.join(unsimulated)}: DeepSpeed makes its own communicators and CUDA graphs replay "
                "collectives without the simulated group: run these over a real world (torchrun)")
    try:
        return network_from_preset(args.simulate_network, emulated_ranks_per_node(args.world, args.ranks_per_node),
                                   args.network_override)
    except ValueError as error:
        p.error(f"--simulate-network {args.simulate_network}: {error}")


def fill_defaults(args: argparse.Namespace, on_gpu: bool) -> None:
    """The 607M-parameter GPT on GPUs; a model that runs in seconds on CPU (the CI smoke test).
    A Llama shape brings its own width, heads and depth."""
    gpu = {"dim": 2048, "layers": 12, "heads": 16, "seq": 1024, "batch": 2, "steps": 10, "warmup": 3}
    cpu = {"dim": 64, "layers": 2, "heads": 2, "seq": 64, "batch": 2, "steps": 2, "warmup": 1}
    defaults = gpu if on_gpu else cpu
    if args.model != "gpt":
        shape = LLAMA_SHAPES[args.model]
        defaults = {**defaults, "dim": shape.dim, "layers": shape.layers, "heads": shape.heads}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    graphs = on_gpu and args.compile_mode == "inductor"  # what Config.cuda_graphs needs
    simulated = args.simulate_network is not None
    args.variants = args.variants or ",".join(default_variants(on_gpu, graphs and not simulated, not simulated))


# ----------------------------------------------------------------------------- models


def build_model(args: argparse.Namespace) -> nn.Module:
    """The benchmarked model, on the current default device, from the seed set before."""
    if args.model == "gpt":
        return GPT(GPTConfig(seq=args.seq, dim=args.dim, heads=args.heads, layers=args.layers))
    return llama(LLAMA_SHAPES[args.model], args.layers, args.seq)


def llama(shape: LlamaShape, layers: int, seq: int, rope_theta: float = 500000.0) -> nn.Module:
    """HF transformers' LlamaForCausalLM of `shape` with `layers` decoder layers, causal SDPA
    attention (`causal_sdpa`), no KV cache; on the current default device."""
    transformers = importlib.import_module("transformers")
    config = transformers.LlamaConfig(
        vocab_size=shape.vocab, hidden_size=shape.dim, intermediate_size=shape.ffn, num_hidden_layers=layers,
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, tie_word_embeddings=shape.tied,
        max_position_embeddings=max(seq, 8192), rope_theta=rope_theta, rms_norm_eps=1e-5, use_cache=False,
        attn_implementation=causal_sdpa(transformers),
    )
    return transformers.LlamaForCausalLM(config)


def causal_sdpa(transformers: Any) -> str:
    """The name of an attention implementation that calls SDPA with `is_causal=True` and no mask tensor
    (registered under it on first use), for batches of whole, unpadded sequences.

    transformers' own "sdpa" builds an explicit mask whenever the mask's creation is traced by Dynamo
    (its test for packed sequences reads the position ids), which rules out SDPA's causal kernels. A
    whole-step compile (zeropp) traces it, a per-block compile (FSDP2 here) does not; without this, the
    systems would run different attention kernels."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    # An attention name without a mask function gets no mask from transformers' mask creation.
    transformers.AttentionInterface.register("sdpa_causal", sdpa_attention_forward)
    return "sdpa_causal"


def model_layers(model: nn.Module) -> nn.ModuleList:
    """The repeated blocks (what FSDP2 shards one by one and checkpointing wraps)."""
    return model.blocks if isinstance(model, GPT) else model.model.layers


def step_loss(model_name: str, step_model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The loss of one batch (for the Llama models y is x: HF causal LMs shift the labels themselves)."""
    if model_name == "gpt":
        return step_model(x, y)
    return step_model(input_ids=x, labels=y).loss


def random_tokens(vocab: int, step: int, rank: int, world: int, per_rank: int, seq: int,
                  seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s token ids for `step`, as inputs and labels (one tensor: the model shifts)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    ids = torch.randint(0, vocab, (world * per_rank, seq), generator=g)[rank * per_rank:(rank + 1) * per_rank]
    return ids, ids


# Ops whose outputs torch's selective checkpointing keeps for FSDP2 and DeepSpeed (what zeropp's
# "selective" keeps): matrix products and attention.
_SAVED_OPS = {getattr(torch.ops.aten, name) for name in (
    "mm", "addmm", "bmm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention") if hasattr(torch.ops.aten, name)}


def _selective_contexts() -> tuple[Any, Any]:
    """torch's selective checkpointing: keep _SAVED_OPS' outputs, recompute the rest."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        saved = getattr(op, "overloadpacket", op) in _SAVED_OPS
        return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


class Checkpointed(nn.Module):
    """A layer under torch.utils.checkpoint: its activations are recomputed in backward."""

    def __init__(self, layer: nn.Module, selective: bool) -> None:
        super().__init__()
        self.layer, self.selective = layer, selective

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.selective:
            return torch.utils.checkpoint.checkpoint(self.layer, *args, use_reentrant=False,
                                                     context_fn=_selective_contexts, **kwargs)
        return torch.utils.checkpoint.checkpoint(self.layer, *args, use_reentrant=False, **kwargs)


def checkpoint_layers(model: nn.Module, mode: str) -> None:
    """torch.utils.checkpoint around every layer (as torchtitan applies it to FSDP2 models)."""
    if mode == "none":
        return
    layers = model_layers(model)
    for index, layer in enumerate(layers):
        layers[index] = Checkpointed(layer, selective=mode == "selective")


# ----------------------------------------------------------------------------- building a variant


def build_fsdp2(model: nn.Module, variant: Variant, mesh: DeviceMesh, backend: str,
                checkpointing: str) -> tuple[nn.Module, nn.Module]:
    """`model` under FSDP2; returns (the module to call, the module holding the parameters)."""
    checkpoint_layers(model, checkpointing)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=variant.reduce_dtype)
    reshard = not variant.keeps_weights
    layers = model_layers(model)
    for index, block in enumerate(layers):
        compiled = torch.compile(block, backend=backend)  # FSDP2's hooks stay outside the compiled block
        fully_shard(compiled, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
        layers[index] = compiled
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    return model, model


def build_zeropp(model: nn.Module, variant: Variant, ranks_per_node: int, debug: bool, extra: dict[str, Any],
                 checkpointing: str) -> tuple[nn.Module, nn.Module]:
    options = {"activation_checkpointing": checkpointing, **variant.zpp_options, **extra}
    config = zpp.Config(param_dtype=torch.bfloat16, reduce_dtype=variant.reduce_dtype, ranks_per_node=ranks_per_node,
                        **options)
    model = zpp.shard(model, config)
    return torch.compile(model, backend="zeropp", options={"inductor": False} if debug else None), model


def deepspeed_config(variant: Variant, batch_per_gpu: int, world: int) -> dict[str, Any]:
    """DeepSpeed's JSON config for a variant: ZeRO stage 3 in bf16 with its AdamW (the
    hyperparameters of the other systems' AdamW), plus the variant's ZeRO++ keys."""
    return {
        "train_batch_size": batch_per_gpu * world,
        "train_micro_batch_size_per_gpu": batch_per_gpu,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
        "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True, **variant.zpp_options},
        "steps_per_print": 1 << 30,
    }


def build_deepspeed(model: nn.Module, variant: Variant, batch_per_gpu: int, world: int,
                    checkpointing: str) -> tuple[Any, nn.Module]:
    """`model` under a DeepSpeed engine, which owns its optimizer; returns (engine, engine)."""
    import deepspeed

    checkpoint_layers(model, checkpointing)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=deepspeed_config(variant, batch_per_gpu, world))
    return engine, engine


# ----------------------------------------------------------------------------- measuring


def timed(device: torch.device, run: Callable[[], None]) -> tuple[float, float]:
    """(seconds `run` takes on this rank with its GPU work, seconds the host takes to issue it).
    When the two are close, the host, not the GPU, sets the pace."""
    start = time.perf_counter()
    if device.type != "cuda":
        run()
        host = time.perf_counter() - start
        return host, host
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    run()
    end.record()
    host = time.perf_counter() - start
    end.synchronize()
    return begin.elapsed_time(end) / 1e3, host


def profile_host(run: Callable[[], None], path: str, device: torch.device) -> None:
    """Runs `run` under cProfile (the GPU synchronized after it, so no queued work falls on a later
    step) and writes it (`write_profile`)."""
    import cProfile

    profiler = cProfile.Profile()
    profiler.runcall(run)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    write_profile(profiler, path)


def write_profile(profiler: Any, path: str | Path) -> None:
    """A cProfile profile as `path`.pstats, and to `path`.txt the 40 costliest functions by own time
    and the 60 costliest counting what they call."""
    import io
    import pstats

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    profiler.dump_stats(f"{path}.pstats")
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(40)
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(60)
    Path(f"{path}.txt").write_text(text.getvalue())


def merged(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, disjoint intervals covering the same time as `intervals`."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def is_communication(kernel_name: str) -> bool:
    """A NCCL kernel, or the kernel a simulated collective spins in for its modeled time."""
    return kernel_name.startswith("nccl") or COLLECTIVE_KERNEL in kernel_name


def exposed_communication(kernels: Iterable[tuple[str, float, float]]) -> float:
    """Time during which a communication kernel runs and no other kernel does, from (name, start,
    end) kernel records on one GPU: the union of NCCL (or simulated) intervals minus its overlap
    with the union of all other (compute, quantization, copy) kernels."""
    kernels = list(kernels)
    comm = merged((s, e) for name, s, e in kernels if is_communication(name))
    compute = merged((s, e) for name, s, e in kernels if not is_communication(name))
    overlap, j = 0.0, 0
    for start, end in comm:
        while j < len(compute) and compute[j][1] <= start:
            j += 1
        k = j
        while k < len(compute) and compute[k][0] < end:
            overlap += min(end, compute[k][1]) - max(start, compute[k][0])
            k += 1
    return sum(e - s for s, e in comm) - overlap


def compute_time(kernels: Iterable[tuple[str, float, float]]) -> float:
    """Time in which some kernel other than communication's runs, from (name, start, end) records on one GPU."""
    return sum(end - start for start, end in merged((s, e) for name, s, e in kernels if not is_communication(name)))


# The compute-stream breakdown's kernel kinds, by the names the profiler gives CUDA kernels; the
# first kind whose pattern a name holds (lower case) takes it, "other" what none does.
KERNEL_KINDS = (
    ("nccl", ("nccl", COLLECTIVE_KERNEL)),  # a simulated collective's spin stands for NCCL's kernel
    ("matmul", ("gemm", "nvjet", "xmma", "cutlass", "cublas")),
    ("attention", ("flash", "fmha", "attention", "attn")),
    ("quantization", ("qwz_", "qgz_")),  # zeropp's Triton kernels
    ("inductor", ("triton_",)),  # the kernels Inductor generates (fused pointwise, reductions)
    ("optimizer", ("multi_tensor_apply",)),
    ("copy and cast", ("copy", "elementwise", "catarray", "fill")),  # eager ATen copies and casts
)


def kernel_kind(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind, patterns in KERNEL_KINDS if any(p in lowered for p in patterns)), "other")


def kernel_breakdown(kernels: Iterable[tuple[str, float, float]], steps: int) -> dict[str, float]:
    """Kernel time per step in ms by kind (`KERNEL_KINDS`), summed over kernels (ones that overlap
    count twice), from (name, start, end) records in microseconds on one GPU."""
    totals = dict.fromkeys([kind for kind, _ in KERNEL_KINDS] + ["other"], 0.0)
    for name, start, end in kernels:
        totals[kernel_kind(name)] += (end - start) / 1e3 / steps
    return totals


def transfer_only(kernels: list[tuple[str, float, float]], transfer: list[float]) -> list[tuple[str, float, float]]:
    """`kernels` with the i-th NCCL kernel cut to its last `transfer[i]` (the time it moved data,
    after every rank had joined)."""
    times = iter(transfer)
    return [(name, max(start, end - next(times)), end) if name.startswith("nccl") else (name, start, end)
            for name, start, end in kernels]


def nccl_durations(kernels: list[tuple[str, float, float]]) -> dict[str, list[float]]:
    durations: dict[str, list[float]] = defaultdict(list)
    for name, start, end in kernels:
        if name.startswith("nccl"):
            durations[name].append(end - start)
    return dict(durations)


def transfer_times(kernels: list[tuple[str, float, float]],
                   everyone: list[dict[str, list[float]]]) -> list[float] | None:
    """Per NCCL kernel of `kernels` (in order), the collective's shortest kernel over the ranks'
    `nccl_durations`; NCCL runs a communicator's collectives in issue order, so the i-th kernel
    of a name is the same collective on every rank. None if the ranks ran different collectives."""
    mine = nccl_durations(kernels)
    if any({n: len(d) for n, d in other.items()} != {n: len(d) for n, d in mine.items()} for other in everyone):
        return None
    shortest = {n: [min(d) for d in zip(*(other[n] for other in everyone))] for n in mine}
    seen: dict[str, int] = defaultdict(int)
    out = []
    for name, _, _ in kernels:
        if name.startswith("nccl"):
            out.append(shortest[name][seen[name]])
            seen[name] += 1
    return out


def exposed_and_peer_wait(kernels: list[tuple[str, float, float]], wall_us: float) -> tuple[float, float]:
    """(exposed transfer, peer wait) on this rank as shares of `wall_us`; collective (all ranks)."""
    everyone: list[dict[str, list[float]]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(everyone, nccl_durations(kernels))
    in_nccl_alone = exposed_communication(kernels)
    transfer = transfer_times(kernels, everyone)
    if transfer is None:  # no pairing possible: all of it counts as exposed
        return in_nccl_alone / wall_us, 0.0
    exposed = exposed_communication(transfer_only(kernels, transfer))
    return exposed / wall_us, (in_nccl_alone - exposed) / wall_us


def profiled_kernels(run: Callable[[], None],
                     trace_prefix: str | None = None) -> tuple[list[tuple[str, float, float]], float]:
    """(name, start, end) of every GPU kernel while `run` executes, in start order, and the wall
    time in microseconds (CUDA only). With `trace_prefix`, host activity is recorded too and the
    trace (`.json.gz`) and a table of the most expensive ops (`.txt`) are kept there."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if trace_prefix else [])
    torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        run()
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - start) * 1e6
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
        if trace_prefix:
            with open(path, "rb") as f, gzip.open(trace_prefix + ".json.gz", "wb") as out:
                out.write(f.read())
            averages = prof.key_averages()
            with open(trace_prefix + ".txt", "w") as out:
                out.write(averages.table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=70))
                out.write(averages.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=70))
    return sorted((e["name"], e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "kernel"), wall_us


def flops_per_token(layers: int, dim: int, seq: int, n_params: int) -> float:
    return 6 * n_params + 12 * layers * dim * seq


def peak_tflops(args: argparse.Namespace, device: torch.device) -> float | None:
    """Peak bf16 dense TFLOP/s of one GPU: --peak-tflops, else the table's entry for this GPU."""
    if args.peak_tflops or device.type != "cuda":
        return args.peak_tflops
    name = torch.cuda.get_device_name()
    return next((peak for key, peak in PEAK_TFLOPS.items() if key in name), None)


def padded_shard_numel(model: nn.Module, world: int) -> int:
    """Elements of one rank's shards, each parameter's rows padded to a multiple of the world
    (how FSDP2 and zeropp both shard dim 0); tied parameters once. A 0-d parameter, which
    FSDP2 cannot shard, counts as zeropp holds it: one element per rank."""
    return sum(padding.shard_numel(p, world) for p in model.parameters())


def gather_reduce_bytes(shard_numel: int, gathers: int, reduce_dtype: torch.dtype, world: int,
                        ranks_per_node: int) -> tuple[int, int]:
    """(intra, inter) bytes one rank receives per step from `gathers` bf16 all-gathers and one
    reduce-scatter in `reduce_dtype` over all ranks, counted as zeropp's ledger counts them:
    each peer sends this rank one shard's worth per collective."""
    per_peer = shard_numel * (2 * gathers + torch.empty((), dtype=reduce_dtype).element_size())
    return world_received_bytes(world, ranks_per_node, per_peer)


def rank_max(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def warm_up_the_process(device: torch.device, compile_mode: str) -> None:
    """Compiles and runs a small function and runs one collective, so that what a process pays
    once (Inductor's compile workers, the first kernel's compilation, the GPU's and the network
    library's start) falls on no variant's first step: the first variant's would hold it otherwise."""
    if compile_mode == "inductor":
        torch.compile(lambda x: (x * 2).sin().sum(), backend="inductor")(torch.ones(1024, device=device))
    dist.all_reduce(torch.ones(1, device=device))


def alloc_retries(device: torch.device) -> int:
    """How often the CUDA caching allocator has freed its cached blocks to retry an allocation:
    each retry synchronizes the device, which stalls the host (a round whose host issues a step in
    about the step's time, with the GPU idle between kernels)."""
    return torch.cuda.memory_stats(device).get("num_alloc_retries", 0) if device.type == "cuda" else 0


# ----------------------------------------------------------------------------- one variant

TORCH_LINEAR = torch.nn.functional.linear  # what release_deepspeed puts back


def require_torch_linear(variant_name: str) -> None:
    """Refuses to measure a variant while `torch.nn.functional.linear` is not torch's own: a library
    that replaced it (DeepSpeed's ZeRO-3 does, for the whole process) would be measured instead."""
    if torch.nn.functional.linear is not TORCH_LINEAR:
        raise RuntimeError(
            f"{variant_name}: torch.nn.functional.linear is {torch.nn.functional.linear!r}, not torch's own; "
            "something run before this variant replaced it (release_deepspeed puts it back after DeepSpeed)")


def run_variant(variant: Variant, args: argparse.Namespace, data: list[tuple[torch.Tensor, torch.Tensor]],
                env: dict[str, Any], trace_name: str) -> dict[str, Any]:
    device, world, ranks_per_node = env["device"], env["world"], env["ranks_per_node"]
    debug, checkpointing = args.compile_mode == "debug", args.activation_checkpointing
    require_torch_linear(variant.name)
    zpp.reset_comm_report()  # the report then covers this variant's graphs only
    leftover = None
    if device.type == "cuda":  # what earlier variants left allocated (should be ~0) is reported
        torch.cuda.reset_peak_memory_stats()
        leftover = torch.cuda.memory_allocated()
    torch.manual_seed(args.seed)
    with device:
        model = build_model(args)
        n_params = sum(p.numel() for p in model.parameters())  # tied parameters once
        shard_numel = padded_shard_numel(model, world)
        if variant.system == "fsdp2":
            backend = "aot_eager" if debug else "inductor"
            step_model, model = build_fsdp2(model, variant, env["mesh"], backend, checkpointing)
        elif variant.system == "zeropp":
            step_model, model = build_zeropp(model, variant, ranks_per_node, debug, args.zpp_option, checkpointing)
        else:
            step_model, model = build_deepspeed(model, variant, args.batch, world, checkpointing)
    opt = None  # DeepSpeed's engine owns its optimizer
    if variant.system == "deepspeed":
        def optimize(loss: torch.Tensor) -> None:
            step_model.backward(loss)
            step_model.step()
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, betas=(0.9, 0.95),
                                fused=device.type == "cuda")

        def optimize(loss: torch.Tensor) -> None:
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    step_index = 0

    def train(steps: int) -> None:
        nonlocal step_index
        for _ in range(steps):
            x, y = data[step_index % len(data)]
            optimize(step_loss(args.model, step_model, x, y))
            step_index += 1

    first_step_s, _ = timed(device, lambda: train(1))
    first_step_s = rank_max(first_step_s, device)
    warmup_s, _ = timed(device, lambda: train(args.warmup - 1))
    warmup_s += first_step_s
    dist.barrier()
    retries_before = alloc_retries(device)
    simulated: SimulatedWorld | None = env["simulated"]
    if simulated:
        simulated.ledger.clear()
        waited_before = simulated.host_waited_seconds()
    seconds, host_seconds = timed(device, lambda: train(args.steps))
    if simulated:  # read before any other collective is charged
        modeled_comm_s = simulated.ledger.seconds() / args.steps
        host_waited_share = (simulated.host_waited_seconds() - waited_before) / seconds
    retries = rank_max(alloc_retries(device) - retries_before, device) if device.type == "cuda" else None
    seconds = rank_max(seconds, device) / args.steps
    host_seconds = rank_max(host_seconds, device) / args.steps
    exposed = peer_wait = busy = breakdown = None
    if device.type == "cuda" and args.profile_steps:
        trace = os.path.join(args.trace_dir, f"{trace_name}.rank{dist.get_rank()}") if args.trace_dir else None
        kernels, wall_us = profiled_kernels(lambda: train(args.profile_steps), trace)
        breakdown = kernel_breakdown(kernels, args.profile_steps)  # rank 0's
        busy = compute_time(kernels) / 1e6 / args.profile_steps / seconds
        if simulated:  # one rank: every other is taken to run as it does, so none waits for a peer
            exposed = exposed_communication(kernels) / wall_us
        else:
            exposed, peer_wait = exposed_and_peer_wait(kernels, wall_us)
            exposed, peer_wait, busy = (rank_max(v, device) for v in (exposed, peer_wait, busy))
    elif simulated and device.type == "cpu":
        exposed = host_waited_share  # the time the program stood waiting for the modeled network
    if args.host_profile and args.profile_steps:
        profile_host(lambda: train(args.profile_steps), os.path.join(args.host_profile, trace_name), device)
    peak = rank_max(torch.cuda.max_memory_allocated(), device) if device.type == "cuda" else None

    tokens_per_s = world * args.batch * args.seq / seconds
    tflops = flops_per_token(args.layers, args.dim, args.seq, n_params) * tokens_per_s / world / 1e12
    result = {
        "name": variant.name, "label": variant.label, "system": variant.system,
        "reduce_dtype": str(variant.reduce_dtype).removeprefix("torch."), "keeps_weights": variant.keeps_weights,
        "ms_per_step": seconds * 1e3, "host_ms_per_step": host_seconds * 1e3, "tokens_per_s": tokens_per_s,
        "first_step_s": first_step_s, "warmup_s": warmup_s, "tflops_per_gpu": tflops,
        "mfu": tflops / env["peak_tflops"] if env["peak_tflops"] else None,
        "peak_memory_bytes": peak, "allocated_at_start_bytes": leftover, "exposed_comm_fraction": exposed,
        "peer_wait_fraction": peer_wait, "gpu_busy_fraction": busy, "kernel_ms_per_step": breakdown,
        "parameters": n_params, "alloc_retries_in_timed_steps": retries,
        "simulated_comm_ms_per_step": modeled_comm_s * 1e3 if simulated else None,
        **comm_bytes(variant, shard_numel, world, ranks_per_node),
    }
    if variant.system == "deepspeed":
        release_deepspeed(step_model)
    released = weakref.ref(model)  # a DeepSpeed engine's is emptied instead (release_deepspeed)
    step_model = model = opt = optimize = None  # the variant's memory goes before the next one's
    release_memory(device)
    if variant.system != "deepspeed" and released() is not None and dist.get_rank() == 0:
        print(f"  {variant.name}: its model is still alive after its release; what refers to it:\n"
              f"{describe_referrers(released())}", flush=True)
    if device.type == "cuda":
        result["kept_after_release_bytes"] = kept = torch.cuda.memory_allocated() - leftover
        if kept > 2**30 and dist.get_rank() == 0:
            print(f"  {variant.name} left {kept / 2**30:.1f} GiB allocated after its release; the variants after it "
                  f"run with that much less memory. What holds it:\n{describe_cuda_tensors()}", flush=True)
    return result


def comm_bytes(variant: Variant, shard_numel: int, world: int, ranks_per_node: int) -> dict[str, Any]:
    """Bytes per step and rank, with their ratios to plain bf16 ZeRO-3 of the same model and
    topology; `shard_numel` is one rank's padded shard of the model (see padded_shard_numel)."""
    if variant.system == "zeropp":
        report = zpp.comm_report()
        if not report.rows and world > 1:
            raise RuntimeError(f"{variant.name}: the zeropp ledger recorded no training graph")
        intra, inter, source = report.intra_bytes, report.inter_bytes, "ledger"
        baseline_intra, baseline_inter = report.baseline_intra_bytes, report.baseline_inter_bytes
        phases = report.to_dict()["phases"]
    elif variant.zpp_options:  # DeepSpeed ZeRO++: its traffic is not modelled here
        return {"intra_bytes": None, "inter_bytes": None, "bytes_source": "-", "phases": None,
                "inter_ratio": None, "total_ratio": None}
    else:
        # FSDP2 and DeepSpeed's ZeRO-3 gather in bf16 in forward, again in backward unless they
        # keep the weights, and reduce-scatter in their reduce dtype; the baseline is plain ZeRO-3
        # all in bf16.
        gathers = 1 if variant.keeps_weights else 2
        intra, inter = gather_reduce_bytes(shard_numel, gathers, variant.reduce_dtype, world, ranks_per_node)
        baseline_intra, baseline_inter = gather_reduce_bytes(shard_numel, 2, torch.bfloat16, world, ranks_per_node)
        source, phases = "analytic", None
    ratio = lambda value, base: value / base if base else None  # noqa: E731 (no inter-node bytes on one node)
    return {"intra_bytes": intra, "inter_bytes": inter, "bytes_source": source, "phases": phases,
            "inter_ratio": ratio(inter, baseline_inter),
            "total_ratio": ratio(intra + inter, baseline_intra + baseline_inter)}


def release_deepspeed(engine: Any) -> None:
    """Ends a DeepSpeed engine before the next variant is measured: `destroy()` (its hooks and
    buffers), and what that leaves:
    - DeepSpeed's ZeRO-3 pushes each engine's model on a module-level stack
      (`deepspeed.runtime.zero.parameter_offload.FWD_MODULE_STACK`) that `destroy()` does not pop,
      which keeps the model, and what it refers to, allocated in every later variant;
    - it replaces `torch.nn.functional.linear` with its own autograd function for good, so every
      later variant would run DeepSpeed's linear (other graphs, so zeropp's compile caches miss);
    - with ZeRO++'s quantized paths the engine and its model stay referenced from outside Python's
      reach, so its optimizer's and its own attributes are dropped, and the partitions its
      parameters carry (`ds_tensor` and DeepSpeed's other attributes), which frees their memory."""
    engine.destroy()
    for param in engine.module.parameters():
        vars(param).clear()
    offload = importlib.import_module("deepspeed.runtime.zero.parameter_offload")
    stack = getattr(offload, "FWD_MODULE_STACK", None)
    if stack is not None:
        stack[:] = [module for module in stack if module is not engine.module]
    torch.nn.functional.linear = TORCH_LINEAR
    vars(engine.optimizer).clear()
    vars(engine).clear()


def release_memory(device: torch.device) -> None:
    """Frees the finished variant's compiled graphs and tensors before the next one is measured."""
    zpp.release_cuda_graphs()
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def describe_referrers(obj: Any, depth: int = 4) -> str:
    """What keeps `obj` alive: the objects that refer to it, and those that refer to them, to `depth`
    levels (type names; for a function, its name; for a dict, its first keys)."""
    lines: list[str] = []
    seen = {id(lines)}

    def visit(target: Any, level: int) -> None:
        referrers = gc.get_referrers(target)
        seen.add(id(referrers))
        for ref in referrers:
            if id(ref) in seen or inspect.isframe(ref):
                continue
            seen.add(id(ref))
            described = type(ref).__qualname__
            if isinstance(ref, dict):
                described += " with keys " + ", ".join(map(str, list(ref)[:5]))
            elif hasattr(ref, "__qualname__"):
                described += " " + str(ref.__qualname__)
            lines.append("    " + "  " * level + described[:160])
            if level + 1 < depth:
                visit(ref, level + 1)

    gc.collect()
    visit(obj, 0)
    return "\n".join(lines[:60])


def describe_cuda_tensors(count: int = 5) -> str:
    """The largest live CUDA storages, each by its largest tensor with the types of the objects that
    refer to that (for a dict, the object whose attributes it holds): where a released variant's
    memory is kept. Plain tensors and parameters only: a tensor subclass (DTensor, a compiler's fake
    tensor) holds its memory, if any, in plain tensors of its own."""
    gc.collect()
    with warnings.catch_warnings():  # isinstance() on deprecated module attributes warns
        warnings.simplefilter("ignore")
        live = [o for o in gc.get_objects() if type(o) in (torch.Tensor, nn.Parameter) and o.is_cuda]
    by_storage = {t.untyped_storage().data_ptr(): t for t in sorted(live, key=lambda t: t.numel())}
    tensors = sorted(by_storage.values(), key=lambda t: t.untyped_storage().nbytes(), reverse=True)[:count]
    del live, by_storage
    lines = []
    for t in tensors:
        holders = []
        for ref in gc.get_referrers(t):
            if isinstance(ref, dict):
                owners = [type(o).__qualname__ for o in gc.get_referrers(ref) if getattr(o, "__dict__", None) is ref]
                holders.append(f"dict of {owners[0]}" if owners else "dict")
            elif ref is not tensors:
                holders.append(type(ref).__qualname__)
        lines.append(f"    {t.untyped_storage().nbytes() / 2**30:.2f} GiB {type(t).__name__} {tuple(t.shape)} "
                     f"{t.dtype}, held by {sorted(set(holders))}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- comparing


def medians(rounds: dict[str, list[dict[str, Any]]], names: list[str]) -> list[dict[str, Any]]:
    """Each variant's median round, with the comparisons between them."""
    results = [median_round(rounds[name]) for name in names]
    add_comparisons(results)
    return results


def write_json(path: str, content: dict[str, Any]) -> None:
    """Writes `content` to a temporary file renamed over `path`: a launch stopped while writing
    leaves the previous version whole."""
    partial = f"{path}.partial"
    with open(partial, "w") as f:
        json.dump(content, f, indent=1)
    os.replace(partial, path)


def median_round(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median step time (of an even count, the slower middle one), with every run's
    step time; its first step and warm-up are the first run's, which compiled (later runs reuse
    the process's compiled code)."""
    median = sorted(runs, key=lambda r: r["ms_per_step"])[len(runs) // 2]
    return {**median, "first_step_s": runs[0]["first_step_s"], "warmup_s": runs[0]["warmup_s"],
            "ms_per_step_rounds": [r["ms_per_step"] for r in runs]}


def add_comparisons(results: list[dict[str, Any]]) -> None:
    """Throughput (and memory) ratios to FSDP2's default, to FSDP2's best setting at equal
    memory, and to zeropp's plain ZeRO-3, each where that reference was run."""
    by_name = {r["name"]: r for r in results}
    fsdp2 = [r for r in results if r["system"] == "fsdp2"]
    for r in results:
        peers = [f for f in fsdp2 if f["keeps_weights"] <= r["keeps_weights"]]
        best = max(peers, key=lambda f: f["tokens_per_s"]) if peers else None
        r["fsdp2_equal_memory"] = best["name"] if best else None
        for key, ref in (("vs_fsdp2_default", by_name.get("fsdp2")), ("vs_fsdp2_equal_memory", best),
                         ("vs_zero3", by_name.get("zero3"))):
            r[key] = r["tokens_per_s"] / ref["tokens_per_s"] if ref else None
        memory_ref = best["peak_memory_bytes"] if best else None
        r["memory_vs_fsdp2_equal_memory"] = r["peak_memory_bytes"] / memory_ref if memory_ref else None


def table(results: list[dict[str, Any]]) -> str:
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    headers = ("variant", "ms/step", "tokens/s", "TFLOP/s", "MFU", "1st s", "peak GB", "inter MB", "src", "inter x",
               "exposed", "wait", "busy", "/FSDP2", "/eq.mem", "(ref)", "/ZeRO-3", "mem x")
    rows = []
    for r in results:
        peak = r["peak_memory_bytes"] / 1e9 if r["peak_memory_bytes"] is not None else None
        inter = r["inter_bytes"] / 1e6 if r["inter_bytes"] is not None else None
        rows.append((
            r["name"], f"{r['ms_per_step']:.1f}", f"{r['tokens_per_s']:,.0f}", f"{r['tflops_per_gpu']:.1f}",
            fmt(r["mfu"], ".1%"), f"{r['first_step_s']:.1f}", fmt(peak, ".2f"), fmt(inter, ".1f"), r["bytes_source"],
            fmt(r["inter_ratio"], ".3f"), fmt(r["exposed_comm_fraction"], ".1%"), fmt(r["peer_wait_fraction"], ".1%"),
            fmt(r["gpu_busy_fraction"], ".1%"), fmt(r["vs_fsdp2_default"], ".2f"),
            fmt(r["vs_fsdp2_equal_memory"], ".2f"), r["fsdp2_equal_memory"] or "-", fmt(r["vs_zero3"], ".2f"),
            fmt(r["memory_vs_fsdp2_equal_memory"], ".2f")))
    return text_table.render(headers, rows, align="<>>>>>>><>>>>>><>>", gap=1)


def breakdown_table(results: list[dict[str, Any]]) -> str | None:
    """Each variant's kernel time per step by kind (rank 0's profiled steps), if profiled."""
    profiled = [r for r in results if r.get("kernel_ms_per_step")]
    if not profiled:
        return None
    kinds = [kind for kind in profiled[0]["kernel_ms_per_step"] if any(r["kernel_ms_per_step"][kind] for r in profiled)]
    rows = [(r["name"], *(f"{r['kernel_ms_per_step'][kind]:.1f}" for kind in kinds),
             f"{sum(r['kernel_ms_per_step'].values()):.1f}") for r in profiled]
    return text_table.render(("kernel ms/step", *kinds, "all"), rows, align="<" + ">" * (len(kinds) + 1))


def plot(results: list[dict[str, Any]], title: str, path: str) -> None:
    """A bar chart per measure (tokens/s, bytes received from other nodes, peak memory), one bar per
    variant under its label, each bar's value written on it; a value not measured (DeepSpeed's
    bytes, memory off GPUs) gets no bar and says so, never a bar of 0."""
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed: no chart written to {path} (pip install matplotlib)")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [textwrap.fill(r.get("label") or r["name"], 18) for r in results]
    colors = [{"fsdp2": "tab:gray", "deepspeed": "tab:orange"}.get(r["system"], "tab:blue") for r in results]
    megabytes = lambda n: None if n is None else n / 1e6  # noqa: E731
    gigabytes = lambda n: None if n is None else n / 1e9  # noqa: E731
    panels = [("tokens/s (all ranks)", [r["tokens_per_s"] for r in results], "{:,.0f}"),
              ("MB received from other nodes, per step and rank", [megabytes(r["inter_bytes"]) for r in results],
               "{:,.0f}"),
              ("peak memory, GB", [gigabytes(r["peak_memory_bytes"]) for r in results], "{:.1f}")]
    panels = [panel for panel in panels if any(v is not None for v in panel[1])]
    fig, axes = plt.subplots(1, len(panels), figsize=(0.9 * len(results) * len(panels) + 3, 5.5), squeeze=False)
    for ax, (label, values, form) in zip(axes[0], panels):
        positions = range(len(values))
        bars = ax.bar(positions, [0 if v is None else v for v in values], color=colors)
        top = max(v for v in values if v is not None)
        for bar, value in zip(bars, values):
            if value is None:
                bar.set_visible(False)
                ax.text(bar.get_x() + bar.get_width() / 2, top * 0.02, "not\nmeasured", ha="center", va="bottom",
                        fontsize=7, color="dimgray")
            else:
                ax.text(bar.get_x() + bar.get_width() / 2, value, form.format(value), ha="center", va="bottom",
                        fontsize=7)
        ax.set_xticks(list(positions), labels, rotation=60, ha="right", fontsize=7)
        ax.set_ylim(0, top * 1.12)
        ax.set_title(label, fontsize=9)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def chart_title(setup: dict[str, Any], described: str) -> str:
    """Where the run ran, what it ran and when, marked SIMULATED for a simulated network's."""
    world, device = setup["world"], setup["device"]
    where = f"SIMULATED, rank 0 of {world} on {device}" if setup.get("simulated_network") else f"{device} x{world}"
    return f"{where}, link {setup['link']}, {described} ({setup['date']})"


def chart_from_json(json_path: str, png_path: str) -> None:
    """Draws `plot`'s chart of a recorded run (its `--json` file), running nothing."""
    record = json.loads(Path(json_path).read_text())
    setup = record["setup"]
    model = setup.get("model") or {}
    described = f"{model.get('name', 'model')}, seq {model.get('seq', '?')}, batch {setup.get('batch_per_gpu', '?')}"
    plot(record["variants"], chart_title(setup, described), png_path)


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    if args.chart_from:
        chart_from_json(args.chart_from, args.png)
        return []
    if args.slow_link:  # NCCL reads these when it creates a communicator, which happens after this
        os.environ.update(SLOW_LINK_ENV)
    simulated = join_simulated_world(args.world, args.network) if args.network else None
    device = simulated.device if simulated else init_distributed()
    if args.trace_dir:
        os.makedirs(args.trace_dir, exist_ok=True)
    fill_defaults(args, device.type == "cuda")
    rank, world = dist.get_rank(), dist.get_world_size()
    ranks_per_node = emulated_ranks_per_node(world, args.ranks_per_node)
    hpz_size = ranks_per_node if world // ranks_per_node > 1 else 1
    variants = all_variants(hpz_size, DTYPES[args.zpp_reduce_dtype], ranks_per_node)
    peak = peak_tflops(args, device)
    env = {"device": device, "world": world, "ranks_per_node": ranks_per_node, "peak_tflops": peak,
           "mesh": init_device_mesh(device.type, (world,)), "simulated": simulated}

    steps = args.warmup + args.steps + (args.profile_steps if device.type == "cuda" else 0)
    if args.model == "gpt":
        text = stdlib_bytes(args.data_bytes)
        batches = [batch(text, i, rank, world, args.batch, args.seq, args.seed) for i in range(steps)]
        vocab = 256
    else:
        vocab = LLAMA_SHAPES[args.model].vocab
        batches = [random_tokens(vocab, i, rank, world, args.batch, args.seq, args.seed) for i in range(steps)]
    data = [tuple(t.to(device) for t in b) for b in batches]
    model_setup = {"name": args.model, "dim": args.dim, "layers": args.layers, "heads": args.heads, "seq": args.seq,
             "vocab": vocab}
    if args.model != "gpt":
        shape = LLAMA_SHAPES[args.model]
        model_setup.update(kv_heads=shape.kv_heads, ffn=shape.ffn, tied_embeddings=shape.tied)
    described = f"{args.model} d={args.dim} L={args.layers} T={args.seq}, {args.batch} seq/GPU"
    if args.activation_checkpointing != "none":
        described += f", activation checkpointing {args.activation_checkpointing}"

    slow = all(os.environ.get(k) == v for k, v in SLOW_LINK_ENV.items())
    setup = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "command": " ".join(sys.argv),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "world": world,
        "ranks_per_node": ranks_per_node, "hpz_partition_size": hpz_size, "backend": dist.get_backend(),
        "link": (f"simulated: {args.simulate_network}" if simulated else
                 "slow (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1)" if slow else "default"),
        "simulated_network": {"preset": args.simulate_network, "overrides": args.network_override,
                              **args.network.to_dict()} if simulated else None,
        "torch": torch.__version__, "nccl": str(torch.cuda.nccl.version()) if device.type == "cuda" else None,
        "model": model_setup, "activation_checkpointing": args.activation_checkpointing,
        "transformers": _version("transformers"), "deepspeed": _version("deepspeed"),
        "batch_per_gpu": args.batch, "warmup_steps": args.warmup, "timed_steps": args.steps, "rounds": args.rounds,
        "profile_steps": args.profile_steps if device.type == "cuda" else 0, "compile_mode": args.compile_mode,
        "param_dtype": "bfloat16", "zeropp_reduce_dtype": str(DTYPES[args.zpp_reduce_dtype]).removeprefix("torch."),
        "flops_per_token": "6 N + 12 L d T (N parameters, L layers, d width, T sequence)",
        "peak_tflops_per_gpu": peak, "peak_tflops_source": "--peak-tflops" if args.peak_tflops else (
            "bf16 dense, H100/H200 SXM" if peak else None),
    }
    if rank == 0:
        print(f"bench: {world} ranks as {world // ranks_per_node} emulated nodes x {ranks_per_node}, "
              f"{setup['device']}, "
              f"link {setup['link']}, {described}", flush=True)
        if simulated:
            print(f"SIMULATED: rank 0 of {world} runs alone; its collectives move nothing and last what the network "
                  f"model gives ({args.simulate_network}: {describe_network(args.network)}); every figure below is "
                  "rank 0's, taken as every rank's", flush=True)
        if peak:
            print(f"MFU against a peak of {peak:.0f} TFLOP/s per GPU ({setup['peak_tflops_source']})", flush=True)

    warm_up_the_process(device, args.compile_mode)
    names = variant_specs(args.variants)
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    launch_start = time.perf_counter()
    for index in range(args.rounds):
        for name in names:
            label = f"{name}.round{index}" if args.rounds > 1 else name
            r = run_variant(variant_of(name, variants), args, data, env, label)
            rounds[name].append(r)
            if rank == 0:
                modeled = r["simulated_comm_ms_per_step"]
                print(f"  {label:<24} {r['ms_per_step']:8.1f} ms/step "
                      f"(host issues a step in {r['host_ms_per_step']:.1f} ms"
                      + (f"; the network model charged {modeled:.1f} ms of collectives" if simulated else "") + ") "
                      f"{r['tokens_per_s']:>10,.0f} tokens/s  (first step {r['first_step_s']:.1f} s, "
                      f"warmup {r['warmup_s']:.1f} s; {time.perf_counter() - launch_start:.0f} s into the launch)"
                      + (f", {r['alloc_retries_in_timed_steps']:.0f} allocator retries in the timed steps"
                         if r["alloc_retries_in_timed_steps"] else ""), flush=True)
        if rank == 0 and args.json and index + 1 < args.rounds:  # a launch stopped later keeps its rounds
            write_json(args.json, {"setup": {**setup, "rounds_finished": index + 1},
                                   "variants": medians(rounds, names)})
    results = medians(rounds, names)
    if rank == 0:
        if simulated:
            print(f"SIMULATED network ({args.simulate_network}), rank 0 of {world}:")
        print(table(results))
        if (breakdown := breakdown_table(results)) is not None:
            print(breakdown)
        if args.rounds > 1:
            for r in results:
                print(f"  {r['name']:<18} rounds, ms/step: " + ", ".join(f"{ms:.1f}" for ms in r["ms_per_step_rounds"]))
        if args.json:
            write_json(args.json, {"setup": {**setup, "rounds_finished": args.rounds}, "variants": results})
        if args.png:
            plot(results, chart_title(setup, described), args.png)
    dist.destroy_process_group()
    return results


def join_simulated_world(world: int, network: Network) -> SimulatedWorld:
    """This process as rank 0 of `world` ranks over `network` (runtime/simulated_group.py), on the
    first GPU where there is one."""
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
    return init_simulated_world(world, network)


def describe_network(network: Network) -> str:
    """The network model's parameters in a line: each link's latency and bus bandwidth."""
    links = [("within a node", network.intra_node), ("between nodes", network.inter_node or network.intra_node)]
    return ", ".join(f"{where} {link.latency_s * 1e6:.1f} us + {link.busbw_bytes_per_s / 1e9:.1f} GB/s bus bandwidth"
                     for where, link in links) + f", {network.ranks_per_node} ranks per node"


def _version(package: str) -> str | None:
    """The installed version of an optional package, or None."""
    if importlib.util.find_spec(package) is None:
        return None
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()

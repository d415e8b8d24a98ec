"""Where the first training step's time goes at model depth: zeropp against FSDP2 + torch.compile.

Builds HuggingFace transformers' `LlamaForCausalLM` from a config (Llama-3.2's layout: grouped query
attention, SDPA, tied embeddings; any width and depth), and for every variant and depth launches
`torchrun` twice on its own fresh Inductor cache directory: cold (empty caches) and warm (a new
process, the same caches, as a restarted job). The variants take turns, launch by launch (every
variant's cold launch, then every variant's warm one), so a host whose speed drifts slows them
alike; `--launches cold warm warm warm` repeats the warm launch and prints the medians. Each launch
reports the first step's seconds (forward, backward and optimizer step, compilation included), ms
per step after it, peak GPU memory, and where compilation went, from
`torch._dynamo.utils.compile_times()`: Dynamo's tracing, AOTAutograd's joint graph, the partitioner,
zeropp's passes, Inductor's lowering, scheduling and code generation, and the compilation of the
generated code (C++ / Triton).

    python examples/compile_probe.py                                  # CPU, 2 gloo ranks, 16 and 28 layers
    python examples/compile_probe.py --shape llama-1b --nproc 1 --seq 2048 --batch 2 --dtype bf16   # one GPU
    python examples/compile_probe.py --shape llama-3b --nproc 1 --seq 2048 --batch 2 --dtype bf16

Variants: `fsdp2` (`fully_shard` on every decoder layer and the root, then `torch.compile(model)`),
`zero3` (zeropp, plain ZeRO-3), `zero3-layers` (the same with `Config.compile_layers_once`: each
layer a graph of its own, compiled once for every identical layer), `all3` (zeropp with qwZ, hpZ and
qgZ); a zeropp variant named NAME@KEY=VALUE runs with that Config field on top
(`zero3-layers@bucket_size=67108864`, each spec its own cold and warm launches, so two settings
compare without one warming the other's process). `--profile DIR` writes a cProfile of rank 0's
first step per launch (`DIR/{variant}-{layers}-{cold|warm}.pstats`, a repeated warm launch
`-warm-N`, and the costliest functions as `.txt`, as `examples/bench.py --host-profile` writes
them). `--json FILE` saves every launch's numbers.

`--fake-world N` runs rank 0 of an N-rank world alone, on one GPU (or the CPU), over torch's fake
process group: its collectives return at once and move nothing, so the graphs, kernels and their
compilation are those of a rank of that world, while step times, and the values trained, are not.

    python examples/compile_probe.py --shape llama-3b --fake-world 2 --seq 4096 --batch 1 --dtype bf16 \
        --variants fsdp2 zero3-layers

With `--simulate-network PRESET` the fake world's collectives take the time the network model
gives (runtime/network_model.py, runtime/simulated_group.py) on nodes of `--ranks-per-node` ranks:
the step times are then rank 0's over that modeled network, marked as simulated, with the
collectives' modeled time per step ("net ms") and, on CPU, the part of it the step stood waiting
for ("exposed ms"); the JSON keeps the model's parameters.

    python examples/compile_probe.py --shape llama-3b --fake-world 64 --simulate-network ib-100g \
        --ranks-per-node 8 --seq 4096 --batch 1 --dtype bf16 --variants fsdp2 zero3-layers all3
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from bench import (  # examples/bench.py (this folder)
    LLAMA_SHAPES,
    LlamaShape,
    join_simulated_world,
    llama,
    variant_name,
    variant_options,
    variant_spec_error,
    write_profile,
)

from zpp_compile.reports import text_table
from zpp_compile.runtime.network_model import PRESETS, Network, network_from_preset

# Llama-3.2 layouts; "small" is a narrow model whose compilation is that of a deep one.
SHAPES = {"small": LlamaShape(1024, 128, 16, 4, 2, 352, True),
          "llama-1b": LLAMA_SHAPES["llama-1b"], "llama-3b": LLAMA_SHAPES["llama-3b"]}
DEFAULT_LAYERS = {"small": [16, 28], "llama-1b": [16], "llama-3b": [28]}
VARIANTS = {"fsdp2": "fsdp2", "zero3": "zeropp", "zero3-layers": "zeropp", "all3": "zeropp"}  # name: system

# The table's phases, from compile_times() keys (the functions torch.compile times), each without
# the phases nested in it, so that they add up to the first step's time with "rest" (the step's run,
# AOTAutograd's wrappers, guards). Keys a torch version lacks count as 0.
COLUMNS = ["dynamo", "aot trace", "partitioner", "zeropp passes", "inductor passes", "lowering", "sched+codegen",
           "compile code", "rest"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="small")
    p.add_argument("--layers", type=int, nargs="+", help="decoder layers (default: 16 28 for small, else the model's)")
    p.add_argument("--hidden", type=int, help="override the shape's hidden size (intermediate = 2.75x)")
    p.add_argument("--heads", type=int, help="override the shape's attention heads (KV heads at most as many)")
    p.add_argument("--vocab", type=int, help="override the shape's vocabulary size")
    p.add_argument("--variants", nargs="+", default=["fsdp2", "zero3"],
                   help=f"of {list(VARIANTS)}; a zeropp one as NAME@KEY=VALUE[@KEY=VALUE] with Config fields on top, "
                        "e.g. 'zero3-layers@inductor_options={\"combo_kernels\": true}'")
    p.add_argument("--launches", nargs="+", choices=["cold", "warm"], default=["cold", "warm"],
                   help="launches per variant and depth, in this order on the variant's cache directory "
                        "(`cold warm warm warm`: three warm launches; cold only first)")
    p.add_argument("--nproc", type=int, default=2, help="ranks (one per GPU on CUDA)")
    p.add_argument("--fake-world", type=int, metavar="N",
                   help="run rank 0 of N alone over torch's fake process group (collectives move nothing)")
    p.add_argument("--simulate-network", choices=sorted(PRESETS), metavar="PRESET",
                   help=f"with --fake-world: collectives last the network model's time ({', '.join(sorted(PRESETS))})")
    p.add_argument("--ranks-per-node", type=int,
                   help="ranks per node of the simulated network and of zeropp's Config (default: the world is one "
                        "node, all3 two)")
    p.add_argument("--network-override", default="", metavar="KEY=VALUE,...",
                   help="network model parameters replacing the preset's, e.g. inter_busbw_gbyte_per_s=20")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=2, help="sequences per rank")
    p.add_argument("--steps", type=int, default=3, help="steps timed after the first")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="compute dtype (reduction in fp32)")
    p.add_argument("--peak-tflops", type=float, default=989.0 if torch.cuda.is_available() else None,
                   help="the GPU's dense bf16 peak, for MFU (H100 / H200: 989)")
    p.add_argument("--profile", help="folder for cProfile output of rank 0's first step")
    p.add_argument("--json", help="write every launch's numbers here")
    p.add_argument("--keep-cache", action="store_true", help="keep the Inductor cache folders (printed)")
    # Internal: one launch, as torchrun runs it.
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--launch", help=argparse.SUPPRESS)
    p.add_argument("--repeat", type=int, default=0, help=argparse.SUPPRESS)  # earlier launches of this kind
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if "cold" in args.launches[1:]:
        p.error("--launches: 'cold' can only be the first launch (later ones find the caches filled)")
    for spec in args.variants:
        if (error := variant_spec_error(spec, VARIANTS)) is not None:
            p.error(f"--variants {spec}: {error}")
    if (args.simulate_network or args.network_override) and not args.fake_world:
        p.error("--simulate-network times the collectives of a world run by one process: give --fake-world N too")
    if args.ranks_per_node and args.ranks_per_node < 1:
        p.error(f"--ranks-per-node {args.ranks_per_node}: give 1 or more")
    world = args.fake_world or args.nproc
    if args.ranks_per_node and world % args.ranks_per_node:
        p.error(f"--ranks-per-node {args.ranks_per_node} does not divide the world of {world} ranks")
    if args.simulate_network:
        try:
            simulated_network(args)
        except ValueError as error:
            p.error(f"--simulate-network {args.simulate_network}: {error}")
    return args


def simulated_network(args: argparse.Namespace) -> Network:
    """The network model of --simulate-network, on nodes of --ranks-per-node (default: one node)."""
    return network_from_preset(args.simulate_network, args.ranks_per_node or args.fake_world, args.network_override)


# ----------------------------------------------------------------------------- one launch


def build_llama(args: argparse.Namespace, layers: int, device: torch.device) -> nn.Module:
    shape = SHAPES[args.shape]
    if args.hidden:
        shape = dataclasses.replace(shape, dim=args.hidden, ffn=args.hidden * 11 // 4)
    if args.heads:
        shape = dataclasses.replace(shape, heads=args.heads, kv_heads=min(shape.kv_heads, args.heads))
    if args.vocab:
        shape = dataclasses.replace(shape, vocab=args.vocab)
    torch.manual_seed(0)
    with torch.device(device):
        return llama(shape, layers, args.seq)


def prepare(args: argparse.Namespace, model: nn.Module, device: torch.device) -> nn.Module:
    """Shards `model` as the variant asks and returns the compiled step function."""
    world = dist.get_world_size()
    compute = torch.bfloat16 if args.dtype == "bf16" else None
    if args.variant == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(device.type, (world,))
        policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        return torch.compile(model)
    import zpp_compile as zpp

    zpp.shard(model, zpp_config(args.variant, world, compute, args.ranks_per_node))
    return torch.compile(model, backend="zeropp")


def zpp_config(spec: str, world: int, compute: torch.dtype | None, ranks_per_node: int | None = None) -> Any:
    """The zeropp Config of a variant spec (`zero3`, `zero3-layers`, `all3`, each with @KEY=VALUE fields)."""
    import zpp_compile as zpp

    name = variant_name(spec)
    options = {"param_dtype": compute, "ranks_per_node": ranks_per_node or world,
               "compile_layers_once": name == "zero3-layers"}
    if name == "all3":
        # Two emulated nodes where there are two ranks or more, so each technique has a link to act on.
        per_node = ranks_per_node or max(world // 2, 1)
        options.update(quantized_weights=True, hpz_partition_size=per_node, quantized_gradients=True,
                       ranks_per_node=per_node)
    return zpp.Config(**{**options, **variant_options(spec)})


def compile_seconds() -> dict[str, float]:
    """Every function torch.compile timed in this process, in seconds (summed over graphs)."""
    from torch._dynamo.utils import compile_times

    names, values = compile_times(repr="csv", aggregate=True)
    return {name: float(value) for name, value in zip(names, values)}


def cache_counts() -> dict[str, int]:
    """Hits, misses and bypasses of AOTAutograd's and Inductor's FX graph caches in this process."""
    from torch._dynamo.utils import counters

    kept = {**counters["aot_autograd"], **counters["inductor"]}
    return {name: count for name, count in kept.items() if "cache" in name}


def worker(args: argparse.Namespace) -> None:
    from gpt import init_distributed  # examples/gpt.py

    simulated = None
    if args.simulate_network:
        simulated = join_simulated_world(args.fake_world, simulated_network(args))
        device = simulated.device
    else:
        device = join_fake_world(args.fake_world) if args.fake_world else init_distributed()
    rank = dist.get_rank()
    layers = int(args.layers[0])
    model = build_llama(args, layers, device)
    step_fn = prepare(args, model, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    g = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), generator=g).to(device)

    def step() -> float:
        loss = step_fn(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return loss.item()

    dist.barrier()
    profiler = cProfile.Profile() if args.profile and rank == 0 else None
    start, start_cpu = time.perf_counter(), cpu_seconds()
    if profiler:
        profiler.enable()
    step()
    if profiler:
        profiler.disable()
    first, first_cpu = time.perf_counter() - start, cpu_seconds() - start_cpu
    times = []
    if simulated:
        simulated.ledger.clear()
        waited_before = simulated.host_waited_seconds()
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    network = None
    if simulated and args.steps:
        waited = (simulated.host_waited_seconds() - waited_before) / args.steps
        network = {"preset": args.simulate_network, "overrides": args.network_override,
                   **simulated.network.to_dict(), "comm_ms_per_step": 1e3 * simulated.ledger.seconds() / args.steps,
                   # the CPU's host waits; on CUDA the waiting is a stream's, which this probe does not trace
                   "exposed_ms_per_step": 1e3 * waited if device.type == "cpu" else None}
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    step_s = statistics.median(times) if times else None
    tflops = flops_per_step(model.config, args.batch, args.seq) / step_s / 1e12 if step_s else None
    firsts = [None] * dist.get_world_size()
    dist.all_gather_object(firsts, first)
    if rank == 0:
        result = {"variant": args.variant, "layers": layers, "launch": args.launch, "world": dist.get_world_size(),
                  "fake_world": bool(args.fake_world), "simulated_network": network, "first_step_s": max(firsts),
                  "first_step_cpu_s": first_cpu,
                  "ms_per_step": 1e3 * step_s if step_s else None, "peak_gib": peak, "tflops": tflops,
                  "mfu": tflops / args.peak_tflops if tflops and args.peak_tflops else None,
                  "compile_times": compile_seconds(), "caches": cache_counts()}
        Path(args.out).write_text(json.dumps(result))
        if profiler:
            again = f"-{args.repeat + 1}" if args.repeat else ""
            write_profile(profiler, Path(args.profile) / f"{file_name(args.variant)}-{layers}-{args.launch}{again}")
    dist.destroy_process_group()


def join_fake_world(world: int) -> torch.device:
    """Rank 0 of `world` ranks, alone in this process, over torch's fake process group."""
    from zpp_compile.torch_compat import init_fake_process_group

    init_fake_process_group(0, world)
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def flops_per_step(config: Any, batch: int, seq: int) -> float:
    """Training FLOPs of one rank's step: (6 N + 12 L d T) per token, PaLM's formula (N parameters
    with the tied embedding once, L layers, d width, T sequence; the causal half not subtracted)."""
    d, layers, kv_dim = config.hidden_size, config.num_hidden_layers, config.num_key_value_heads * config.head_dim
    per_layer = d * (2 * d + 2 * kv_dim) + 3 * d * config.intermediate_size + 2 * d
    params = layers * per_layer + config.vocab_size * d + d
    return (6 * params + 12 * layers * d * seq) * batch * seq


def cpu_seconds() -> float:
    """CPU seconds of this process and of the children it waited for (the C++ compiler): on a
    shared machine a steadier measure of compilation than the wall clock."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


# ----------------------------------------------------------------------------- the driver


def phases(first_step_s: float, times: dict[str, float]) -> dict[str, float]:
    """The first step's seconds by phase (COLUMNS), then each zeropp pass as "pass NAME"."""
    t = lambda *keys: sum(times.get(k, 0.0) for k in keys)  # noqa: E731
    passes = {k.removeprefix("zeropp."): v for k, v in times.items() if k.startswith("zeropp.")}
    out = {
        "dynamo": t("_compile.compile_inner") - t("OutputGraph.call_user_compiler"),
        "aot trace": t("aot_collect_metadata", "aot_trace_joint_graph"),
        "partitioner": t("min_cut_rematerialization_partition"),
        "zeropp passes": sum(passes.values()),
        # zeropp's passes run inside Inductor's joint and post-grad pass pipelines.
        "inductor passes": t("_recursive_pre_grad_passes", "_recursive_joint_graph_passes",
                             "_recursive_post_grad_passes") - sum(passes.values()),
        "lowering": t("GraphLowering.run"),
        "sched+codegen": t("GraphLowering.codegen"),
        # Loading the generated module compiles its kernels (C++ on CPU, Triton on GPUs).
        "compile code": t("GraphLowering.compile_to_module") - t("GraphLowering.codegen"),
    }
    out["rest"] = first_step_s - sum(out.values())
    return {**out, **{f"pass {name}": seconds for name, seconds in passes.items()}}


def file_name(variant: str) -> str:
    """A variant spec as a file name's part (its options' brackets and quotes replaced)."""
    return re.sub(r"[^\w.=@-]+", "_", variant)


def launch(args: argparse.Namespace, variant: str, layers: int, name: str, round_index: int, cache: Path) -> dict:
    out = cache / f"{name}.json"
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache)}
    env.setdefault("OMP_NUM_THREADS", "1")
    # A restarted job's AOTAutograd cache hits only with a fixed hash seed on torch versions that key
    # DTensor inputs on their mesh's Python hash (zeropp warns there); the same for every variant.
    env.setdefault("PYTHONHASHSEED", "0")
    if not torch.cuda.is_available():
        env.setdefault("TRITON_INTERPRET", "1")  # zeropp's quantization kernels run in Triton's interpreter
        env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # so that "cpu s" sees every compiler process
    nproc = 1 if args.fake_world else args.nproc
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               __file__, "--worker", "--variant", variant, "--launch", name,
               "--repeat", str(args.launches[:round_index].count(name)), "--out", str(out),
               "--layers", str(layers), "--shape", args.shape, "--seq", str(args.seq), "--batch", str(args.batch),
               "--steps", str(args.steps), "--dtype", args.dtype]
    command += ["--peak-tflops", str(args.peak_tflops)] if args.peak_tflops else []
    command += ["--hidden", str(args.hidden)] if args.hidden else []
    command += ["--heads", str(args.heads)] if args.heads else []
    command += ["--vocab", str(args.vocab)] if args.vocab else []
    command += ["--profile", args.profile] if args.profile else []
    command += ["--fake-world", str(args.fake_world)] if args.fake_world else []
    command += ["--simulate-network", args.simulate_network] if args.simulate_network else []
    command += ["--network-override", args.network_override] if args.network_override else []
    command += ["--ranks-per-node", str(args.ranks_per_node)] if args.ranks_per_node else []
    start = time.perf_counter()
    returncode = subprocess.run(command, env=env).returncode
    if returncode != 0:  # the worker's traceback is above; the launches of other variants still run
        return {"variant": variant, "layers": layers, "launch": name, "round": round_index,
                "failed": f"exit status {returncode}"}
    result = json.loads(out.read_text())
    result.update(round=round_index, launch_s=time.perf_counter() - start)
    return result


def table(results: list[dict]) -> str:
    simulated = any(r.get("simulated_network") for r in results)
    network = ("net ms", "exposed ms") if simulated else ()
    headers = ("variant", "layers", "launch", "first step s", "cpu s", "ms/step", *network, "peak GiB", "MFU", *COLUMNS)
    fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    rows = []
    for r in results:
        if "failed" in r:
            rows.append((r["variant"], r["layers"], r["launch"], f"failed ({r['failed']})", *("" for _ in headers[4:])))
            continue
        p = phases(r["first_step_s"], r["compile_times"])
        peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "-"
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") else "-"
        modeled = r.get("simulated_network") or {}
        comm = (fmt(modeled.get("comm_ms_per_step")), fmt(modeled.get("exposed_ms_per_step"))) if simulated else ()
        rows.append((r["variant"], r["layers"], r["launch"], f"{r['first_step_s']:.1f}", f"{r['first_step_cpu_s']:.1f}",
                     fmt(r["ms_per_step"]), *comm, peak, mfu, *(f"{p[c]:.1f}" for c in COLUMNS)))
    lines = ["SIMULATED network: step times are rank 0's over the modeled network"] if simulated else []
    lines.append(text_table.render(headers, rows, align="<><" + ">" * (5 + len(network) + len(COLUMNS))))
    finished = [r for r in results if "failed" not in r]
    for r in finished:
        p = phases(r["first_step_s"], r["compile_times"])
        if any(k.startswith("pass ") for k in p):
            lines.append(f"  zeropp passes, {r['variant']} {r['layers']} layers {r['launch']}: "
                         + ", ".join(f"{k[5:]} {v:.2f} s" for k, v in p.items() if k.startswith("pass ")))
    for r in finished:
        caches = ", ".join(f"{name} {count}" for name, count in sorted(r.get("caches", {}).items()))
        lines.append(f"  caches, {r['variant']} {r['layers']} layers {r['launch']}: {caches or 'none used'}")
    lines += medians(finished)
    return "\n".join(lines)


def medians(results: list[dict]) -> list[str]:
    """A line per variant, depth and launch kind that ran more than once: the median first step."""
    runs: dict[tuple, list[float]] = {}
    for r in results:
        runs.setdefault((r["variant"], r["layers"], r["launch"]), []).append(r["first_step_s"])
    return [f"  {launch} first step, median of {len(seconds)}: {variant} {layers} layers "
            f"{statistics.median(seconds):.1f} s (from {min(seconds):.1f} to {max(seconds):.1f})"
            for (variant, layers, launch), seconds in runs.items() if len(seconds) > 1]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return
    results = []
    if args.simulate_network:
        print(f"SIMULATED: rank 0 of {args.fake_world} alone, its collectives moving nothing and lasting what the "
              f"network model gives ({args.simulate_network}, {args.ranks_per_node or args.fake_world} ranks per node)",
              flush=True)
    elif args.fake_world:
        print(f"rank 0 of {args.fake_world} alone, over torch's fake process group: its collectives move nothing, "
              "so step times are not the world's", flush=True)
    for layers in args.layers or DEFAULT_LAYERS[args.shape]:
        caches = {v: Path(tempfile.mkdtemp(prefix=f"zpp-probe-{file_name(v)}-{layers}-")) for v in args.variants}
        try:
            # Round by round (every variant's cold launch, then every variant's warm one, ...), so a
            # host whose speed drifts during the probe slows the variants alike.
            for round_index, name in enumerate(args.launches):
                for variant in args.variants:
                    if any(r["variant"] == variant and r["layers"] == layers and "failed" in r for r in results):
                        continue  # a warm launch needs what the failed one would have cached
                    results.append(launch(args, variant, layers, name, round_index, caches[variant]))
                    print(table(results[-1:]), flush=True)
                    if args.json:  # after every launch, so that a later one failing or hanging loses nothing
                        Path(args.json).write_text(json.dumps(results, indent=1))
        finally:
            for cache in caches.values():
                if args.keep_cache:
                    print(f"cache kept: {cache}")
                else:
                    shutil.rmtree(cache, ignore_errors=True)
    print()
    print(table(results))
    failed = [f"{r['variant']} ({r['layers']} layers, {r['launch']})" for r in results if "failed" in r]
    if failed:
        sys.exit(f"compile_probe: these launches failed (their tracebacks are above): {', '.join(failed)}")


if __name__ == "__main__":
    main()

"""Does ZeRO++'s quantization cost accuracy? Each variant trained from the same seeds on the same
batches in the same order, on Python source bytes, and compared with plain ZeRO-3 seed by seed, so
that the gap is told apart from run-to-run noise.

    torchrun --nproc_per_node=2 examples/convergence.py --model llama --seeds 0,1,2 --steps 2000 \
        --corpus stdlib+torch --data-bytes 60000000 --json conv.json --png conv.png  # 2 GPUs, 2 emulated nodes
    torchrun --nproc_per_node=2 examples/convergence.py --seeds 0,1 --steps 20 --dim 64 --layers 2 \
        --heads 2 --seq 64 --batch 2 --variants zero3,all3                # CPU, a minute

A study is long: --json is rewritten after every finished run, and --resume FILE ... reads the runs
of earlier launches (with the same settings) and trains only the missing ones. So a stopped study
goes on where it stopped, and launches of a part each (say one variant, all seeds, on their own
GPUs) are merged by one last launch that resumes from all their files and has nothing left to train.

Models: "gpt", the byte-level GPT of examples/gpt.py (d=384, 6 layers by default); "llama", HF
transformers' LlamaForCausalLM from a config (RMSNorm, SwiGLU, RoPE, grouped-query attention) over
the 256 byte values, by default width 768, 16 layers, 12 heads of which 4 key/value, MLP 2048, tied
embeddings: about 100M parameters. Variants: zero3 (plain ZeRO-3), qwz, qgz (its defaults: INT8
inside a node, INT4 across), all3 (qwZ + hpZ + qgZ), qgz_int4 (qgZ with INT4 on both hops).

The text (--corpus) is the standard library's .py files, or those and then torch's own; every tenth
file is held out. Training reads the rest in windows of --seq bytes in a seeded order, each once per
epoch, and the launch prints how many epochs it trains: a study of more than one epoch trains on
bytes it has seen, and its held-out loss then measures memorization as much as the quantization
(the first command trains 16 MB of about 50).

Every run trains from its seed's initial weights with AdamW (linear warmup, cosine decay to 10%),
gradient clipping at 1.0 (each step's norm before clipping is recorded), bf16 compute, Inductor and
fused AdamW on GPUs (fp32 and debug mode, no Inductor, on CPU). The loss of a step is the mean over
all ranks. A run's final loss is the mean of its last 50 steps (--final-window); its held-out loss
is the mean over --val-batches batches of the held-out files. Per variant: mean and standard
deviation over seeds, and the gap to plain ZeRO-3 with a 95% interval from the per-seed (paired)
differences (Student's t with seeds - 1 degrees of freedom). With 2 ranks the default emulates 2
nodes of 1 rank, so qgZ reduces across the (emulated) node boundary and hpZ keeps a full copy.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from bench import write_json  # examples/bench.py
from gpt import (  # examples/gpt.py
    GPT,
    STDLIB,
    GPTConfig,
    as_tokens,
    batch,
    emulated_ranks_per_node,
    init_distributed,
    python_sources,
    windows,
)
from torch.distributed.tensor import DTensor

import zpp_compile as zpp
from zpp_compile.reports import text_table

VARIANT_NAMES = ("zero3", "qwz", "qgz", "all3", "qgz_int4")
CLIP_NORM = 1.0  # gradient clipping
# Two-sided 95% quantiles of Student's t by degrees of freedom (1 to 10); beyond 10, the 10's.
T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)


def variants(names: list[str], hpz_size: int) -> dict[str, dict[str, Any]]:
    """Config overrides per variant."""
    every = {
        "zero3": {},
        "qwz": {"quantized_weights": True},
        "qgz": {"quantized_gradients": True},
        "all3": {"quantized_weights": True, "hpz_partition_size": hpz_size, "quantized_gradients": True},
        "qgz_int4": {"quantized_gradients": True, "intra_node_gradient_bits": 4},
    }
    return {name: every[name] for name in names}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("gpt", "llama"), default="gpt")
    p.add_argument("--variants", default=",".join(VARIANT_NAMES),
                   help=f"comma-separated subset of {VARIANT_NAMES}; gaps need zero3's runs (here or resumed)")
    p.add_argument("--seeds", default="0", help="comma-separated seeds; every variant runs from each")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--dim", type=int, help="width (gpt 384, llama 768)")
    p.add_argument("--layers", type=int, help="layers (gpt 6, llama 16)")
    p.add_argument("--heads", type=int, help="attention heads (gpt 6, llama 12)")
    p.add_argument("--kv-heads", type=int, help="llama: key/value heads (default a third of the heads)")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=16, help="sequences per rank per step")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=100, help="linear warmup steps")
    p.add_argument("--final-window", type=int,
                   help="last steps averaged for the final loss (default 50, at most --steps)")
    p.add_argument("--val-batches", type=int, default=64,
                   help="held-out batches per rank (the same batches for every variant of a seed, so that the "
                        "held-out gap compares the runs on the same bytes)")
    p.add_argument("--reduce-dtype", choices=("fp32", "bf16"), default="fp32", help="gradient reduce dtype")
    p.add_argument("--ranks-per-node", type=int, help="ranks per emulated node (default: half the ranks)")
    p.add_argument("--corpus", choices=sorted(CORPORA), default="stdlib",
                   help="the text: the standard library's .py files, or those and then torch's")
    p.add_argument("--data-bytes", type=int, default=30_000_000,
                   help="bytes of the corpus to read, every tenth file held out (default: 30 MB, all of a "
                        "standard library up to that size)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="replay each compiled step as a CUDA graph (Config.cuda_graphs; GPUs): less host time")
    p.add_argument("--json", help="write every run's losses and the summary here, after every run (rank 0)")
    p.add_argument("--resume", nargs="+", default=[], metavar="FILE",
                   help="--json files of earlier launches of this study: their runs are kept, not trained again")
    p.add_argument("--png", help="write the loss curves here, seed spread shaded (rank 0; needs matplotlib)")
    args = p.parse_args(argv)
    args.final_window = args.final_window or min(50, args.steps)
    if args.final_window > args.steps:
        p.error(f"--final-window {args.final_window} is longer than --steps {args.steps}")
    args.variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(args.variants) - set(VARIANT_NAMES))
    if unknown or not args.variants:
        p.error(f"--variants takes names from {VARIANT_NAMES}; got {unknown or args.variants}")
    try:
        args.seeds = [int(s) for s in args.seeds.split(",") if s]
    except ValueError:
        p.error(f"--seeds takes comma-separated integers, got {args.seeds!r}")
    defaults = {"gpt": (384, 6, 6), "llama": (768, 16, 12)}[args.model]
    args.dim, args.layers, args.heads = (given or default for given, default in
                                         zip((args.dim, args.layers, args.heads), defaults))
    args.kv_heads = args.kv_heads or max(args.heads // 3, 1)
    if args.model == "llama" and args.heads % args.kv_heads:
        p.error(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
    return args


class ByteLlama(nn.Module):
    """HF LlamaForCausalLM over the 256 byte values, called like the GPT: (x, y) -> mean loss."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        from bench import LlamaShape, llama  # examples/bench.py

        ffn = 256 * math.ceil(args.dim * 8 / 3 / 256)
        shape = LlamaShape(256, args.dim, args.layers, args.heads, args.kv_heads, ffn, tied=True)
        self.llama = llama(shape, args.layers, args.seq, rope_theta=10000.0)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.llama(input_ids=x).logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))


def build_model(args: argparse.Namespace) -> nn.Module:
    if args.model == "gpt":
        return GPT(GPTConfig(seq=args.seq, dim=args.dim, heads=args.heads, layers=args.layers))
    return ByteLlama(args)


def lr_factor(step: int, warmup: int, steps: int) -> float:
    """Linear warmup to 1, then cosine decay to 0.1 at the last step."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(steps - warmup, 1)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def train(options: dict[str, Any], seed: int, args: argparse.Namespace, device: torch.device,
          train_bytes: torch.Tensor, val_bytes: torch.Tensor) -> dict[str, Any]:
    """One run from `seed`; returns its per-step losses (mean over ranks) and held-out loss."""
    rank, world = dist.get_rank(), dist.get_world_size()
    on_gpu = device.type == "cuda"
    config = zpp.Config(param_dtype="bf16" if on_gpu else None, reduce_dtype=args.reduce_dtype,
                        ranks_per_node=args.ranks_per_node, inductor=on_gpu, cuda_graphs=args.cuda_graphs, **options)
    torch.manual_seed(seed)
    with device:
        model = zpp.shard(build_model(args), config)
    step_model = torch.compile(model, backend="zeropp")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95), fused=on_gpu)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, args.warmup, args.steps))
    losses = torch.zeros(args.steps, device=device, dtype=torch.float64)
    grad_norms = torch.zeros(args.steps, device=device, dtype=torch.float64)
    starts = window_starts(len(train_bytes), args.seq, args.steps * world * args.batch, seed)
    for step in range(args.steps):
        first = (step * world + rank) * args.batch
        x, y = windows(train_bytes, starts[first:first + args.batch], args.seq)
        loss = step_model(x.to(device), y.to(device))
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)
        grad_norms[step] = grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm
        opt.step()
        schedule.step()
        opt.zero_grad(set_to_none=True)
        losses[step] = loss.detach()  # no host sync per step
        if rank == 0 and (step % 100 == 0 or step == args.steps - 1):
            print(f"  step {step:5d}  loss {loss.item():.4f}", flush=True)
    dist.all_reduce(losses)
    val = validation_loss(model, seed, args, device, val_bytes)
    torch._dynamo.reset()
    return {"config": config.to_dict(), "seed": seed, "losses": (losses / world).tolist(),
            "grad_norms": grad_norms.tolist(), "val_loss": val}


def window_starts(n_bytes: int, seq: int, count: int, seed: int) -> torch.Tensor:
    """Where the first `count` training sequences start: the data cut into consecutive windows of
    `seq` bytes, in a seeded random order, every window once before any is taken again (a new
    order per epoch), so a study shorter than one epoch never trains on a byte twice."""
    per_epoch = (n_bytes - 1) // seq
    if per_epoch < 1:
        raise ValueError(f"{n_bytes} bytes of training text hold no sequence of {seq} + 1 bytes")
    g = torch.Generator().manual_seed(seed)
    orders = [torch.randperm(per_epoch, generator=g) for _ in range(math.ceil(count / per_epoch))]
    return torch.cat(orders)[:count] * seq


def epochs(args: argparse.Namespace, world: int, n_bytes: int) -> float:
    """How many times a study's training reads its text: above 1, bytes are trained on more than once
    and the held-out loss measures memorization as much as the quantization."""
    return args.steps * world * args.batch * args.seq / n_bytes


@torch.no_grad()
def validation_loss(model: torch.nn.Module, seed: int, args: argparse.Namespace, device: torch.device,
                    val_bytes: torch.Tensor) -> float:
    """Mean loss over held-out batches, with the trained (master) weights run eagerly, so every
    run is scored the same way whatever its training-time quantization."""
    rank, world = dist.get_rank(), dist.get_world_size()
    total = torch.zeros((), device=device, dtype=torch.float64)
    for i in range(args.val_batches):
        x, y = batch(val_bytes, i, rank, world, args.batch, args.seq, seed + 1)
        total += model(x.to(device), y.to(device)).double()
    dist.all_reduce(total)
    return total.item() / (world * args.val_batches)


def interval(differences: list[float]) -> tuple[float, float, float]:
    """Mean of paired differences and its two-sided 95% interval (Student's t); a single pair has
    no interval (nan bounds)."""
    mean = statistics.fmean(differences)
    if len(differences) < 2:
        return mean, math.nan, math.nan
    t = T_975[min(len(differences) - 1, len(T_975)) - 1]
    half = t * statistics.stdev(differences) / math.sqrt(len(differences))
    return mean, mean - half, mean + half


def summarize(runs: dict[str, list[dict[str, Any]]], window: int) -> dict[str, dict[str, Any]]:
    """Per variant: mean and standard deviation over seeds of the final and held-out losses, and the
    gap to zero3 with its 95% interval, paired by seed (over the seeds both have; none without
    zero3's runs). `runs[variant]` lists one run per seed, each naming its "seed"."""
    def final(run: dict[str, Any]) -> float:
        return statistics.fmean(run["losses"][-window:])

    reference = {run["seed"]: run for run in runs.get("zero3", [])}
    out = {}
    for name, seeded in runs.items():
        row: dict[str, Any] = {"seeds": [run["seed"] for run in seeded]}
        paired = [run for run in seeded if run["seed"] in reference]
        for measure, value in (("final", final), ("val", lambda run: run["val_loss"])):
            values = [value(run) for run in seeded]
            row[f"{measure}_mean"] = statistics.fmean(values)
            row[f"{measure}_std"] = statistics.stdev(values) if len(values) > 1 else math.nan
            gaps = [value(run) - value(reference[run["seed"]]) for run in paired]
            row[f"{measure}_gap"], row[f"{measure}_gap_low"], row[f"{measure}_gap_high"] = (
                interval(gaps) if gaps else (math.nan,) * 3)
        norms = [run["grad_norms"] for run in seeded if "grad_norms" in run]
        if norms:  # a noisier gradient has a larger norm, which clipping cuts more often
            row["grad_norm_mean"] = statistics.fmean(statistics.fmean(n) for n in norms)
            row["clipped_fraction"] = statistics.fmean(statistics.fmean(x > CLIP_NORM for x in n) for n in norms)
        out[name] = row
    return out


HELD_OUT_EVERY = 10  # every tenth source file is held out


# Python source present wherever the study runs: the standard library (about 10 MB on the GPU
# machines' Python), then torch's own modules (about 40 MB more).
CORPORA = {"stdlib": (STDLIB,), "stdlib+torch": (STDLIB, Path(torch.__file__).parent)}


def train_and_held_out(limit: int, corpus: str = "stdlib") -> tuple[torch.Tensor, torch.Tensor]:
    """The corpus's source (up to `limit` bytes) to train on, and the held-out bytes: every tenth
    file, so that they come from the same mix of modules as the training bytes (the last tenth in
    path order would be a few packages of their own) and from no training batch."""
    sources = python_sources(limit, CORPORA[corpus])
    held_out = [s for i, s in enumerate(sources) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1]
    train = [s for i, s in enumerate(sources) if i % HELD_OUT_EVERY != HELD_OUT_EVERY - 1]
    return as_tokens(b"".join(train)), as_tokens(b"".join(held_out))


# What makes two launches' runs one study: the model, the data, the optimization and the topology.
STUDY_SETTINGS = ("model", "dim", "layers", "heads", "kv_heads", "seq", "batch", "steps", "lr", "warmup",
                  "val_batches", "reduce_dtype", "ranks_per_node", "corpus", "data_bytes")


def study_settings(args: argparse.Namespace, world: int, bytes_read: int) -> dict[str, Any]:
    """The settings that make launches one study; `bytes_read` is what the corpus held, which is
    less than --data-bytes where it is smaller (it differs between Pythons and torch versions)."""
    return {**{key: getattr(args, key) for key in STUDY_SETTINGS}, "world": world, "bytes_read": bytes_read,
            "held_out": f"every {HELD_OUT_EVERY}th file", "training_order": "every window once per epoch"}


def resumed_runs(paths: list[str], settings: dict[str, Any]) -> dict[tuple[str, int], dict[str, Any]]:
    """The runs recorded in earlier launches' --json files, by (variant, seed); a file from a study
    with other settings is an error that names them (its runs would not be comparable)."""
    done: dict[tuple[str, int], dict[str, Any]] = {}
    for path in paths:
        with open(path) as f:
            recorded = json.load(f)
        theirs = recorded.get("settings", {})
        differ = {key: (theirs.get(key), value) for key, value in settings.items() if theirs.get(key) != value}
        if differ:
            raise ValueError(f"--resume {path}: recorded with other settings than this launch's "
                             f"({', '.join(f'{k}: {a!r} there, {b!r} here' for k, (a, b) in differ.items())}); "
                             "resume only from launches of the same study")
        for name, seeded in recorded["runs"].items():
            for run in seeded:
                done[name, run["seed"]] = run
    return done


def ordered_runs(done: dict[tuple[str, int], dict[str, Any]], variant_order: list[str],
                 seed_order: list[int]) -> dict[str, list[dict[str, Any]]]:
    """`done` as runs per variant, each variant's in seed order; variants and seeds named by this
    launch first, in its order, then any others the resumed files hold."""
    names = list(dict.fromkeys([*variant_order, *(name for name, _ in sorted(done))]))
    seeds = list(dict.fromkeys([*seed_order, *sorted(seed for _, seed in done)]))
    runs = {name: [done[name, seed] for seed in seeds if (name, seed) in done] for name in names}
    return {name: seeded for name, seeded in runs.items() if seeded}


def plot(runs: dict[str, list[dict[str, Any]]], title: str, path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed: no chart written to {path} (pip install matplotlib)")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, gap_ax) = plt.subplots(1, 2, figsize=(14, 5))
    colors = dict(zip(VARIANT_NAMES, ("tab:gray", "tab:blue", "tab:orange", "tab:green", "tab:red")))
    reference = {run["seed"]: run["losses"] for run in runs.get("zero3", [])}
    for name, seeded in runs.items():
        losses = torch.tensor([run["losses"] for run in seeded])  # seeds x steps
        window = max(1, min(100, losses.shape[1] // 10))
        steps = range(window - 1, losses.shape[1])
        shade(ax, steps, moving_average(losses, window), colors[name], name)
        paired = [run for run in seeded if run["seed"] in reference]
        if name != "zero3" and paired:
            mine = torch.tensor([run["losses"] for run in paired])
            gaps = mine - torch.tensor([reference[run["seed"]] for run in paired])
            shade(gap_ax, steps, moving_average(gaps, window), colors[name], name)
    ax.set_ylabel("training loss (nats per byte), mean over seeds, range shaded")
    gap_ax.axhline(0.0, color="tab:gray", linewidth=0.8)
    gap_ax.set_ylabel(f"variant - zero3, same seed, {window}-step moving average")
    for axis in (ax, gap_ax):
        axis.set_xlabel("step")
        axis.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def moving_average(rows: torch.Tensor, window: int) -> torch.Tensor:
    """Each row's mean over a sliding window (for the eye only: the table uses raw losses)."""
    return rows.unfold(1, window, 1).mean(2)


def shade(ax: Any, steps: range, rows: torch.Tensor, color: str, label: str) -> None:
    """The mean over rows (seeds) as a line, their range shaded."""
    ax.plot(steps, rows.mean(0), color=color, linewidth=1, label=label)
    ax.fill_between(steps, rows.min(0).values, rows.max(0).values, color=color, alpha=0.2, linewidth=0)


def study(args: argparse.Namespace, settings: dict[str, Any], done: dict[tuple[str, int], dict[str, Any]],
          device: torch.device) -> dict[str, Any]:
    """Every finished run (this launch's and resumed ones) with the summary over them."""
    runs = ordered_runs(done, args.variants, args.seeds)
    return {
        "variants": summarize(runs, args.final_window), "seeds": sorted({seed for _, seed in done}),
        "final_window": args.final_window, "settings": settings,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "command": " ".join(sys.argv),
        "args": {k: v for k, v in vars(args).items() if k not in ("json", "png", "resume")}, "runs": runs,
    }


def print_summary(summary: dict[str, Any]) -> None:
    print(f"{len(summary['seeds'])} seeds; final = mean of the last {summary['final_window']} steps; "
          "gap = variant - zero3, paired by seed, with its 95% interval")
    rows = []
    for name, row in summary["variants"].items():
        cells = [f"{row[f'{m}_mean']:.4f} +- {row[f'{m}_std']:.4f}" for m in ("final", "val")]
        gaps = [f"{row[f'{m}_gap']:+.4f} [{row[f'{m}_gap_low']:+.4f}, {row[f'{m}_gap_high']:+.4f}]"
                if name != "zero3" else "(reference)" for m in ("final", "val")]
        rows.append((name, len(row["seeds"]), cells[0], gaps[0], cells[1], gaps[1]))
    headers = ("variant", "seeds", "final", "final gap [95%]", "held-out", "held-out gap [95%]")
    print(text_table.render(headers, rows, align="<>>>>>"))
    norms = [f"{name} {row['grad_norm_mean']:.3f} ({row['clipped_fraction']:.0%} clipped)"
             for name, row in summary["variants"].items() if "grad_norm_mean" in row]
    if norms:
        print(f"mean gradient norm before clipping at {CLIP_NORM}: " + ", ".join(norms))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    args.ranks_per_node = emulated_ranks_per_node(world, args.ranks_per_node)
    hpz = args.ranks_per_node if world // args.ranks_per_node > 1 else 1
    train_bytes, val_bytes = train_and_held_out(args.data_bytes, args.corpus)

    if args.cuda_graphs and device.type != "cuda":
        raise SystemExit("--cuda-graphs needs GPUs (CUDA graphs); drop it on CPU")
    settings = study_settings(args, world, len(train_bytes) + len(val_bytes))
    if rank == 0:
        print(f"{len(train_bytes) / 1e6:.2f} MB of Python source ({args.corpus}) to train on "
              f"({epochs(args, world, len(train_bytes)):.2f} epochs), "
              f"{len(val_bytes) / 1e6:.2f} MB held out", flush=True)
    done = resumed_runs(args.resume, settings)
    for seed in args.seeds:
        for name, options in variants(args.variants, hpz).items():
            if (name, seed) in done:
                continue
            if rank == 0:
                print(f"seed {seed}, {name}: {options or 'plain ZeRO-3'}", flush=True)
            done[name, seed] = train(options, seed, args, device, train_bytes, val_bytes)
            if rank == 0 and args.json:  # a stopped study keeps what it finished
                write_json(args.json, study(args, settings, done, device))
    summary = study(args, settings, done, device)
    if rank == 0:
        print_summary(summary)
        if args.json:
            write_json(args.json, summary)
        if args.png:
            shape = f"{args.model} d={args.dim} L={args.layers} T={args.seq}"
            plot(summary["runs"], f"{shape}, {args.batch} seq x {world} ranks, {args.steps} steps, "
                                  f"seeds {summary['seeds']}", args.png)
    zpp.release_cuda_graphs()  # with Config.cuda_graphs: a captured NCCL collective blocks the teardown
    dist.destroy_process_group()
    return summary


if __name__ == "__main__":
    main()

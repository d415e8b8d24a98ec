"""Train a small byte-level GPT with ZeRO++ on the Python standard library's own source code.

    torchrun --nproc_per_node=2 examples/train_gpt.py            # ZeRO++: qwZ + hpZ + qgZ
    torchrun --nproc_per_node=2 examples/train_gpt.py --zero3    # the plain ZeRO-3 baseline
    torchrun --nproc_per_node=2 examples/train_gpt.py --no-qgz   # switch one technique off
    torchrun --nproc_per_node=2 examples/train_gpt.py --png run.png  # loss curve and bytes per phase

Each rank keeps 1/N of the weights (ZeRO-3); the model runs through
torch.compile(backend="zeropp"), which turns the gathers and gradient reductions into the
collectives the flags ask for: CPU ranks talk over gloo, GPU ranks over NCCL. At the end it prints
the bytes each rank received per step, phase by phase, against plain ZeRO-3 for the same model.

ZeRO++ saves bytes that cross between nodes. Launched on one machine, the ranks are counted as two
emulated nodes (`--ranks-per-node` sets another split); launched over several machines, torchrun's
nodes are the nodes.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import textwrap
import time

import torch
import torch.distributed as dist
from gpt import GPT, GPTConfig, batch, emulated_ranks_per_node, init_distributed, stdlib_bytes  # examples/gpt.py
from tqdm import tqdm

import zpp_compile as zpp
from zpp_compile.reports import text_table

# Each phase of a step: the ZeRO++ technique that rewrites it, and the Config field that switches it on.
TECHNIQUES = {"forward weight gather": ("qwZ", "quantized_weights"),
              "backward weight gather": ("hpZ", "hpz_partition_size"),
              "gradient reduction": ("qgZ", "quantized_gradients")}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--data-bytes", type=int, default=8_000_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--zero3", action="store_true", help="plain ZeRO-3: every ZeRO++ technique off")
    p.add_argument("--qwz", action=argparse.BooleanOptionalAction, default=None,
                   help="quantized weight all-gather, INT8 (default: on)")
    p.add_argument("--hpz", type=int, default=None,
                   help="hpZ secondary group size, 0 = off (default: the ranks of one node)")
    p.add_argument("--qgz", action=argparse.BooleanOptionalAction, default=None,
                   help="quantized two-hop gradient reduction (default: on)")
    p.add_argument("--ranks-per-node", type=int, default=None,
                   help="ranks per node (default: torchrun's nodes; on one machine, two emulated nodes)")
    p.add_argument("--config", help="a zeropp JSON config, used instead of the ZeRO++ defaults (flags still apply)")
    p.add_argument("--eager", action="store_true", help="run without torch.compile (plain ZeRO-3)")
    p.add_argument("--log-every", type=int, default=10, help="steps between progress lines when not on a terminal")
    p.add_argument("--png", help="save the loss curve and the bytes per phase here (needs matplotlib)")
    return p.parse_args(argv)


def nodes(world: int, requested: int | None) -> tuple[int, str]:
    """Ranks per node, and how they were counted (for the first line of output)."""
    launched_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if requested:
        return requested, f"{plural(world // requested, 'node')} of {plural(requested, 'rank')} (--ranks-per-node)"
    if launched_per_node < world:
        return launched_per_node, f"{plural(world // launched_per_node, 'node')} of {plural(launched_per_node, 'rank')}"
    per_node = emulated_ranks_per_node(world, None)
    return per_node, (f"one machine, counted as {plural(world // per_node, 'emulated node')} of "
                      f"{plural(per_node, 'rank')} (--ranks-per-node to change)")


def plural(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def make_config(args: argparse.Namespace, ranks_per_node: int, use_cuda: bool) -> zpp.Config:
    """The ZeRO++ defaults (or --config, or plain ZeRO-3 with --zero3), then the flags on top."""
    if args.config:
        config = zpp.Config.load(args.config)
    elif args.zero3:
        config = zpp.Config()
    else:
        config = zpp.Config(quantized_weights=True, hpz_partition_size=ranks_per_node, quantized_gradients=True)
    flags = {"quantized_weights": args.qwz, "hpz_partition_size": args.hpz, "quantized_gradients": args.qgz}
    overrides = {k: v for k, v in flags.items() if v is not None}
    overrides["ranks_per_node"] = config.ranks_per_node or ranks_per_node
    if use_cuda and config.param_dtype is None:
        overrides["param_dtype"] = "bf16"
    return config.updated(overrides)


def main(argv: list[str] | None = None) -> float:
    args = parse_args(argv)
    device = init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    ranks_per_node, how_counted = nodes(world, args.ranks_per_node)
    config = make_config(args, ranks_per_node, device.type == "cuda")

    torch.manual_seed(args.seed)
    cfg = GPTConfig(seq=args.seq, dim=args.dim, heads=args.heads, layers=args.layers)
    model = zpp.shard(GPT(cfg).to(device), config)
    step_model = model if args.eager else torch.compile(model, backend="zeropp")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))

    data = stdlib_bytes(args.data_bytes)
    tokens_per_step = world * args.batch * args.seq
    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters())
        print(f"zeropp: {world} ranks on {device.type} ({dist.get_backend()}), {how_counted}; "
              f"{describe(config)}, {'eager' if args.eager else 'compiled'}; "
              f"GPT of {n_params / 1e6:.2f}M parameters on {len(data) / 1e6:.1f} MB of stdlib source", flush=True)
    loss_value, start, losses = float("nan"), time.perf_counter(), []
    progress = Progress(args.steps, enabled=rank == 0)
    for step in range(args.steps):
        x, y = batch(data, step, rank, world, args.batch, args.seq, args.seed)
        loss = step_model(x.to(device), y.to(device))
        loss.backward()
        losses.append(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step == 0:  # the first step compiles; time the rest
            start = time.perf_counter()
        if rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            loss_value = loss.item()
            speed = tokens_per_step * step / (time.perf_counter() - start) if step else 0.0
            progress.note(f"loss {loss_value:.3f}  {speed:,.0f} tok/s")
        progress.advance()
    progress.close()
    if rank == 0:
        print(comm_summary(zpp.comm_report(), config, eager=args.eager, world_size=world), flush=True)
        if args.png:
            phases = [] if args.eager or world == 1 else phase_bytes(zpp.comm_report(), config)
            save_chart(args.png, [loss.item() for loss in losses], phases, f"{describe(config)}, {world} ranks")
    zpp.release_cuda_graphs()  # with Config.cuda_graphs: a captured NCCL collective blocks the teardown
    dist.destroy_process_group()
    return loss_value


def describe(config: zpp.Config) -> str:
    on = [name for name, field in TECHNIQUES.values() if getattr(config, field)]
    return f"ZeRO++ ({' + '.join(on)})" if on else "plain ZeRO-3"


class Progress:
    """A tqdm bar on a terminal; one plain line per report elsewhere (logs, CI, pipes)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled, self.done = total, enabled, 0
        self.bar = tqdm(total=total, file=sys.stdout) if enabled and sys.stdout.isatty() else None

    def note(self, text: str) -> None:
        """Shows `text` beside the bar, or prints it on a line of its own."""
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)
        elif self.enabled:
            print(f"step {self.done + 1}/{self.total}  {text}", flush=True)

    def advance(self) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def phase_bytes(report: zpp.CommReport, config: zpp.Config) -> list[tuple[str, bool, int, int, int, int]]:
    """Per phase of a step: whether its technique is on, the bytes each rank received (within a
    node, across nodes), and plain ZeRO-3's for the same model in this run's dtypes (its weights
    gathered in param_dtype, its gradients reduced in reduce_dtype)."""
    weights, gradients = config.param_dtype or torch.get_default_dtype(), config.reduce_dtype
    # The bf16 baseline's three collectives are equal; in this run's dtypes each scales by its bytes per value.
    dtypes = dict(zip(TECHNIQUES, (weights, weights, gradients)))
    rows = []
    for phase, (intra, inter) in report.by_phase().items():
        itemsize = dtypes[phase].itemsize
        base_intra, base_inter = (total // 3 * itemsize // 2 for total in (report.baseline_intra_bytes,
                                                                           report.baseline_inter_bytes))
        rows.append((phase, bool(getattr(config, TECHNIQUES[phase][1])), intra, inter, base_intra, base_inter))
    return rows


def comm_summary(report: zpp.CommReport, config: zpp.Config, eager: bool, world_size: int) -> str:
    """One line per phase of a step: the bytes each rank received against plain ZeRO-3's in this
    run's dtypes (`phase_bytes`), and the total against ZeRO-3 in bf16 too (the paper's baseline)."""
    if eager:
        return "eager run: the ZeRO++ passes act under torch.compile, so there is no compiled step to report"
    if world_size == 1:
        return ("one rank: nothing is communicated, so there are no bytes to compare; launch two or more "
                "(torchrun --nproc_per_node=2 examples/train_gpt.py) to see ZeRO++ against plain ZeRO-3")
    mb = lambda n: f"{n / 1e6:.3f} MB"  # noqa: E731
    name = lambda dtype: str(dtype).removeprefix("torch.")  # noqa: E731
    weights = config.param_dtype or torch.get_default_dtype()
    lines = [f"bytes each rank received per step, against plain ZeRO-3 of the same model in this run's dtypes "
             f"({name(weights)} weights, {name(config.reduce_dtype)} gradient reduction):"]
    phases = phase_bytes(report, config)
    rows = [(phase, TECHNIQUES[phase][0] if on else "-", mb(inter), mb(base_inter),
             times(inter / base_inter if base_inter else math.nan), mb(intra), mb(base_intra))
            for phase, on, intra, inter, base_intra, base_inter in phases]
    headers = ("phase", "technique", "cross-node", "ZeRO-3", "ratio", "within a node", "ZeRO-3")
    lines.append(textwrap.indent(text_table.render(headers, rows, align="<<>>>>>"), "  "))
    base_inter = sum(row[5] for row in phases)
    base_all = base_inter + sum(row[4] for row in phases)
    lines.append(f"cross-node bytes per step {times(report.inter_bytes / base_inter if base_inter else math.nan)} of "
                 f"ZeRO-3's ({mb(report.inter_bytes)} vs {mb(base_inter)}), {times(report.inter_ratio)} of ZeRO-3's "
                 f"in bf16 (the paper's baseline); all bytes "
                 f"{times((report.intra_bytes + report.inter_bytes) / base_all if base_all else math.nan)}")
    return "\n".join(lines)


def save_chart(path: str, losses: list[float], phases: list[tuple], title: str) -> None:
    """The training loss by step, and beside it each phase's bytes against plain ZeRO-3's (`phase_bytes`)."""
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed: no chart written to {path} (pip install matplotlib)")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2 if phases else 1, figsize=(11 if phases else 6, 4), squeeze=False)
    axes[0][0].plot(range(1, len(losses) + 1), losses)
    axes[0][0].set(title="training loss", xlabel="step", ylabel="nats per byte")
    if phases:
        ax, width = axes[0][1], 0.2
        series = (("cross-node", 3, "tab:blue"), ("ZeRO-3 cross-node", 5, "silver"),
                  ("within a node", 2, "tab:cyan"), ("ZeRO-3 within", 4, "gainsboro"))
        for offset, (label, column, color) in enumerate(series):
            places = [i + (offset - 1.5) * width for i in range(len(phases))]
            bars = ax.bar(places, [row[column] / 1e6 for row in phases], width, label=label, color=color)
            ax.bar_label(bars, fmt="%.2f", fontsize=6)
        names = [f"{row[0]}\n({TECHNIQUES[row[0]][0] if row[1] else 'off'})" for row in phases]
        ax.set_xticks(range(len(phases)), names, fontsize=7)
        ax.set(title="MB each rank received per step")
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def times(ratio: float) -> str:
    """A ratio as "0.26x"; "-" where there is no baseline (nan)."""
    return "-" if math.isnan(ratio) else f"{ratio:.2f}x"


if __name__ == "__main__":
    main()

"""Does ZeRO++'s quantization cost accuracy? Plain ZeRO-3 and all three techniques, same GPT,
same seed, same batches in the same order, on the standard library's source bytes.

    torchrun --nproc_per_node=2 examples/convergence.py --json conv.json --png conv.png
    torchrun --nproc_per_node=2 examples/convergence.py --steps 20 --dim 64 --layers 2 --seq 64 --batch 2   # CPU

Both runs train from the same initial weights with AdamW (linear warmup, cosine decay to 10%),
gradient clipping at 1.0, bf16 compute and Inductor on GPUs (fp32 and debug mode, no Inductor,
on CPU). The loss of a step is the mean over all ranks.
The final-loss gap is all3 minus ZeRO-3, each the mean loss of the last 50 steps (--final-window);
the validation loss is the mean over --val-batches held-out batches from the last 10% of the
bytes, which training never reads. With 2 ranks the default emulates 2 nodes of 1 rank, so qgZ
reduces across the (emulated) node boundary in INT4 and hpZ keeps a full copy.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

import torch
import torch.distributed as dist

import zpp_compile as zpp
from gpt import GPT, GPTConfig, batch, emulated_ranks_per_node, init_distributed, stdlib_bytes  # examples/gpt.py

def variants(hpz_size: int) -> dict[str, dict[str, Any]]:
    """Config overrides per run: plain ZeRO-3, and qwZ + hpZ + qgZ."""
    return {"zero3": {}, "all3": {"quantized_weights": True, "hpz_partition_size": hpz_size, "quantized_gradients": True}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=16, help="sequences per rank per step")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=100, help="linear warmup steps")
    p.add_argument("--final-window", type=int, default=50, help="last steps averaged for the final loss")
    p.add_argument("--val-batches", type=int, default=16, help="held-out batches per rank")
    p.add_argument("--reduce-dtype", choices=("fp32", "bf16"), default="fp32", help="gradient reduce dtype")
    p.add_argument("--ranks-per-node", type=int, help="ranks per emulated node (default: half the ranks)")
    p.add_argument("--data-bytes", type=int, default=8_000_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write losses and the gap here (rank 0)")
    p.add_argument("--png", help="write both loss curves here (rank 0; needs matplotlib)")
    args = p.parse_args(argv)
    if args.final_window > args.steps:
        p.error(f"--final-window {args.final_window} is longer than --steps {args.steps}")
    return args


def lr_factor(step: int, warmup: int, steps: int) -> float:
    """Linear warmup to 1, then cosine decay to 0.1 at the last step."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(steps - warmup, 1)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def train(options: dict[str, Any], args: argparse.Namespace, device: torch.device, train_bytes: torch.Tensor,
          val_bytes: torch.Tensor) -> dict[str, Any]:
    """One run from the seed; returns its per-step losses (mean over ranks) and validation loss."""
    rank, world = dist.get_rank(), dist.get_world_size()
    on_gpu = device.type == "cuda"
    config = zpp.Config(param_dtype="bf16" if on_gpu else None, reduce_dtype=args.reduce_dtype,
                        ranks_per_node=args.ranks_per_node, inductor=on_gpu, **options)
    torch.manual_seed(args.seed)
    with device:
        model = zpp.shard(GPT(GPTConfig(seq=args.seq, dim=args.dim, heads=args.heads, layers=args.layers)), config)
    step_model = torch.compile(model, backend="zeropp")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, args.warmup, args.steps))
    losses = torch.zeros(args.steps, device=device, dtype=torch.float64)
    for step in range(args.steps):
        x, y = batch(train_bytes, step, rank, world, args.batch, args.seq, args.seed)
        loss = step_model(x.to(device), y.to(device))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        schedule.step()
        opt.zero_grad(set_to_none=True)
        losses[step] = loss.detach()  # no host sync per step
        if rank == 0 and (step % 100 == 0 or step == args.steps - 1):
            print(f"  step {step:5d}  loss {loss.item():.4f}", flush=True)
    dist.all_reduce(losses)
    val = validation_loss(model, args, device, val_bytes)
    torch._dynamo.reset()
    return {"config": config.to_dict(), "losses": (losses / world).tolist(), "val_loss": val}


@torch.no_grad()
def validation_loss(model: torch.nn.Module, args: argparse.Namespace, device: torch.device,
                    val_bytes: torch.Tensor) -> float:
    """Mean loss over held-out batches, with the trained (master) weights run eagerly, so both
    runs are scored the same way whatever their training-time quantization."""
    rank, world = dist.get_rank(), dist.get_world_size()
    total = torch.zeros((), device=device, dtype=torch.float64)
    for i in range(args.val_batches):
        x, y = batch(val_bytes, i, rank, world, args.batch, args.seq, args.seed + 1)
        total += model(x.to(device), y.to(device)).double()
    dist.all_reduce(total)
    return total.item() / (world * args.val_batches)


def plot(runs: dict[str, dict[str, Any]], title: str, path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed: no chart written to {path} (pip install matplotlib)")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for (name, run), color in zip(runs.items(), ("tab:gray", "tab:blue")):
        losses = torch.tensor(run["losses"])
        window = min(25, len(losses))
        smooth = losses.unfold(0, window, 1).mean(1)  # moving average, for the eye only
        ax.plot(losses, color=color, alpha=0.25, linewidth=0.7)
        ax.plot(range(window - 1, len(losses)), smooth, color=color, label=f"{name} (val {run['val_loss']:.4f})")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats per byte)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    args.ranks_per_node = emulated_ranks_per_node(world, args.ranks_per_node)
    hpz = args.ranks_per_node if world // args.ranks_per_node > 1 else 1
    data = stdlib_bytes(args.data_bytes)
    split = len(data) * 9 // 10
    train_bytes, val_bytes = data[:split], data[split:]

    runs = {}
    for name, options in variants(hpz).items():
        if rank == 0:
            print(f"{name}: {options or 'plain ZeRO-3'}", flush=True)
        runs[name] = train(options, args, device, train_bytes, val_bytes)

    window = args.final_window
    final = {name: sum(run["losses"][-window:]) / window for name, run in runs.items()}
    summary = {
        "final_loss": final, "final_loss_gap": final["all3"] - final["zero3"],
        "val_loss_gap": runs["all3"]["val_loss"] - runs["zero3"]["val_loss"],
        "final_window": window, "world": world, "ranks_per_node": args.ranks_per_node,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "command": " ".join(sys.argv),
        "args": {k: v for k, v in vars(args).items() if k not in ("json", "png")},
    }
    if rank == 0:
        for name, run in runs.items():
            print(f"{name:<6} final loss (mean of last {window} steps) {final[name]:.4f}  val loss {run['val_loss']:.4f}")
        print(f"gap all3 - zero3: final loss {summary['final_loss_gap']:+.4f} nats, "
              f"val loss {summary['val_loss_gap']:+.4f} nats")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({**summary, "runs": runs}, f, indent=1)
        if args.png:
            plot(runs, f"GPT d={args.dim} L={args.layers} T={args.seq}, {args.batch} seq x {world} ranks, "
                       f"{args.steps} steps: final-loss gap {summary['final_loss_gap']:+.4f} nats", args.png)
    zpp.release_cuda_graphs()  # with Config.cuda_graphs: a captured NCCL collective blocks the teardown
    dist.destroy_process_group()
    return summary


if __name__ == "__main__":
    main()

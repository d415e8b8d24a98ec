"""Train the byte-level GPT of examples/gpt.py with Lightning Fabric, sharded and compiled by zeropp:
an ordinary Fabric loop in which the strategy is the one change (marked "zeropp:" below).

    torchrun --nproc_per_node=2 examples/train_lightning.py                  # CPU (gloo) or GPUs (NCCL)
    python examples/train_lightning.py --devices 2                           # Fabric starts the processes
    torchrun --nproc_per_node=2 examples/train_lightning.py --zeropp ds_config.json
    torchrun --nproc_per_node=2 examples/train_lightning.py --resume lightning_output/step-20

Each step accumulates `--accumulation` micro-batches (all but the last without gradient
communication), clips the global gradient norm at 1.0, and takes an AdamW step on a cosine
schedule. Every `--save-every` steps it writes a checkpoint (every rank its shards) that
`--resume` continues from, at any number of ranks.
"""

from __future__ import annotations

import argparse
import math
import os
import time

import lightning as L
import torch
from gpt import GPT, GPTConfig, batch, stdlib_bytes  # examples/gpt.py

import zpp_compile as zpp
from zpp_compile.integrations.lightning import ZeroppStrategy


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, default=None, help="ranks on this machine (default: torchrun's, else 1)")
    p.add_argument("--zeropp", help="a zeropp or DeepSpeed JSON config (default: bf16 compute on GPUs)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per micro-batch")
    p.add_argument("--accumulation", type=int, default=2, help="micro-batches per step")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--save-every", type=int, default=20)
    p.add_argument("--output-dir", default="lightning_output")
    p.add_argument("--resume", help="a checkpoint directory this script saved")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    on_gpu = torch.cuda.is_available()
    # zeropp: the strategy; param_dtype is zeropp's mixed precision (Fabric's own stays "32-true").
    config = args.zeropp or zpp.Config(param_dtype="bf16" if on_gpu else None)
    devices = args.devices or int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    fabric = L.Fabric(accelerator="cuda" if on_gpu else "cpu", devices=devices, strategy=ZeroppStrategy(config))
    fabric.launch()
    torch.manual_seed(0)

    model = fabric.setup_module(GPT(GPTConfig(seq=args.seq)))  # sharded, compiled with backend="zeropp"
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: 0.5 * (1 + math.cos(math.pi * min(step, args.steps) / args.steps)))
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
    if args.resume:
        fabric.load(args.resume, state)
        fabric.print(f"resumed from {args.resume} at step {state['step']}")

    data = stdlib_bytes(8_000_000)
    start = time.perf_counter()
    for step in range(state["step"], args.steps):
        for micro in range(args.accumulation):
            x, y = batch(data, step * args.accumulation + micro, fabric.global_rank, fabric.world_size,
                         args.batch, args.seq, seed=0)
            with fabric.no_backward_sync(model, enabled=micro < args.accumulation - 1):
                loss = model(x.to(fabric.device), y.to(fabric.device))
                fabric.backward(loss / args.accumulation)
        norm = fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        state["step"] = step + 1
        if state["step"] % 10 == 0 or state["step"] == args.steps:
            loss = fabric.all_reduce(loss.detach(), reduce_op="mean")
            fabric.print(f"step {state['step']}: loss {loss.item():.3f}, "
                         f"gradient norm {norm.full_tensor().item():.3f}, {time.perf_counter() - start:.1f} s")
        if state["step"] % args.save_every == 0:
            fabric.save(f"{args.output_dir}/step-{state['step']}", state)


if __name__ == "__main__":
    main()

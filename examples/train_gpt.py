"""Train a small byte-level GPT with zeropp on the Python standard library's own source code.

    torchrun --nproc_per_node=2 examples/train_gpt.py                  # CPU (gloo) or GPUs (NCCL)
    torchrun --nproc_per_node=8 examples/train_gpt.py --qwz --hpz 8 --qgz

Each rank keeps 1/N of the weights (ZeRO-3); the model runs through
torch.compile(backend="zeropp"), which turns the gathers and gradient reductions into the
collectives the flags ask for. Prints loss, tokens/s and the bytes each rank receives per step.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.distributed as dist

import zpp_compile as zpp
from gpt import GPT, GPTConfig, batch, init_distributed, stdlib_bytes  # examples/gpt.py


# ----------------------------------------------------------------------------- training


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--data-bytes", type=int, default=8_000_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--qwz", action="store_true", help="quantized weight all-gather (INT8)")
    p.add_argument("--hpz", type=int, default=0, help="hpZ secondary group size (0 = off)")
    p.add_argument("--qgz", action="store_true", help="quantized gradient reduction")
    p.add_argument("--ranks-per-node", type=int, default=None, help="emulate nodes of this many ranks")
    p.add_argument("--config", help="a zeropp JSON config (flags above are applied on top)")
    p.add_argument("--eager", action="store_true", help="run without torch.compile (plain ZeRO-3)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> float:
    args = parse_args(argv)
    device = init_distributed()
    use_cuda = device.type == "cuda"
    rank, world = dist.get_rank(), dist.get_world_size()

    overrides = {"quantized_weights": args.qwz, "hpz_partition_size": args.hpz, "quantized_gradients": args.qgz,
                 "ranks_per_node": args.ranks_per_node, "param_dtype": "bf16" if use_cuda else None}
    config = zpp.Config.load(args.config).updated({k: v for k, v in overrides.items() if v})
    torch.manual_seed(args.seed)
    cfg = GPTConfig(seq=args.seq, dim=args.dim, heads=args.heads, layers=args.layers)
    model = zpp.shard(GPT(cfg).to(device), config)
    step_model = model if args.eager else torch.compile(model, backend="zeropp")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))

    data = stdlib_bytes(args.data_bytes)
    tokens_per_step = world * args.batch * args.seq
    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters())
        print(f"zeropp: {n_params / 1e6:.2f}M parameters, {world} ranks, {len(data) / 1e6:.1f} MB of stdlib source, "
              f"{'eager' if args.eager else 'compiled'}, config: qwZ={config.quantized_weights} "
              f"hpZ={config.hpz_partition_size} qgZ={config.quantized_gradients}", flush=True)
    loss_value, start = float("nan"), None
    for step in range(args.steps):
        x, y = batch(data, step, rank, world, args.batch, args.seq, args.seed)
        loss = step_model(x.to(device), y.to(device))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step == 0:  # the first step compiles; time the rest
            start = time.perf_counter()
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            loss_value = loss.item()
            elapsed = time.perf_counter() - start
            speed = tokens_per_step * step / elapsed if step and elapsed > 0 else 0.0
            intra, inter = zpp.step_comm_bytes()
            held = f"  hpZ copies {zpp.secondary_copy_bytes() / 1e6:.1f} MB" if config.hpz_partition_size else ""
            progress(step + 1, args.steps, f"loss {loss_value:.3f}  {speed:,.0f} tok/s  "
                     f"comm/step/rank {intra / 1e6:.2f} MB intra-node + {inter / 1e6:.2f} MB inter-node{held}")
    if rank == 0:
        print()
    zpp.release_cuda_graphs()  # with Config.cuda_graphs: a captured NCCL collective blocks the teardown
    dist.destroy_process_group()
    return loss_value


def progress(done: int, total: int, text: str) -> None:
    width = 24
    filled = width * done // total
    sys.stdout.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total}  {text}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()

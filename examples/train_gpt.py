"""Train a small byte-level GPT with zeropp on the Python standard library's own source code.

    torchrun --nproc_per_node=2 examples/train_gpt.py                  # CPU (gloo) or GPUs (NCCL)
    torchrun --nproc_per_node=8 examples/train_gpt.py --qwz --hpz 8 --qgz

Each rank keeps 1/N of the weights (ZeRO-3); the model runs through
torch.compile(backend="zeropp"), which turns the gathers and gradient reductions into the
collectives the flags ask for. Prints loss, tokens/s and the bytes each rank receives per step.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import zpp_compile as zpp


# ----------------------------------------------------------------------------- model


@dataclass
class GPTConfig:
    vocab: int = 256  # bytes
    seq: int = 256
    dim: int = 256
    heads: int = 4
    layers: int = 4


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.ln1, self.ln2 = nn.LayerNorm(cfg.dim), nn.LayerNorm(cfg.dim)
        self.qkv, self.proj = nn.Linear(cfg.dim, 3 * cfg.dim), nn.Linear(cfg.dim, cfg.dim)
        self.fc, self.out = nn.Linear(cfg.dim, 4 * cfg.dim), nn.Linear(4 * cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(cfg.vocab, cfg.dim), nn.Embedding(cfg.seq, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.head.weight = self.embed.weight  # tied input and output embeddings
        for name, p in self.named_parameters():
            if p.dim() == 2:  # GPT-2 init; residual projections scaled by depth
                std = 0.02 / math.sqrt(2 * cfg.layers) if name.endswith(("proj.weight", "out.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


# ----------------------------------------------------------------------------- data


def stdlib_bytes(limit: int) -> torch.Tensor:
    """The standard library's .py files, concatenated in a fixed order, as a byte tensor."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= limit:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:limit]), dtype=torch.uint8).long()


def batch(data: torch.Tensor, step: int, rank: int, world: int, per_rank: int, seq: int, seed: int):
    """Rank `rank`'s sequences for `step`: a seeded draw shared by all ranks, sliced per rank."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(data) - seq - 1, (world * per_rank,), generator=g)[rank * per_rank:(rank + 1) * per_rank]
    x = torch.stack([data[s:s + seq] for s in starts.tolist()])
    y = torch.stack([data[s + 1:s + seq + 1] for s in starts.tolist()])
    return x, y


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
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():  # torchrun sets RANK etc.; a plain `python` run is one rank
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        dist.init_process_group("nccl" if use_cuda else "gloo", rank=int(os.environ.get("RANK", 0)),
                                world_size=int(os.environ.get("WORLD_SIZE", 1)))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda") if use_cuda else torch.device("cpu")

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
    dist.destroy_process_group()
    return loss_value


def progress(done: int, total: int, text: str) -> None:
    width = 24
    filled = width * done // total
    sys.stdout.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total}  {text}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()

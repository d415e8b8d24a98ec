"""The byte-level GPT and its data (the Python standard library's own source), shared by
train_gpt.py, bench.py and convergence.py, plus the launch boilerplate they have in common."""

from __future__ import annotations

import math
import os
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

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


def python_sources(limit: int, roots: Sequence[Path]) -> list[bytes]:
    """The .py files under each root in turn (each root's in a fixed order, skipping installed
    packages below it), until they hold `limit` bytes (the last one cut there), or all of them."""
    sources, total = [], 0
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            if "site-packages" in path.relative_to(root).parts:
                continue
            source = path.read_bytes()[:limit - total]
            sources.append(source)
            total += len(source)
            if total >= limit:
                return sources
    return sources


STDLIB = Path(sysconfig.get_paths()["stdlib"])


def stdlib_sources(limit: int) -> list[bytes]:
    """The standard library's .py files in a fixed order, until they hold `limit` bytes."""
    return python_sources(limit, [STDLIB])


def as_tokens(text: bytes) -> torch.Tensor:
    """Bytes as a tensor of token ids (0-255)."""
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


def stdlib_bytes(limit: int) -> torch.Tensor:
    """The standard library's .py files, concatenated in a fixed order, as a byte tensor."""
    return as_tokens(b"".join(stdlib_sources(limit)))


def batch(data: torch.Tensor, step: int, rank: int, world: int, per_rank: int, seq: int,
          seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s sequences for `step`: a seeded draw shared by all ranks, sliced per rank."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    every_start = torch.randint(0, len(data) - seq - 1, (world * per_rank,), generator=g)
    return windows(data, every_start[rank * per_rank:(rank + 1) * per_rank], seq)


def windows(data: torch.Tensor, starts: torch.Tensor, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Input and target sequences (the target one byte on) of the windows at `starts`."""
    x = torch.stack([data[s:s + seq] for s in starts.tolist()])
    y = torch.stack([data[s + 1:s + seq + 1] for s in starts.tolist()])
    return x, y


# ----------------------------------------------------------------------------- launch


def init_distributed() -> torch.device:
    """Joins the process group torchrun describes (NCCL with one GPU per rank, else gloo) and
    returns this rank's device. A plain `python` run is a world of one rank."""
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        dist.init_process_group("nccl" if use_cuda else "gloo", rank=int(os.environ.get("RANK", 0)),
                                world_size=int(os.environ.get("WORLD_SIZE", 1)))
    return torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")


def emulated_ranks_per_node(world: int, requested: int | None) -> int:
    """Ranks per emulated node: `requested`, else half the world (so one host is two nodes and
    "inter-node" bytes exist to be measured), else 1 for a single rank."""
    ranks_per_node = requested or max(world // 2, 1)
    if world % ranks_per_node:
        raise ValueError(f"--ranks-per-node {ranks_per_node} does not divide the world size {world}")
    return ranks_per_node

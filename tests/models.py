"""A small transformer for the tests, shaped to exercise the awkward cases: odd sizes that do
not divide the world size, a 0-d parameter, a frozen parameter, and tied input/output embeddings."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        # No qkv bias: its key part has an exactly zero gradient, which Adam turns into noise.
        self.qkv, self.proj = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim)
        self.fc, self.out = nn.Linear(dim, 4 * dim + 3), nn.Linear(4 * dim + 3, dim)
        self.gate = nn.Parameter(torch.tensor(0.75))  # 0-d

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.gate * self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.norm2(x))))


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int = 37, dim: int = 24, heads: int = 2, layers: int = 2, seq: int = 9) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.1, requires_grad=False)  # frozen
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class GraphBreakTransformer(TinyTransformer):
    """The same model with a graph break between blocks: Dynamo hands it over as several graphs."""

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
            torch._dynamo.graph_break()
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def batches(steps: int, world_size: int, per_rank: int = 2, vocab: int = 37,
            seq: int = 9) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Global batches (all ranks' samples, rank-major) for `steps` steps, fixed by a seed."""
    g = torch.Generator().manual_seed(1234)
    data = torch.randint(0, vocab, (steps, world_size * per_rank, seq + 1), generator=g)
    return [(d[:, :-1], d[:, 1:]) for d in data]


class CheckpointedTransformer(TinyTransformer):
    """The same model with every block under activation checkpointing (recomputed in backward)."""

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

"""How a parameter is padded to equal shards: zeropp splits its dim-0 rows over the ranks,
rounded up to whole rows, so that every rank holds the same number of elements."""

from __future__ import annotations

import math
from typing import Sequence

import torch


def rows_per_rank(rows: int, world_size: int) -> int:
    """Rows of a dim-0 sharded tensor each rank holds, padding included: torch.chunk's chunk size."""
    return math.ceil(rows / world_size)


def shard_numel(param_or_shape: torch.Tensor | Sequence[int], world_size: int) -> int:
    """Elements of one rank's shard of a parameter (or of a parameter of this shape) sharded over
    `world_size` ranks: its rows split evenly, rounded up to whole rows. A 0-d parameter, which
    every rank holds whole, counts its one element."""
    shape = tuple(param_or_shape.shape if isinstance(param_or_shape, torch.Tensor) else param_or_shape)
    rows = shape[0] if shape else 1
    row_numel = math.prod(shape[1:])  # 1 for a 0-d or 1-d parameter; a (0, n) one has n
    return rows_per_rank(rows, world_size) * row_numel


def padded_numel(param_or_shape: torch.Tensor | Sequence[int], world_size: int) -> int:
    """Elements of a parameter as gathered: every rank's shard, padding included."""
    return shard_numel(param_or_shape, world_size) * world_size

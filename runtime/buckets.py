"""The layout of a bucket: one gather of several parameters' shards.

Joined (`zpp::join_bucket`, `zpp::quantize_bucket`), a rank's shards lie side by side, each
padded to its segment. Gathered, the bucket holds rank-major rows: every rank's joined shards.
Split (`zpp::split_bucket`, `zpp::dequantize_bucket`), member p's weight is its columns of every
row, cut to sizes[p] per row and flattened: group_size * sizes[p] values, starting at
`member_starts(...)[p]`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Each member starts on this boundary, as a tensor allocated on its own does: matmul libraries
# choose their kernels by the alignment of the operands (up to 256 bytes), so a weight cut from a
# bucket is computed bit for bit as an unbucketed one is.
MEMBER_ALIGNMENT_BYTES = 256


def member_starts(group_size: int, sizes: list[int], element_size: int) -> tuple[list[int], int]:
    """The element offset of each member's weight in a split bucket, and the split's length."""
    align = max(1, MEMBER_ALIGNMENT_BYTES // element_size)
    starts, end = [], 0
    for size in sizes:
        start = -(-end // align) * align
        starts.append(start)
        end = start + group_size * size
    return starts, end


def split_rows(rows: torch.Tensor, segments: list[int], sizes: list[int]) -> torch.Tensor:
    """A bucket's [group_size, sum(segments)] rows split into its members' weights (the gaps
    between them zero)."""
    group_size = rows.shape[0]
    starts, _ = member_starts(group_size, sizes, rows.element_size())
    parts, end = [], 0
    for piece, size, start in zip(rows.split(list(segments), dim=1), sizes, starts):
        parts.append(F.pad(piece[:, :size].reshape(-1), (start - end, 0)))
        end = start + group_size * size
    return torch.cat(parts)


def join_shards(shards: list[torch.Tensor], segments: list[int]) -> torch.Tensor:
    """`shards` side by side along their last dimension, each padded with zeros to its segment: a
    rank's flat shards, or the rows of gradients laid out per destination rank."""
    return torch.cat([F.pad(shard, (0, segment - shard.shape[-1])) for shard, segment in zip(shards, segments)],
                     dim=-1)


def side_by_side(pieces: list[torch.Tensor], segments: list[int]) -> torch.Tensor:
    """`pieces` side by side along their last dimension, each padded with zeros to its segment,
    as one elementwise expression: each column takes its piece's value (a load masked to that
    piece's columns). Inductor generates it as one kernel for any number of pieces, where a
    concatenation of more than 8 becomes a copy per piece into a buffer (and a cast of it, a
    second pass). For compiled graphs only: run eagerly, every piece is padded to the full width."""
    total = sum(segments)
    column = torch.arange(total, device=pieces[0].device)
    out, end = None, total
    for piece, segment in reversed(list(zip(pieces, segments))):
        start = end - segment
        placed = F.pad(piece, (start, total - start - piece.shape[-1]))
        out = placed if out is None else torch.where(column < end, placed, out)
        end = start
    return out

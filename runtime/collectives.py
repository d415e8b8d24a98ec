"""The collectives zeropp issues, as `torch.ops._c10d_functional` calls.

The IR ops run these eagerly, and the lowering passes trace the same functions into the compiled
graphs, so eager and compiled runs issue identical collectives and Inductor sees ordinary
functional collectives it knows how to schedule. A group of one member (one GPU, or a level of
the hierarchy holding one rank) issues none: its collectives return their input, so a traced
gather or reduction over it is its cast alone, with no buffer copied through the network library.
"""

from __future__ import annotations

import torch

from ..torch_compat import C10D_FUNCTIONAL

_c10d = C10D_FUNCTIONAL


# The functional all-gathers, as they appear in lowered graphs; the wait every collective ends in;
# the namespace of the functional collectives (a node in it issues or waits for one).
ALL_GATHERS = (_c10d.all_gather_into_tensor.default, _c10d.all_gather_into_tensor_out.default)
WAIT = _c10d.wait_tensor.default
COLLECTIVE_NAMESPACE = "_c10d_functional"


def gathers_into_given_output(device: torch.device) -> bool:
    """Whether gathers on `device` use the `out=` all-gather. On CPU (gloo) they do: gloo's
    all-gather that allocates its own output goes through its coalesced implementation, which
    corrupts the heap when several are in flight at once (as overlap scheduling issues them); the
    `out=` form runs gloo's plain all-gather. Graphs holding it must be compiled without
    Inductor's buffer reuse, which would overwrite its input before its wait (`zeropp_backend`)."""
    return device.type == "cpu"


def all_gather(x: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    """Every member's `x` concatenated along dim 0, in group rank order; `x` itself in a group of
    one."""
    if group_size == 1:
        return x.contiguous()
    return _c10d.wait_tensor(issue_all_gather(x, group_size, group_name))


def issue_all_gather(x: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    """`all_gather` issued: its result is valid once waited for (`_c10d_functional.wait_tensor`)."""
    x = x.contiguous()
    if gathers_into_given_output(x.device):
        out = x.new_empty((x.shape[0] * group_size, *x.shape[1:]))
        return _c10d.all_gather_into_tensor_out(x, group_size, group_name, out=out)
    return _c10d.all_gather_into_tensor(x, group_size, group_name)


def reduce_scatter_sum(x: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    """Chunk `rank` (of `group_size` equal chunks along dim 0) of the sum of every member's `x`;
    `x` itself in a group of one."""
    if group_size == 1:
        return x.contiguous()
    return _c10d.wait_tensor(_c10d.reduce_scatter_tensor(x.contiguous(), "sum", group_size, group_name))


def all_to_all(x: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    """Chunk i of `x` (equal chunks along dim 0) goes to member i; received chunks in rank order;
    `x` itself in a group of one."""
    if group_size == 1:
        return x.contiguous()
    splits = [x.shape[0] // group_size] * group_size
    return _c10d.wait_tensor(_c10d.all_to_all_single(x.contiguous(), splits, splits, group_name))


def all_to_all_between_nodes(x: torch.Tensor, group_size: int, group_name: str, rank_in_group: int) -> torch.Tensor:
    """`all_to_all` over a group whose members are on different nodes (this rank being member
    `rank_in_group`).

    With two members it is an all-gather of the one chunk each sends its peer: the same bytes,
    but NCCL's network transport runs a collective over all its channels and point-to-point
    sends over fewer (docs/performance.md has the measurement).
    """
    if group_size != 2:
        return all_to_all(x, group_size, group_name)
    chunks = x.contiguous().chunk(2)
    gathered = all_gather(chunks[1 - rank_in_group], 2, group_name).chunk(2)  # [0's chunk for 1, 1's for 0]
    own, from_peer = chunks[rank_in_group], gathered[1 - rank_in_group]
    return torch.cat([own, from_peer] if rank_in_group == 0 else [from_peer, own])

"""Where every rank sits (node, local index) and the process groups ZeRO++ communicates over.

Ranks are numbered node by node, as torchrun numbers them: rank = node * ranks_per_node + local.
Groups, each created with the configured timeout so a dead peer raises instead of hanging:

- world: all ranks (parameter gathers, plain gradient reduce-scatter);
- intra_node: the ranks of this rank's node (qgZ's first hop);
- inter_node: the ranks with this rank's local index on every node (qgZ's second hop);
- secondary: hpZ's group of `hpz_partition_size` consecutive ranks, when hpZ is on;
- agreement: all ranks again, over gloo (in a dry run over torch's fake group, that group), for the
  checks that ranks run the same collectives.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class Group:
    """A process group as passes see it: its name for functional collectives, and its members."""

    name: str
    ranks: tuple[int, ...]

    @property
    def size(self) -> int:
        return len(self.ranks)


@dataclass(frozen=True)
class Topology:
    rank: int
    world_size: int
    ranks_per_node: int
    device: torch.device
    world: Group
    intra_node: Group
    inter_node: Group
    secondary: Group | None
    mesh: DeviceMesh  # 1-D mesh over `world`, for the DTensor shards
    # A gloo group of all ranks that carries only runtime.agreement's checks, never the model's
    # collectives (None in a Topology made by hand, for a graph that is never compiled).
    agreement: dist.ProcessGroup | None = field(default=None, compare=False)
    # Config.collective_timeout_s, every group's timeout: how long runtime.agreement's checks wait
    # before they warn that ranks are missing (None in a Topology made by hand).
    timeout_s: float | None = field(default=None, compare=False)

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    @property
    def node(self) -> int:
        """This rank's node, which is also its index in its inter-node group."""
        return node_of(self.rank, self.ranks_per_node)

    def received_bytes(self, group: Group, per_peer: int) -> tuple[int, int]:
        """(intra, inter) bytes this rank receives in a collective over `group` in which every
        other member sends it `per_peer` bytes."""
        return received_bytes(*peers_by_link(self.rank, self.ranks_per_node, group.ranks), per_peer)

    @property
    def secondary_member(self) -> int:
        """This rank's index inside its hpZ secondary group (hpZ must be on)."""
        return secondary_member(self.rank, self.secondary.size)


def node_of(rank: int, ranks_per_node: int) -> int:
    """The node of `rank`: ranks are numbered node by node, as torchrun numbers them."""
    return rank // ranks_per_node


def peers_by_link(rank: int, ranks_per_node: int, group_ranks: Sequence[int]) -> tuple[int, int]:
    """How many other members of the group `group_ranks` are on `rank`'s node, and how many are on
    other nodes (`rank` is a member)."""
    node = node_of(rank, ranks_per_node)
    same = sum(1 for r in group_ranks if r != rank and node_of(r, ranks_per_node) == node)
    return same, len(group_ranks) - 1 - same


def received_bytes(peers_same_node: int, peers_other_nodes: int, per_peer: int) -> tuple[int, int]:
    """(intra, inter) bytes a rank receives in a collective in which each of its peers sends it
    `per_peer` bytes: an all-gather's whole input, or a reduce-scatter's or all-to-all's chunk."""
    return peers_same_node * per_peer, peers_other_nodes * per_peer


def bytes_per_peer(gathers: bool, input_bytes: int, group_size: int) -> int:
    """What each peer sends a rank in a collective whose input is `input_bytes` on every member:
    an all-gather's peer its whole input, a reduce-scatter's or all-to-all's the rank's chunk."""
    return input_bytes if gathers else input_bytes // group_size


def world_received_bytes(world_size: int, ranks_per_node: int, per_peer: int) -> tuple[int, int]:
    """(intra, inter) bytes any rank receives in a collective over all ranks in which each peer
    sends it `per_peer` bytes (every rank's view is alike, so rank 0's is taken)."""
    return received_bytes(*peers_by_link(0, ranks_per_node, range(world_size)), per_peer)


def node_groups(world_size: int, ranks_per_node: int) -> list[tuple[int, ...]]:
    """The intra-node groups: each node's ranks."""
    return [tuple(range(n * ranks_per_node, (n + 1) * ranks_per_node)) for n in range(world_size // ranks_per_node)]


def local_index_groups(world_size: int, ranks_per_node: int) -> list[tuple[int, ...]]:
    """The inter-node groups: the ranks of one local index on every node."""
    return [tuple(range(local, world_size, ranks_per_node)) for local in range(ranks_per_node)]


def secondary_groups(world_size: int, size: int) -> list[tuple[int, ...]]:
    """hpZ's secondary groups: `size` consecutive ranks each (normally one node's, or part of it)."""
    return [tuple(range(k * size, (k + 1) * size)) for k in range(world_size // size)]


def secondary_member(rank: int, size: int) -> int:
    """`rank`'s index inside its secondary group of `size` consecutive ranks (`secondary_groups`)."""
    return rank % size


def launcher_ranks_per_node(world_size: int) -> int:
    """Ranks per node as the launcher reports it (torchrun's LOCAL_WORLD_SIZE); the world otherwise."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))


def collective_device(backend_config: str) -> torch.device:
    """The device zeropp keeps shards on and communicates from, given the default process group's
    backend for each device type ("cuda:nccl", "cpu:gloo,cuda:nccl"; `dist.get_backend_config()`):
    the current GPU where the group has a GPU backend of its own, the CPU where only gloo serves.

    Gloo also takes CUDA tensors, by copying them through the host; a group set up with it alone
    runs on the CPU. `init_process_group()` without a backend, on a machine with GPUs, makes NCCL
    the GPU's backend without naming it in `dist.get_backend()`, which says "undefined".
    """
    backends = backends_by_device(backend_config)
    if torch.cuda.is_available() and backends.get("cuda", "gloo") != "gloo":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def backends_by_device(backend_config: str) -> dict[str, str]:
    """{"cpu": "gloo", "cuda": "nccl"} of a group's backend config ("cpu:gloo,cuda:nccl")."""
    return dict(pair.split(":") for pair in backend_config.split(","))


def one_process_world(group: dist.ProcessGroup | None = None) -> bool:
    """Whether `group` (the default group by default) is a world of one process: rank 0 alone playing
    every rank, over torch's fake backend (a dry run, `torch_compat.init_fake_process_group`) or the
    simulated network's groups, which are served under that name for every device they time
    (runtime.simulated_group). Its collectives agree with themselves, and it has no store that a
    gloo group's members could meet at."""
    return all(backend == "fake" for backend in backends_by_device(dist.get_backend_config(group)).values())


def build_topology(ranks_per_node: int, hpz_partition_size: int, timeout_s: float) -> Topology:
    """Creates the process groups (torch.distributed must be initialized).

    A collective call: every rank makes it, with equal arguments.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    timeout = timedelta(seconds=timeout_s)

    def my_group(rank_lists: list[tuple[int, ...]]) -> tuple[Group, dist.ProcessGroup]:
        # Every rank creates every group, in the same order (torch.distributed requires it).
        mine = None
        for ranks in rank_lists:
            pg = dist.new_group(list(ranks), timeout=timeout)
            if rank in ranks:
                mine = Group(pg.group_name, ranks), pg
        return mine

    world, world_pg = my_group([tuple(range(world_size))])
    intra, _ = my_group(node_groups(world_size, ranks_per_node))
    inter, _ = my_group(local_index_groups(world_size, ranks_per_node))
    secondary = None
    if hpz_partition_size:
        secondary, _ = my_group(secondary_groups(world_size, hpz_partition_size))

    agreement_backend = None if one_process_world() else "gloo"  # no gloo group can form in one process
    agreement = dist.new_group(list(range(world_size)), timeout=timeout, backend=agreement_backend)

    device = collective_device(dist.get_backend_config())
    mesh = DeviceMesh.from_group(world_pg, device.type)
    return Topology(rank, world_size, ranks_per_node, device, world, intra, inter, secondary, mesh, agreement,
                    timeout_s)

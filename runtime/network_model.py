"""A model of the time a collective takes on a network of GPU nodes, for a simulated world.

Rank 0 of an N-rank world can run on one GPU over torch's fake process group, whose collectives
take no time; a simulated group would make each collective occupy a communication stream for the
time this model gives. Pure Python: nothing here touches torch or a device.

Conventions (NCCL's and nccl-tests'):

- `input_bytes` is the size of one rank's input tensor: an all-gather's shard (its output is n
  times that), a reduce-scatter's or all-reduce's whole tensor, an all-to-all's send buffer, a
  broadcast's buffer. nccl-tests' size S is the larger buffer: n x input for an all-gather, the
  input itself for every other op.
- A link's bandwidth is bus bandwidth (what nccl-tests reports as busbw, per GPU, 1 GB = 1e9
  bytes): the time to move S is factor x S / busbw, the factor being (n-1)/n for an all-gather,
  reduce-scatter and all-to-all, 2(n-1)/n for an all-reduce, 1 for a broadcast. A link may scale
  its bandwidth per op where measurements differ by op.
- Latency is counted per step a chunk waits for: a ring (NCCL's only algorithm here but for the
  all-reduce) takes n-1 steps, twice that for an all-reduce; a broadcast is a pipelined ring of
  n-1 steps (NCCL runs broadcasts on rings only); an all-to-all n-1 steps, one per peer. A step
  crossing nodes costs the inter-node latency, one inside a node the intra-node one, as NCCL's
  tuning model counts them.
- Ranks are numbered node by node (node = rank // ranks_per_node). A group inside one node uses the
  intra-node link. A group spanning nodes runs one ring per member of a node (NCCL's channels, one
  per NIC on rail-optimized nodes): each GPU sends 1/m of the bus bytes through its own NIC and the
  rest over NVLink, at once, so m members on a node give m x the per-GPU inter-node bandwidth,
  capped by their NVLink hops. A group of one rank per node (qgZ's second hop) gets exactly the
  per-GPU inter-node bandwidth. An all-to-all is no ring: each GPU sends its off-node peers' share
  through its own NIC, which m does not multiply.
- An all-reduce across nodes also has NCCL's tree: 2 x ((m-1) intra + ceil(log2 nodes) inter)
  steps, moving 2 x S at 0.92 of the bus bandwidth (NCCL's tuning model); the
  faster of ring and tree is taken, as NCCL's tuner picks. Inside one node NCCL's tree is a chain
  of as many steps as the ring at less bandwidth, so the ring is always taken there.
- A network without an inter-node link (`inter_node=None`) times every group on the intra-node
  link: nodes emulated on one NVLink host, as the project's 2- and 4-GPU launches ran them.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from types import MappingProxyType
from typing import Callable, Mapping, Sequence

OPS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast")
GB = 1e9  # bytes: nccl-tests' GB/s
TREE_BANDWIDTH_EFFICIENCY = 0.92  # NCCL's tuning model: a tree runs at `busBw*.92` of the ring's


@dataclass(frozen=True)
class Link:
    """One kind of link: its latency per algorithm step and its per-GPU bus bandwidth, scaled per
    op by `op_factors` (an op not named runs at the bandwidth itself)."""

    latency_s: float
    busbw_bytes_per_s: float
    op_factors: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self):
        unknown = set(self.op_factors) - set(OPS)
        if unknown:
            raise ValueError(f"Link op_factors name unknown ops {sorted(unknown)}; ops: {', '.join(OPS)}")
        if not self.latency_s >= 0 or not self.busbw_bytes_per_s > 0 or not all(
                f > 0 for f in self.op_factors.values()):
            raise ValueError(f"a Link needs latency >= 0 and bandwidth and factors > 0, got {self}")

    def bandwidth(self, op: str) -> float:
        """Bus bandwidth of `op` over this link, bytes/s."""
        return self.busbw_bytes_per_s * self.op_factors.get(op, 1.0)


@dataclass(frozen=True)
class Network:
    """Nodes of `ranks_per_node` GPUs joined by `intra_node` links inside a node and `inter_node`
    links between nodes (None: the nodes share the intra-node fabric)."""

    ranks_per_node: int
    intra_node: Link
    inter_node: Link | None

    def __post_init__(self):
        if self.ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be >= 1, got {self.ranks_per_node}")

    def to_dict(self) -> dict[str, float | int | None]:
        """Every parameter, for JSON records, units in the keys; the keys `with_overrides` takes."""
        return {"ranks_per_node": self.ranks_per_node, **_link_parameters("intra", self.intra_node),
                **_link_parameters("inter", self.inter_node)}


def _link_parameters(prefix: str, link: Link | None) -> dict[str, float | None]:
    """A link's parameters in human units under `prefix`; None for each of an absent link."""
    values = {"latency_us": None, "busbw_gbyte_per_s": None, **{f"{op}_factor": None for op in OPS}}
    if link is not None:
        values = {"latency_us": link.latency_s * 1e6, "busbw_gbyte_per_s": link.busbw_bytes_per_s / GB,
                  **{f"{op}_factor": link.op_factors.get(op, 1.0) for op in OPS}}
    return {f"{prefix}_{key}": value for key, value in values.items()}


def _link_from_parameters(prefix: str, values: Mapping[str, float | None]) -> Link | None:
    """The inverse of `_link_parameters`."""
    if values[f"{prefix}_latency_us"] is None:
        return None
    return Link(latency_s=values[f"{prefix}_latency_us"] * 1e-6,
                busbw_bytes_per_s=values[f"{prefix}_busbw_gbyte_per_s"] * GB,
                op_factors={op: values[f"{prefix}_{op}_factor"] for op in OPS})


def collective_seconds(network: Network, op: str, ranks: Sequence[int], input_bytes: int) -> float:
    """Modeled seconds of one `op` over the group of global ranks `ranks`, each rank's input tensor
    being `input_bytes` (see the module's conventions). A group of one, or no bytes, takes none."""
    if op not in OPS:
        raise ValueError(f"unknown collective {op!r}; ops: {', '.join(OPS)}")
    members = tuple(ranks)
    if len(set(members)) != len(members) or min(members, default=0) < 0 or input_bytes < 0:
        raise ValueError(f"a group needs distinct ranks >= 0 and bytes >= 0, got {members}, {input_bytes}")
    n = len(members)
    if n <= 1 or input_bytes == 0:
        return 0.0
    size = input_bytes * n if op == "all_gather" else input_bytes  # nccl-tests' size
    per_node = Counter(rank // network.ranks_per_node for rank in members)
    if network.inter_node is None or len(per_node) == 1:
        link = network.intra_node
        return _ring_steps(op, n) * link.latency_s + _bus_factor(op, n) * size / link.bandwidth(op)
    return _across_nodes_seconds(network, op, n, per_node, size)


def _ring_steps(op: str, n: int) -> int:
    """Steps of `op` over a ring (or, for an all-to-all, a round of sends) of `n` ranks."""
    return 2 * (n - 1) if op == "all_reduce" else n - 1


def _bus_factor(op: str, n: int) -> float:
    """nccl-tests' busbw factor: the bytes each rank moves per byte of size S."""
    return {"all_reduce": 2 * (n - 1) / n, "broadcast": 1.0}.get(op, (n - 1) / n)


def _across_nodes_seconds(network: Network, op: str, n: int, per_node: Counter, size: int) -> float:
    """Seconds of `op` over a group of `n` ranks on several nodes, `per_node` counting its members
    on each node."""
    intra, inter = network.intra_node, network.inter_node
    nodes, fewest, most = len(per_node), min(per_node.values()), max(per_node.values())
    if op == "all_to_all":
        # The member with the fewest node-mates has the most off-node peers: the slowest to finish.
        latency = (fewest - 1) * intra.latency_s + (n - fewest) * inter.latency_s
        return latency + max(size * (n - fewest) / n / inter.bandwidth(op),
                             size * (most - 1) / n / intra.bandwidth(op))
    # A chunk's pass round the ring: it crosses into each other node once, moves inside them otherwise.
    ring_pass = (n - nodes) * intra.latency_s + (nodes - 1) * inter.latency_s
    passes = 2 if op == "all_reduce" else 1
    ring = passes * ring_pass + _split_ring_seconds(network, op, _bus_factor(op, n) * size, fewest, most)
    if op != "all_reduce":
        return ring
    tree_latency = 2 * ((most - 1) * intra.latency_s + math.ceil(math.log2(nodes)) * inter.latency_s)
    tree_bytes = 2 * size / TREE_BANDWIDTH_EFFICIENCY
    return min(ring, tree_latency + _split_ring_seconds(network, op, tree_bytes, fewest, most))


def _split_ring_seconds(network: Network, op: str, bus_bytes: float, fewest: int, most: int) -> float:
    """Seconds to move `bus_bytes` per rank over rings spanning nodes: a node's members send 1/m of
    them each through their own NIC, (m-1)/m over NVLink, at once; the node with the fewest members
    has the fewest NICs, the one with the most the most NVLink hops."""
    over_network = bus_bytes / (fewest * network.inter_node.bandwidth(op))
    inside_node = bus_bytes * (most - 1) / most / network.intra_node.bandwidth(op)
    return max(over_network, inside_node)


# Presets. Figures not measured by the project are assumptions, to be calibrated against collective
# measurements (never against the step times the simulation is checked on).
NETWORK_EFFICIENCY = 0.9  # bus bandwidth over a NIC's line rate: an assumption, not measured here


def nvlink_link() -> Link:
    """NVLink 4 inside an H100 or H200 node: both carry 18 links, 900 GB/s per GPU (NVIDIA's
    datasheets), so the figures measured on either stand for both until each is measured."""
    all_gather = 245 * GB  # docs/performance.md, "Collectives alone": 256 MB, 2 H200
    return Link(
        latency_s=1.9e-6,  # NCCL's tuning model: an NVLink ring step, LL128; assumption
        busbw_bytes_per_s=all_gather,
        op_factors={
            "reduce_scatter": 229 * GB / all_gather,  # the same table: 229 GB/s
            "all_to_all": 283 * GB / all_gather,  # the same table: 283 GB/s
            # the same table: 1 GiB on 2 H100s, 329 GB/s (355 on 4, 361 on 8: the model keeps no count).
            "all_reduce": 329 * GB / all_gather,
            # broadcast: not measured; a pipelined ring like the all-gather's (factor 1, assumption).
        })


def infiniband_link(gbit_per_s: float) -> Link:
    """A NIC of `gbit_per_s` line rate per GPU: NETWORK_EFFICIENCY of it as bus bandwidth for every
    op (assumption)."""
    # NCCL's tuning model puts a network ring step at 4.0 us with LL128, before the NIC's own
    # latency: 5 us, an assumption.
    return Link(latency_s=5e-6, busbw_bytes_per_s=gbit_per_s * 1e9 / 8 * NETWORK_EFFICIENCY)


def socket_link() -> Link:
    """NCCL's socket transport (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1), the project's stand-in for a
    slow inter-node link. The benchmark's --slow-link launches sent every pair over it, same-node
    pairs too; the preset keeps NVLink inside nodes, as a slow network would. Launches of one GPU
    per node, the only ones recorded over it, see its inter-node link alone either way."""
    # docs/performance.md, "Collectives alone": 4.2 GB/s all-gather at 256 MB, 2 H200; 2.3-2.7 GB/s
    # at 8-128 MB: this transport is slower on smaller messages, a dependence on size the model does
    # not keep.
    all_gather = 4.2 * GB
    return Link(
        latency_s=14e-6,  # NCCL's tuning model: a network ring step with its Simple protocol; assumption
        busbw_bytes_per_s=all_gather,
        op_factors={
            "reduce_scatter": 4.3 * GB / all_gather,  # the same table: 4.3 GB/s
            "all_to_all": 2.7 * GB / all_gather,  # the same table: 2.7 GB/s
            # all-reduce (a reduce-scatter then an all-gather) and broadcast: not measured, factor 1.
        })


def _nodes_joined_by(inter_node: Callable[[], Link] | None) -> Callable[[int], Network]:
    """A preset: NVLink inside each node, `inter_node`'s link between them (None: nodes share NVLink)."""
    return lambda ranks_per_node: Network(ranks_per_node, nvlink_link(), inter_node and inter_node())


PRESETS: Mapping[str, Callable[[int], Network]] = MappingProxyType({
    "nvlink-h100": _nodes_joined_by(None),
    "nvlink-h200": _nodes_joined_by(None),
    **{f"ib-{rate}g": _nodes_joined_by(partial(infiniband_link, rate)) for rate in (100, 200, 400, 800)},
    "slow-link": _nodes_joined_by(socket_link),
})


def network_from_preset(name: str, ranks_per_node: int, overrides: str = "") -> Network:
    """The preset `name` for nodes of `ranks_per_node`, with `overrides` applied (`with_overrides`)."""
    if name not in PRESETS:
        raise ValueError(f"unknown network preset {name!r}; presets: {', '.join(PRESETS)}")
    return with_overrides(PRESETS[name](ranks_per_node), overrides)


def with_overrides(network: Network, overrides: str) -> Network:
    """`network` with parameters replaced as a command line passes them: "key=value,key=value",
    keys those of `Network.to_dict` but ranks_per_node (e.g. "inter_busbw_gbyte_per_s=25")."""
    values = network.to_dict()
    allowed = [key for key, value in values.items() if key != "ranks_per_node" and value is not None]
    for item in filter(None, (part.strip() for part in overrides.split(","))):
        key, _, text = (part.strip() for part in item.partition("="))
        if key not in allowed:
            why = {"ranks_per_node": " (the preset's argument, not an override)"}.get(key, "")
            if key.startswith("inter_") and network.inter_node is None:
                why = " (this network's nodes share the intra-node fabric: it has no inter-node link)"
            raise ValueError(f"unknown network override {key!r}{why}; allowed: {', '.join(allowed)}")
        try:
            values[key] = float(text)
        except ValueError:
            raise ValueError(f"network override {key!r} needs a number, got {text!r}") from None
    return Network(network.ranks_per_node, _link_from_parameters("intra", values),
                   _link_from_parameters("inter", values))

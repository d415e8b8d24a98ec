"""The communication ledger: every collective a compiled graph issues, with its bytes per link.

Bytes are counted per rank as what it receives from its peers (the volume the ZeRO++ paper
counts: a bf16 all-gather of M bytes moves M * (n-1)/n to each rank), split by whether the peer
is on this rank's node (intra-node) or not (inter-node). They are read from the lowered graph, so
the volume of a step is known without running it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from .topology import Group, Topology

_c10d = torch.ops._c10d_functional
_OPS = {
    _c10d.all_gather_into_tensor.default: "all_gather",
    _c10d.reduce_scatter_tensor.default: "reduce_scatter",
    _c10d.all_to_all_single.default: "all_to_all",
}


@dataclass(frozen=True)
class CollectiveRecord:
    op: str
    group: Group
    dtype: torch.dtype
    intra_bytes: int  # received from peers on this rank's node
    inter_bytes: int  # received from peers on other nodes


@dataclass(frozen=True)
class GraphComm:
    """The collectives of one compiled graph (one forward, backward or inference graph)."""

    graph_name: str
    kind: str
    collectives: tuple[CollectiveRecord, ...]
    secondary_bytes: int = 0  # hpZ copies this (forward) graph keeps for backward

    @property
    def intra_bytes(self) -> int:
        return sum(c.intra_bytes for c in self.collectives)

    @property
    def inter_bytes(self) -> int:
        return sum(c.inter_bytes for c in self.collectives)


def collectives_in_graph(graph: fx.Graph, topology: Topology) -> tuple[CollectiveRecord, ...]:
    groups = {g.name: g for g in (topology.world, topology.intra_node, topology.inter_node, topology.secondary) if g}
    records = []
    for node in graph.nodes:
        op = _OPS.get(node.target)
        group = groups.get(str(node.args[-1])) if op else None
        if group is None:  # not a collective, or one of the user's own groups
            continue
        value = node.args[0].meta["val"]
        nbytes = value.numel() * value.element_size()
        # What each peer sends this rank: its whole input for a gather, else the chunk for here.
        per_peer = nbytes if op == "all_gather" else nbytes // group.size
        same, other = topology.peers_by_link(group)
        records.append(CollectiveRecord(op, group, value.dtype, same * per_peer, other * per_peer))
    return tuple(records)



def training_graphs(graphs: list[GraphComm]) -> list[GraphComm]:
    """The forward and backward graphs of every compiled graph that has a backward (so not the
    inference-only graphs of, say, evaluation): what one training step runs."""
    trained = {g.graph_name.split(".")[0] for g in graphs if g.kind == "backward"}
    return [g for g in graphs if g.graph_name.split(".")[0] in trained]


def training_step_bytes(graphs: list[GraphComm]) -> tuple[int, int]:
    """(intra, inter) bytes one training step moves."""
    chosen = training_graphs(graphs)
    return sum(g.intra_bytes for g in chosen), sum(g.inter_bytes for g in chosen)

"""Overlap scheduling: weight gathers issued ahead of the compute that needs them, gradient
reductions waited for only when the next one starts."""

from __future__ import annotations

import networkx
import torch.fx as fx

from ..runtime.collectives import ALL_GATHERS, WAIT
from ..runtime.prefetch import GATHER_PREFETCHED
from ..torch_compat import C10D_FUNCTIONAL
from .base import PassContext
from .fx_util import ancestors, backward_nodes, descendants

_c10d = C10D_FUNCTIONAL
COLLECTIVES = (*ALL_GATHERS, _c10d.reduce_scatter_tensor.default, _c10d.all_to_all_single.default)
# A layer graph's first gather, issued during the graph before (prefetch_across_layers): its own wait.
PREFETCHED = GATHER_PREFETCHED


def schedule_overlap(graph: fx.Graph, ctx: PassContext) -> None:
    """Reorders a lowered graph so that communication runs while the GPU computes.

    A collective waits, on its own stream, for everything the compute stream did before it was
    issued; its wait makes the compute stream wait for it. So:
    - weight gathers (of shards or hpZ copies, which are graph inputs) are issued `prefetch`
      gathers ahead: gather i + prefetch, with the casts and quantization before it, moves to just
      before the wait of gather i, so it runs during gather i's compute. At most prefetch + 1
      gathered buckets are alive at once: the memory bound;
    - reductions (collectives of computed gradients) start where their gradient is ready; what
      follows each collective (its wait, the reduction kernels, the next hop) moves to just before
      the next reduction's first collective, so each hop runs during the next gradients' compute.
    The reordering is a priority order made valid by a stable topological sort; every rank
    computes the same order from the same graph, so collectives are issued in the same order.
    """
    nodes = [n for n in graph.nodes if n.op != "output"]
    rank = {node: float(index) for index, node in enumerate(nodes)}
    collectives = [n for n in nodes if n.target in COLLECTIVES]
    # Weight gathers read graph inputs (shards, hpZ copies); collectives computed from an incoming
    # gradient reduce it, all-gathers among them (a two-node gradient exchange is one).
    from_gradients = backward_nodes(graph)
    gathers = [c for c in collectives if c.target in ALL_GATHERS and c not in from_gradients]
    gathers += [n for n in nodes if n.target is PREFETCHED]
    reductions = [c for c in collectives if c not in gathers]
    _prefetch_gathers(gathers, ctx.config.prefetch, rank)
    _defer_reductions(reductions, nodes, rank)
    _reorder(graph, rank)


def _wait_of(collective: fx.Node) -> fx.Node:
    if collective.target is PREFETCHED:
        return collective
    return next(u for u in collective.users if u.target is WAIT)


def _prefetch_gathers(gathers: list[fx.Node], prefetch: int, rank: dict) -> None:
    """Gives gather i + prefetch (and what it is computed from) a place just before gather i's wait."""
    gathers = sorted(gathers, key=lambda c: rank[_wait_of(c)])
    for early, late in zip(gathers, gathers[prefetch:]):
        anchor = rank[_wait_of(early)]
        start = [n for n in ancestors(late) if n.op != "placeholder"]
        for offset, node in enumerate(sorted(start, key=rank.__getitem__)):
            rank[node] = min(rank[node], anchor - 0.5 + offset * 1e-6)


def _defer_reductions(reductions: list[fx.Node], nodes: list[fx.Node], rank: dict) -> None:
    """Moves what follows each reduction's collectives to just before later reductions' first
    collectives: the k-th segment after a reduction's start (its k-th wait up to its next
    collective) goes before the k-th reduction after it, or to the end."""
    order = {node: index for index, node in enumerate(nodes)}
    others = set(reductions)
    first_hops = [c for c in reductions if not (ancestors(c) - {c}) & others]
    claimed: set[fx.Node] = set()
    for index, start in enumerate(first_hops):
        for k, segment in enumerate(_segments(start, order, claimed), start=1):
            later = first_hops[index + k] if index + k < len(first_hops) else None
            anchor = rank[later] if later is not None else float(len(nodes))
            for offset, node in enumerate(segment):
                rank[node] = anchor - 0.5 + offset * 1e-6


def _segments(start: fx.Node, order: dict[fx.Node, int], claimed: set[fx.Node]) -> list[list[fx.Node]]:
    """The nodes computed from a reduction's first collective, split after each further
    collective: [[wait, ..., collective 2], [wait 2, ...], ...], in graph order."""
    after = sorted((n for n in descendants(start) - {start} - claimed if n in order), key=order.__getitem__)
    claimed.update(after)
    segments: list[list[fx.Node]] = [[]]
    for node in after:
        segments[-1].append(node)
        if node.target in COLLECTIVES:
            segments.append([])
    return [s for s in segments if s]


def _reorder(graph: fx.Graph, rank: dict[fx.Node, float]) -> None:
    """Puts the graph's nodes in order of `rank` as far as dependencies allow: a topological sort
    that always places the ready node of lowest rank (ties in graph order)."""
    index = {node: i for i, node in enumerate(rank)}
    dependencies = networkx.DiGraph()
    dependencies.add_nodes_from(rank)
    dependencies.add_edges_from((source, node) for node in rank for source in node.all_input_nodes)
    output = next(n for n in graph.nodes if n.op == "output")
    for node in networkx.lexicographical_topological_sort(dependencies, key=lambda n: (rank[n], index[n])):
        output.prepend(node)

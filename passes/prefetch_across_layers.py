"""Prefetch across layers: a layer graph's first weight gather, issued while the layer before computes.

A layer compiled as a graph of its own (Config.compile_layers_once) starts its first gather when
it is called, so that gather waits for nothing and nothing hides it: in forward, the layer's
first bucket; in backward, its re-gather. This pass rewrites, in each lowered layer graph, the
gather waited for first (from the graph's inputs: shards, or in backward hpZ's copies) with
everything it is computed from (casts, padding, bucket copies, qwZ's quantization), its
all-gather and its wait, into one `zpp::gather_prefetched` call that holds what the gather sends
as its program and issues the gather itself. At run time that op takes the result issued one call
ahead and issues the next call's (`runtime/prefetch.py`), so every layer graph's first gather runs
during the previous layer graph's compute, as FSDP2 prefetches the next block. It runs on nothing
but layer graphs over more than one rank, after `fold_bucket_copies`, so that the program holds the
kernels the graph would have run (a bucket's copies folded into its quantization, or one
elementwise expression with its casts), and Inductor compiles it as it would have compiled them in
the graph (`runtime/programs.py`); `schedule_overlap` then issues the graph's next gather before it.
"""

from __future__ import annotations

import torch.fx as fx

from ..runtime.collectives import ALL_GATHERS, COLLECTIVE_NAMESPACE, WAIT
from ..runtime.prefetch import GATHER_PREFETCHED
from .base import PassContext
from .fx_util import ancestors, backward_nodes, program_source


def prefetch_across_layers(graph: fx.Graph, ctx: PassContext) -> None:
    """Turns a layer graph's first weight gather into one issued during the layer graph before."""
    if not ctx.one_layer or ctx.topology.world.size == 1:
        return
    first = _first_gather(graph)
    if first is None:
        return
    collective, wait = first
    if collective in backward_nodes(graph):
        return  # a gradient's exchange, not a weight gather
    chain = sorted(ancestors(collective) - {collective})  # nodes compare by graph position
    inputs = [n for n in chain if n.op == "placeholder"]
    computed = [n for n in chain if n.op != "placeholder"]
    if not inputs or not _movable(computed, collective):
        return
    # What the gather sends; the op issues the gather (its `out=` buffer, on CPU, it makes itself).
    sent, group_size, group_name = collective.args[:3]
    program = program_source(inputs, sorted(ancestors(sent) - set(inputs)), [sent])
    if program is None:
        return
    value = wait.meta["val"]
    # The gather's own group, which the ledger counts it over: backward's gathers hpZ's copies
    # inside the node, not over the world.
    with graph.inserting_before(wait):
        prefetched = graph.call_function(
            GATHER_PREFETCHED, (inputs, program, value.numel(), value.dtype, ctx.kind == "backward", group_size,
                                group_name, ctx.config.inductor),
        )
    prefetched.meta["val"] = value
    wait.replace_all_uses_with(prefetched)
    for node in [wait, collective, *reversed(computed)]:
        graph.erase_node(node)


def _first_gather(graph: fx.Graph) -> tuple[fx.Node, fx.Node] | None:
    """The all-gather whose wait comes first in the graph, and that wait."""
    for node in graph.nodes:
        if node.target is WAIT and node.args[0].target in ALL_GATHERS:
            return node.args[0], node
    return None


def _movable(computed: list[fx.Node], collective: fx.Node) -> bool:
    """Whether the nodes the gather is computed from serve it alone and can run outside the graph:
    plain function calls, no other collective, none read by anything but the gather's chain."""
    own = {*computed, collective}
    return all(
        node.op == "call_function" and getattr(node.target, "namespace", None) != COLLECTIVE_NAMESPACE
        and all(user in own for user in node.users)
        for node in computed
    ) and len(collective.users) == 1

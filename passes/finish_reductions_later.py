"""Finish reductions later: a graph's last gradient reductions, waited for during the next graph's backward.

With Config.compile_layers_once the step is many graphs: each layer's, and those around the
layers (the embedding's, the head's). Each backward graph issues its last gradient reductions at
its end and waits for them before it returns, with nothing of its own left to compute meanwhile.
This pass rewrites, in each lowered backward graph over more than one rank, the waits of the
graph's gradient exchanges (collectives of what the incoming gradient computes) that only local
shards' gradients depend on, with everything computed from them up to those outputs (the
division by the group size, the cuts into shards, qgZ's dequantization), into one
`zpp::finish_reductions_later` call that holds the rest as its program and returns placeholders
for those outputs. The collectives stay where the schedule put them; their ends run when the next
backward graph calls the op, or at the end of the backward pass (`runtime/deferred_reductions.py`).
The last of the lowering passes, after the schedule.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..runtime.collectives import COLLECTIVE_NAMESPACE, WAIT
from ..runtime.deferred_reductions import FINISH_REDUCTIONS_LATER, results_literal
from ..torch_compat import USER_VISIBLE_OUTPUTS, OpOverload, cuda_graph_unsafe_tags, detect_fake_mode, mutates_arguments
from .base import PassContext
from .fx_util import backward_nodes, program_source


def finish_reductions_later(graph: fx.Graph, ctx: PassContext) -> None:
    """Turns the ends of a backward graph's last gradient reductions into one op run later."""
    if (not ctx.config.compile_layers_once or ctx.kind != "backward" or ctx.topology.world.size == 1
            or ctx.shard_inputs is None):
        return
    output = next(iter(reversed(graph.nodes)))  # torch 2.11-2.12: a node list is not an iterator
    inputs_count, shards = ctx.shard_inputs
    if len(output.args[0]) != inputs_count:
        return
    # Only `LocalShards` takes placeholders: the other outputs must be results when the graph returns.
    kept = {a for i, a in enumerate(output.args[0]) if isinstance(a, fx.Node) and i not in shards}
    tail = _tail(graph, output, kept)
    # An item of a multi-output node computed before the tail (a coalesced collective's) enters
    # the program as an input itself: a list is no argument of the op's.
    tail -= {n for n in tail if n.target is operator.getitem and n.args[0] not in tail}
    if not tail:
        return
    nodes = sorted(tail)  # nodes compare by graph position
    results = list(dict.fromkeys(a for i, a in enumerate(output.args[0]) if i in shards and a in tail))
    inputs = sorted({arg for node in nodes for arg in node.all_input_nodes if arg not in tail})
    values = [node.meta["val"] for node in results]
    if not inputs or any(not isinstance(size, int) for v in values for size in v.shape):
        return
    if not all(isinstance(node.meta.get("val"), torch.Tensor) for node in inputs):
        return  # an input the op cannot take (no tensor): the graph waits for its reductions itself
    program = program_source(inputs, nodes, results)
    if program is None:
        return
    shapes = results_literal(values)
    with graph.inserting_before(output):
        later = graph.call_function(FINISH_REDUCTIONS_LATER, (inputs, program, shapes, ctx.config.inductor))
        with detect_fake_mode(values):
            later.meta["val"] = FINISH_REDUCTIONS_LATER([node.meta["val"] for node in inputs], program, shapes,
                                                        ctx.config.inductor)
        placeholders = {}
        for index, node in enumerate(results):
            placeholders[node] = graph.call_function(operator.getitem, (later, index))
            placeholders[node].meta["val"] = later.meta["val"][index]
    outputs = output.args[0]
    output.update_arg(0, type(outputs)(placeholders.get(a, a) for a in outputs))
    if USER_VISIBLE_OUTPUTS in output.meta:
        # Inductor would copy each output to the strides the graph had before the passes: the
        # placeholders are for `LocalShards`, which must get them as they are.
        held = {index for index, node in enumerate(outputs) if node in placeholders}
        output.meta[USER_VISIBLE_OUTPUTS] = [i for i in output.meta[USER_VISIBLE_OUTPUTS] if i not in held]
    for node in reversed(nodes):
        graph.erase_node(node)


def _tail(graph: fx.Graph, output: fx.Node, kept: set[fx.Node]) -> set[fx.Node]:
    """The waits of the graph's gradient exchanges that nothing but the graph's outputs depends
    on, with the nodes computed from them that only lead there (not to the outputs `kept`): what
    can run after the graph."""
    gradient = backward_nodes(graph)
    exchanges, after_exchange = set(), set()
    for node in graph.nodes:
        if node.target is WAIT and node.args[0] in gradient:
            exchanges.add(node)
        if node in exchanges or (node.op == "call_function" and any(a in after_exchange for a in node.all_input_nodes)):
            after_exchange.add(node)
    tail: set[fx.Node] = set()
    for node in reversed(graph.nodes):
        if (node in after_exchange and node not in kept and _can_run_later(node)
                and all(user in tail or user is output for user in node.users)):
            tail.add(node)
    return tail if tail & exchanges else set()


def _can_run_later(node: fx.Node) -> bool:
    """A wait, or a computation free of side effects and of run-time state: an operator that
    writes none of its arguments, issues no collective and may be replayed (zeropp's ops that read
    Python state are kept out of CUDA graphs), or a tuple item."""
    if node.target is WAIT or node.target is operator.getitem:
        return True
    if not isinstance(node.target, OpOverload) or node.target.namespace == COLLECTIVE_NAMESPACE:
        return False
    return not mutates_arguments(node.target) and not set(cuda_graph_unsafe_tags()) & set(node.target.tags)

"""Small FX helpers shared by the passes."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch._inductor.decomposition import select_decomp_table
from torch.fx.experimental.proxy_tensor import make_fx


def nodes_calling(graph: fx.Graph, op: Any) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op == "call_function" and n.target is op]


def is_backward(graph: fx.Graph) -> bool:
    """AOTAutograd names the incoming gradients of a backward (or joint) graph tangents_*."""
    return any(n.op == "placeholder" and str(n.target).startswith("tangents") for n in graph.nodes)


def insert_traced(graph: fx.Graph, before: fx.Node, fn: Callable[..., torch.Tensor], *args: Any) -> fx.Node:
    """Inserts the aten ops of `fn(*args)`, traced on the args' fake values, before `before`.

    `args` are fx Nodes (standing for their tensors) or constants. The inserted nodes carry
    "val" metadata like the rest of the graph, and are decomposed as Inductor expects of the
    graphs its passes see. Returns the node holding fn's result.
    """
    tensor_args = [a for a in args if isinstance(a, fx.Node)]

    def with_constants(*tensors: torch.Tensor) -> torch.Tensor:
        it = iter(tensors)
        return fn(*(next(it) if isinstance(a, fx.Node) else a for a in args))

    values = [a.meta["val"] for a in tensor_args]
    with detect_fake_mode(values):
        traced = make_fx(with_constants, decomposition_table=select_decomp_table())(*values)
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    with graph.inserting_before(before):
        return graph.graph_copy(traced.graph, dict(zip(placeholders, tensor_args)))


def replace_with_traced(graph: fx.Graph, node: fx.Node, fn: Callable[..., torch.Tensor], *args: Any) -> fx.Node:
    """Replaces `node` by the aten ops of `fn(*args)` (see `insert_traced`)."""
    result = insert_traced(graph, node, fn, *args)
    node.replace_all_uses_with(result)
    graph.erase_node(node)
    return result


def graph_input(node: fx.Node) -> fx.Node:
    """The node that `node` is a chain of single-input ops of (for a shard: its placeholder)."""
    while node.op == "call_function" and len(node.all_input_nodes) == 1:
        node = node.all_input_nodes[0]
    return node


def gathered_param(gather: fx.Node) -> tuple:
    """What a `zpp.all_gather_param` gathers: equal for every gather of one parameter's shard.
    Each gather reads its own flat view of the local shard, so the graph input behind it tells
    them apart."""
    return (graph_input(gather.args[0]), *gather.args[1:])


def weight_chain(gather: fx.Node) -> list[fx.Node]:
    """`gather` and every node computed from gathered weights alone (casts, views, transposes),
    in graph order: what backward can recompute from the weight without any activation."""
    chain: set[fx.Node] = set()
    todo = [gather]
    while todo:
        node = todo.pop()
        if node in chain:
            continue
        chain.add(node)
        todo.extend(
            user for user in node.users
            if user.op == "call_function" and all(arg in chain or arg is node for arg in user.all_input_nodes)
        )
    return [n for n in gather.graph.nodes if n in chain]


def backward_nodes(graph: fx.Graph) -> set[fx.Node]:
    """The nodes of a joint graph that depend on an incoming gradient (tangents_*)."""
    found: set[fx.Node] = set()
    for node in graph.nodes:
        if (node.op == "placeholder" and str(node.target).startswith("tangents")) or any(
            arg in found for arg in node.all_input_nodes
        ):
            found.add(node)
    return found


def hoist(nodes: list[fx.Node], anchor: fx.Node) -> None:
    """Moves each of `nodes` that comes after `anchor`, with whatever it is computed from that
    also comes after it, to just before `anchor` (keeping their order). Only for nodes free of
    side effects whose inputs can move (views of graph inputs, casts)."""
    earlier: set[fx.Node] = set()
    for node in anchor.graph.nodes:
        if node is anchor:
            break
        earlier.add(node)

    def move(node: fx.Node) -> None:
        if node in earlier:
            return
        for arg in node.all_input_nodes:
            move(arg)
        anchor.prepend(node)
        earlier.add(node)

    for node in nodes:
        move(node)


def sink_users(nodes: list[fx.Node], anchor: fx.Node) -> None:
    """Moves every node that comes before `anchor` and is computed from one of `nodes` (directly
    or not) to just after it, keeping their order: the mirror of `hoist`."""
    found = set(nodes)
    moving = []
    for node in anchor.graph.nodes:
        if node is anchor:
            break
        if any(arg in found for arg in node.all_input_nodes):
            found.add(node)
            moving.append(node)
    for node in reversed(moving):
        anchor.append(node)


def ancestors(node: fx.Node) -> set[fx.Node]:
    """`node` and every node it is computed from."""
    return _closure(node, lambda n: n.all_input_nodes)


def descendants(node: fx.Node) -> set[fx.Node]:
    """`node` and every node computed from it."""
    return _closure(node, lambda n: n.users)


def _closure(node: fx.Node, step: Callable[[fx.Node], Any]) -> set[fx.Node]:
    found, todo = set(), [node]
    while todo:
        current = todo.pop()
        if current not in found:
            found.add(current)
            todo.extend(step(current))
    return found

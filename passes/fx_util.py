"""Small FX helpers shared by the passes."""

from __future__ import annotations

import re
import types
import weakref
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from ..runtime.ops import gather_param_args
from ..runtime.programs import PROGRAM_NAMES
from ..torch_compat import OpOverload, detect_fake_mode, node_module_stack, select_decomp_table

_ROOT = re.compile(r"^L\[['\"][^'\"]*['\"]\]")  # the compiled function's argument: L['self']
# `insert_traced`'s traces by call, by the fake mode of the compilation they serve (weakly: they go
# with it): this module's own.
_TRACES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def nodes_calling(graph: fx.Graph, op: Any) -> list[fx.Node]:
    """The calls of `op` in graph order, as a list (the passes rewrite the graph while they walk it)."""
    return list(graph.find_nodes(op="call_function", target=op))


def is_backward(graph: fx.Graph) -> bool:
    """AOTAutograd names the incoming gradients of a backward (or joint) graph tangents_*."""
    return any(n.op == "placeholder" and str(n.target).startswith("tangents") for n in graph.nodes)


def insert_traced(graph: fx.Graph, before: fx.Node, fn: Callable[..., torch.Tensor], *args: Any,
                  meta: dict[str, Any] | None = None) -> fx.Node:
    """Inserts the aten ops of `fn(*args)`, traced on the args' fake values, before `before`.

    `args` are fx Nodes (standing for their tensors) or constants. The inserted nodes carry
    "val" metadata like the rest of the graph, plus `meta` (e.g. the replaced node's recompute
    tag), and are decomposed as Inductor expects of the graphs its passes see. Returns the node
    holding fn's result.

    Tracing costs far more than copying: a trace is kept and copied again for the same function,
    constants and argument shapes, as every identical layer of a model asks for; the copy's values
    are computed afresh, in this graph's fake mode. The traces are kept with the fake mode they were
    traced in, weakly, and go with it: nothing outlives the compilation (or `torch.compiler.reset()`).
    """
    tensor_args = [a for a in args if isinstance(a, fx.Node)]
    values = [a.meta["val"] for a in tensor_args]
    fake_mode = detect_fake_mode(values)
    traces = _TRACES.setdefault(fake_mode, {}) if fake_mode is not None else {}
    key = _trace_key(fn, args, values)
    traced = traces.get(key) if key is not None else None
    if traced is None:

        def with_constants(*tensors: torch.Tensor) -> torch.Tensor:
            it = iter(tensors)
            return fn(*(next(it) if isinstance(a, fx.Node) else a for a in args))

        with fake_mode:
            traced = make_fx(with_constants, decomposition_table=select_decomp_table())(*values)
    copies = dict(zip([n for n in traced.graph.nodes if n.op == "placeholder"], tensor_args))
    with graph.inserting_before(before):
        result = graph.graph_copy(traced.graph, copies)  # also maps each copied node in `copies`
    for original, node in copies.items():
        if meta and original.op == "call_function":
            node.meta.update(meta)
    if key is not None and key in traces:
        _propagate_values(copies, fake_mode)
    elif key is not None:
        for node in traced.graph.nodes:  # kept without this graph's fake values
            node.meta.pop("val", None)
        traces[key] = traced
    return result


def _trace_key(fn: Callable[..., Any], args: tuple, values: list[torch.Tensor]) -> tuple | None:
    """What decides `fn`'s trace: the function, the constants, and the tensors' shapes, strides
    and dtypes. None (trace afresh) for closures and bound methods, which hide state, and for
    symbolic shapes."""
    plain_function = isinstance(fn, types.FunctionType) and fn.__closure__ is None
    if not (plain_function or isinstance(fn, OpOverload)):
        return None
    metas = [(tuple(v.shape), tuple(v.stride()), v.dtype, v.device, v.requires_grad) for v in values]
    if any(not isinstance(d, int) for shape, stride, *_ in metas for d in (*shape, *stride)):
        return None
    constants = tuple(None if isinstance(a, fx.Node) else (type(a), a) for a in args)
    try:
        hash(constants)
    except TypeError:
        return None
    return fn, constants, tuple(metas)


def _propagate_values(copies: dict[fx.Node, fx.Node], fake_mode: Any) -> None:
    """Computes "val" for the copied nodes (in graph order) from their inputs' values."""
    with fake_mode:
        for original, node in copies.items():
            if original.op == "call_function":
                args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
                node.meta["val"] = node.target(*args, **kwargs)


def replace_with_traced(graph: fx.Graph, node: fx.Node, fn: Callable[..., torch.Tensor], *args: Any,
                        meta: dict[str, Any] | None = None) -> fx.Node:
    """Replaces `node` by the aten ops of `fn(*args)` (see `insert_traced`)."""
    result = insert_traced(graph, node, fn, *args, meta=meta)
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
    shard, *rest = gather_param_args(gather)
    return (graph_input(shard), *rest)


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


def layer_of(node: fx.Node, layers: tuple[str, ...]) -> str | None:
    """The layer whose forward `node` belongs to (for a gradient reduction: whose forward it
    differentiates), from the module stack Dynamo records; None outside every layer."""
    stack = node_module_stack(node)
    if not layers or not stack:  # no layers to keep to (bucket_size in bytes): skip the parsing
        return None
    source = list(stack.values())[-1][0]  # e.g. "L['self'].blocks.0.attn"
    path = "." + re.sub(r"\[['\"]?([^'\"\]]+)['\"]?\]", r".\1", _ROOT.sub("", source)).strip(".") + "."
    return next((layer for layer in layers if layer and f".{layer}." in path), None)


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
    side effects whose inputs can move (views of graph inputs, casts).

    Nodes compare by graph position, so the cost is that of the moved nodes, not of the graph."""

    def move(node: fx.Node) -> None:
        if node < anchor:
            return
        for arg in node.all_input_nodes:
            move(arg)
        anchor.prepend(node)

    for node in nodes:
        move(node)


def sink_users(nodes: list[fx.Node], anchor: fx.Node) -> None:
    """Moves every node that comes before `anchor` and is computed from one of `nodes` (directly
    or not) to just after it, keeping their order: the mirror of `hoist`. Users after `anchor`
    need no move, and neither do theirs, so only the moved nodes are visited."""
    moving: set[fx.Node] = set()
    todo = list(nodes)
    while todo:
        for user in todo.pop().users:
            if user < anchor and user not in moving:
                moving.add(user)
                todo.append(user)
    for node in sorted(moving, reverse=True):
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


def program_source(inputs: list[fx.Node], nodes: list[fx.Node], results: list[fx.Node]) -> str | None:
    """The source of an FX graph that computes `results` from `inputs` through `nodes` (in graph
    order), for a run-time op to run (`runtime.programs`); None where its code would need names
    that the op does not provide. A single result is returned as itself, several as a tuple."""
    program = fx.Graph()
    copies: dict[fx.Node, fx.Node] = {}
    for node in inputs:
        copies[node] = program.placeholder(node.name)
    for node in nodes:
        copies[node] = program.node_copy(node, copies.__getitem__)
    program.output(copies[results[0]] if len(results) == 1 else tuple(copies[r] for r in results))
    code = program.python_code(root_module="self")
    used = {name for name in code.globals if re.search(rf"\b{re.escape(name)}\b", code.src)}
    return code.src if used <= PROGRAM_NAMES.keys() else None

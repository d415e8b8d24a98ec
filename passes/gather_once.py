"""Gather once: a parameter read several times per step is gathered once and reduced once."""

from __future__ import annotations

import torch
import torch.fx as fx

from ..runtime.ops import reduce_grad_args
from ..torch_compat import FWD_NN_MODULE_STACK, NN_MODULE_STACK
from .base import READ_REPEATEDLY, PassContext
from .fx_util import descendants, gathered_param, insert_traced, nodes_calling, replace_with_traced


def gather_once(graph: fx.Graph, ctx: PassContext) -> None:
    """Merges the gathers of one parameter into one, and the reductions of its gradient into one.

    Every read of a sharded parameter is a `zpp.all_gather_param`, and autograd gives each one a
    `zpp.reduce_grad` in backward, so a weight read in several places (an embedding tied to the
    output head, a module applied twice, one layer shared by several blocks) is gathered and
    reduced once per read. This rewrites the later gathers of a shard into the first: every read
    uses its weight, which is held from the first read to the last (bucketing keeps such weights
    apart from those read once, which are not held with them). It rewrites the reductions whose
    results sum into one parameter's gradient into one reduction of the summed gradients (summed
    in the reduction's dtype) at the last of them, and the others into zeros. Reductions are
    linear, so the gradient is that of the separate reductions, for the bytes of one gather and
    one reduction. Reshard after forward then re-gathers the weight once for backward.

    A weight the graph returns is held for a later graph (`layer_graphs.tie_across_graphs`: an
    embedding tied to the head, with Config.compile_layers_once): autograd adds the gradient that
    graph sends back to the gradient of the uses here. Autograd sums a weight's uses in the
    weight's dtype; this sums them in the reduction's, as merged reductions are.
    """
    _merge_gathers(graph)
    _merge_reductions(graph)
    _sum_uses_in_reduce_dtype(graph)


def _merge_gathers(graph: fx.Graph) -> None:
    first_of: dict[tuple, fx.Node] = {}
    for gather in nodes_calling(graph, torch.ops.zpp.all_gather_param.default):
        first = first_of.setdefault(gathered_param(gather), gather)
        if first is not gather:
            gather.replace_all_uses_with(first)
            _erase_with_unused_inputs(graph, gather)
            first.meta[READ_REPEATEDLY] = True
        elif any(user.op == "output" for user in gather.users):  # held for a later graph
            gather.meta[READ_REPEATEDLY] = True


def _merge_reductions(graph: fx.Graph) -> None:
    results = next(n for n in reversed(graph.nodes) if n.op == "output").all_input_nodes
    by_gradient: dict[tuple, list[fx.Node]] = {}
    for reduction in nodes_calling(graph, torch.ops.zpp.reduce_grad.default):
        reached = descendants(reduction)
        gradients = [result for result in results if result in reached]
        if len(gradients) == 1:  # what the graph returns as one parameter's gradient
            _, *settings = reduce_grad_args(reduction)
            by_gradient.setdefault((gradients[0], *settings), []).append(reduction)
    for reductions in by_gradient.values():
        if len(reductions) > 1:
            _reduce_sum_once(graph, reductions)


def _sum_uses_in_reduce_dtype(graph: fx.Graph) -> None:
    """Each reduction of a sum autograd formed (a weight's uses) sums in the reduction's dtype."""
    for reduction in nodes_calling(graph, torch.ops.zpp.reduce_grad.default):
        args = reduce_grad_args(reduction)
        terms = _summed_terms(args.grad)
        if len(terms) > 1 and any(term.meta["val"].dtype != args.dtype for term in terms):
            total = insert_traced(graph, reduction, _sum_in, args.dtype, *terms)
            reduction.replace_input_with(args.grad, total)
            _erase_with_unused_inputs(graph, args.grad)


def _summed_terms(node: fx.Node) -> list[fx.Node]:
    """The terms of `node` if it is a sum of `aten.add`s used only by that sum, else [node]."""
    if (node.target is not torch.ops.aten.add.Tensor or node.kwargs or len(node.users) > 1
            or not all(isinstance(operand, fx.Node) for operand in node.args)):
        return [node]
    return [term for operand in node.args for term in _summed_terms(operand)]


def _sum_in(dtype: torch.dtype, *terms: torch.Tensor) -> torch.Tensor:
    """The sum of `terms`, each cast to `dtype` first."""
    total = terms[0].to(dtype)
    for term in terms[1:]:
        total = total + term.to(dtype)
    return total


def _reduce_sum_once(graph: fx.Graph, reductions: list[fx.Node]) -> None:
    """One reduction of the sum of `reductions`' gradients, at the last of them (where every
    gradient exists); the others' results become zeros."""
    *earlier, last = reductions
    final = reduce_grad_args(last)
    shard_numel, dtype = final.shard_numel, final.dtype
    module_stack = {k: last.meta[k] for k in (NN_MODULE_STACK, FWD_NN_MODULE_STACK) if k in last.meta}
    merged = replace_with_traced(graph, last, _reduce_sum, shard_numel, final.group_size, final.group_name, dtype,
                                 *(reduce_grad_args(r).grad for r in reductions))
    merged.meta.update(module_stack)  # bucketing keeps reductions to the layer they differentiate
    for reduction in earlier:
        replace_with_traced(graph, reduction, _zeros, shard_numel, dtype, reduce_grad_args(reduction).grad)


def _reduce_sum(shard_numel: int, group_size: int, group_name: str, dtype: torch.dtype,
                *grads: torch.Tensor) -> torch.Tensor:
    return torch.ops.zpp.reduce_grad(_sum_in(dtype, *grads), shard_numel, group_size, group_name, dtype)


def _zeros(shard_numel: int, dtype: torch.dtype, grad: torch.Tensor) -> torch.Tensor:
    """What a reduction's result becomes once another reduces its gradient: nothing to add."""
    return grad.new_zeros(shard_numel, dtype=dtype)


def _erase_with_unused_inputs(graph: fx.Graph, node: fx.Node) -> None:
    """Erases `node`, then whatever computed its inputs and is left without a use (the flat
    view of the shard it read), back to the graph inputs."""
    todo = [node]
    while todo:
        current = todo.pop()
        inputs = current.all_input_nodes
        graph.erase_node(current)
        todo.extend(n for n in inputs if n.op == "call_function" and not n.users and n not in todo)

"""Values that many kernels read and that are costly to compute are computed once."""

from __future__ import annotations

import torch
import torch.fx as fx

from ..torch_compat import REALIZE_TO_STRIDES
from .base import PassContext

_aten = torch.ops.aten
# Pointwise ops that take many instructions per element (library calls on the GPU).
_COSTLY = {_aten.sin.default, _aten.cos.default, _aten.tan.default, _aten.exp.default, _aten.exp2.default,
           _aten.expm1.default, _aten.log.default, _aten.log1p.default, _aten.log2.default, _aten.tanh.default,
           _aten.sigmoid.default, _aten.erf.default, _aten.atan.default}
# More readers than this and a costly value is stored: an activation has a few readers (its
# consumer, backward's); a value shared by every layer (RoPE's cos and sin) has one or two per layer.
MAX_INLINED_READERS = 4


def realize_shared_values(graph: fx.Graph, ctx: PassContext) -> None:
    """Marks for Inductor to store each pointwise value that costly ops compute and more than
    `MAX_INLINED_READERS` nodes read (through views).

    Inductor inlines a pointwise computation into every kernel that reads it unless it reads many
    buffers or has many ops; transcendental ops count as one op each. In a whole-step graph,
    RoPE's cos and sin (computed once by the model, read by every layer's attention in forward
    and backward) are then recomputed, per element of q and k, in every layer's kernels; in a
    per-layer graph they are inputs. The mark (`inductor_realize_to_strides`, Inductor's own node
    hint) makes Inductor write the value once, and its readers load it.
    """
    for node in graph.nodes:
        if _pointwise(node) and _reader_count(node) > MAX_INLINED_READERS and _computed_costly(node):
            node.meta[REALIZE_TO_STRIDES] = True


def _pointwise(node: fx.Node) -> bool:
    return node.op == "call_function" and torch.Tag.pointwise in getattr(node.target, "tags", ())


def _is_view(node: fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "is_view", False)


def _reader_count(node: fx.Node) -> int:
    """The nodes that read `node`'s value, views of it counted by their own readers."""
    return sum(_reader_count(user) if _is_view(user) else 1 for user in node.users)


def _computed_costly(node: fx.Node) -> bool:
    """Whether a costly op is among the pointwise ops and views that `node` is inlined from."""
    todo, seen = [node], set()
    while todo:
        current = todo.pop()
        if current.target in _COSTLY:
            return True
        seen.add(current)
        todo.extend(n for n in current.all_input_nodes if n not in seen and (_pointwise(n) or _is_view(n)))
    return False

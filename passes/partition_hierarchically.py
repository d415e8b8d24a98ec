"""hpZ: backward gathers weights from a secondary copy inside the node, never across nodes."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from ..runtime.ops import gather_secondary, secondary_slice
from ..torch_compat import RECOMPUTE
from .base import RECOMPUTED, SECONDARY_COPY, PassContext, weight_gathers
from .fx_util import backward_nodes, insert_traced, weight_chain


def partition_hierarchically(graph: fx.Graph, ctx: PassContext) -> None:
    """Backward re-gathers each weight from a secondary copy sharded over `hpz_partition_size` ranks.

    For every parameter gather whose weight backward uses: forward keeps this rank's slice of
    the gathered weight as the secondary copy (tagged MUST_SAVE); backward gathers the copies of
    its secondary group (consecutive ranks, normally one node) and rebuilds the weight; the casts
    and views that backward applied to the weight are repeated on the rebuilt one. After qwZ
    (`quantize_weights`) the copy is cut from the received INT8 blocks and scales (half the memory
    and intra-node traffic), or with `hpz_quantized_copy=False` from the dequantized weight (no
    dequantizing in backward); either way backward sees exactly the weights forward used. With a
    group of one rank the copy is the whole buffer itself, kept rather than copied, and backward
    gathers nothing.
    """
    config, topology = ctx.config, ctx.topology
    members = config.hpz_partition_size
    member = topology.secondary_member
    secondary = topology.secondary.name
    # Backward's uses of a weight: those of the gradient, and those of forward nodes that
    # activation checkpointing recomputes in backward. Not the output, which returns forward's
    # results too: a weight returned there is held for a later graph, which keeps it for backward.
    needs_grad = backward_nodes(graph) | {n for n in graph.nodes if n.meta.get(RECOMPUTED)}
    needs_grad -= set(graph.find_nodes(op="output"))
    order = {node: index for index, node in enumerate(graph.nodes)}
    for gather in weight_gathers(graph):
        chain = weight_chain(gather.weight)
        backward_users = [u for n in chain for u in n.users if u in needs_grad and u not in chain]
        if not backward_users:
            continue
        first_backward_use = min(backward_users, key=order.__getitem__)

        # Forward: the copy is cut from the gathered buffer (packed bytes with qwZ, unless the
        # copy holds the dequantized weight).
        weight = gather.weight
        block_size = gather.block_size if config.hpz_quantized_copy else 0
        source = gather.gathered if block_size else weight
        users = set(weight.users)  # before the copy's own nodes start reading the weight
        sliced = members > 1
        copy = insert_traced(graph, weight.next, secondary_slice, source, member, members) if sliced else source
        copy.meta[RECOMPUTE] = CheckpointPolicy.MUST_SAVE
        copy.meta[SECONDARY_COPY] = True
        with graph.inserting_after(copy if sliced else weight):
            kept = graph.call_function(torch.ops.zpp.with_secondary_copy.default, (weight, copy))
        kept.meta.update({"val": weight.meta["val"], RECOMPUTE: CheckpointPolicy.MUST_RECOMPUTE})
        weight.replace_all_uses_with(kept, delete_user_cb=users.__contains__)

        # Backward: the weight rebuilt from the secondary group, and the chain repeated on it.
        chain = [kept, *chain[1:]]
        rebuilt = {kept: insert_traced(
            graph, first_backward_use, gather_secondary, copy, members, secondary, gather.shard_size, block_size,
            gather.dtype)}
        with graph.inserting_before(first_backward_use):
            for node in chain[1:]:
                rebuilt[node] = graph.node_copy(node, lambda arg, rebuilt=rebuilt: rebuilt.get(arg, arg))
                rebuilt[node].meta.pop(RECOMPUTE, None)
        for node in chain:
            for user in list(node.users):
                if user in needs_grad:
                    user.replace_input_with(node, rebuilt[node])
        for node in reversed(list(rebuilt.values())):
            if not node.users:
                graph.erase_node(node)

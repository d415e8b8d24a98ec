"""What every pass is: a named function over an FX graph, run at one stage of compilation.

Stages, in order:
- "joint": the AOTAutograd joint graph (forward + backward), before partitioning; passes here
  decide what forward saves for backward.
- "lowering": each partitioned graph (forward, backward, or inference); passes here replace the
  zpp IR ops by quantized, hierarchical or plain functional collectives.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, NamedTuple

import torch
import torch.fx as fx

from ..runtime.ops import dequantize_weight_args, gather_param_args, reduce_grad_args
from ..runtime.topology import Topology
from .fx_util import layer_of

if TYPE_CHECKING:  # the passes see the compiler's Config, never import it
    from ..config import Config

# Node metadata set on the gather of a parameter read in several places (gather_once): its weight
# is held from the first read to the last, so bucketing keeps it apart from weights read once.
READ_REPEATEDLY = "zpp_read_repeatedly"
# Node metadata set on a bucket of parameters smaller than one quantization block: the quantizing
# passes leave it in full precision, as they leave each such parameter on its own.
FULL_PRECISION = "zpp_full_precision"
# Node metadata set on the copies of forward nodes that activation checkpointing makes for
# backward: passes that treat backward's uses of a weight apart (hpZ) treat these uses alike.
RECOMPUTED = "zpp_recomputed"
# Node metadata set on hpZ's secondary copies (kept from forward to backward): the pass manager
# reports their bytes with the forward graph.
SECONDARY_COPY = "zpp_secondary_copy"


def weight_block_size(config: Config, gather: fx.Node) -> int:
    """The qwZ block size for a parameter gather (a rule the quantizing passes and bucketing
    share); 0 means gather it unquantized (qwZ off, a shard smaller than one block, which
    quantizing would not make smaller, or a bucket of such shards)."""
    block, shard_size = config.weight_block_size, gather_param_args(gather).shard_size
    wanted = config.quantized_weights and shard_size >= block and not gather.meta.get(FULL_PRECISION)
    return block if wanted else 0


def gradient_block_size(config: Config, reduction: fx.Node) -> int:
    """The qgZ block size for a gradient reduction; 0 means reduce it in full precision (qgZ off,
    a shard smaller than one block, whose scales would outweigh the saving, or a bucket of such)."""
    args = reduce_grad_args(reduction)
    block = config.gradient_block_size
    shard_numel = args.grad.meta["val"].numel() // args.group_size
    wanted = config.quantized_gradients and shard_numel >= block and not reduction.meta.get(FULL_PRECISION)
    return block if wanted else 0


class WeightGather(NamedTuple):
    """A gathered parameter (or bucket) in the joint graph, as the joint passes left it."""

    weight: fx.Node  # the gathered weight, flat: the gather itself, or qwZ's dequantization
    gathered: fx.Node  # what the ranks exchanged: the weight, or qwZ's packed INT8 blocks and scales
    shard_size: int  # elements per rank
    block_size: int  # qwZ's block size; 0: gathered in full precision
    dtype: torch.dtype  # of the weight


def weight_gathers(graph: fx.Graph) -> list[WeightGather]:
    """The graph's parameter gathers, in graph order: `zpp.all_gather_param` nodes, and the
    quantized gathers `quantize_weights` made of them (a `zpp.dequantize_weight` of a
    `zpp.all_gather_flat`)."""
    found = []
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is torch.ops.zpp.all_gather_param.default:
            args = gather_param_args(node)
            found.append(WeightGather(node, node, args.shard_size, 0, args.dtype))
        elif node.target is torch.ops.zpp.dequantize_weight.default:
            args = dequantize_weight_args(node)
            if args.packed.target is torch.ops.zpp.all_gather_flat.default:
                found.append(WeightGather(node, args.packed, args.n, args.block_size, args.dtype))
    return found


@dataclass(frozen=True)
class PassContext:
    config: Config  # this compilation's, with bucket_size="layer" replaced by the largest layer's bytes
    topology: Topology
    graph_name: str  # e.g. "g0.backward"
    kind: str  # "joint", "forward", "backward" or "inference"
    layers: tuple[str, ...] = ()  # qualified names of the model's layers (ShardingState.layers)
    # Whether a bucket must keep within one layer: Config.bucket_size="layer", which the backend
    # has replaced by the largest layer's bytes in `config`; a size given in bytes may span layers.
    buckets_within_layers: bool = True
    # The graph is one layer's own (Config.compile_layers_once): every node belongs to that layer.
    one_layer: bool = False
    # The graph's local-shard inputs (`local_shards`), which `LocalShards` hands the gradients of to
    # their parameters: (the graph's number of inputs, their positions), where every input is a
    # plain tensor, so that a backward graph's outputs are the inputs' gradients in their order.
    shard_inputs: tuple[int, tuple[int, ...]] | None = None

    def layer_of(self, node: fx.Node) -> str | None:
        """The layer whose forward `node` belongs to (`fx_util.layer_of`); in one layer's own
        graph, that layer, named "" (the graph serves every identical layer)."""
        return "" if self.one_layer else layer_of(node, self.layers)


@dataclass(frozen=True)
class GraphPass:
    name: str
    stage: str
    run: Callable[[fx.Graph, PassContext], None]
    # Whether the configuration asks for this pass at all (switching off by name is separate).
    wanted: Callable[[Config], bool] = lambda config: True

    @property
    def summary(self) -> str:
        """The first sentence of the pass function's docstring, on one line."""
        paragraph = " ".join((self.run.__doc__ or "").strip().split("\n\n")[0].split())
        return re.split(r"(?<=[.;:])\s", paragraph, maxsplit=1)[0]

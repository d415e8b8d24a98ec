"""Small graphs for running one compiler pass of `zpp_compile.passes.PASSES` on its own, in this
process, in seconds: tiny sharded models, their joint graphs, hand-made topologies and contexts,
and what the tests read back (calls, collectives).

Graphs are built two ways. Joint graphs are traced from tiny models whose modules call the zpp IR
op `zpp.all_gather_param` on a shard of their own, as sharding's do (4 ranks, world group "0"):
torch.compile hands the step to AOTAutograd, whose partition function receives the joint graph
(with Dynamo's module stacks), keeps it and stops the compilation, so nothing runs and no process
group is needed. The lowering passes get the forward and backward graphs the min-cut partitioner
makes of such a joint graph, or a graph written by hand with fake values. Topologies are made by
hand (world 4, 2 ranks per node). Graphs holding collectives are never run; the tests check their
structure: which ops, over which groups, with which sizes and dtypes, and the recompute tags the
partitioner obeys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from functorch.compile import min_cut_rematerialization_partition
from torch._dynamo.backends.common import aot_autograd
from torch.utils.checkpoint import CheckpointPolicy

import zpp_compile as zpp
from zpp_compile.passes import PASSES, PassContext
from zpp_compile.runtime.topology import Group, Topology
from zpp_compile.torch_compat import C10D_FUNCTIONAL

aten, zpp_ops, c10d = torch.ops.aten, torch.ops.zpp, C10D_FUNCTIONAL
GATHER, REDUCE = zpp_ops.all_gather_param.default, zpp_ops.reduce_grad.default
WORLD_SIZE, WORLD = 4, "0"  # the group every model below gathers over
LAYERS = ("blocks.0", "blocks.1")
MUST_RECOMPUTE, MUST_SAVE = CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.MUST_SAVE


# ------------------------------------------------------------------------------ tiny sharded models


def gathered(shard: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The flat weight of a shard, as a sharded module reads it."""
    return torch.ops.zpp.all_gather_param(shard, shard.numel(), WORLD_SIZE, WORLD, dtype, torch.float32, 0)


class Linear(nn.Module):
    def __init__(self, out_features: int, in_features: int) -> None:
        super().__init__()
        self.shape = (out_features, in_features)
        self.shard = nn.Parameter(torch.randn(out_features * in_features // WORLD_SIZE))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ gathered(self.shard).view(self.shape).t()


class Scale(nn.Module):
    """A norm's weight: smaller per rank than one quantization block."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.shard = nn.Parameter(torch.randn(features // WORLD_SIZE))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * gathered(self.shard)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2 = Scale(8), Linear(16, 8), Linear(8, 16)  # 32 elements per rank each

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class TwoBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.sum()


class ReadTwice(nn.Module):
    """One weight applied twice (as a tied embedding and head, or a layer shared by two blocks)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.fc(x))).sum()


class HeldForLaterGraph(nn.Module):
    """An embedding tied to a head in a later graph (Config.compile_layers_once): the graph reads
    the weight, gathered in bf16, and returns it for the head."""

    def __init__(self) -> None:
        super().__init__()
        self.shard = nn.Parameter(torch.randn(16))

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weight = gathered(self.shard, torch.bfloat16)
        return nn.functional.embedding(tokens, weight.view(8, 8)).float().sum(), weight


# ------------------------------------------------------------------------------ graphs and contexts


@dataclass
class Joint:
    """A joint graph as AOTAutograd hands it to the partitioner, with what the partitioner takes."""

    module: fx.GraphModule
    inputs: Any
    kwargs: dict

    @property
    def graph(self) -> fx.Graph:
        return self.module.graph

    def partition(self) -> tuple[fx.Graph, fx.Graph]:
        """(forward, backward) as the min-cut partitioner splits the joint graph, honouring its tags."""
        self.module.recompile()
        forward, backward = min_cut_rematerialization_partition(self.module, self.inputs, **self.kwargs)
        return forward.graph, backward.graph


class _Captured(Exception):
    pass


def capture_joint(model: nn.Module, *inputs: torch.Tensor) -> Joint:
    """The joint graph of `model(*inputs)`, without compiling or running anything."""
    captured = []

    def partition(joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any):
        captured.append(Joint(joint, joint_inputs, kwargs))
        raise _Captured

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=lambda gm, _: gm, partition_fn=partition)
    try:
        torch.compile(model, backend=backend, fullgraph=True)(*inputs)
    except Exception:
        if not captured:
            raise
    return captured[0]


def two_blocks_joint() -> Joint:
    torch.manual_seed(0)
    return capture_joint(TwoBlocks(), torch.randn(3, 8))


def topology(rank: int = 0, secondary: tuple[int, ...] | None = None) -> Topology:
    """Rank `rank` of 4 ranks on 2 nodes: groups "0" world, "1" its node, "2" its peers on the other
    node, "3" hpZ's secondary group (`secondary`)."""
    node, local = divmod(rank, 2)
    return Topology(rank, 4, 2, torch.device("cpu"), Group(WORLD, (0, 1, 2, 3)), Group("1", (2 * node, 2 * node + 1)),
                    Group("2", (local, local + 2)), Group("3", secondary) if secondary else None, None)


def context(kind: str = "joint", topology: Topology | None = None, layers: tuple[str, ...] = LAYERS,
            **config: Any) -> PassContext:
    return PassContext(zpp.Config(**config), topology, f"g0.{kind}", kind, layers)


def calls(graph: fx.Graph, op: Any) -> list[fx.Node]:
    return list(graph.find_nodes(op="call_function", target=op))


def collectives(graph: fx.Graph) -> list[tuple[str, str, int, torch.dtype, int]]:
    """(collective, group name, group size, input dtype, input elements) of each functional
    collective in `graph`, in graph order."""
    found = []
    for node in graph.nodes:
        if node.op != "call_function" or getattr(node.target, "namespace", None) != "_c10d_functional":
            continue
        name, x = node.target.overloadpacket.__name__, node.args[0].meta["val"]
        if name.startswith("all_gather_into_tensor"):
            group_size, group = node.args[1:3]
        elif name == "reduce_scatter_tensor":
            group_size, group = node.args[2:4]
        elif name == "all_to_all_single":
            group_size, group = len(node.args[1]), node.args[3]
        else:
            continue  # wait_tensor
        found.append((name.removesuffix("_out"), group, group_size, x.dtype, x.numel()))
    return found




def run_pass(name: str, graph: fx.Graph, kind: str = "forward") -> None:
    """Runs one of PASSES, by name, on a small graph."""
    next(p for p in PASSES if p.name == name).run(graph, PassContext(zpp.Config(), None, f"g0.{kind}", kind))

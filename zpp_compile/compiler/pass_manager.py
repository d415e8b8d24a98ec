"""Runs the passes of one stage over a graph: in order, each switchable, each watched by the observers
(`pass_observers`: the trace, a dump)."""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch
import torch.fx as fx

from ..config import Config
from ..passes import PASSES, GraphPass, PassContext
from ..passes.base import SECONDARY_COPY
from ..passes.fx_util import is_backward, nodes_calling
from ..reports.dump import GraphDump
from ..reports.ledger import LEDGER, GraphComm, ShardedModel, collectives_in_graph, enter_graph
from ..runtime.ops import gather_param_args
from ..runtime.registry import REGISTRY
from ..runtime.topology import Topology
from ..torch_compat import OpOverload, dynamo_timed
from .pass_observers import PassObserver, PassRun, PassTrace


def enabled_passes(config: Config, passes: Sequence[GraphPass] = PASSES) -> list[GraphPass]:
    """The `passes` `config` asks for, minus those switched off by name (Config checked the names)."""
    return [p for p in passes if p.wanted(config) and p.name not in config.disable_passes]


@contextlib.contextmanager
def _naming_pass_on_oom(pass_name: str, graph_name: str) -> Iterator[None]:
    """An out-of-memory while compiling says where it happened and what to try."""
    try:
        yield
    except torch.OutOfMemoryError as error:
        raise torch.OutOfMemoryError(
            f"zeropp ran out of memory compiling graph {graph_name} in pass {pass_name!r}: {error}. "
            "Compilation runs in the first step: free memory held before it, use a smaller batch or "
            "sequence length for that step, or compile without Inductor (options={'inductor': False})"
        ) from error


def _is_zeropp_op(target: object) -> bool:
    return isinstance(target, OpOverload) and target.namespace == "zpp"


class PassManager:
    """The passes for one Dynamo graph (named `graph_id`), applied stage by stage: zeropp's own
    (`PASSES`) unless the backend was given others."""

    def __init__(self, config: Config, topology: Topology, graph_id: str, layers: tuple[str, ...] = (),
                 frame: int | None = None, passes: Sequence[GraphPass] = PASSES,
                 buckets_within_layers: bool = True, one_layer: bool = False) -> None:
        config = config.with_environment()  # ZEROPP_DUMP_DIR, ZEROPP_DISABLE_PASSES
        self.config, self.topology, self.graph_id, self.layers = config, topology, graph_id, layers
        self.buckets_within_layers = buckets_within_layers
        self.one_layer = one_layer  # one layer's own graph (PassContext.one_layer)
        self.shard_inputs: tuple[int, tuple[int, ...]] | None = None  # set by the backend (PassContext.shard_inputs)
        self.frame = frame  # the Python frame Dynamo compiles (GraphComm.frame)
        self.passes = enabled_passes(config, passes)
        self.secondary_bytes = 0  # set by the joint stage, reported with the forward graph
        self.joint_done = False
        self.model: ShardedModel | None = None  # found in the first graph that gathers parameters
        self.graphs: list[GraphComm] = []  # this Dynamo graph's entries of the ledger
        self.restored: dict[str, GraphComm] = {}  # those read from the compile cache, by graph name
        self.dump = GraphDump(config.dump_dir, topology) if config.dump_dir is not None else None
        self.observers: list[PassObserver] = [PassTrace(), *([self.dump] if self.dump else [])]

    def run(self, stage: str, graph: fx.Graph) -> None:
        """Runs every enabled pass of `stage`; after lowering, records the graph's collectives.

        A graph compiled without a joint stage (inference, under no_grad) gets the joint passes
        first, so bucketing and the other joint rewrites apply to it as well. A graph without
        zeropp's ops is left as it is.
        """
        if not any(node.op == "call_function" and _is_zeropp_op(node.target) for node in graph.nodes):
            return
        if stage == "lowering" and not self.joint_done:
            self.run("joint", graph)
        self.joint_done = self.joint_done or stage == "joint"
        kind = "joint" if stage == "joint" else ("backward" if is_backward(graph) else "forward")
        ctx = PassContext(self.config, self.topology, f"{self.graph_id}.{kind}", kind, self.layers,
                          self.buckets_within_layers, self.one_layer, self.shard_inputs)
        self.model = self.model or self._sharded_model(graph)
        for index, graph_pass in enumerate(p for p in self.passes if p.stage == stage):
            run = PassRun(ctx.graph_name, stage, index, graph_pass.name)
            with contextlib.ExitStack() as watched:
                for observer in self.observers:
                    watched.enter_context(observer.watching(run, graph))
                # Timed as torch.compile times its own phases: torch._dynamo.utils.compile_times() lists each pass.
                with _naming_pass_on_oom(graph_pass.name, ctx.graph_name), dynamo_timed(f"zeropp.{graph_pass.name}"):
                    graph_pass.run(graph, ctx)
                    graph.lint()
        if stage == "joint":
            self.secondary_bytes = sum(
                n.meta["val"].nbytes for n in graph.nodes if n.meta.get(SECONDARY_COPY)
            )
        else:
            graph.eliminate_dead_code()
            secondary = self.secondary_bytes if kind == "forward" else 0
            comm = GraphComm(ctx.graph_name, kind, collectives_in_graph(graph, self.topology), secondary, self.model,
                             self.frame, self.one_layer)
            self.record(comm)
            for observer in self.observers:
                observer.lowered(comm, graph)

    def record(self, comm: GraphComm, restored: bool = False) -> None:
        """Enters a compiled graph's collectives in the ledger. An entry `restored` from the compile
        cache is replaced if its graph is compiled after all (a backward compiled at its first use)."""
        replacing = self.restored.get(comm.graph_name)
        enter_graph(self.graphs, comm, replacing)
        LEDGER.enter(comm, replacing)
        if restored:
            self.restored[comm.graph_name] = comm
        else:
            self.restored.pop(comm.graph_name, None)

    def _sharded_model(self, graph: fx.Graph) -> ShardedModel | None:
        """The sharded model whose parameters `graph` gathers (the backend allows only one)."""
        for node in nodes_calling(graph, torch.ops.zpp.all_gather_param.default):
            sharding_id = gather_param_args(node).sharding_id
            state = REGISTRY.states[sharding_id]
            return ShardedModel(sharding_id, state.padded_numel, self.topology.world_size, self.topology.ranks_per_node)
        return None

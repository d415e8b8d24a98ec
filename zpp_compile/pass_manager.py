"""Runs the passes of one stage over a graph: in order, each switchable, each able to dump."""

from __future__ import annotations

from pathlib import Path

import torch.fx as fx

from .config import Config, ConfigError
from .passes import PASSES, GraphPass, PassContext
from .passes.fx_util import is_backward
from .runtime.ledger import GraphComm, collectives_in_graph
from .runtime.registry import REGISTRY
from .runtime.topology import Topology


def enabled_passes(config: Config) -> list[GraphPass]:
    """The passes `config` asks for, minus those switched off by name."""
    unknown = sorted(set(config.disable_passes) - {p.name for p in PASSES})
    if unknown:
        raise ConfigError(
            f"Config.disable_passes names unknown passes {unknown}; known: {[p.name for p in PASSES]}"
        )
    return [p for p in PASSES if p.wanted(config) and p.name not in config.disable_passes]


class PassManager:
    """The passes for one Dynamo graph (named `graph_id`), applied stage by stage."""

    def __init__(self, config: Config, topology: Topology, graph_id: str) -> None:
        self.config, self.topology, self.graph_id = config, topology, graph_id
        self.passes = enabled_passes(config)
        self.secondary_bytes = 0  # set by the joint stage, reported with the forward graph

    def run(self, stage: str, graph: fx.Graph) -> None:
        """Runs every enabled pass of `stage`; after lowering, records the graph's collectives."""
        kind = "joint" if stage == "joint" else ("backward" if is_backward(graph) else "forward")
        ctx = PassContext(self.config, self.topology, f"{self.graph_id}.{kind}", kind)
        for index, graph_pass in enumerate(p for p in self.passes if p.stage == stage):
            self._dump(graph, ctx, f"{stage}.{index:02d}.{graph_pass.name}.before")
            graph_pass.run(graph, ctx)
            graph.lint()
            self._dump(graph, ctx, f"{stage}.{index:02d}.{graph_pass.name}.after")
        if stage == "joint":
            self.secondary_bytes = sum(
                n.meta["val"].nbytes for n in graph.nodes if n.meta.get("zpp_secondary_copy")
            )
        else:
            graph.eliminate_dead_code()
            secondary = self.secondary_bytes if kind == "forward" else 0
            REGISTRY.ledger.append(
                GraphComm(ctx.graph_name, kind, collectives_in_graph(graph, self.topology), secondary)
            )

    def _dump(self, graph: fx.Graph, ctx: PassContext, label: str) -> None:
        if self.config.dump_dir is None:
            return
        folder = Path(self.config.dump_dir) / f"rank{self.topology.rank}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{ctx.graph_name}.{label}.py").write_text(graph.python_code("self").src)

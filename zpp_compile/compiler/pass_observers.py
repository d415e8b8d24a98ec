"""What watches the pass manager without changing a graph.

As torch's own passes leave dumps and tracing to an observer of the pass loop
(`torch.fx.passes.graph_transform_observer`), the pass manager only runs the passes and tells
its observers: `watching` wraps each pass's run on a graph, `lowered` follows a graph's last pass
with the collectives it issues. Observers here: the debug log and structured trace of every pass
(`PassTrace`), and a dump's files (`dump.GraphDump`).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

import torch.fx as fx

from ..torch_compat import trace_structured

if TYPE_CHECKING:
    from ..reports.ledger import GraphComm

log = logging.getLogger(__name__)  # TORCH_LOGS="+zpp_compile" shows it


@dataclass(frozen=True)
class PassRun:
    """One pass's run on one graph: "g0.backward", "lowering", its place in the stage, its name."""

    graph_name: str
    stage: str
    index: int
    pass_name: str

    def __str__(self) -> str:  # a dump's file names start with it
        return f"{self.graph_name}.{self.stage}.{self.index:02d}.{self.pass_name}"


class PassObserver:
    """Sees every pass run and every graph lowered; changes nothing. Each hook does nothing here."""

    @contextlib.contextmanager
    def watching(self, run: PassRun, graph: fx.Graph) -> Iterator[None]:
        """Around `run`'s pass on `graph`: before it, then (once it returned) after."""
        yield

    def lowered(self, comm: GraphComm, graph: fx.Graph) -> None:
        """`graph` after its last pass, issuing `comm`'s collectives."""


class PassTrace(PassObserver):
    """Each pass in the debug log (its node counts) and in torch's structured trace (the graph it
    left, beside Inductor's own in TORCH_TRACE / tlparse)."""

    @contextlib.contextmanager
    def watching(self, run: PassRun, graph: fx.Graph) -> Iterator[None]:
        nodes_before = len(graph.nodes)
        yield
        log.debug("%s: %s, %d -> %d nodes", run.graph_name, run.pass_name, nodes_before, len(graph.nodes))
        trace_structured(
            "artifact",
            metadata_fn=lambda: {"name": f"zeropp_{run.graph_name}_{run.pass_name}", "encoding": "string"},
            payload_fn=lambda: graph.python_code("self").src,
        )

"""What `Config.dump_dir` (or ZEROPP_DUMP_DIR, or `zeropp dump`) writes, in `{dump_dir}/rank{r}/`.

Per pass, for each graph it ran on (`{graph}.{stage}.{index}.{pass}.*`):
- `before.py`, `after.py`: the graph as readable FX code;
- `summary.json`: nodes added and removed by op, and the collectives before and after, grouped by
  op, ranks and dtype with their bytes.
Per compiled graph, after its last pass (`{graph}.*`):
- `lowered.py`: the graph that is compiled (or run, without Inductor);
- `comm.json`: its collectives with bytes per link class, the hpZ copy bytes, and the sharded
  model's size and topology, so that `zeropp report` can compute everything from files alone;
- `schedule.txt`: the order of compute and communication (Inductor may reorder it further), and
  `schedule.png` the same as a picture where matplotlib is installed (`schedule_image.py`).
With Config.compile_layers_once, `layer_runs.json` says how many layers ran each layer's own graph.
"""

from __future__ import annotations

import contextlib
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.fx as fx

from ..compiler.pass_observers import PassObserver, PassRun
from ..runtime.ops import gather_flat_args, gather_param_args, reduce_grad_args
from ..runtime.topology import Topology, bytes_per_peer
from ..torch_compat import C10D_FUNCTIONAL, OpOverload
from .ledger import CollectiveRecord, GraphComm, collectives_by_node, field_of, ranks_text, zeropp_groups
from .schedule_image import Span, can_draw, write_schedule_image

LAYER_RUNS = "layer_runs.json"


@dataclass(frozen=True)
class GraphSnapshot:
    """A graph as it was before a pass ran: its code, node counts by op, and collectives."""

    code: str
    ops: Counter
    collectives: list[dict[str, Any]]


def op_name(node: fx.Node) -> str:
    """'aten.mm.default', 'zpp.quantize_weight.default', ...; placeholders and outputs by kind."""
    if node.op != "call_function":
        return node.op
    if isinstance(node.target, OpOverload):
        return str(node.target)
    return getattr(node.target, "__name__", str(node.target))


class GraphDump(PassObserver):
    """Writes one rank's dump files, watching the pass manager."""

    def __init__(self, dump_dir: str, topology: Topology) -> None:
        self.folder = Path(dump_dir) / f"rank{topology.rank}"
        self.folder.mkdir(parents=True, exist_ok=True)
        self.topology = topology

    @contextlib.contextmanager
    def watching(self, run: PassRun, graph: fx.Graph) -> Iterator[None]:
        before = self.snapshot(graph)
        yield
        self.write_pass(str(run), before, graph)

    def lowered(self, comm: GraphComm, graph: fx.Graph) -> None:
        self.write_graph(comm, graph)

    def snapshot(self, graph: fx.Graph) -> GraphSnapshot:
        return GraphSnapshot(_code(graph), Counter(op_name(n) for n in graph.nodes), self._collectives(graph))

    def write_pass(self, label: str, before: GraphSnapshot, graph: fx.Graph) -> None:
        """The files of one pass on one graph; `label` is `{graph}.{stage}.{index}.{pass}`."""
        after = self.snapshot(graph)
        graph_name, kind, stage, index, name = label.split(".")
        summary = {
            "graph": f"{graph_name}.{kind}", "stage": stage, "index": int(index), "pass": name,
            "nodes_before": sum(before.ops.values()), "nodes_after": sum(after.ops.values()),
            "added": dict(sorted((after.ops - before.ops).items())),
            "removed": dict(sorted((before.ops - after.ops).items())),
            "collectives_before": before.collectives, "collectives_after": after.collectives,
        }
        (self.folder / f"{label}.before.py").write_text(before.code)
        (self.folder / f"{label}.after.py").write_text(after.code)
        (self.folder / f"{label}.summary.json").write_text(json.dumps(summary, indent=1))

    def write_graph(self, comm: GraphComm, graph: fx.Graph) -> None:
        """The files of one compiled graph, once every pass has run."""
        (self.folder / f"{comm.graph_name}.lowered.py").write_text(_code(graph))
        (self.folder / f"{comm.graph_name}.comm.json").write_text(json.dumps(comm.to_dict(), indent=1))
        (self.folder / f"{comm.graph_name}.schedule.txt").write_text(self._schedule(comm.graph_name, graph))
        if can_draw():
            spans, compute = self._spans(graph)
            write_schedule_image(self.folder / f"{comm.graph_name}.schedule.png",
                                 f"{comm.graph_name}: collectives from issue to wait, over the compute between them",
                                 spans, compute, len(graph.nodes))

    def write_layer_runs(self, runs: dict[str, int]) -> None:
        """How many layers ran each layer's own graph last (Config.compile_layers_once), by graph id."""
        (self.folder / LAYER_RUNS).write_text(json.dumps(runs, indent=1, sort_keys=True))

    def _collectives(self, graph: fx.Graph) -> list[dict[str, Any]]:
        """Collectives grouped by op, ranks and dtype: the functional collectives, and the zpp IR
        ops that stand for one before lowering (named `zpp.<op>`), counted the same way."""
        records = [*collectives_by_node(graph, self.topology).values(), *self._ir_collectives(graph)]
        groups: dict[tuple, dict[str, Any]] = {}
        for record in records:
            row = record.to_dict()
            key = (row["op"], tuple(row["ranks"]), row["dtype"])
            total = groups.setdefault(key, {**row, "count": 0, "intra_bytes": 0, "inter_bytes": 0})
            total["count"] += 1
            total["intra_bytes"] += row["intra_bytes"]
            total["inter_bytes"] += row["inter_bytes"]
        return list(groups.values())

    def _ir_collectives(self, graph: fx.Graph) -> list[CollectiveRecord]:
        topology = self.topology
        groups = zeropp_groups(topology)
        zpp = torch.ops.zpp
        records = []
        for node in graph.nodes:
            if node.target is zpp.all_gather_param.default:
                gather = gather_param_args(node)
                op, group_name, dtype = "zpp.all_gather_param", gather.group_name, gather.dtype
                input_bytes = gather.shard_size * dtype.itemsize
            elif node.target is zpp.all_gather_flat.default:
                flat = gather_flat_args(node)
                op, group_name, dtype = "zpp.all_gather_flat", flat.group_name, flat.x.meta["val"].dtype
                input_bytes = flat.x.meta["val"].nbytes
            elif node.target is zpp.reduce_grad.default:
                reduction = reduce_grad_args(node)
                op, group_name, dtype = "zpp.reduce_grad", reduction.group_name, reduction.dtype
                input_bytes = reduction.grad.meta["val"].numel() * dtype.itemsize
            else:
                continue
            group = groups.get(str(group_name))
            if group is None:
                continue
            of_gradient = node.target is zpp.reduce_grad.default
            intra, inter = topology.received_bytes(group, bytes_per_peer(not of_gradient, input_bytes, group.size))
            records.append(CollectiveRecord(op, group, dtype, intra, inter, of_gradient))
        return records

    def _spans(self, graph: fx.Graph) -> tuple[list[Span], list[int]]:
        """The graph's collectives from issue to wait (`schedule_image.Span`), and its compute nodes, by index."""
        records = collectives_by_node(graph, self.topology)
        wait = C10D_FUNCTIONAL.wait_tensor.default
        index = {node: i for i, node in enumerate(graph.nodes)}
        waited = {n.args[0]: index[n] for n in graph.nodes
                  if n.op == "call_function" and n.target is wait and n.args[0] in records}
        spans = [Span(index[node], waited.get(node), r.op, f"{ranks_text(r.group.ranks)} {_dtype_name(r.dtype)}")
                 for node, r in records.items()]
        compute = [index[n] for n in graph.nodes
                   if n.op == "call_function" and n not in records and n.target is not wait]
        return spans, compute

    def _schedule(self, graph_name: str, graph: fx.Graph) -> str:
        """One line per collective issued and waited on, one per run of compute between them."""
        records = collectives_by_node(graph, self.topology)
        wait = C10D_FUNCTIONAL.wait_tensor.default
        lines = [f"# {graph_name}: graph order of compute and communication (node index: event)"]
        index = {node: i for i, node in enumerate(graph.nodes)}
        run: list[int] = []

        def flush() -> None:
            if run:
                lines.append(f"{run[0]:>5}-{run[-1]:<5} compute   {len(run)} ops")
                run.clear()

        for node in graph.nodes:
            if node in records:
                flush()
                r = records[node]
                dtype = str(r.dtype).removeprefix("torch.")
                lines.append(f"{index[node]:>5}       issue     {r.op:<14} ranks {list(r.group.ranks)} {dtype} "
                             f"in {r.intra_bytes:,} B intra + {r.inter_bytes:,} B inter")
            elif node.op == "call_function" and node.target is wait and node.args[0] in records:
                flush()
                lines.append(f"{index[node]:>5}       wait      {records[node.args[0]].op:<14} "
                             f"issued at {index[node.args[0]]}")
            elif node.op == "call_function":
                run.append(index[node])
        flush()
        return "\n".join(lines) + "\n"


def read_pass_summary(values: Any) -> dict[str, Any]:
    """A pass's summary.json read back: checked to hold what `write_pass` writes and the report
    reads; a ValueError says what is missing or wrong."""
    for key in ("graph", "pass"):
        field_of(values, key, str)
    for key in ("nodes_before", "nodes_after"):
        field_of(values, key, int)
    for op, count in field_of(values, "added", dict).items():
        if not isinstance(count, int) or isinstance(count, bool):
            raise ValueError(f"'added' must map op names to counts, got {op!r}: {count!r}")
    for key in ("collectives_before", "collectives_after"):
        for index, row in enumerate(field_of(values, key, list)):
            try:
                for name, kind in (("count", int), ("op", str), ("dtype", str), ("intra_bytes", int),
                                   ("inter_bytes", int)):
                    field_of(row, name, kind)
            except ValueError as error:
                raise ValueError(f"{key}[{index}]: {error}") from None
    return values


def _code(graph: fx.Graph) -> str:
    return graph.python_code("self").src


def read_layer_runs(values: Any) -> dict[str, int]:
    """Reads back `layer_runs.json`; a ValueError says what is wrong."""
    if not isinstance(values, dict) or not all(
            isinstance(k, str) and type(v) is int and v >= 0 for k, v in values.items()):
        raise ValueError(f"expected graph ids with layer counts (non-negative integers), got {values!r}")
    return values



def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")

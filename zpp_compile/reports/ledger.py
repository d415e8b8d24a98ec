"""The communication ledger: every collective a compiled graph issues, with its bytes per link.

Bytes are counted per rank as what it receives from its peers (the volume the ZeRO++ paper
counts: a bf16 all-gather of M bytes moves M * (n-1)/n to each rank), split by whether the peer
is on this rank's node (intra-node) or not (inter-node). They are read from the lowered graph, so
the volume of a step is known without running it.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
import torch.fx as fx

from ..passes.fx_util import backward_nodes
from ..runtime.collectives import ALL_GATHERS
from ..runtime.ops import gather_prefetched_args
from ..runtime.prefetch import GATHER_PREFETCHED
from ..runtime.topology import Group, Topology, bytes_per_peer, world_received_bytes
from ..torch_compat import C10D_FUNCTIONAL
from . import text_table

_c10d = C10D_FUNCTIONAL
_OPS = {
    **{gather: "all_gather" for gather in ALL_GATHERS},
    _c10d.reduce_scatter_tensor.default: "reduce_scatter",
    _c10d.all_to_all_single.default: "all_to_all",
}


@dataclass(frozen=True)
class CollectiveRecord:
    op: str
    group: Group
    dtype: torch.dtype
    intra_bytes: int  # received from peers on this rank's node
    inter_bytes: int  # received from peers on other nodes
    of_gradient: bool  # it moves a gradient (else weights)

    def to_dict(self) -> dict[str, Any]:
        return {"op": self.op, "group": self.group.name, "ranks": list(self.group.ranks),
                "dtype": str(self.dtype).removeprefix("torch."), "intra_bytes": self.intra_bytes,
                "inter_bytes": self.inter_bytes, "of_gradient": self.of_gradient}

    @classmethod
    def from_dict(cls, values: Any) -> CollectiveRecord:
        """Reads back `to_dict`; a ValueError names what is missing or of the wrong type."""
        ranks = field_of(values, "ranks", list)
        if not all(isinstance(r, int) and not isinstance(r, bool) for r in ranks):
            raise ValueError(f"'ranks' must be a list of rank numbers, got {ranks!r}")
        dtype = getattr(torch, field_of(values, "dtype", str), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"'dtype' must name a torch dtype, got {values['dtype']!r}")
        group = Group(field_of(values, "group", str), tuple(ranks))
        return cls(field_of(values, "op", str), group, dtype, field_of(values, "intra_bytes", int),
                   field_of(values, "inter_bytes", int), field_of(values, "of_gradient", bool))


@dataclass(frozen=True)
class ShardedModel:
    """What the plain ZeRO-3 baseline needs to know of one sharded model: how many parameter
    elements it shards (padded to equal shards, tied parameters once) and over which topology."""

    sharding_id: int
    padded_numel: int
    world_size: int
    ranks_per_node: int

    def zero3_bytes(self) -> tuple[int, int]:
        """(intra, inter) bytes one rank receives per step under plain ZeRO-3 in bf16 (the
        paper's 3M): forward all-gather, backward all-gather and gradient reduce-scatter over all
        ranks, each peer sending this rank 2 x padded_numel / world bytes, counted as
        `collectives_in_graph` counts them."""
        per_peer = 2 * self.padded_numel // self.world_size
        return world_received_bytes(self.world_size, self.ranks_per_node, 3 * per_peer)


@dataclass(frozen=True)
class GraphComm:
    """The collectives of one compiled graph (one forward, backward or inference graph)."""

    graph_name: str
    kind: str
    collectives: tuple[CollectiveRecord, ...]
    secondary_bytes: int = 0  # hpZ copies this (forward) graph keeps for backward
    model: ShardedModel | None = None  # the sharded model whose parameters it gathers
    # The Python frame Dynamo compiled it for, with the parameters it reads (backend._frame): a
    # later compilation of the same frame (a recompile, for a new input shape or a changed flag)
    # replaces it in one step's report.
    frame: int | None = None
    # A layer's own graph (Config.compile_layers_once), run once per layer that calls it.
    one_layer: bool = False

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, for a dump; `from_dict` reads it back."""
        return {"graph": self.graph_name, "kind": self.kind, "secondary_bytes": self.secondary_bytes,
                "model": vars(self.model) if self.model else None, "frame": self.frame, "one_layer": self.one_layer,
                "collectives": [c.to_dict() for c in self.collectives]}

    @classmethod
    def from_dict(cls, values: Any) -> GraphComm:
        """Reads back `to_dict` (a dump's comm.json); a ValueError names what is missing or wrong."""
        model = field_of(values, "model", (dict, type(None)))
        if model is not None:
            model = _within("model", lambda: ShardedModel(
                field_of(model, "sharding_id", int), field_of(model, "padded_numel", int),
                field_of(model, "world_size", int, minimum=1), field_of(model, "ranks_per_node", int, minimum=1)))
        records = tuple(_within(f"collectives[{index}]", functools.partial(CollectiveRecord.from_dict, record))
                        for index, record in enumerate(field_of(values, "collectives", list)))
        frame = values.get("frame") if isinstance(values, dict) else None
        if frame is not None and (type(frame) is not int or frame < 0):
            raise ValueError(f"'frame' must be a non-negative integer or null, got {frame!r}")
        one_layer = values.get("one_layer", False) if isinstance(values, dict) else False
        if type(one_layer) is not bool:
            raise ValueError(f"'one_layer' must be true or false, got {one_layer!r}")
        return cls(field_of(values, "graph", str), field_of(values, "kind", str), records,
                   field_of(values, "secondary_bytes", int), model, frame, one_layer)


class Ledger:
    """Every graph compiled in this process that issues zeropp's collectives, in compile order:
    what `comm_report()` reads. The pass manager enters each lowered graph (`enter`); `shard`
    forgets a gone model's (`forget_model`); `reset_comm_report()` empties it."""

    def __init__(self) -> None:
        self._graphs: list[GraphComm] = []

    @property
    def graphs(self) -> tuple[GraphComm, ...]:
        return tuple(self._graphs)

    def enter(self, comm: GraphComm, replacing: GraphComm | None = None) -> None:
        """Adds `comm`, in the place of the entry `replacing` where the ledger holds it."""
        enter_graph(self._graphs, comm, replacing)

    def forget_model(self, sharding_id: int) -> None:
        """Takes a gone model's graphs out (a new model that takes its sharding id would otherwise
        count them twice in its report)."""
        self._graphs = [g for g in self._graphs if g.model is None or g.model.sharding_id != sharding_id]

    def clear(self) -> None:
        self._graphs.clear()


LEDGER = Ledger()  # the process's: written only through its methods


def enter_graph(graphs: list[GraphComm], comm: GraphComm, replacing: GraphComm | None) -> None:
    """`comm` into `graphs`: in the place of `replacing` where `graphs` holds it, else at the end."""
    same = [i for i, g in enumerate(graphs) if replacing is not None and g is replacing]
    if same:
        graphs[same[0]] = comm
    else:
        graphs.append(comm)


def field_of(values: Any, key: str, kind: type | tuple[type, ...], minimum: int = 0) -> Any:
    """`values[key]` of JSON read back, checked to be a `kind` (an int: at least `minimum`); else
    a ValueError that says what was expected."""
    if not isinstance(values, dict):
        raise ValueError(f"expected a JSON object, got {type(values).__name__}")
    if key not in values:
        raise ValueError(f"{key!r} is missing")
    value = values[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        names = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
        raise ValueError(f"{key!r} must be {names}, got {value!r}")
    if kinds == (int,) and isinstance(value, int) and value < minimum:
        raise ValueError(f"{key!r} must be at least {minimum}, got {value!r}")
    return value


def _within(where: str, read: Callable[[], Any]) -> Any:
    """`read()`, with `where` (the part of the JSON being read) put in front of its ValueError."""
    try:
        return read()
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None


def collectives_in_graph(graph: fx.Graph, topology: Topology) -> tuple[CollectiveRecord, ...]:
    return tuple(collectives_by_node(graph, topology).values())


def zeropp_groups(topology: Topology) -> dict[str, Group]:
    """The process groups zeropp communicates over, by name."""
    return {g.name: g for g in (topology.world, topology.intra_node, topology.inter_node, topology.secondary) if g}


def collectives_by_node(graph: fx.Graph, topology: Topology) -> dict[fx.Node, CollectiveRecord]:
    """The zeropp collectives of `graph` (those over its topology's groups), in graph order."""
    groups = zeropp_groups(topology)
    of_gradients = backward_nodes(graph)
    records = {}
    for node in graph.nodes:
        op: str | None
        if node.target is GATHER_PREFETCHED:  # an all-gather issued one call ahead
            prefetched = gather_prefetched_args(node)
            op, group = "all_gather", groups.get(prefetched.group_name)
            dtype = prefetched.dtype
            nbytes = prefetched.gathered_numel // prefetched.group_size * dtype.itemsize
        else:
            op = _OPS.get(node.target)
            group = groups.get(str(node.args[-1])) if op else None
            if group is not None:
                value = node.args[0].meta["val"]
                dtype, nbytes = value.dtype, value.numel() * value.element_size()
        if group is None or op is None:  # not a collective, or one of the user's own groups
            continue
        intra, inter = topology.received_bytes(group, bytes_per_peer(op == "all_gather", nbytes, group.size))
        records[node] = CollectiveRecord(op, group, dtype, intra, inter, node in of_gradients)
    return records


def training_graphs(graphs: list[GraphComm], layer_runs: Mapping[str, int] | None = None) -> list[GraphComm]:
    """What one training step runs, of `graphs` in compile order (as the ledger holds them and
    `zeropp report` reads a dump): the forward and backward graphs of every compiled graph that
    has a backward (not the inference-only graphs of, say, evaluation), and of a frame Dynamo
    compiled several times for one model (recompiled for a new input shape or a changed flag), the
    latest compilation only. Several frames (a step with graph breaks) all count. A layer's own
    graph counts while some layer ran it last (`layer_runs`, by graph id: `layer_graphs.layer_runs`)."""
    runs = layer_runs or {}
    trained = {_dynamo_graph(g) for g in graphs if g.kind == "backward"}
    latest: dict[tuple | str, str] = {}  # by (sharding id, frame), or by the graph's own id
    for g in graphs:
        if _dynamo_graph(g) in trained and not g.one_layer:
            frame = (g.model.sharding_id if g.model else None, g.frame) if g.frame is not None else _dynamo_graph(g)
            latest[frame] = _dynamo_graph(g)
    kept = set(latest.values()) | {_dynamo_graph(g) for g in graphs if g.one_layer and runs.get(_dynamo_graph(g))}
    return [g for g in graphs if _dynamo_graph(g) in kept and _dynamo_graph(g) in trained]


def _dynamo_graph(graph: GraphComm) -> str:
    return graph.graph_name.split(".")[0]  # "g3.forward" -> "g3"


# ------------------------------------------------------------------------------ the report

PHASES = ("forward weight gather", "backward weight gather", "gradient reduction")


def phase_of(kind: str, record: CollectiveRecord) -> str:
    """Which of plain ZeRO-3's three collectives a collective stands for (qwZ rewrites the first,
    hpZ the second, qgZ the third)."""
    if record.of_gradient:
        return PHASES[2]
    return PHASES[1] if kind == "backward" else PHASES[0]


@dataclass(frozen=True)
class CommRow:
    """One collective of a training step, as this rank sees it."""

    graph: str
    phase: str
    op: str
    ranks: tuple[int, ...]
    dtype: str
    intra_bytes: int
    inter_bytes: int

    @property
    def link(self) -> str:
        """The link class its bytes travel: "intra", "inter", "intra+inter", or "-" (none)."""
        return "+".join(name for name, n in (("intra", self.intra_bytes), ("inter", self.inter_bytes)) if n) or "-"


@dataclass(frozen=True)
class CommReport:
    """The communication of one training step on one rank, against plain ZeRO-3 in bf16.

    Bytes are what this rank receives per step (see the module docstring). The baseline moves
    3 x 2 bytes x the padded parameter count x (world-1)/world, split by link class the same way.
    """

    rows: tuple[CommRow, ...]
    secondary_bytes: int  # hpZ copies held from forward to backward
    baseline_intra_bytes: int
    baseline_inter_bytes: int
    sharded_numel: int  # padded parameter elements of the models in the report (M = 2 x this)

    @classmethod
    def from_graphs(cls, graphs: list[GraphComm], layer_runs: Mapping[str, int] | None = None) -> CommReport:
        """The report of the training graphs among `graphs` (the ledger, or a dump read back); a
        layer's own graph's collectives once for every layer that ran it (`training_graphs`)."""
        chosen = training_graphs(graphs, layer_runs)
        runs = lambda g: (layer_runs or {})[_dynamo_graph(g)] if g.one_layer else 1  # noqa: E731
        rows = tuple(
            CommRow(g.graph_name, phase_of(g.kind, c), c.op, c.group.ranks, str(c.dtype).removeprefix("torch."),
                    c.intra_bytes, c.inter_bytes)
            for g in chosen for _ in range(runs(g)) for c in g.collectives
        )
        models = {g.model.sharding_id: g.model for g in chosen if g.model}.values()
        baselines = [m.zero3_bytes() for m in models]
        return cls(rows, sum(g.secondary_bytes * runs(g) for g in chosen), sum(b[0] for b in baselines),
                   sum(b[1] for b in baselines), sum(m.padded_numel for m in models))

    @property
    def intra_bytes(self) -> int:
        return sum(r.intra_bytes for r in self.rows)

    @property
    def inter_bytes(self) -> int:
        return sum(r.inter_bytes for r in self.rows)

    @property
    def inter_ratio(self) -> float:
        """Inter-node bytes over plain ZeRO-3's (nan on one node, where the baseline has none)."""
        return _ratio(self.inter_bytes, self.baseline_inter_bytes)

    @property
    def total_ratio(self) -> float:
        return _ratio(self.intra_bytes + self.inter_bytes, self.baseline_intra_bytes + self.baseline_inter_bytes)

    def by_phase(self) -> dict[str, tuple[int, int]]:
        """(intra, inter) bytes per phase, each of plain ZeRO-3's three collectives included."""
        out = {phase: (0, 0) for phase in PHASES}
        for r in self.rows:
            intra, inter = out.get(r.phase, (0, 0))
            out[r.phase] = (intra + r.intra_bytes, inter + r.inter_bytes)
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (ratios are null where the baseline is zero)."""
        as_json = lambda x: None if math.isnan(x) else x  # noqa: E731
        third = (self.baseline_intra_bytes // 3, self.baseline_inter_bytes // 3)
        return {
            "intra_bytes": self.intra_bytes, "inter_bytes": self.inter_bytes,
            "baseline_intra_bytes": self.baseline_intra_bytes, "baseline_inter_bytes": self.baseline_inter_bytes,
            "inter_ratio": as_json(self.inter_ratio), "total_ratio": as_json(self.total_ratio),
            "secondary_bytes": self.secondary_bytes, "sharded_numel": self.sharded_numel,
            "phases": {phase: {"intra_bytes": intra, "inter_bytes": inter, "baseline_intra_bytes": third[0],
                               "baseline_inter_bytes": third[1]}
                       for phase, (intra, inter) in self.by_phase().items()},
            "collectives": [{**vars(r), "ranks": list(r.ranks), "link": r.link} for r in self.rows],
        }

    def table(self, collectives: bool = True, width: int | None = None) -> str:
        """The report as text: one line per collective (optional), then totals per phase; with
        `width`, its notes wrapped to keep within it."""
        lines = []
        if collectives:
            lines.append(text_table.render(
                ("graph", "phase", "op", "ranks", "dtype", "intra B", "inter B", "link"),
                [(r.graph, r.phase, r.op, ranks_text(r.ranks), r.dtype, f"{r.intra_bytes:,}", f"{r.inter_bytes:,}",
                  r.link) for r in self.rows], align="<<<<<>><"))
            lines.append("")
        third = (self.baseline_intra_bytes // 3, self.baseline_inter_bytes // 3)
        totals = [(phase, intra, inter, *third) for phase, (intra, inter) in self.by_phase().items()]
        totals.append(("total", self.intra_bytes, self.inter_bytes,
                       self.baseline_intra_bytes, self.baseline_inter_bytes))
        lines.append(text_table.render(
            ("per step, per rank", "intra B", "inter B", "ZeRO-3 intra", "ZeRO-3 inter", "inter x", "total x"),
            [(name, f"{intra:,}", f"{inter:,}", f"{base_intra:,}", f"{base_inter:,}",
              f"{_ratio(inter, base_inter):.3f}", f"{_ratio(intra + inter, base_intra + base_inter):.3f}")
             for name, intra, inter, base_intra, base_inter in totals], align="<>>>>>>"))
        lines.append(text_table.prose(
            f"hpZ secondary copies held: {self.secondary_bytes:,} B; M = 2 B x {self.sharded_numel:,} sharded "
            f"parameter elements = {2 * self.sharded_numel:,} B; ZeRO-3 = plain ZeRO-3 in bf16 (3M x (world-1)/world "
            "per rank)", width))
        return "\n".join(lines)


def _ratio(value: int, baseline: int) -> float:
    return value / baseline if baseline else math.nan


def ranks_text(ranks: tuple[int, ...]) -> str:
    """A group's ranks, short: "[0,1]", or "[0..15] (16)" past a few."""
    text = ",".join(map(str, ranks))
    return f"[{text}]" if len(text) <= 12 else f"[{ranks[0]}..{ranks[-1]}] ({len(ranks)})"

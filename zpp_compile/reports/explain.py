"""The communication of one training step, predicted from a Config and a model size alone.

Two accountings, side by side:
- the paper's (ZeRO++, section 3): each of ZeRO-3's three collectives moves the full model volume
  M (M = 2N bytes for N parameters in bf16), so plain ZeRO-3 moves 3M; counted is what crosses
  nodes, scaled by the bytes per element: qwZ's INT8 forward gather 0.5M, hpZ's node-local
  backward gather 0, qgZ's INT4 inter-node hop 0.25M, so 3M -> 0.75M;
- the ledger's: the bytes one rank receives from its peers, as `zpp_compile.reports.ledger` counts them in
  the compiled graphs, with the (n-1)/n factor of every collective, qwZ/qgZ scales and the
  padding to whole shards and blocks, split into intra- and inter-node. The model is taken as
  one flat parameter of N elements whose every weight backward re-gathers. A real model differs
  a little: small parameters are gathered unquantized, each parameter is padded on its own, and
  a weight backward does not use (the first layer's, when its input needs no gradient; an
  embedding's) is not re-gathered.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Sequence

import torch

from ..compiler.pass_manager import enabled_passes
from ..config import Config, ConfigError
from ..runtime.quantization.grad_format import piece_bytes
from ..runtime.quantization.weight_format import packed_weight_bytes
from ..runtime.topology import (
    local_index_groups,
    node_groups,
    peers_by_link,
    received_bytes,
    secondary_groups,
    world_received_bytes,
)
from ..sharding import padding
from . import text_table
from .ledger import PHASES


@dataclass(frozen=True)
class PhaseVolume:
    phase: str
    technique: str  # the technique acting on it under this config, or "-"
    paper_m: float  # cross-node volume in units of M, the paper's accounting
    intra_bytes: int  # per rank per step, as the ledger counts
    inter_bytes: int


@dataclass(frozen=True)
class Prediction:
    n_params: int
    world_size: int
    ranks_per_node: int
    phases: tuple[PhaseVolume, ...]
    baseline: tuple[PhaseVolume, ...]  # plain ZeRO-3 in bf16

    @property
    def m_bytes(self) -> int:
        return 2 * self.n_params

    def to_dict(self) -> dict[str, Any]:
        def total(volumes: tuple[PhaseVolume, ...]) -> dict[str, float]:
            return {key: sum(getattr(v, key) for v in volumes) for key in ("paper_m", "intra_bytes", "inter_bytes")}

        return {"n_params": self.n_params, "world_size": self.world_size, "ranks_per_node": self.ranks_per_node,
                "m_bytes": self.m_bytes, "phases": [asdict(v) for v in self.phases],
                "baseline": [asdict(v) for v in self.baseline],
                "total": total(self.phases), "baseline_total": total(self.baseline)}

    def table(self, width: int | None = None) -> str:
        """The prediction as text: per phase, the paper's cross-node volumes (in M), then the bytes
        each rank receives as the ledger counts them, for plain ZeRO-3 and for this config. With
        `width`, the ledger's bytes in one decimal unit and the notes wrapped, to keep within it;
        without, exact byte counts."""
        m = self.m_bytes
        base, mine = self.to_dict()["baseline_total"], self.to_dict()["total"]
        ledger_totals = (base["intra_bytes"], base["inter_bytes"], mine["intra_bytes"], mine["inter_bytes"])
        unit, scale = _unit(max(ledger_totals)) if width else ("B", 1)
        count = (lambda b: f"{b:,}") if scale == 1 else (lambda b: f"{b / scale:,.3f}")  # noqa: E731
        rows = []
        for base_phase, phase in zip(self.baseline, self.phases):
            label = f"{phase.paper_m:.2f}M" + (f" ({phase.technique})" if phase.technique != "-" else "")
            rows.append((base_phase.phase, f"{base_phase.paper_m:.2f}M", label, count(base_phase.intra_bytes),
                         count(base_phase.inter_bytes), count(phase.intra_bytes), count(phase.inter_bytes)))
        rows.append(("total", f"{base['paper_m']:.2f}M", f"{mine['paper_m']:.2f}M", *map(count, ledger_totals)))
        rows.append(("total in M", "", "", *(f"{b / m:.3f}M" for b in ledger_totals)))
        headers = ("phase", "paper: ZeRO-3", "this config", "ZeRO-3 intra", "ZeRO-3 inter", "intra", "inter")
        lines = [text_table.render(headers, rows, align="<>>>>>>")]
        if self.world_size == self.ranks_per_node:
            lines.append("one node: nothing crosses nodes, so the paper's cross-node volumes are all 0")
        lines.append(text_table.prose("paper: each collective's full volume (M = 2 bytes x parameters), cross-node "
                                      f"only; the last four columns, in {unit}: what each rank receives as the "
                                      "ledger counts it, (n-1)/n of each volume, with scales and padding", width))
        return "\n".join(lines)


def _unit(largest: int) -> tuple[str, int]:
    """The decimal unit that shows `largest` bytes in a few digits."""
    return next(((unit, scale) for unit, scale in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)) if largest >= scale),
                ("B", 1))


def predict(config: Config, n_params: int, world_size: int, ranks_per_node: int,
            stored_dtype: torch.dtype = torch.float32) -> Prediction:
    """What `config` moves per training step for a model of `n_params` parameters on
    `world_size` ranks, `ranks_per_node` per node; nothing runs. `stored_dtype` is the parameters'
    dtype (what is gathered when Config.param_dtype is None)."""
    if n_params < 1:
        raise ConfigError(f"the parameter count must be positive, got {n_params}")
    config.check_topology(world_size, ranks_per_node)
    on = {p.name for p in enabled_passes(config)}
    hpz = "partition_hierarchically" in on
    qwz = "quantize_weights" in on
    qgz = "quantize_gradients" in on
    link = _Link(world_size, ranks_per_node)
    shard = padding.shard_numel((n_params,), world_size)
    param_bytes = (config.param_dtype or stored_dtype).itemsize
    reduce_bytes = config.reduce_dtype.itemsize

    quantized = qwz and shard >= config.weight_block_size

    def weights(in_int8: bool) -> tuple[int, float]:
        """(bytes of one rank's shard of the weights, paper volume in M), as INT8 blocks or not."""
        if in_int8:
            return packed_weight_bytes(shard, config.weight_block_size), 0.5
        return shard * param_bytes, param_bytes / 2

    per_peer, weight_m = weights(quantized)
    forward = PhaseVolume(PHASES[0], "qwZ" if quantized else "-", link.cross(weight_m), *link.world(per_peer))
    if hpz:
        members = config.hpz_partition_size
        same, other = link.peers_of_first(secondary_groups(world_size, members)[0])
        copy_peer, copy_m = weights(quantized and config.hpz_quantized_copy)
        part = world_size * copy_peer // members  # the secondary copy: the gathered weights split over the group
        backward = PhaseVolume(PHASES[1], "hpZ", copy_m if other else 0.0, *received_bytes(same, other, part))
    elif "reshard_after_forward" in on:
        backward = PhaseVolume(PHASES[1], forward.technique, forward.paper_m, forward.intra_bytes, forward.inter_bytes)
    else:
        backward = PhaseVolume(PHASES[1], "-", 0.0, 0, 0)
    gradient = (_qgz(config, link, shard) if qgz and shard >= config.gradient_block_size
                else PhaseVolume(PHASES[2], "-", link.cross(reduce_bytes / 2), *link.world(shard * reduce_bytes)))

    plain = PhaseVolume("", "-", link.cross(1.0), *link.world(shard * 2))
    baseline = tuple(PhaseVolume(phase, "-", plain.paper_m, plain.intra_bytes, plain.inter_bytes) for phase in PHASES)
    return Prediction(n_params, world_size, ranks_per_node, (forward, backward, gradient), baseline)


def _qgz(config: Config, link: _Link, shard: int) -> PhaseVolume:
    """qgZ's hops, sized as `reduce_grad_quantized` and its kernels size them."""
    nodes, local, block = link.nodes, link.local, config.gradient_block_size
    if nodes == 1 or local == 1:  # one hop over all ranks
        bits = config.intra_node_gradient_bits if nodes == 1 else config.gradient_bits
        return PhaseVolume(PHASES[2], "qgZ", link.cross(bits / 16), *link.world(piece_bytes(shard, block, bits)))
    intra_piece = piece_bytes(shard, block, config.intra_node_gradient_bits)
    inter_piece = piece_bytes(shard, block, config.gradient_bits)
    # First hop, within the node: each peer sends this rank a piece for each node; second hop,
    # across nodes, over the ranks of this rank's local index: each peer sends one piece.
    intra, _ = received_bytes(*link.peers_of_first(node_groups(link.world_size, local)[0]), nodes * intra_piece)
    _, inter = received_bytes(*link.peers_of_first(local_index_groups(link.world_size, local)[0]), inter_piece)
    return PhaseVolume(PHASES[2], "qgZ", config.gradient_bits / 16, intra, inter)


@dataclass(frozen=True)
class _Link:
    world_size: int
    local: int

    @property
    def nodes(self) -> int:
        return self.world_size // self.local

    def world(self, per_peer: int) -> tuple[int, int]:
        """(intra, inter) bytes a rank receives when each other rank sends it `per_peer` bytes."""
        return world_received_bytes(self.world_size, self.local, per_peer)

    def peers_of_first(self, group_ranks: Sequence[int]) -> tuple[int, int]:
        """Rank 0's peers in its group `group_ranks`: (on its node, on other nodes). The
        prediction is rank 0's view; every group of a kind is laid out alike."""
        return peers_by_link(0, self.local, group_ranks)

    def cross(self, volume_m: float) -> float:
        return volume_m if self.nodes > 1 else 0.0

"""What `zpp_compile` exports, loaded at the first use of any of it (the package's `__getattr__`):
importing the package alone loads no torch, so `zeropp --help` answers at once."""


from torch import nn

from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from .compiler.layer_graphs import layer_runs
from .config import Config, ConfigError
from .reports.ledger import LEDGER, CommReport
from .runtime.agreement import RankMismatchError
from .runtime.cuda_graphs import release_cuda_graphs
from .runtime.registry import REGISTRY
from .sharding.initialization import load_full_state_dict
from .sharding.parameter_reads import no_sync, set_requires_gradient_sync
from .sharding.shard import full_state_dict, shard


def is_sharded(model: nn.Module) -> bool:
    """Whether `model` was sharded by `shard`, or holds a model that was (a PEFT wrapper around one)."""
    return REGISTRY.state_of(model) is not None


def step_comm_bytes() -> tuple[int, int]:
    """(intra-node, inter-node) bytes this rank receives per training step, read from the
    compiled graphs (nothing is measured at run time)."""
    report = comm_report()
    return report.intra_bytes, report.inter_bytes


def secondary_copy_bytes() -> int:
    """Bytes of hpZ secondary copies this rank holds from forward to backward, per step."""
    return comm_report().secondary_bytes


def comm_report(model: nn.Module | None = None) -> CommReport:
    """The collectives of one training step on this rank, from the compiled graphs, against plain
    ZeRO-3 in bf16 for the same sharded parameters and topology (`.table()`, `.to_dict()`).

    Every sharded model's graphs count unless `model` (a model given to `shard`) picks one; of a
    step Dynamo recompiled (a new sequence length, say), only the latest graphs count."""
    graphs = list(LEDGER.graphs)
    if model is not None:
        if model not in REGISTRY.models:
            raise ValueError(f"comm_report(model): {type(model).__name__} was not sharded by zpp_compile.shard")
        sharding_id = REGISTRY.sharding_id(model)
        graphs = [g for g in graphs if g.model is not None and g.model.sharding_id == sharding_id]
    return CommReport.from_graphs(graphs, layer_runs())


def reset_comm_report() -> None:
    """Forgets the graphs compiled so far: `comm_report()` then reports only graphs compiled after
    this call (e.g. between benchmark variants that share a process)."""
    LEDGER.clear()


__all__ = [  # the package's own list less __version__ (tests/test_package.py checks they agree)
    "Config", "ConfigError", "CommReport", "shard", "is_sharded", "full_state_dict", "step_comm_bytes",
    "secondary_copy_bytes", "comm_report", "set_requires_gradient_sync", "no_sync",
    "release_cuda_graphs", "save_checkpoint", "load_checkpoint", "CheckpointError", "load_full_state_dict",
    "RankMismatchError", "reset_comm_report",
]

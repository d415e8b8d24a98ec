"""zeropp: ZeRO++ (qwZ, hpZ, qgZ) as a torch.compile backend.

    model = zpp_compile.shard(model, zpp_compile.Config(quantized_weights=True, ...))
    step_model = torch.compile(model, backend="zeropp")
"""

from .config import Config, ConfigError
from .runtime.ledger import training_graphs, training_step_bytes
from .runtime.registry import REGISTRY
from .sharding import full_state_dict, shard


def step_comm_bytes() -> tuple[int, int]:
    """(intra-node, inter-node) bytes this rank receives per training step, read from the
    compiled graphs (nothing is measured at run time)."""
    return training_step_bytes(REGISTRY.ledger)


def secondary_copy_bytes() -> int:
    """Bytes of hpZ secondary copies this rank holds from forward to backward, per step."""
    return sum(g.secondary_bytes for g in training_graphs(REGISTRY.ledger))


__all__ = ["Config", "ConfigError", "shard", "full_state_dict", "step_comm_bytes", "secondary_copy_bytes"]

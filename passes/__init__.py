"""The compiler passes of zeropp, in the order they run. One pass per file.

Each entry can be switched off by name (Config.disable_passes, or `zeropp --disable-pass`);
`zeropp passes` lists them with their one-line summaries.
"""

from .base import GraphPass, PassContext
from .bucket_collectives import bucket_collectives
from .checkpoint_activations import checkpoint_activations
from .finish_reductions_later import finish_reductions_later
from .fold_bucket_copies import fold_bucket_copies
from .gather_once import gather_once
from .lower_collectives import lower_collectives
from .partition_hierarchically import partition_hierarchically
from .prefetch_across_layers import prefetch_across_layers
from .quantize_gradients import quantize_gradients
from .quantize_weights import quantize_weights
from .realize_shared_values import realize_shared_values
from .reshard_after_forward import reshard_after_forward
from .schedule_overlap import schedule_overlap

PASSES: tuple[GraphPass, ...] = (
    GraphPass("gather_once", "joint", gather_once),
    GraphPass("bucket_collectives", "joint", bucket_collectives,
              wanted=lambda config: config.bucket_size != 0),
    GraphPass("reshard_after_forward", "joint", reshard_after_forward,
              wanted=lambda config: config.reshard_after_forward),
    GraphPass("checkpoint_activations", "joint", checkpoint_activations,
              wanted=lambda config: config.activation_checkpointing != "none"),
    GraphPass("quantize_weights", "joint", quantize_weights,
              wanted=lambda config: config.quantized_weights),
    GraphPass("partition_hierarchically", "joint", partition_hierarchically,
              wanted=lambda config: config.hpz_partition_size > 0),
    GraphPass("quantize_gradients", "lowering", quantize_gradients,
              wanted=lambda config: config.quantized_gradients),
    GraphPass("lower_collectives", "lowering", lower_collectives),
    GraphPass("fold_bucket_copies", "lowering", fold_bucket_copies),
    # These two hold run-time state across graphs, which a CUDA graph's replay would not consult.
    GraphPass("prefetch_across_layers", "lowering", prefetch_across_layers,
              wanted=lambda config: config.compile_layers_once and not config.cuda_graphs),
    GraphPass("realize_shared_values", "lowering", realize_shared_values),
    GraphPass("schedule_overlap", "lowering", schedule_overlap),
    GraphPass("finish_reductions_later", "lowering", finish_reductions_later,
              wanted=lambda config: config.compile_layers_once and not config.cuda_graphs),
)

__all__ = ["PASSES", "GraphPass", "PassContext"]

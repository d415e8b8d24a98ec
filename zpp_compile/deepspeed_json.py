"""A DeepSpeed JSON config read as a zeropp `Config`, so a DeepSpeed ZeRO++ user's file carries over.

What maps:
- `zero_optimization.stage`: 3 only (zeropp shards parameters, gradients and optimizer state, as
  ZeRO-3 does; a stage 1 or 2 run would keep full parameters on every rank, which zeropp never
  does, so another stage is an error rather than a silently different memory footprint);
- the ZeRO++ switches `zero_quantized_weights`, `zero_hpz_partition_size`,
  `zero_quantized_gradients` (as `Config.from_dict` reads them);
- `bf16.enabled` / `fp16.enabled`: the dtype parameters are gathered and computed in
  (`param_dtype`; the shards and the optimizer stay in their own dtype, as DeepSpeed's fp32 master
  weights do); `communication_data_type`: the dtype gradients are reduced in (`reduce_dtype`).

A key of `zero_optimization` that DeepSpeed does not know either, spelled like one of the ZeRO++
switches (`zero_quantized_weight`), is an error that says which was meant: left in the warning,
it would leave that technique off while the run looks configured. Settings that zeropp always has
are accepted quietly when they ask for what it does (`overlap_comm`,
`contiguous_gradients`, `reduce_scatter`, `stage3_gather_16bit_weights_on_model_save` set to true).
The training loop's settings (batch sizes, gradient accumulation, clipping) belong to whoever runs
the loop: `training_settings` returns them for a framework integration to check against its own
arguments. Every other key has no meaning here: all of them are named in one warning, never dropped
without a word.
"""

from __future__ import annotations

import difflib
from typing import Any, Mapping

from .config import Config, ConfigError
from .runtime.job import warn_for_the_job

# DeepSpeed's training-loop settings; "auto" leaves each to the framework running the loop.
TRAINING_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                 "gradient_clipping")
_ZERO_PLUS_PLUS = ("zero_quantized_weights", "zero_hpz_partition_size", "zero_quantized_gradients")
_ALWAYS_ON = ("overlap_comm", "contiguous_gradients", "reduce_scatter", "stage3_gather_16bit_weights_on_model_save")
_PRECISIONS = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16"}
# The keys of DeepSpeed's `zero_optimization` section (its config schema's fields and their aliases):
# what a typo is told apart from.
_DEEPSPEED_ZERO_KEYS = frozenset((
    "stage", "contiguous_gradients", "reduce_scatter", "reduce_bucket_size", "use_multi_rank_bucket_allreduce",
    "allgather_partitions", "allgather_bucket_size", "overlap_comm", "load_from_fp32_weights", "elastic_checkpoint",
    "offload_param", "offload_optimizer", "sub_group_size", "cpu_offload_param", "cpu_offload_use_pin_memory",
    "cpu_offload", "prefetch_bucket_size", "stage3_prefetch_bucket_size", "param_persistence_threshold",
    "stage3_param_persistence_threshold", "model_persistence_threshold", "stage3_model_persistence_threshold",
    "max_live_parameters", "stage3_max_live_parameters", "max_reuse_distance", "stage3_max_reuse_distance",
    "gather_16bit_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save",
    "module_granularity_threshold", "stage3_module_granularity_threshold", "use_all_reduce_for_fetch_params",
    "stage3_use_all_reduce_for_fetch_params", "stage3_gather_fp16_weights_on_model_save", "ignore_unused_parameters",
    "legacy_stage1", "round_robin_gradients", "zero_hpz_partition_size", "zero_quantized_weights",
    "zero_quantized_nontrainable_weights", "zero_quantized_gradients", "zeropp_loco_param", "mics_shard_size",
    "mics_hierarchical_params_gather", "memory_efficient_linear", "pipeline_loading_checkpoint",
    "override_module_apply",
))


def is_deepspeed_config(values: Any) -> bool:
    """Whether `values` is a DeepSpeed config (it has a `zero_optimization` section)."""
    return isinstance(values, Mapping) and "zero_optimization" in values


def from_deepspeed(values: Mapping[str, Any], precision: str | None = None, loop_checked: bool = False) -> Config:
    """The Config a DeepSpeed config asks for. `precision` ("bf16", "fp16" or None) is what a
    framework's own arguments say, for a `"enabled": "auto"` precision section; without a framework,
    "auto" means off. `loop_checked`: the caller checks `training_settings` itself; otherwise they
    have no meaning here either. Keys with no meaning here are named in one warning."""
    zero = values.get("zero_optimization")
    if not isinstance(zero, Mapping):
        raise ConfigError(f"DeepSpeed config: 'zero_optimization' must be a JSON object, got {zero!r}")
    if zero.get("stage") != 3:
        raise ConfigError(
            f"DeepSpeed config: zero_optimization.stage={zero.get('stage')!r}; zeropp is ZeRO stage 3 (parameters, "
            "gradients and optimizer state sharded): set \"stage\": 3, or keep DeepSpeed for stages 1 and 2"
        )
    _refuse_misspelled_switches(zero)
    ours: dict[str, Any] = {key: zero[key] for key in _ZERO_PLUS_PLUS if key in zero}
    ignored = [f"zero_optimization.{key}" for key, value in zero.items()
               if key not in (*_ZERO_PLUS_PLUS, "stage") and not (key in _ALWAYS_ON and value is True)]
    enabled = [name for name in _PRECISIONS if _enabled(values.get(name), _PRECISIONS[name] == precision)]
    if len(enabled) > 1:
        raise ConfigError(f"DeepSpeed config: {' and '.join(enabled)} are both enabled; enable one")
    if enabled:
        ours["param_dtype"] = _PRECISIONS[enabled[0]]
    for name in _PRECISIONS:
        if isinstance(values.get(name), Mapping):
            ignored += [f"{name}.{key}" for key in values[name] if key != "enabled"]
    if "communication_data_type" in values:
        ours["reduce_dtype"] = values["communication_data_type"]
    known = ("zero_optimization", "communication_data_type", *_PRECISIONS, *(TRAINING_KEYS if loop_checked else ()))
    ignored += [key for key in values if key not in known and values[key] != "auto"]
    if ignored:
        warn_for_the_job(f"DeepSpeed config: zeropp has no use for {', '.join(ignored)}; these keys are ignored",
                         stacklevel=3)
    return Config.from_dict(ours)


def _refuse_misspelled_switches(zero: Mapping[str, Any]) -> None:
    """Raises for a key DeepSpeed does not know that is spelled like one of the ZeRO++ switches."""
    for key in zero:
        close = [] if key in _DEEPSPEED_ZERO_KEYS else difflib.get_close_matches(key, _ZERO_PLUS_PLUS, n=1, cutoff=0.8)
        if close:
            raise ConfigError(f"DeepSpeed config: zero_optimization.{key} is no DeepSpeed setting; did you mean "
                              f"{close[0]!r}? As written it would be ignored, and that technique left off")


def training_settings(values: Mapping[str, Any]) -> dict[str, Any]:
    """The training-loop settings a DeepSpeed config gives, "auto" ones left out."""
    return {key: values[key] for key in TRAINING_KEYS if key in values and values[key] != "auto"}


def _enabled(section: Any, auto: bool) -> bool:
    if section is None:
        return False
    if not isinstance(section, Mapping):
        raise ConfigError(f"DeepSpeed config: a precision section must be a JSON object like {{\"enabled\": true}}, "
                          f"got {section!r}")
    value = section.get("enabled", False)
    if value not in (True, False, "auto"):
        raise ConfigError(f"DeepSpeed config: \"enabled\": {value!r} must be true, false or \"auto\"")
    return auto if value == "auto" else value

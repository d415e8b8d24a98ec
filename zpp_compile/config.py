"""`Config`: every knob of sharding and of the compiler passes, validated where it is set.

A Config is built from keyword arguments, a dict, or a JSON file. DeepSpeed's ZeRO++ key names
are accepted too, so a DeepSpeed user's settings carry over. A bad value fails at construction,
with a message naming the key, the value and what is allowed; values that depend on the launch
(world size, ranks per node) are checked by `check_topology` when the model is sharded.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import functools
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, TypeGuard

import torch

from .environment import DISABLE_PASSES_ENV, DUMP_DIR_ENV
from .runtime.job import warn_for_the_job
from .torch_compat import inductor_config

_DTYPE_NAMES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
}
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ACTIVATION_CHECKPOINTING = ("none", "full", "selective")

# DUMP_DIR_ENV, DISABLE_PASSES_ENV: switches read at compile time (see `Config.with_environment`).

# DeepSpeed's "zero_optimization" names -> ours. hpZ partition size 1 means "off" in DeepSpeed;
# here 1 means "a full copy on every rank", so the value is translated too (see `from_dict`).
_DEEPSPEED_KEYS = {
    "zero_quantized_weights": "quantized_weights",
    "zero_hpz_partition_size": "hpz_partition_size",
    "zero_quantized_gradients": "quantized_gradients",
}


# A wait longer than a year is no timeout; much longer ones overflow the backends' clock arithmetic.
_MAX_TIMEOUT_S = 365 * 24 * 3600.0

# Fields `shard()` acts on: they fix the shards' gathers and reductions (param_dtype, reduce_dtype),
# the process groups (hpz_partition_size, ranks_per_node, collective_timeout_s) or the layers'
# forward (compile_layers_once, leaf_modules), so torch.compile's options may repeat them but not change them.
# Every other field is read when a graph is compiled and may be overridden per compilation.
SHARD_FIELDS = ("hpz_partition_size", "ranks_per_node", "param_dtype", "reduce_dtype", "collective_timeout_s",
                "compile_layers_once", "leaf_modules")
# Fields that may differ between ranks (a dump folder may name each rank's own path): the checks
# that ranks agree leave them out.
PER_RANK_FIELDS = ("dump_dir",)
# Fields that change no compiled graph (where dumps go, how long a collective may wait): the compile
# cache's key leaves them out.
GRAPH_NEUTRAL_FIELDS = ("dump_dir", "collective_timeout_s")


class ConfigError(ValueError):
    """A configuration value is wrong; the message says which key, what was given and what is allowed."""


def _as_dtype(key: str, value: Any) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        dtype = value
    elif isinstance(value, str) and value.lower().removeprefix("torch.") in _DTYPE_NAMES:
        dtype = _DTYPE_NAMES[value.lower().removeprefix("torch.")]
    else:
        raise ConfigError(
            f"Config.{key}={value!r} is not a dtype; use a torch.dtype or one of {sorted(_DTYPE_NAMES)}"
        )
    if dtype is not None and dtype not in _FLOAT_DTYPES:
        raise ConfigError(f"Config.{key}={dtype} is not supported; use float32, bfloat16 or float16")
    return dtype


@dataclass(frozen=True)
class Config:
    """Sharding and compiler settings. Field names match the README's configuration table."""

    # qwZ: forward weight all-gather in block-quantized INT8 (one float32 scale per block).
    quantized_weights: bool = False
    weight_block_size: int = 256
    # hpZ: 0 = off (backward re-gathers from all ranks); k = a secondary copy sharded over groups
    # of k consecutive ranks (normally the ranks of one node); 1 = a full copy on every rank.
    hpz_partition_size: int = 0
    # With qwZ, what the secondary copy holds: True = the received INT8 blocks and scales (half the
    # memory and intra-node bytes, dequantized again in backward); False = the dequantized weights
    # (twice the memory, nothing to dequantize in backward). Backward sees the same weights either way.
    hpz_quantized_copy: bool = True
    # qgZ: gradient reduce-scatter as a two-hop quantized all-to-all.
    quantized_gradients: bool = False
    gradient_bits: int = 4  # inter-node hop
    intra_node_gradient_bits: int = 8  # intra-node hop
    gradient_block_size: int = 256
    # Topology: ranks per node, overriding the launcher's LOCAL_WORLD_SIZE (emulates nodes).
    ranks_per_node: int | None = None
    # Mixed precision: parameters are gathered and used in param_dtype (None: as stored), and
    # gradients are reduced in reduce_dtype.
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype = torch.float32
    # Gathered weights are re-gathered in backward instead of being kept from forward.
    reshard_after_forward: bool = True
    # Activations backward recomputes instead of forward keeping them, per layer (the same layers
    # as bucketing): "none"; "full" (forward keeps each layer's input); "selective" (forward also
    # keeps the outputs of matrix products and attention). Acts under the backend only.
    activation_checkpointing: str = "none"
    # Scheduling: gathered bytes per communication bucket and how many buckets' gathers may be in
    # flight ahead of the compute that needs them, so at most (prefetch + 1) x bucket_size gathered
    # bytes are alive at once. "layer": one bucket per layer of the model (a block of its largest
    # stack of repeated blocks, else a child of the model), never spanning two, so two layers by
    # default; a number of bytes: buckets of up to that size, across layers (fewer, larger
    # collectives where the link needs large messages); 0: one collective per parameter. Every
    # bucket costs the host a fixed time (collective launch, quantize and dequantize calls),
    # which cuda_graphs takes off the step (docs/performance.md).
    bucket_size: int | str = "layer"
    prefetch: int = 1
    # Compilation and debugging.
    inductor: bool = True
    # Compile each layer as a graph of its own, once for every identical layer (`layer_graphs`), so
    # compile time stays flat in depth, as with FSDP2's compile per block. A layer's gathers and
    # reductions are then in its own graph; its first gather is issued while the layer before
    # computes (the pass prefetch_across_layers), its last reductions end while the next graph's
    # backward computes (finish_reductions_later).
    compile_layers_once: bool = False
    # Inductor settings for zeropp's graphs, as torch._inductor.config names (e.g.
    # {"max_autotune": True}); applied on top of the ones the backend sets. Kept as sorted pairs.
    inductor_options: Mapping[str, Any] | tuple[tuple[str, Any], ...] = ()
    # Replay each compiled forward and backward as a CUDA graph (Inductor's cudagraph trees): the
    # host issues one call per graph instead of every kernel and collective (CUDA and Inductor only).
    cuda_graphs: bool = False
    # Modules whose parameters are gathered together on entry and reduced together in backward,
    # however their forward uses them (a mixture of experts skipping experts no token chose): class
    # names (e.g. "Qwen2MoeSparseMoeBlock"), classes, or qualified module names.
    leaf_modules: tuple[str, ...] = ()
    disable_passes: tuple[str, ...] = ()
    dump_dir: str | None = None
    collective_timeout_s: float = 600.0

    def __new__(cls, *args: Any, **kwargs: Any) -> Config:
        # The dataclass __init__ would reject an unknown keyword with a bare TypeError.
        for key in kwargs:
            if key not in _field_names():
                raise _unknown_key(key)
        return super().__new__(cls)

    def __post_init__(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass)
        for key in ("quantized_weights", "hpz_quantized_copy", "quantized_gradients", "reshard_after_forward",
                    "inductor", "cuda_graphs", "compile_layers_once"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"Config.{key}={getattr(self, key)!r} must be True or False")
        for key in ("weight_block_size", "gradient_block_size"):
            value = getattr(self, key)
            if not _is_int(value) or value < 32 or value > 65536 or value & (value - 1):
                raise ConfigError(f"Config.{key}={value!r} must be a power of 2 between 32 and 65536")
        for key in ("gradient_bits", "intra_node_gradient_bits"):
            if not _is_int(getattr(self, key)) or getattr(self, key) not in (4, 8):
                raise ConfigError(f"Config.{key}={getattr(self, key)!r} is not supported; use 4 or 8")
        if not _is_int(self.hpz_partition_size) or self.hpz_partition_size < 0:
            raise ConfigError(
                f"Config.hpz_partition_size={self.hpz_partition_size!r} must be 0 (off) or a "
                "positive number of ranks that divides the world size"
            )
        if self.ranks_per_node is not None and (not _is_int(self.ranks_per_node) or self.ranks_per_node < 1):
            raise ConfigError(f"Config.ranks_per_node={self.ranks_per_node!r} must be a positive integer or None")
        if self.bucket_size != "layer" and (not _is_int(self.bucket_size) or self.bucket_size < 0):
            raise ConfigError(f"Config.bucket_size={self.bucket_size!r} must be 'layer' or a number of bytes >= 0")
        if self.activation_checkpointing not in ACTIVATION_CHECKPOINTING:
            raise ConfigError(
                f"Config.activation_checkpointing={self.activation_checkpointing!r} is not supported; "
                f"use one of {list(ACTIVATION_CHECKPOINTING)}"
            )
        if not _is_int(self.prefetch) or self.prefetch < 0:
            raise ConfigError(f"Config.prefetch={self.prefetch!r} must be an integer >= 0")
        if self.cuda_graphs and not self.inductor:
            raise ConfigError("Config.cuda_graphs=True needs Inductor; drop inductor=False or cuda_graphs=True")
        timeout = self.collective_timeout_s
        if (not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not math.isfinite(timeout)
                or not 0 < timeout <= _MAX_TIMEOUT_S):
            raise ConfigError(
                f"Config.collective_timeout_s={timeout!r} must be a positive number of seconds, "
                f"at most {_MAX_TIMEOUT_S:.0f} (a year)"
            )
        set_("param_dtype", _as_dtype("param_dtype", self.param_dtype))
        reduce_dtype = _as_dtype("reduce_dtype", self.reduce_dtype)
        if reduce_dtype is None:
            raise ConfigError("Config.reduce_dtype=None is not allowed; use float32, bfloat16 or float16")
        set_("reduce_dtype", reduce_dtype)
        set_("inductor_options", _inductor_options(self.inductor_options))
        set_("disable_passes", _pass_names(self.disable_passes))
        set_("leaf_modules", _leaf_module_names(self.leaf_modules))
        if self.dump_dir is not None:
            set_("dump_dir", str(self.dump_dir))

    # -- construction from user data -------------------------------------------------------

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> Config:
        """Builds a Config from our key names or DeepSpeed's ZeRO++ names (not both for one knob), or
        from a whole DeepSpeed config (one with a `zero_optimization` section; `deepspeed_json`)."""
        from .deepspeed_json import from_deepspeed, is_deepspeed_config  # here: it builds on this module

        if is_deepspeed_config(values):
            return from_deepspeed(values)
        return cls(**_our_names(values))

    @classmethod
    def from_json(cls, path: str | Path) -> Config:
        return cls.from_dict(read_json_object(path))

    @classmethod
    def load(cls, value: Config | Mapping[str, Any] | str | Path | None) -> Config:
        """Accepts a Config, a dict, a JSON file path (ours or DeepSpeed's), or None (defaults)."""
        if value is None:
            return cls()
        if isinstance(value, Config):
            return value
        if isinstance(value, Mapping):
            return cls.from_dict(value)
        if isinstance(value, (str, Path)):
            return cls.from_json(value)
        raise ConfigError(f"expected a zpp_compile.Config, a dict or a JSON path, got {type(value).__name__}")

    def updated(self, values: Mapping[str, Any]) -> Config:
        """A copy with `values` (our names or DeepSpeed's) applied on top, validated."""
        return Config(**{**self.to_dict(), **_our_names(values)})

    def for_compilation(self, options: Mapping[str, Any], ranks_per_node: int) -> Config:
        """This config, the one a model was sharded with, with torch.compile's `options` applied.

        Compile-time fields take effect; a field in `SHARD_FIELDS` may only repeat the sharded
        model's value (for ranks_per_node: also the value in effect, `ranks_per_node`).
        """
        config = self.updated(options)
        changed = [key for key in SHARD_FIELDS if getattr(config, key) != getattr(self, key)
                   and not (key == "ranks_per_node" and config.ranks_per_node == ranks_per_node)]
        if changed:
            given = ", ".join(f"{key}={getattr(config, key)!r}" for key in changed)
            sharded = ", ".join(f"{key}={getattr(self, key)!r}" for key in changed)
            hint = ("; to switch hpZ off for one compilation, use options={'disable_passes': "
                    "['partition_hierarchically']}" if "hpz_partition_size" in changed and self.hpz_partition_size
                    and not config.hpz_partition_size else "")
            raise ConfigError(
                f"torch.compile(..., backend='zeropp', options=...) sets {given}, but the model was sharded with "
                f"{sharded}: {', '.join(changed)} {'is' if len(changed) == 1 else 'are'} fixed when the model is "
                f"sharded (shards, process groups); pass {'it' if len(changed) == 1 else 'them'} to "
                f"zpp_compile.shard(model, Config(...)) instead{hint}"
            )
        return config

    def with_layer_size(self, layer_nbytes: int) -> Config:
        """This config with bucket_size="layer" replaced by `layer_nbytes`."""
        return self.updated({"bucket_size": layer_nbytes}) if self.bucket_size == "layer" else self

    def compiled_apart_from(self, sharded: Config) -> dict[str, Any]:
        """The fields of this config (a compilation's) that differ from `sharded` (the model's, its
        layer size applied), less those that may differ by rank (`PER_RANK_FIELDS`): what every
        rank's compilation must agree on besides the model's."""
        theirs = sharded.to_dict()
        return {k: v for k, v in self.to_dict().items() if v != theirs[k] and k not in PER_RANK_FIELDS}

    def with_environment(self) -> Config:
        """This config with the debugging switches of the environment applied (what `zeropp dump`
        sets, so any launch can dump): ZEROPP_DUMP_DIR replaces `dump_dir`, and ZEROPP_DISABLE_PASSES
        (comma-separated pass names) adds to `disable_passes`."""
        values: dict[str, Any] = {}
        if os.environ.get(DUMP_DIR_ENV):
            values["dump_dir"] = os.environ[DUMP_DIR_ENV]
        disabled = [name.strip() for name in os.environ.get(DISABLE_PASSES_ENV, "").split(",") if name.strip()]
        if disabled:
            values["disable_passes"] = tuple(dict.fromkeys([*self.disable_passes, *disabled]))
        return self.updated(values) if values else self

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready values (dtypes as strings)."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else value
        out["disable_passes"] = list(self.disable_passes)
        out["leaf_modules"] = list(self.leaf_modules)
        out["inductor_options"] = dict(self.inductor_options)
        return out

    # -- checks that need the launch ---------------------------------------------------------

    def check_topology(self, world_size: int, ranks_per_node: int) -> None:
        """Raises ConfigError if a value does not fit `world_size` ranks, `ranks_per_node` per node."""
        if world_size % ranks_per_node:
            source = "Config.ranks_per_node" if self.ranks_per_node else "LOCAL_WORLD_SIZE"
            raise ConfigError(
                f"{source}={ranks_per_node} does not divide the world size {world_size}; "
                f"allowed: {_divisors(world_size)}"
            )
        if self.hpz_partition_size and world_size % self.hpz_partition_size:
            raise ConfigError(
                f"Config.hpz_partition_size={self.hpz_partition_size} does not divide the world size "
                f"{world_size}; allowed: 0 (off) or one of {_divisors(world_size)}"
            )
        if self.hpz_partition_size > ranks_per_node:
            warn_for_the_job(
                f"Config.hpz_partition_size={self.hpz_partition_size} is larger than the "
                f"{ranks_per_node} ranks of a node: backward weight gathers will cross nodes",
                stacklevel=3,
            )


def read_json_object(path: str | Path) -> dict[str, Any]:
    """The JSON object in the file `path` (a config, ours or DeepSpeed's); ConfigError if it is not one."""
    try:
        values = json.loads(Path(path).read_text())
    except UnicodeDecodeError as error:
        raise ConfigError(f"config file {str(path)!r} is not a JSON text file ({error})") from None
    except (OSError, ValueError) as error:  # json.JSONDecodeError is a ValueError
        raise ConfigError(f"cannot read config file {str(path)!r}: {error}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a JSON object, not {type(values).__name__}")
    return values


def _inductor_options(value: Any) -> tuple[tuple[str, Any], ...]:
    """Inductor settings as sorted (name, value) pairs (hashable, like the rest of Config)."""
    items = value.items() if isinstance(value, Mapping) else value
    try:
        pairs = tuple(sorted((str(k), v) for k, v in items))
    except (TypeError, ValueError) as error:
        raise ConfigError(f"Config.inductor_options={value!r} must map Inductor setting names to values") from error
    known = inductor_config.get_config_copy() if pairs else {}
    for name, _ in pairs:
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"Config.inductor_options: {name!r} is not a torch._inductor.config setting{hint}")
    return pairs


def _our_names(values: Mapping[str, Any]) -> dict[str, Any]:
    """`values` with DeepSpeed's key names (and hpZ size) translated to ours; unknown keys are errors."""
    if not isinstance(values, Mapping):
        raise ConfigError(f"a config must be a dict of settings, got {type(values).__name__}")
    ours: dict[str, Any] = {}
    for key, value in values.items():
        if not isinstance(key, str):
            raise ConfigError(f"config keys must be strings, got {key!r}")
        if key in _DEEPSPEED_KEYS:
            name = _DEEPSPEED_KEYS[key]
            if name in values:
                raise ConfigError(f"both {key!r} (DeepSpeed's name) and {name!r} are set; keep one")
            if key == "zero_hpz_partition_size" and value == 1:
                value = 0  # DeepSpeed's 1 means "no secondary partition"
            key = name
        elif key not in _field_names():
            raise _unknown_key(key, deepspeed_names=True)
        ours[key] = value
    return ours


def _pass_names(value: Any) -> tuple[str, ...]:
    """Config.disable_passes as a tuple of known pass names (a single name is accepted too)."""
    names = [value] if isinstance(value, str) else value
    if isinstance(names, (set, frozenset)):
        names = sorted(names, key=str)
    if not isinstance(names, (list, tuple)) or not all(isinstance(name, str) for name in names):
        raise ConfigError(f"Config.disable_passes={value!r} must be a list of pass names (see `zeropp passes`)")
    from .passes import PASSES  # here, not at the top: a pass may import this module

    known = [p.name for p in PASSES]
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ConfigError(
            f"Config.disable_passes (or {DISABLE_PASSES_ENV}) names unknown passes {unknown}; known: {known}"
        )
    return tuple(dict.fromkeys(names))


def _leaf_module_names(value: Any) -> tuple[str, ...]:
    """Config.leaf_modules as a tuple of names; a class stands for its full name."""
    items = [value] if isinstance(value, (str, type)) else value
    if isinstance(items, (set, frozenset)):
        items = sorted(items, key=str)
    if not isinstance(items, (list, tuple)) or not all(isinstance(item, (str, type)) and item for item in items):
        raise ConfigError(f"Config.leaf_modules={value!r} must be a list of module classes, class names or "
                          "qualified module names (e.g. ['Qwen2MoeSparseMoeBlock'] or ['model.layers.0.mlp'])")
    names = [item if isinstance(item, str) else f"{item.__module__}.{item.__qualname__}" for item in items]
    return tuple(dict.fromkeys(names))


@functools.cache
def _field_names() -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(Config))


def _unknown_key(key: str, deepspeed_names: bool = False) -> ConfigError:
    """The error for a key that is not a Config field, with the closest name as a hint."""
    if key in _DEEPSPEED_KEYS and not deepspeed_names:
        return ConfigError(f"{key!r} is DeepSpeed's name for {_DEEPSPEED_KEYS[key]!r}: use that, or Config.from_dict")
    names = sorted(_field_names() | (set(_DEEPSPEED_KEYS) if deepspeed_names else set()))
    close = difflib.get_close_matches(key, names, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {sorted(_field_names())}"
    return ConfigError(f"unknown config key {key!r}{hint}")


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def field_setting(text: str) -> tuple[str, Any]:
    """A Config field's setting as a command line gives it, KEY=VALUE: the value read as JSON, else
    as a Python literal (true and True alike), else kept as text. For argparse's `type=`."""
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    for read in (json.loads, ast.literal_eval):
        try:
            return key, read(value)
        except (ValueError, SyntaxError):
            pass
    return key, value

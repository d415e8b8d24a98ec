"""Lightning training a zeropp-sharded model: `ZeroppStrategy` for Fabric, `ZeroppTrainerStrategy`
for the `Trainer`.

    fabric = L.Fabric(strategy=ZeroppStrategy(zpp.Config(quantized_weights=True)), devices=2)
    fabric.launch()
    model = fabric.setup_module(model)                         # sharded, compiled by zeropp
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters()))
    with fabric.no_backward_sync(model, enabled=not last_micro_batch):
        fabric.backward(model(x, y))
    fabric.clip_gradients(model, optimizer, max_norm=1.0)
    fabric.save("ckpt/step-100", {"model": model, "optimizer": optimizer, "step": 100})

The strategy is Lightning's `ModelParallelStrategy` (the one FSDP2 models use), changed where
zeropp differs:
- the device mesh is one data-parallel dimension over every rank (zeropp shards over all ranks,
  so the distributed sampler gives each rank its own part of the data);
- `setup_module` shards the model with `zpp.shard` (a model built under
  `fabric.init_module(empty_init=True)`, on the meta device, is materialized there one module at a
  time, by `init=` or each module's `reset_parameters()`) and compiles it with the zeropp backend;
  `compile=False` keeps it eager (plain ZeRO-3, the reference);
- an optimizer must be made from the sharded parameters, after `setup_module`: one made before
  holds parameters that training never updates, so it is refused;
- `no_backward_sync` is `zpp.no_sync` (Lightning's looks for FSDP2 modules);
- checkpoints: the model and one optimizer through `zpp.save_checkpoint` into `<path>/zeropp/`
  (every rank writes its shards, verified on load, loadable at another world size); the rest of
  the state (anything not a module or an optimizer) into `<path>/meta.pt` by rank 0, as Lightning
  writes it. `fabric.load_raw(path, model)` loads a full state dict file (`torch.save` of
  `zpp.full_state_dict`, or an unsharded model's) into the shards.
Clipping (`fabric.clip_gradients`) and the rest are Lightning's own: the sharded parameters and
their gradients are DTensors, as under FSDP2, whose global norm `clip_grad_norm_` computes.

`ZeroppTrainerStrategy` is the Trainer's `ModelParallelStrategy` changed the same way. As with
FSDP2 under the Trainer, the LightningModule's `configure_model()` applies the parallelism:

    def configure_model(self):
        zpp.shard(self.model, zpp.Config(quantized_weights=True))
        self.model.compile(backend="zeropp")           # in place: parameter names stay as they are

Gradient accumulation (`accumulate_grad_batches`) runs the micro-batches before the last under
`zpp.no_sync`; `gradient_clip_val` clips the global norm; `ModelCheckpoint` and
`trainer.save_checkpoint` write the model's and the optimizer's shards with `zpp.save_checkpoint`
into `<path>/zeropp/` and the Trainer's own state (loops, schedulers, callbacks) into
`<path>/meta.pt`; `fit(ckpt_path=...)` resumes from them, at any number of ranks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies.model_parallel import ModelParallelStrategy

# Fabric's `no_backward_sync` asks the strategy's `_backward_sync_control` (no public base for it).
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.pytorch.strategies.model_parallel import ModelParallelStrategy as TrainerModelParallelStrategy
from torch import nn
from torch.distributed.tensor import DTensor

import zpp_compile as zpp

from ..config import Config, ConfigError
from . import CHECKPOINT_FOLDER, checkpoint_folder

METADATA_FILE = "meta.pt"  # everything else, as Lightning's ModelParallelStrategy names it


class ZeroppStrategy(ModelParallelStrategy):
    """Fabric strategy that shards the model with zeropp and compiles it with the zeropp backend
    (see the module's docstring). `config`: a `zpp.Config`, a dict of its fields, or a JSON path
    (zeropp's or a DeepSpeed config); `init`: how `zpp.shard` initializes a model built on the meta
    device (under `fabric.init_module(empty_init=True)`), one module at a time (default: each
    module's `reset_parameters()`); `compile_options`: passed to `torch.compile(..., options=...)`."""

    def __init__(
        self,
        config: Config | Mapping[str, Any] | str | Path | None = None,
        *,
        init: Callable[[nn.Module], None] | None = None,
        compile: bool = True,
        compile_options: Mapping[str, Any] | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        super().__init__(parallelize_fn=self._shard_and_compile, process_group_backend=process_group_backend,
                         timeout=timeout)
        self.zeropp_config = Config.load(config)
        self._init = init
        self._compile = compile
        self._compile_options = dict(compile_options or {})
        self._backward_sync_control = _ZeroppBackwardSyncControl()

    def setup_environment(self) -> None:
        # One data-parallel dimension over every rank, whatever the nodes: zeropp's own process
        # groups (hpZ's, qgZ's hops) follow `Config.ranks_per_node`, not this mesh.
        self._data_parallel_size = self.num_nodes * self.num_processes
        self._tensor_parallel_size = 1
        super().setup_environment()

    def _shard_and_compile(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        sharded = zpp.shard(module, self.zeropp_config, init=self._init)
        if not self._compile:
            return sharded
        return torch.compile(sharded, backend="zeropp", options=self._compile_options or None)

    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list[torch.optim.Optimizer],
                                    scheduler: Any = None) -> tuple[nn.Module, list[torch.optim.Optimizer], Any]:
        if optimizers:
            raise ConfigError(
                "ZeroppStrategy: an optimizer made before the model is set up holds the unsharded parameters, which "
                "training would never update; set the model up first, then make the optimizer from its parameters: "
                "`model = fabric.setup_module(model)`, `optimizer = fabric.setup_optimizers(AdamW(model.parameters()))`"
            )
        return super().setup_module_and_optimizers(module, optimizers, scheduler)

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        _check_optimizer(optimizer, "make the optimizer from the parameters of the model `fabric.setup_module` "
                                    "returned")
        return super().setup_optimizer(optimizer)

    def save_checkpoint(self, path: str | Path, state: dict[str, Any], storage_options: Any = None,
                        filter: dict[str, Callable[[str, Any], bool]] | None = None) -> None:
        if storage_options is not None or filter is not None:
            raise TypeError("ZeroppStrategy.save_checkpoint: storage_options and filter are not taken: every rank "
                            "writes all its shards, which the load verifies as a whole")
        path = Path(self.broadcast(path))
        model, optimizer, metadata = _split_state(state)
        if path.is_file():
            raise FileExistsError(f"{path} is a file; a zeropp checkpoint is a directory: pass another path")
        zpp.save_checkpoint(model, optimizer, path / CHECKPOINT_FOLDER)
        if self.global_rank == 0:
            torch.save({key: _state_of(value) for key, value in metadata.items()}, path / METADATA_FILE)

    def load_checkpoint(self, path: str | Path, state: nn.Module | torch.optim.Optimizer | dict[str, Any] | None = None,
                        strict: bool = True, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(path))
        if isinstance(state, nn.Module):
            _load_full_state_dict_file(path, state, strict)
            return {}
        if not isinstance(state, dict) or not state:
            raise ValueError("ZeroppStrategy.load_checkpoint needs state={'model': model, ...} holding the sharded "
                             "model (and its optimizer, and whatever else to restore)")
        folder = checkpoint_folder(path, "save it with fabric.save under ZeroppStrategy, or load a full state "
                                         "dict with load_raw")
        model, optimizer, requested = _split_state(state)
        metadata = torch.load(path / METADATA_FILE, weights_only=weights_only)
        missing = requested.keys() - metadata.keys()
        if strict and missing:  # before anything is loaded, which leaves the model as it was
            raise KeyError(f"{path} holds no {sorted(missing)} (it holds {sorted(metadata)}); pass strict=False to "
                           "restore what it holds")
        zpp.load_checkpoint(model, optimizer, folder)
        for key in requested.keys() & metadata.keys():
            value = metadata.pop(key)
            if _is_stateful(state[key]):
                state[key].load_state_dict(value)
            else:
                state[key] = value
        return metadata


class ZeroppTrainerStrategy(TrainerModelParallelStrategy):
    """Lightning `Trainer` strategy for a LightningModule whose `configure_model()` shards its
    model with `zpp.shard` (and compiles it with the zeropp backend); see the module's docstring."""

    def __init__(self, process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout) -> None:
        super().__init__(tensor_parallel_size=1, process_group_backend=process_group_backend, timeout=timeout)

    def setup_environment(self) -> None:
        self._data_parallel_size = self.num_nodes * self.num_processes  # as ZeroppStrategy's
        self._tensor_parallel_size = 1
        super().setup_environment()

    def setup(self, trainer: Any) -> None:
        if not zpp.is_sharded(self.lightning_module):
            raise ConfigError(
                f"ZeroppTrainerStrategy: {type(self.lightning_module).__name__} holds no model sharded by zeropp; "
                "shard it in configure_model(): `zpp.shard(self.model, config)`, then "
                "`self.model.compile(backend=\"zeropp\")`"
            )
        super().setup(trainer)
        for optimizer in self.optimizers:
            _check_optimizer(optimizer, "make the optimizers in configure_optimizers() from self.parameters()")

    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        with zpp.no_sync(self.lightning_module):
            yield

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # the shards go through zpp.save_checkpoint (save_checkpoint below)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return {}  # as the model's

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: str | Path, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError("ZeroppTrainerStrategy.save_checkpoint takes no storage_options: every rank writes "
                            "its shards with zpp.save_checkpoint")
        path = Path(self.broadcast(filepath))
        if path.is_file():
            raise FileExistsError(f"{path} is a file; a zeropp checkpoint is a directory: pass another path")
        zpp.save_checkpoint(self.lightning_module, self._the_optimizer(), path / CHECKPOINT_FOLDER)
        if self.global_rank == 0:
            rest = {key: value for key, value in checkpoint.items() if key not in ("state_dict", "optimizer_states")}
            torch.save(rest, path / METADATA_FILE)

    def load_checkpoint(self, checkpoint_path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))
        folder = checkpoint_folder(path, "save it under ZeroppTrainerStrategy (ModelCheckpoint or "
                                         "trainer.save_checkpoint)")
        checkpoint = torch.load(path / METADATA_FILE, weights_only=weights_only)
        zpp.load_checkpoint(self.lightning_module, self._the_optimizer(), folder)
        return checkpoint

    def _the_optimizer(self) -> torch.optim.Optimizer | None:
        if len(self.optimizers) > 1:
            raise ValueError(f"ZeroppTrainerStrategy checkpoints hold one optimizer; configure_optimizers() made "
                             f"{len(self.optimizers)}: use one optimizer with parameter groups")
        return self.optimizers[0] if self.optimizers else None


class _ZeroppBackwardSyncControl(_BackwardSyncControl):
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        return zpp.no_sync(module) if enabled else contextlib.nullcontext()


def _check_optimizer(optimizer: torch.optim.Optimizer, fix: str) -> None:
    """Every parameter the optimizer updates must be a zeropp shard: any other would not be updated
    (one made before sharding) or not averaged across ranks."""
    unsharded = [p for group in optimizer.param_groups for p in group["params"] if not isinstance(p, DTensor)]
    if unsharded:
        raise ConfigError(
            f"the optimizer holds {len(unsharded)} parameter(s) that are not zeropp shards (the first of shape "
            f"{tuple(unsharded[0].shape)}), which training would not update or not average across ranks; {fix}"
        )


def _split_state(state: dict[str, Any]) -> tuple[nn.Module, torch.optim.Optimizer | None, dict[str, Any]]:
    """The sharded model, its optimizer (or None) and the rest of `state`."""
    models = [key for key, value in state.items() if isinstance(value, nn.Module) and zpp.is_sharded(value)]
    optimizers = [key for key, value in state.items() if isinstance(value, torch.optim.Optimizer)]
    if len(models) != 1:
        raise ValueError(f"ZeroppStrategy checkpoints hold one model sharded by zeropp; state has {len(models)} "
                         f"({models}): save each model to a path of its own")
    if len(optimizers) > 1:
        raise ValueError(f"ZeroppStrategy checkpoints hold one optimizer; state has {optimizers}: save the others' "
                         "state under other paths, or use one optimizer with parameter groups")
    others = [key for key, value in state.items() if isinstance(value, nn.Module) and key not in models]
    if others:
        raise ValueError(f"ZeroppStrategy checkpoints hold one model sharded by zeropp; {others} are modules it "
                         "did not shard: save them with torch.save")
    rest = {key: value for key, value in state.items() if key not in models and key not in optimizers}
    return state[models[0]], state[optimizers[0]] if optimizers else None, rest


def _is_stateful(value: Any) -> bool:
    """A scheduler or any object with state_dict/load_state_dict: saved and restored through them."""
    return hasattr(value, "state_dict") and hasattr(value, "load_state_dict")


def _state_of(value: Any) -> Any:
    return value.state_dict() if _is_stateful(value) else value


def _load_full_state_dict_file(path: Path, model: nn.Module, strict: bool) -> None:
    """An unsharded state dict saved with torch.save, read by rank 0 and sent to the shards."""
    if not zpp.is_sharded(model):
        raise ValueError(f"ZeroppStrategy.load_checkpoint: {type(model).__name__} is not sharded by zeropp; set it "
                         "up with fabric.setup_module first")
    if not path.is_file():
        raise ValueError(f"ZeroppStrategy: loading into the model alone takes a full state dict file (torch.save of "
                         f"zpp.full_state_dict or of an unsharded model's state_dict), and {path} is not a file; "
                         "for a zeropp checkpoint directory pass state={'model': model}")
    state_dict = torch.load(path, mmap=True, map_location="cpu", weights_only=True) if dist.get_rank() == 0 else None
    zpp.load_full_state_dict(model, state_dict, from_rank=0, strict=strict)


STRATEGY_NAME = "zeropp"


def _register_by_name() -> None:
    """`strategy="zeropp"` names `ZeroppStrategy` in Fabric and `ZeroppTrainerStrategy` in the
    Trainer (with their defaults: zeropp's default Config), as Lightning's registries name its own."""
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    STRATEGY_REGISTRY.register(STRATEGY_NAME, ZeroppStrategy, override=True,
                               description="zeropp: ZeRO++ sharding compiled by the zeropp backend")
    StrategyRegistry.register(STRATEGY_NAME, ZeroppTrainerStrategy, override=True,
                              description="zeropp: configure_model() shards with zpp.shard")


_register_by_name()

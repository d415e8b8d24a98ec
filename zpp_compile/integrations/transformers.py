"""HF `transformers.Trainer`, and the trainers built on it (TRL's), training a zeropp-sharded model.

    from zpp_compile.integrations.transformers import ZeroppTrainer
    trainer = ZeroppTrainer(model=model, args=args, train_dataset=data, zeropp="ds_config.json")
    trainer.train(); trainer.save_model()

or, for another Trainer subclass, the mixin first: `class SFT(ZeroppTrainerMixin, trl.SFTTrainer)`.

What the mixin changes in the Trainer, and why:
- after the Trainer's own setup (TRL may have added PEFT adapters by then) it shards `self.model`
  with `zpp.shard`, and `_wrap_model` returns it compiled with the zeropp backend. A wrapped model
  that is not `self.model` keeps accelerate from wrapping it in DistributedDataParallel (which
  refuses sharded parameters); the optimizer is made afterwards from the shards, as with FSDP2;
- gradient accumulation: the micro-batches before the last of a window run under `zpp.no_sync`
  (accelerate's `no_sync` looks for DDP's method, which a sharded model has not);
- the logged loss's NaN/Inf filter (`logging_nan_inf_filter`) runs on the device, with the
  Trainer's meaning, instead of asking the host every micro-batch (which stalls the launches);
- `save_model` gathers the full state dict on every rank (a collective) and rank 0 writes it with
  `save_pretrained`, so `from_pretrained` loads the output;
- checkpoints: the model and optimizer state go through `zpp.save_checkpoint` into `zeropp/`
  inside the Trainer's checkpoint folder (every rank writes its shards; resuming at another world
  size reshards), the scheduler as the Trainer saves it; `resume_from_checkpoint` loads them all.
Clipping, the learning-rate schedule and evaluation are the Trainer's own: the sharded parameters
and their gradients are DTensors, as under FSDP2, which `clip_grad_norm_` handles.

`zeropp` takes a `zpp.Config`, a dict of its fields, or a DeepSpeed config (a JSON path or a
dict): its `zero_optimization` keys map over (`zpp_compile.deepspeed_json`), and its training
settings ("auto", or equal to the TrainingArguments') are checked against the TrainingArguments.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Mapping

import torch
import transformers
from torch import nn

import zpp_compile as zpp

from ..config import Config, ConfigError, read_json_object
from ..deepspeed_json import from_deepspeed, is_deepspeed_config, training_settings
from . import CHECKPOINT_FOLDER, checkpoint_folder

SCHEDULER_FILE = "scheduler.pt"  # the name the Trainer saves and reads its scheduler under


class ZeroppTrainerMixin:
    """Mix into `transformers.Trainer` or a subclass of it, before it, to train the model sharded
    by zeropp (see the module's docstring). `zeropp`: a `zpp.Config`, a dict, or a DeepSpeed config
    (path or dict). A model already sharded with `zpp.shard` is trained as it is."""

    def __init__(self, *args: Any, zeropp: Config | Mapping[str, Any] | str | os.PathLike | None = None,
                 **kwargs: Any) -> None:
        _check_compile_arguments(type(self).__name__, kwargs.get("args", args[1] if len(args) > 1 else None))
        super().__init__(*args, **kwargs)
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            other = "DeepSpeed" if self.is_deepspeed_enabled else "FSDP"
            raise ConfigError(
                f"{type(self).__name__}: TrainingArguments turn on {other}, which shards the model too; drop "
                "`deepspeed=`/`fsdp=` from TrainingArguments and pass the config as zeropp=... instead"
            )
        if self.model_init is not None:
            raise ConfigError(
                f"{type(self).__name__}: model_init builds a new model in every train() call, which would train "
                "unsharded next to the sharded one; pass model=... (built, or loaded with from_pretrained) instead"
            )
        if zpp.is_sharded(self.model):
            if zeropp is not None:
                raise ConfigError(f"{type(self).__name__}: the model is already sharded by zpp.shard; pass no "
                                  "zeropp=... config (the one it was sharded with holds)")
        else:
            if self.optimizer is not None:
                raise ConfigError(
                    f"{type(self).__name__}: an optimizer made before sharding holds the unsharded parameters, "
                    "which training would never update; pass no optimizer (the Trainer makes one from the shards), "
                    "or shard the model with zpp.shard before making the optimizer and the trainer"
                )
            zpp.shard(self.model, self._zeropp_config(zeropp))
        self.model_wrapped = self.model
        self._zeropp_compiled: nn.Module | None = None
        self._zeropp_filters_losses = False  # set by train(): training_step then filters the logged losses

    def _zeropp_config(self, zeropp: Config | Mapping[str, Any] | str | os.PathLike | None) -> Config:
        """The Config the model is sharded with (`trainer_config`); zpp_compile.launch adds its options."""
        return trainer_config(zeropp, self.args)

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        if self._zeropp_compiled is None:
            mode = {"mode": self.args.torch_compile_mode} if self.args.torch_compile_mode else {}
            self._zeropp_compiled = torch.compile(self.model, backend="zeropp", **mode)
        return self._zeropp_compiled

    def train(self, *args: Any, **kwargs: Any) -> Any:
        # The Trainer's NaN/Inf filter of logged losses asks the host whether each micro-batch's
        # loss is finite, which waits for the GPU every micro-batch: the host then starts each
        # forward's launches with the GPU idle (measured in docs/performance.md). `training_step`
        # applies the same filter on the GPU instead.
        self._zeropp_filters_losses, self.args.logging_nan_inf_filter = self.args.logging_nan_inf_filter, False
        try:
            return super().train(*args, **kwargs)
        finally:
            self.args.logging_nan_inf_filter = self._zeropp_filters_losses

    def training_step(self, model: nn.Module, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        sync = (self.accelerator.sync_gradients
                or self.accelerator.gradient_state.plugin_kwargs.get("sync_each_batch", False))
        with contextlib.nullcontext() if sync else zpp.no_sync(self.model):
            loss = super().training_step(model, inputs, num_items_in_batch)
        if not self._zeropp_filters_losses:
            return loss
        # What the Trainer's filter adds for a NaN or Inf loss: the mean of the losses since the last log.
        since_logged = self._tr_loss / (1 + self.state.global_step - self._globalstep_last_logged)
        return torch.where(torch.isfinite(loss), loss, since_logged.to(loss.dtype))

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        state_dict = zpp.full_state_dict(self.model)  # a collective: every rank gathers
        if self.args.should_save:
            self._save(output_dir or self.args.output_dir, state_dict=state_dict)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        zpp.save_checkpoint(self.model, _unwrapped(self.optimizer), Path(output_dir) / CHECKPOINT_FOLDER)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_FILE))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        # The model's shards load with the optimizer's state (`_load_optimizer_and_scheduler`), from
        # one checkpoint, verified as a whole; here only whether there is one.
        _checkpoint_folder(resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        zpp.load_checkpoint(self.model, _unwrapped(self.optimizer), _checkpoint_folder(checkpoint))
        scheduler = os.path.join(checkpoint, SCHEDULER_FILE)
        self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))

    def _load_best_model(self) -> None:
        zpp.load_checkpoint(self.model, None, _checkpoint_folder(self.state.best_model_checkpoint))


class ZeroppTrainer(ZeroppTrainerMixin, transformers.Trainer):
    """`transformers.Trainer` training the model sharded by zeropp (`ZeroppTrainerMixin`)."""


def _check_compile_arguments(trainer: str, args: transformers.TrainingArguments | None) -> None:
    """The model is compiled with the zeropp backend (in the mode `torch_compile_mode` names, if
    any); TrainingArguments asking for another backend are refused rather than ignored."""
    backend = getattr(args, "torch_compile_backend", None)
    if getattr(args, "torch_compile", False) and backend not in (None, "inductor"):
        raise ConfigError(
            f"{trainer}: TrainingArguments ask torch.compile for backend {backend!r}, but {trainer} compiles the "
            "model with backend=\"zeropp\" (Inductor, with zeropp's passes); drop torch_compile_backend "
            "(torch_compile_mode is used, e.g. \"max-autotune-no-cudagraphs\")")


def trainer_config(value: Config | Mapping[str, Any] | str | os.PathLike | None,
                   args: transformers.TrainingArguments) -> Config:
    """The Config `value` gives; a DeepSpeed config's training settings must agree with `args`."""
    if isinstance(value, (str, os.PathLike)):
        value = read_json_object(value)
    if not is_deepspeed_config(value):
        return Config.load(value)
    _check_training_settings(training_settings(value), args)
    precision = "bf16" if args.bf16 else "fp16" if args.fp16 else None
    return from_deepspeed(value, precision=precision, loop_checked=True)


def _check_training_settings(settings: dict[str, Any], args: transformers.TrainingArguments) -> None:
    """Each DeepSpeed training setting must equal what TrainingArguments ask for."""
    ours = {
        "train_micro_batch_size_per_gpu": ("per_device_train_batch_size", args.per_device_train_batch_size),
        "gradient_accumulation_steps": ("gradient_accumulation_steps", args.gradient_accumulation_steps),
        "gradient_clipping": ("max_grad_norm", args.max_grad_norm),
        "train_batch_size": ("per_device_train_batch_size x gradient_accumulation_steps x world size",
                             args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size),
    }
    for key, value in settings.items():
        name, expected = ours[key]
        if value != expected:
            raise ConfigError(
                f"DeepSpeed config: {key}={value!r}, but TrainingArguments give {name} = {expected!r}; the Trainer "
                f"runs the loop, so set {key} to \"auto\" (or to {expected!r}), or change TrainingArguments"
            )


def _checkpoint_folder(checkpoint: str) -> Path:
    return checkpoint_folder(checkpoint, "it was not saved by a zeropp trainer; to start from its weights "
                                         "instead, load them with from_pretrained before sharding")


def _unwrapped(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer inside accelerate's AcceleratedOptimizer (torch.distributed.checkpoint reads its state)."""
    return getattr(optimizer, "optimizer", optimizer)

"""What reading a sharded parameter does: the gather of its shard (`gather_shard`,
`gathered_weight`), and around it gradient accumulation without communication (FSDP2's
`set_requires_gradient_sync`, for zeropp).

With sync off, every use of a trainable parameter gathers from a detached shard and routes the
weight through `KeepGradLocal`: backward holds no `zpp::reduce_grad`, and autograd accumulates
the full, unreduced gradient of each micro-step in a per-parameter sink (in `reduce_dtype`).
With sync back on, while a kept gradient waits, every read of the parameter under grad mode
routes its weight through `AddKeptGrad`: the first of those backwards to run takes the kept
gradient (`zpp::add_kept_grad`), adds it to its own and reduces once; any other (the same module
applied again, a layer shared by several blocks, a weight tied across modules, a recompute) finds
none. Taking it in backward, not at the read, matters: a read whose result the compute never
uses (PEFT's LoRA layers read `lora_A.weight.dtype` before the weight itself) has no backward, so
the kept gradient cannot be lost with it. Which of these a module's attribute read does is
decided when it is traced: Dynamo guards on the flag and on whether a kept gradient waits.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Iterator

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..runtime.agreement import check_same_eager_gather
from ..runtime.ops import AddKeptGrad, FromEveryReplica, KeepGradLocal, eager_read
from ..runtime.registry import REGISTRY
from ..torch_compat import write_count
from .module_state import class_name, held_shards


class GradAccumulator:
    """The gradient one trainable parameter keeps on this rank while sync is off.

    [Note: zero_grad drops kept gradients] In one process (and under DDP's `no_sync`) the
    micro-steps' gradients accumulate in `.grad`, so `zero_grad()` (the model's, the optimizer's,
    or `.grad = None`) discards them. Here they are full-size and kept beside the parameter, whose
    `.grad` is its shard's: so while some are kept, `.grad` holds a tensor (zeros, when it was
    None: the next synced backward adds its gradient to them), and a `.grad` found replaced, set
    to None or written in place since (`zero_grad(set_to_none=False)` zeroes it) means the user
    discarded the window: the kept gradients go with it. Checked wherever they are used: before
    a backward adds to them, when sync changes, and when a synced backward takes them."""

    def __init__(self, param: nn.Parameter, shape: torch.Size, dtype: torch.dtype) -> None:
        self.sync = True
        self.param = weakref.ref(param)
        # A leaf only for autograd to accumulate into: stride 0, so it allocates one element.
        self.sink = torch.empty_strided(shape, (0,) * len(shape), dtype=dtype, device=param.device, requires_grad=True)
        self.sink.register_hook(self._before_keeping)
        self.pending: torch.Tensor | None = None  # kept gradients the next synced backward takes
        self.grad_seen: tuple[weakref.ref, int] | None = None  # the parameter's .grad and its version, while kept
        key = next(REGISTRY.accumulator_keys)
        REGISTRY.accumulators[key] = self
        self.token = torch.tensor(key)  # what `zpp::add_kept_grad` finds this accumulator by

    def set_sync(self, sync: bool) -> None:
        self._drop_if_discarded()
        kept, self.sink.grad = self.sink.grad, None
        if sync and kept is not None:
            self.pending = kept if self.pending is None else self.pending + kept
        elif kept is not None:  # still off: keep accumulating
            self.sink.grad = kept
        self.sync = sync

    def take_pending(self) -> torch.Tensor | None:
        """The kept gradients, for the backward running now (`zpp::add_kept_grad`); this
        accumulator holds none afterwards, so they are added once."""
        self._drop_if_discarded()
        pending, self.pending, self.grad_seen = self.pending, None, None
        return pending

    def _before_keeping(self, grad: torch.Tensor) -> None:
        """A backward with sync off is about to add `grad` to the kept gradients."""
        self._drop_if_discarded()
        if self.grad_seen is None and (param := self.param()) is not None:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            self.grad_seen = (weakref.ref(param.grad), write_count(param.grad))

    def _drop_if_discarded(self) -> None:
        """Drops the kept gradients if the parameter's .grad was cleared since they were kept."""
        if self.grad_seen is None:
            return
        param = self.param()
        grad, version = self.grad_seen
        if param is None or param.grad is None or param.grad is not grad() or write_count(param.grad) != version:
            self.sink.grad, self.pending, self.grad_seen = None, None, None


def gathered_weight(module: nn.Module, name: str) -> torch.Tensor:
    """`module.<name>` inside forward (`forward_scope`): gathered (`gather_shard`). Outside forward:
    the sharded parameter itself."""
    shard = module._parameters[name]
    if not isinstance(shard, DTensor) or not module._zpp.scope.gathers():
        return shard
    return gather_shard(module, name)


def gather_shard(module: nn.Module, name: str) -> torch.Tensor:
    """`module.<name>` gathered from this rank's shard, its gradient reduced, kept on this rank, or
    added to the kept one. While gradients are kept, the shard is read detached: they never flow
    back to it.

    Dynamo traces this at every read of a parameter, where each function call and each graph node
    adds to the first step's compilation: so it is one function, and a weight that fills whole
    shards is a view of the gathered buffer, without a slice."""
    held = module._zpp
    numel, shape, shard_size, group_size, *op_args = held.gather_args[name]
    shard = module._parameters[name]
    accumulator = held.accumulators.get(name)
    if accumulator is not None and not accumulator.sync:
        shard = shard.detach()
    # Compiled, a weight tied across graphs is gathered once per forward of the model and held
    # until that forward ends (`layer_graphs.tie_across_graphs`); the model's hooks end it, so a
    # forward called without them (`model.forward(...)`) gathers at every read.
    compiling = torch.compiler.is_compiling()
    tie = held.tied.get(name) if compiling else None
    tied_weights = held.scope.tied_weights if tie is not None and held.scope.depth else None
    gathered = tied_weights.get(tie) if tied_weights is not None else None
    if gathered is None:
        flat = shard.to_local().reshape(-1)
        if compiling:
            gathered = torch.ops.zpp.all_gather_param(flat, shard_size, group_size, *op_args)
        else:
            _check_same_gather(module, name)
            with eager_read():
                gathered = torch.ops.zpp.all_gather_param(flat, shard_size, group_size, *op_args)
        if tied_weights is not None:
            tied_weights[tie] = gathered
    if not shape:
        weight = FromEveryReplica.apply(gathered)
    elif shard_size * group_size == numel:
        weight = gathered.view(shape)
    else:
        weight = gathered[:numel].view(shape)
    if accumulator is None:
        return weight
    if not accumulator.sync:
        return KeepGradLocal.apply(weight, accumulator.sink)
    if accumulator.pending is not None and torch.is_grad_enabled():
        return AddKeptGrad.apply(weight, accumulator.token)
    return weight


def _check_same_gather(module: nn.Module, name: str) -> None:
    """Run eagerly: every rank gathers this parameter now, or every rank raises (`runtime.agreement`)."""
    layout = module._zpp.layouts[name]
    topology = REGISTRY.states[layout.sharding_id].topology
    holder = class_name(module)
    what = f"{holder}.{name} (parameter {layout.index}, shape {tuple(layout.shape)})"
    check_same_eager_gather(topology, layout.sharding_id, layout.index, what)


def set_requires_gradient_sync(model: nn.Module, requires_gradient_sync: bool) -> None:
    """Whether backward reduces gradients (True, the default) or keeps them on this rank.

    As FSDP2's method of the same name: with False, each backward adds every trainable
    parameter's full gradient (unreduced, in `Config.reduce_dtype`) to a buffer on this rank and
    communicates nothing; the next backward with True adds the buffer to its own gradient and
    reduces once. Costs one full-size gradient buffer per trainable parameter while off.
    """
    if not isinstance(requires_gradient_sync, bool):
        raise TypeError(f"requires_gradient_sync must be True or False, got {requires_gradient_sync!r}")
    if not isinstance(model, nn.Module) or REGISTRY.state_of(model) is None:
        raise ValueError("set_requires_gradient_sync needs a model sharded by zpp_compile.shard "
                         "(or a module holding one)")
    accumulators: dict[int, GradAccumulator] = {}
    for module in model.modules():
        held = held_shards(module)
        for name, layout in (held.layouts if held is not None else {}).items():
            param = module._parameters[name]
            if not param.requires_grad:
                continue
            accumulator = held.accumulators.get(name) or accumulators.get(id(param))
            if accumulator is None:  # one per parameter, shared by every module it is tied into
                accumulator = GradAccumulator(param, layout.shape, layout.reduce_dtype)
            held.accumulators[name] = accumulators[id(param)] = accumulator
    for accumulator in accumulators.values():
        accumulator.set_sync(requires_gradient_sync)


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Backward passes inside keep their gradients on this rank; the first one after reduces all."""
    set_requires_gradient_sync(model, False)
    try:
        yield
    finally:
        set_requires_gradient_sync(model, True)

"""Initial values of a sharded model: models built on the meta device, buffers, full state dicts.

- A model built under `torch.device("meta")` holds no memory, so models larger than one rank's
  memory can be built. `shard(model, config, init=...)` materializes it one module at a time,
  children before parents (the order `model.apply` visits them): the module's own meta
  parameters and buffers are allocated full-size on the target device, initialized by
  `init(module)` (by default the module's `reset_parameters()`, as torch's layers define it), and
  sharded before the next module is materialized. A rank holds at most its shards plus one
  module's full parameters. Rank 0's values are kept, as for a model built on a real device;
  the other ranks run the same initialization on a forked random state, so an error in it is
  raised on every rank and their own random streams are left as they were.
- FSDP2's order, `to_empty()` after `shard` and then the model's own init on the sharded
  parameters, works as well: `to_empty()` fills the shards with NaN, as `shard` does the tensors of
  meta modules it has no init for, and a forward checks first that every such tensor was written
  (`await_initialization`, `check_initialized`).
- Buffers are not sharded; `shard` broadcasts them from rank 0 (as DDP does), so a buffer filled
  randomly or per rank ends the same everywhere.
- Full (unsharded) tensors: `load_full_state_dict` sends a state dict held by one rank tensor by
  tensor, each rank receiving only its chunk. Sharded modules also accept full tensors in
  `load_state_dict`, which is what torch's `set_model_state_dict(..., full_state_dict=True,
  broadcast_from_rank0=True)` calls, and what `model.load_state_dict(full)` does when every rank
  holds the full state dict.
"""

from __future__ import annotations

import math
from typing import Callable, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..runtime.registry import REGISTRY, ShardingState
from ..runtime.topology import Topology
from . import padding

InitFn = Callable[[nn.Module], None]


class MetaInit:
    """Materializes and initializes a model's meta-device modules, one at a time, during `shard`.

    A module with no way to initialize it (no `init`, no `reset_parameters()`) is materialized
    unset, to be initialized after `shard` by the model's own code as FSDP2's users do
    (`to_empty()`, then e.g. `init_weights()`); `unset` lists its tensors, which `shard` hands to
    `await_initialization`. Constructed before any collective: a bad `init` is an error raised on
    every rank alike (every rank holds the same model structure, which `shard` checks first)."""

    def __init__(self, model: nn.Module, init: InitFn | None) -> None:
        if init is not None and not callable(init):
            raise TypeError(f"zpp_compile.shard: init must be a function of one module, got {type(init).__name__}")
        modules = children_first(model)
        on_meta = [(name, module) for name, module in modules if _meta_tensor_names(module)]
        if init is not None and not on_meta:
            raise ValueError(
                "zpp_compile.shard: init= initializes parameters and buffers on the meta device, and this model has "
                "none; initialize it before shard(), or build it under `with torch.device('meta'):`"
            )
        # Modules with no way to initialize them wait for the model's own initialization after
        # shard() (FSDP2's order: to_empty(), then e.g. init_weights()); the next forward checks.
        self.waiting = set() if init is not None else {
            id(module) for _, module in on_meta if not callable(getattr(module, "reset_parameters", None))}
        self.init = init
        self.names = {id(module): name or "<root>" for name, module in modules}
        # Meta tensors already initialized, by id; held, so that no id is reused while sharding.
        self.initialized: dict[int, nn.Parameter] = {}
        self.buffers: dict[int, torch.Tensor] = {}  # materialized buffers, by the meta buffer's id
        self.unset: list[torch.Tensor] = []  # meta parameters (the originals) and buffers left unset

    def materialize(self, module: nn.Module, device: torch.device) -> dict[str, nn.Parameter]:
        """Initializes `module`'s own meta parameters and buffers on `device`.

        Buffers are replaced in place. Returns the full, initialized parameters by name, for
        `shard` to shard; a parameter shared with a module initialized before keeps its first
        values (as when a model ties weights after building its layers), but this module's init
        still runs on a scratch copy, so the random stream advances as in the unsharded model.
        """
        params = {name: p for name, p in module._parameters.items() if p is not None and p.is_meta}
        buffers = {name: b for name, b in module._buffers.items() if b is not None and b.is_meta}
        if not params and not buffers:
            return {}
        for name, param in params.items():
            module._parameters[name] = nn.Parameter(_unset(param, device), requires_grad=param.requires_grad)
        for name, buffer in buffers.items():
            module._buffers[name] = self.buffers[id(buffer)] if id(buffer) in self.buffers else _unset(buffer, device)
        kept = {name: module._parameters[name] for name, p in params.items() if id(p) not in self.initialized}
        if id(module) in self.waiting:
            self.unset += [params[name] for name in kept]
            self.unset += [module._buffers[name] for name, b in buffers.items() if id(b) not in self.buffers]
        else:
            self._run_init(module, device)
            self._check_initialized(module, {**kept, **{name: module._buffers[name] for name in buffers}})
        for name, param in params.items():  # `shard` finds tied parameters by the original objects
            module._parameters[name] = param
            self.initialized[id(param)] = param
        for name, buffer in buffers.items():
            self.buffers.setdefault(id(buffer), module._buffers[name])
        return kept

    def _run_init(self, module: nn.Module, device: torch.device) -> None:
        """Runs the init on this rank's random stream. Rank 0's values are the ones kept; other
        ranks fork their stream, so the values they compute (then replaced by rank 0's) leave
        it where it was."""
        accelerator = [] if device.type == "cpu" else [device.index]
        fork = dist.get_rank() != 0
        with torch.random.fork_rng(accelerator, enabled=fork, device_type=device.type), torch.no_grad():
            if self.init is not None:
                self.init(module)
            else:
                module.reset_parameters()

    def _check_initialized(self, module: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
        """Floating tensors start as NaN (`_unset`): one still NaN was not written by the init."""
        unset = [name for name, t in tensors.items() if t.is_floating_point() and bool(t.isnan().any())]
        if unset:
            how = "init(module)" if self.init is not None else f"{type(module).__name__}.reset_parameters()"
            raise ValueError(
                f"zpp_compile.shard: {how} left {listing(unset)} of module {self.names[id(module)]!r} unset (the "
                "model is on the meta device, so these have no values until initialized). The init must set every "
                "parameter and buffer the module holds itself (recurse=False), as torch's reset_parameters() does"
            )


def await_initialization(tensors: list[torch.Tensor], state: ShardingState) -> None:
    """Fills shards or buffers of the model sharded with `state` with NaN (where the dtype has it)
    and marks them as waiting for the model's own initialization: `check_initialized` looks at
    them before the next forward."""
    with torch.no_grad():
        for tensor in tensors:
            if tensor.is_floating_point() or tensor.is_complex():
                (tensor.to_local() if isinstance(tensor, DTensor) else tensor).fill_(math.nan)
                REGISTRY.unset[tensor] = state


def check_initialized(state: ShardingState) -> None:
    """Raises on every rank, before a forward of the model sharded with `state`, if a tensor that
    waited for its initialization still holds NaN where no value was written (one reduction
    across ranks, once: a rank's shard may be empty, and every rank must raise alike)."""
    waiting = [tensor for tensor, owner in REGISTRY.unset.items() if owner is state]
    if not waiting:
        return
    local = [t.to_local() if isinstance(t, DTensor) else t for t in waiting]
    flags = torch.stack([t.isnan().any() for t in local]).to(state.topology.device, torch.float32)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=state.topology.mesh.get_group())
    unset = []
    for tensor, flag in zip(waiting, flags.tolist()):
        if flag:
            unset.append(tensor)
        else:
            del REGISTRY.unset[tensor]
    if unset:
        verb = "holds" if len(unset) == 1 else "hold"
        raise RuntimeError(
            f"zeropp: {_names(unset, state)} {verb} no values yet: the model was built on the meta device or "
            "emptied by to_empty() after zpp_compile.shard, and nothing has initialized them since. Initialize "
            "the sharded model as the unsharded one, after shard() (e.g. model.init_weights(), "
            "model.apply(model._init_weights), nn.init.* on module.weight: each acts on the shards), or give "
            "shard(model, config, init=fn) a function that initializes one module's own parameters and buffers"
        )


def _names(tensors: list[torch.Tensor], state: ShardingState) -> str:
    """The qualified names of `tensors` in the models sharded with `state`, for an error message."""
    ids = {id(t) for t in tensors}
    names = [name for model, owner in REGISTRY.models.items() if owner is state
             for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]
             if id(t) in ids]
    return listing(names or [f"{len(tensors)} tensor(s)"])


def children_first(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every module of `model` once, with its qualified name, children before their parent (the
    order in which `nn.Module.apply` visits them)."""
    seen: set[int] = set()
    order: list[tuple[str, nn.Module]] = []

    def visit(prefix: str, module: nn.Module) -> None:
        seen.add(id(module))
        for name, child in module.named_children():
            if id(child) not in seen:
                visit(f"{prefix}.{name}" if prefix else name, child)
        order.append((prefix, module))

    visit("", model)
    return order


def _meta_tensor_names(module: nn.Module) -> list[str]:
    tensors = {**module._parameters, **module._buffers}
    return [name for name, t in tensors.items() if t is not None and t.is_meta]


def _unset(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Uninitialized memory for `tensor` on `device`: NaN where the dtype has it (so an init that
    misses it is caught), zeros otherwise."""
    out = torch.empty_like(tensor, device=device)
    return out.fill_(math.nan) if out.is_floating_point() or out.is_complex() else out.zero_()


def listing(names: list[str], shown: int = 8) -> str:
    """Names for an error message: the first `shown`, then how many more."""
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def broadcast_buffers(model: nn.Module, topology: Topology) -> None:
    """Every buffer takes rank 0's value, as DDP does at construction: ranks need not share a seed."""
    for buffer in model.buffers():
        staged = buffer.detach().to(topology.device).contiguous()  # the buffer itself where it can be
        dist.broadcast(staged, group_src=0, group=topology.mesh.get_group())
        if staged.data_ptr() != buffer.data_ptr():
            buffer.detach().copy_(staged)


def accept_full_tensors(module: nn.Module) -> None:
    """Lets `module.load_state_dict` take full (unsharded) tensors for its sharded parameters."""
    module.register_load_state_dict_pre_hook(_full_tensors_to_shards)


def _full_tensors_to_shards(module: nn.Module, state_dict: dict, prefix: str, *_) -> None:
    """A plain tensor of a sharded parameter's full shape becomes this rank's chunk of it (no
    communication: the caller gave every rank the full tensor). Anything else is left for
    `load_state_dict` to check and report."""
    for name, layout in module._zpp.layouts.items():
        key = prefix + name
        value, param = state_dict.get(key), module._parameters[name]
        if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.shape == layout.shape:
            full = value.detach().reshape(param.shape)
            local = full if param.dim() == 0 else full[slice(*shard_rows(param))]
            state_dict[key] = DTensor.from_local(local.to(param.device), param.device_mesh, param.placements,
                                                 run_check=False, shape=param.shape, stride=param.stride())


def shard_rows(tensor: DTensor) -> tuple[int, int]:
    """The rows [start, stop) of a dim-0 sharded DTensor this rank holds (torch.chunk's sizes)."""
    rows, world = tensor.shape[0], tensor.device_mesh.size()
    per_rank = padding.rows_per_rank(rows, world)
    start = min(tensor.device_mesh.get_local_rank() * per_rank, rows)
    return start, min(start + per_rank, rows)


def load_full_state_dict(
    model: nn.Module, state_dict: Mapping[str, torch.Tensor] | None, from_rank: int = 0, strict: bool = True
) -> None:
    """Loads an unsharded state dict, held by rank `from_rank` alone, into a sharded model.

    A collective: every rank calls it; ranks other than `from_rank` pass None. Rank `from_rank`
    reads one tensor at a time from `state_dict` (any mapping of names to tensors, e.g. one
    reading safetensors files lazily) and scatters it, so every other rank receives its chunk
    only: its memory grows by one chunk at most, never by a full tensor. Names and shapes are
    checked on `from_rank` first (a lazy mapping is read twice), and a mismatch is raised on
    every rank before anything is sent. A weight tied across modules may appear under any of
    its names (HF checkpoints keep one). With `strict=False`, missing entries keep their current
    values and extra ones are ignored. Values are cast to each parameter's or buffer's dtype.
    """
    state = REGISTRY.state_of(model) if isinstance(model, nn.Module) else None
    if state is None:
        raise ValueError("load_full_state_dict needs a model sharded by zpp_compile.shard (or a module holding one); "
                         "load an unsharded model with model.load_state_dict")
    topology = state.topology
    if not isinstance(from_rank, int) or not 0 <= from_rank < topology.world_size:
        raise ValueError(f"load_full_state_dict: from_rank={from_rank!r} is not a rank of this "
                         f"{topology.world_size}-rank job")
    targets = _load_targets(model)
    plan: list = [None, None]  # (error, the name each target is read from, or None)
    if topology.rank == from_rank:
        plan = list(_plan(targets, state_dict, strict))
    dist.broadcast_object_list(plan, group_src=from_rank, group=topology.mesh.get_group())
    error, sources = plan
    if error:
        raise ValueError(f"load_full_state_dict: {error}")
    with torch.no_grad():
        for (_, tensor), name in zip(targets, sources):
            if name is None or tensor.numel() == 0:
                continue
            value = state_dict[name] if topology.rank == from_rank else None
            if isinstance(tensor, DTensor) and tensor.dim():
                _scatter_rows(tensor, value, from_rank, topology)
            elif isinstance(tensor, DTensor):  # a 0-d parameter: every rank holds it
                _broadcast_into(tensor.to_local(), value, from_rank, topology)
            else:
                _broadcast_into(tensor, value, from_rank, topology)


def _load_targets(model: nn.Module) -> list[tuple[list[str], torch.Tensor]]:
    """Each distinct parameter and persistent buffer: (its names in a state dict, the tensor; a
    shard is a DTensor of the unsharded shape). A tied tensor has several names."""
    targets: dict[int, tuple[list[str], torch.Tensor]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        entry = targets.setdefault(id(tensor), ([], tensor))
        entry[0].append(name)
    return list(targets.values())


def _plan(targets: list[tuple[list[str], torch.Tensor]], state_dict: Mapping[str, torch.Tensor] | None,
          strict: bool) -> tuple[str | None, list[str | None]]:
    """Which entry of `state_dict` each target is read from, or what is wrong with it."""
    if not isinstance(state_dict, Mapping):
        given = type(state_dict).__name__
        return f"rank {dist.get_rank()} (from_rank) must pass a mapping of names to tensors, got {given}", []
    sources, missing, wrong = [], [], []
    for names, tensor in targets:
        shape = tensor.shape
        name = next((n for n in names if n in state_dict), None)
        sources.append(name)
        value = None if name is None else state_dict[name]
        if name is None:
            missing.append(" / ".join(names))
        elif not isinstance(value, torch.Tensor) or value.shape != shape:
            given = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            wrong.append(f"{name} (model {tuple(shape)}, given {given})")
    known = {n for names, _ in targets for n in names}
    unexpected = [n for n in state_dict if n not in known]
    problems = [f"shapes differ: {listing(wrong)}"] if wrong else []
    if strict and missing:
        problems.append(f"missing: {listing(missing)}")
    if strict and unexpected:
        problems.append(f"not in the model: {listing(unexpected)}")
    if problems:
        return ("the state dict does not fit the model (" + "; ".join(problems) + "). Load the checkpoint of this "
                "architecture and config, or pass strict=False to skip missing and extra entries"), []
    return None, sources


def _scatter_rows(target: DTensor, value: torch.Tensor | None, src: int, topology: Topology) -> None:
    """Copies this rank's rows of `value` (the full tensor, on rank `src` only) into `target`'s
    shard; every rank receives an equal, padded chunk, of which it keeps its rows."""
    world, rows = topology.world_size, target.shape[0]
    per_rank = padding.rows_per_rank(rows, world)
    local = target.to_local()
    received = local.new_empty((per_rank, *target.shape[1:]))
    chunks = None
    if value is not None:
        full = value.detach().to(topology.device, target.dtype).reshape(target.shape).contiguous()
        if per_rank * world > rows:
            full = torch.cat([full, full.new_zeros((per_rank * world - rows, *target.shape[1:]))])
        chunks = list(full.chunk(world))
    dist.scatter(received, chunks, group_src=src, group=topology.mesh.get_group())
    start, stop = shard_rows(target)
    local.copy_(received[: stop - start])


def _broadcast_into(target: torch.Tensor, value: torch.Tensor | None, src: int, topology: Topology) -> None:
    """Copies `value` (on rank `src` only) into the replicated `target` on every rank."""
    if value is not None:
        staged = value.detach().to(topology.device, target.dtype).reshape(target.shape).contiguous()
    else:
        staged = torch.empty(target.shape, dtype=target.dtype, device=topology.device)
    dist.broadcast(staged, group_src=src, group=topology.mesh.get_group())
    target.detach().copy_(staged)

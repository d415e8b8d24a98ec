"""`shard(model, config)`: every parameter kept as this rank's shard, gathered where it is used.

Each parameter becomes a DTensor sharded on dim 0 over all ranks (torch.chunk sizes, as FSDP2),
so the optimizer, `clip_grad_norm_`, `state_dict()` and torch.distributed.checkpoint see ordinary
sharded parameters under their original names. The module's class is swapped for a subclass
whose properties return the gathered weight inside forward: reading `module.weight` there calls
the `zpp::all_gather_param` IR op on the local shard, and autograd reduces the gradient back to
the shard through `zpp::reduce_grad`; outside forward it is the shard itself (`forward_scope`).
Run eagerly this is plain ZeRO-3; under `torch.compile(backend="zeropp")` the passes rewrite
those ops. With Config.compile_layers_once, each layer is compiled as a graph of its own, once
for every identical layer (`layer_graphs`). What zeropp keeps on each module holding shards is one object,
`module._zpp` (`module_state`).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import hashlib
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from ..compiler.layer_graphs import compile_layers_once, tie_across_graphs
from ..compiler.layer_graphs import forget_model as forget_layer_runs
from ..config import PER_RANK_FIELDS, Config, ConfigError
from ..reports.ledger import LEDGER
from ..runtime import ops  # noqa: F401  (registers the zpp ops)
from ..runtime.agreement import check_same_call
from ..runtime.prefetch import forget_calls
from ..runtime.registry import REGISTRY, ShardingState
from ..runtime.topology import Topology, build_topology, launcher_ranks_per_node
from ..torch_compat import TO_EMPTY_CONVERSION, ListedWithoutDynamoWalks, refuse_data_parallel
from . import leaf_modules, padding, stale_optimizers
from .added_parameters import added_after_shard
from .forward_scope import ForwardScope, attach_to_model, counting_forward
from .initialization import (
    MetaInit,
    accept_full_tensors,
    await_initialization,
    broadcast_buffers,
    check_initialized,
    children_first,
    listing,
)
from .module_state import SHARDED_CLASS_PREFIX, HeldShards, ParamLayout, class_name, held_shards
from .parameter_reads import gathered_weight


def shard(
    model: nn.Module,
    config: Config | Mapping[str, Any] | str | None = None,
    *,
    init: Callable[[nn.Module], None] | None = None,
) -> nn.Module:
    """Shards `model`'s parameters over all ranks, in place, and returns it.

    A collective: every rank calls it with the same model structure and config. Rank 0's
    parameter and buffer values are the ones kept, so ranks need not share a seed. Tied
    parameters stay tied; parameters with requires_grad=False are gathered but never reduced;
    buffers stay replicated.

    A model built on the meta device is materialized one module at a time, children before
    parents: each module's own parameters and buffers are allocated on the target device,
    initialized by `init(module)` (by default the module's `reset_parameters()`) and sharded, so
    a rank never holds more than its shards plus one module's parameters in full.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"zpp_compile.shard expects an nn.Module, got {type(model).__name__}")
    if model in REGISTRY.models:
        raise ValueError("this model is already sharded; call zpp_compile.shard once per model")
    config = Config.load(config)
    _check_same_on_every_rank(model, config)
    meta_init = MetaInit(model, init)
    topology = _topology(config)
    padded_numel = sum(padding.padded_numel(p, topology.world.size) for p in model.parameters())
    layers = _layers(model)
    layer_nbytes = max(_gathered_nbytes(layer, config, topology.world.size) for layer in layers.values())
    sharding_id, state = _register(ShardingState(config, topology, padded_numel, tuple(layers), layer_nbytes))
    sharded: dict[int, nn.Parameter] = {}
    indices: dict[int, int] = {}
    scope = ForwardScope()
    leaves = _leaf_modules(model, config)
    in_leaves = {id(member) for leaf in leaves for member in leaf.modules()}
    for qualified, module in children_first(model):
        initialized = meta_init.materialize(module, topology.device)
        names = [name for name, p in module._parameters.items() if p is not None]
        if not names:
            if next(module.parameters(), None) is not None:  # holds modules that hold shards
                module.__class__ = _container_class(type(module))
            continue
        layouts = {}
        for name in names:
            param = module._parameters[name]
            if isinstance(param, DTensor):
                raise ValueError(
                    f"parameter {name!r} of {type(module).__name__} is already a DTensor; zeropp "
                    "shards plain parameters (do not combine it with fully_shard or tensor parallel)"
                )
            if id(param) not in sharded:
                indices[id(param)] = len(sharded)
                sharded[id(param)] = _shard_parameter(initialized.get(name, param), state)
                stale_optimizers.note_replaced(param, f"{qualified}.{name}".lstrip("."))
            module._parameters[name] = sharded[id(param)]
            layouts[name] = _layout(param, state, sharding_id, indices[id(param)])
        module._zpp = HeldShards(sharding_id, scope, layouts, leaf_weights={} if id(module) in in_leaves else None)
        module.__class__ = _gathering_class(type(module), frozenset(names), id(module) in in_leaves)
        accept_full_tensors(module)
    if config.compile_layers_once:
        compile_layers_once(layers, sharding_id)
        tie_across_graphs(model, tuple(layers))
    for leaf in leaves:
        leaf_modules.attach(leaf)
    attach_to_model(model, scope)
    model.register_forward_pre_hook(_refuse_unsharded_trainable)
    refuse_data_parallel(model, ConfigError(_WRAPPED_IN_DDP))
    model.register_forward_pre_hook(_check_initialized_before_forward)
    broadcast_buffers(model, topology)
    await_initialization([sharded.get(id(t), t) for t in meta_init.unset], state)
    REGISTRY.models[model] = state
    return model


_WRAPPED_IN_DDP = (
    "zeropp: DistributedDataParallel is wrapping a model sharded by zpp.shard (a plain HF Trainer and "
    "accelerate's prepare(model) do this): its parameters are shards whose gradients zeropp reduces itself. "
    "Train it unwrapped: ZeroppTrainer instead of Trainer (or python -m zpp_compile.launch), "
    "accelerator.prepare(optimizer, dataloader) without the model, or the model itself in your own loop")


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded parameters and buffers under their original names and shapes.

    A collective (it all-gathers every parameter): call it on every rank. Every rank first checks
    that the others are calling it too, and raises RankMismatchError if not.
    """
    state = REGISTRY.state_of(model) if isinstance(model, nn.Module) else None
    if state is None:
        raise ValueError(f"full_state_dict needs a model sharded by zpp_compile.shard (or a module holding one, "
                         f"such as a PEFT wrapper around it), got {type(model).__name__}")
    check_same_call(state.topology, "zpp.full_state_dict")
    # A sharded parameter is a DTensor of its original shape, also under the keys a module's
    # state-dict hook gives it (torchtitan's fused QKV projection saves wq/wk/wv). Buffers are
    # this rank's own ([Note: buffers in checkpoints]).
    return {key: value.full_tensor() if isinstance(value, DTensor) else value
            for key, value in model.state_dict().items()}


def _leaf_modules(model: nn.Module, config: Config) -> list[nn.Module]:
    """The modules Config.leaf_modules names; a name that matches none is an error (a typo would
    otherwise leave the model as it was)."""
    named = [(name, module) for name, module in model.named_modules()]
    unmatched = [item for item in config.leaf_modules
                 if not any(leaf_modules.is_leaf(name, module, (item,)) for name, module in named)]
    if unmatched:
        classes = sorted({type(module).__name__ for _, module in named})
        raise ConfigError(f"Config.leaf_modules names {unmatched}, which match no module of this "
                          f"{type(model).__name__}; give class names ({listing(classes, 12)}) or qualified module "
                          "names")
    return [module for name, module in named if leaf_modules.is_leaf(name, module, config.leaf_modules)]


def _check_initialized_before_forward(model: nn.Module, _args: Any) -> None:
    """Before an eager forward: shards or buffers still waiting for their initial values are an
    error (`check_initialized`). Compiled steps check before each call of their graphs instead."""
    if not torch.compiler.is_compiling() and REGISTRY.unset:
        check_initialized(REGISTRY.models[model])


def _refuse_unsharded_trainable(model: nn.Module, _args: Any) -> None:
    """Raises before an eager forward of a sharded model that holds trainable parameters added after
    `shard` (`added_parameters`). Compiled, the backend refuses them."""
    if torch.compiler.is_compiling() or not torch.is_grad_enabled():
        return
    unsharded = [name for name, p in model.named_parameters() if p.requires_grad and p not in REGISTRY.params]
    if unsharded:
        raise added_after_shard(unsharded, "of this sharded model")


def _layers(model: nn.Module) -> dict[str, nn.Module]:
    """The model's layers by qualified name: the members of its largest stack of blocks, else its
    children. A stack is the children of an nn.ModuleList, nn.ModuleDict (torchtitan's blocks) or
    nn.Sequential, or two or more sibling modules of one class and parameter shapes (blocks held
    as attributes): the repeated blocks, which FSDP users shard one by one. Of stacks holding as
    many parameters, the one of more, smaller blocks wins."""
    numel = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    stacks = []
    for prefix, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
            stacks.append((prefix, list(module.named_children())))
            continue
        siblings: dict[tuple, list[tuple[str, nn.Module]]] = {}
        for name, child in module.named_children():
            if numel(child):
                siblings.setdefault(_structure(child), []).append((name, child))
        stacks.extend((prefix, group) for group in siblings.values() if len(group) > 1)
    stacks = [(prefix, members, sum(numel(m) for _, m in members)) for prefix, members in stacks]
    stacks = [stack for stack in stacks if stack[2]]
    if not stacks:
        return dict(model.named_children()) or {"": model}
    prefix, members, _ = max(stacks, key=lambda stack: (stack[2], len(stack[1])))
    return {f"{prefix}.{name}".lstrip("."): layer for name, layer in members}


def _structure(module: nn.Module) -> tuple:
    """What identical blocks share: the class and every parameter's name, shape and dtype."""
    return type(module), tuple((name, tuple(p.shape), p.dtype) for name, p in module.named_parameters())


def _gathered_nbytes(module: nn.Module, config: Config, world_size: int) -> int:
    """Bytes of `module`'s parameters as gathered: in param_dtype, rows padded to whole shards."""
    return sum(padding.padded_numel(p, world_size) * (config.param_dtype or p.dtype).itemsize
               for p in module.parameters())


def _check_same_on_every_rank(model: nn.Module, config: Config) -> None:
    """Raises on every rank if ranks shard different models or with different configs, which
    would otherwise hang or corrupt the first collective. One small all_gather_object."""
    if not dist.is_initialized():
        return  # _topology says how to initialize
    structure = hashlib.sha256(
        repr([(name, tuple(p.shape), str(p.dtype), p.is_meta) for name, p in model.named_parameters()]).encode()
    ).hexdigest()
    settings = {k: v for k, v in config.to_dict().items() if k not in PER_RANK_FIELDS}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (settings, structure))
    for rank, (theirs, their_structure) in enumerate(everyone):
        differing = sorted(k for k in settings if theirs.get(k) != everyone[0][0].get(k))
        if differing:
            values = ", ".join(f"{k}: rank 0 {everyone[0][0][k]!r}, rank {rank} {theirs[k]!r}" for k in differing)
            raise ConfigError(f"zpp_compile.shard got different configs on different ranks ({values}); "
                              "every rank must pass the same Config")
        if their_structure != everyone[0][1]:
            raise ValueError(
                f"zpp_compile.shard got a different model on rank {rank} than on rank 0 (parameter names, "
                "shapes, dtypes or meta device differ); every rank must build the same model before sharding it"
            )


def _register(state: ShardingState) -> tuple[int, ShardingState]:
    """The sharding id for a model of `state`, and the state it is registered under. A model gone
    since (deleted) whose state equals it gives back its id, so that the new model's Dynamo graphs
    are the gone one's and Inductor's caches serve them in the same process too (a model built again
    from scratch, as a benchmark or a sweep does); else a new id. The ranks decide together, so that
    ids stay equal across ranks. A collective call."""
    if state in REGISTRY.states:  # else nothing could be taken back: no full collection for the first model
        gc.collect()  # a deleted model that only reference cycles held is gone on every rank alike
    forget_calls()  # the layer graphs' gather predictions, which name models by sharding id
    reusable = REGISTRY.reusable_id(state)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, reusable)
    if reusable is not None and len(set(everyone)) == 1:
        LEDGER.forget_model(reusable)
        forget_layer_runs(reusable)
        return reusable, REGISTRY.states[reusable]
    return REGISTRY.add_state(state), state


def _topology(config: Config) -> Topology:
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized: launch with torchrun and call "
            "torch.distributed.init_process_group() (backend 'nccl' on GPUs, 'gloo' on CPUs) "
            "before zpp_compile.shard"
        )
    world_size = dist.get_world_size()
    ranks_per_node = config.ranks_per_node or launcher_ranks_per_node(world_size)
    config.check_topology(world_size, ranks_per_node)
    # A default group destroyed and initialized again in this process (a notebook, a test) leaves
    # the topologies built for the old one holding its dead groups: they go.
    world = dist.group.WORLD
    for stale in [key for key in REGISTRY.topologies if key[0] is not world]:
        del REGISTRY.topologies[stale]
    key = (world, ranks_per_node, config.hpz_partition_size, config.collective_timeout_s)
    if key not in REGISTRY.topologies:
        REGISTRY.topologies[key] = build_topology(*key[1:])
    return REGISTRY.topologies[key]


def _shard_parameter(param: nn.Parameter, state: ShardingState) -> nn.Parameter:
    # A 0-d parameter has no dim 0 to shard: every rank holds it (rank 0's value), and gathering
    # it gives every rank the mean gradient (`runtime.ops.FromEveryReplica`).
    placement = Replicate() if param.dim() == 0 else Shard(0)
    shard = distribute_tensor(param.detach().to(state.topology.device), state.topology.mesh, [placement])
    out = nn.Parameter(shard, requires_grad=param.requires_grad)
    REGISTRY.params[out] = state
    return out


def _layout(param: nn.Parameter, state: ShardingState, sharding_id: int, index: int) -> ParamLayout:
    topology, config = state.topology, state.config
    world = topology.world
    return ParamLayout(
        shape=param.shape,
        shard_size=padding.shard_numel(param, world.size),
        group_size=world.size,
        group_name=world.name,
        dtype=config.param_dtype or param.dtype,
        reduce_dtype=config.reduce_dtype,
        sharding_id=sharding_id,
        index=index,
    )


def _gathering_class(cls: type, names: frozenset[str], in_leaf: bool) -> type:
    """`cls` with a property per parameter name that returns the gathered parameter inside forward
    (inside a leaf module, the weight it gathered on entry) and the shard elsewhere
    (`forward_scope`), a forward counted as inside, a `__setattr__` that shards a parameter
    assigned to one of those names (`_assign_parameter`), and an `_apply` (behind `.to()`,
    `.bfloat16()`, ...) that converts the shards in place."""
    key = (cls, names, in_leaf)
    if key not in REGISTRY.gathering_classes:

        def gathered(name: str) -> property:
            if in_leaf:
                return property(functools.partial(_leaf_or_gathered, name=name))
            return property(functools.partial(gathered_weight, name=name))

        def _apply(self: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
            return _apply_to_shards(self, lambda: cls._apply(self, fn, recurse), fn)

        def __setattr__(self: nn.Module, name: str, value: Any) -> None:
            if name in names:
                _assign_parameter(self, name, value)
            else:
                cls.__setattr__(self, name, value)

        body = {name: gathered(name) for name in sorted(names)}
        body.update(_apply=_apply, __setattr__=__setattr__, forward=counting_forward(cls.forward))
        sharded_name = f"{SHARDED_CLASS_PREFIX}{cls.__name__}"
        REGISTRY.gathering_classes[key] = type(sharded_name, (ListedWithoutDynamoWalks, cls), body)
    return REGISTRY.gathering_classes[key]


def _container_class(cls: type) -> type:
    """`cls`, under its own name, listing its parameters as it did (`ListedWithoutDynamoWalks`:
    Dynamo then visits a sharded model's containers without walking every parameter under them)."""
    if cls not in REGISTRY.container_classes:
        REGISTRY.container_classes[cls] = type(cls.__name__, (ListedWithoutDynamoWalks, cls),
                                               {"__module__": cls.__module__, "__qualname__": cls.__qualname__})
    return REGISTRY.container_classes[cls]


def _leaf_or_gathered(module: nn.Module, name: str) -> torch.Tensor:
    weight = leaf_modules.leaf_weight(module, name)
    return gathered_weight(module, name) if weight is None else weight


def _assign_parameter(module: nn.Module, name: str, value: Any) -> None:
    """`module.<name> = value` for a parameter name `shard` sharded: a shard of the same model
    (tying two modules' parameters) is taken as it is; a plain Parameter is sharded as `shard`
    shards (rank 0's values are kept: a collective, so every rank assigns), and must have the
    shape of the parameter it replaces; None removes the parameter. As with a plain module, an
    optimizer made before holds the old parameter."""
    held = held_shards(module)
    state = REGISTRY.states[held.sharding_id]
    layouts, where = dict(held.layouts), f"{class_name(module)}.{name}"
    is_shard = False  # another module's shard assigned here: a tie
    if value is None:
        layouts.pop(name, None)
        module._parameters[name] = None
    elif not isinstance(value, nn.Parameter):
        raise TypeError(f"cannot assign a {type(value).__name__} to {where}, a sharded parameter: assign an "
                        "nn.Parameter (it is sharded over the ranks) or None")
    else:
        old, is_shard = layouts.get(name), value in REGISTRY.params
        if is_shard and REGISTRY.params[value] is not state:
            raise ValueError(f"cannot assign to {where} a parameter of another sharded model; "
                             "tie parameters within one model, or shard the models together")
        if not is_shard and isinstance(value, DTensor):
            raise ValueError(f"cannot assign to {where} a DTensor parameter that zeropp did not shard; assign a "
                             "plain nn.Parameter, which zeropp shards")
        if old is not None and value.shape != old.shape:
            raise ValueError(
                f"cannot assign a parameter of shape {tuple(value.shape)} to {where}, sharded with shape "
                f"{tuple(old.shape)}: a sharded parameter keeps its shape. Replace the module itself "
                f"(`parent.child = nn.Linear(...)`) before zpp_compile.shard, or assign a parameter of that shape"
            )
        new = value if is_shard else _shard_parameter(value, state)
        index = old.index if old is not None else -1  # -1: a parameter put where shard() found none
        layouts[name] = _layout(new, state, held.sharding_id, index)
        module._parameters[name] = new
    held.accumulators.pop(name, None)
    held.set_layouts(layouts)
    if state.config.compile_layers_once and (is_shard or name in held.tied):  # a tie made or undone
        model = next((model for model, its_state in REGISTRY.models.items() if its_state is state), None)
        if model is not None:
            tie_across_graphs(model, state.layers)


def _apply_to_shards(
    module: nn.Module, apply: Callable[[], nn.Module], fn: Callable[[torch.Tensor], torch.Tensor]
) -> nn.Module:
    """Runs nn.Module._apply (`apply`) on a module holding shards, as FSDP2 allows: each shard is
    converted in place (same Parameter object, so an optimizer built before keeps it), and its
    gathers then produce the new dtype unless Config.param_dtype fixes one. The shards must stay
    on the device of the process groups (`shard()` put them there). `to_empty()` (FSDP2's step
    before the model's own initialization) leaves each shard unset until something writes it."""
    held = held_shards(module)
    shards = {id(p): p for p in (module._parameters[name] for name in held.layouts)}
    for shard in shards.values():
        state = REGISTRY.params[shard]
        with torch.no_grad():
            target = fn(torch.empty(0, dtype=shard.dtype, device=shard.device)).device
        if not _same_device(target, state.topology.device):
            raise RuntimeError(
                f"cannot move the shards of {type(module).__name__} from {shard.device} to {target}: "
                f"zeropp keeps them on {state.topology.device}, the device of its process groups; move the "
                "model before zpp_compile.shard (dtype conversions such as .to(torch.bfloat16) are fine)"
            )
    # swap_tensors, which converts DTensor parameters in place, refuses a tensor that has weak
    # references; the registry's are the only ones.
    states = {key: REGISTRY.params.pop(shard) for key, shard in shards.items()}
    unset = {key: REGISTRY.unset.pop(shard) for key, shard in shards.items() if shard in REGISTRY.unset}
    try:
        out = apply()
    finally:
        for key, shard in shards.items():
            REGISTRY.params[shard] = states[key]
            if key in unset:
                REGISTRY.unset[shard] = unset[key]
    layouts = {}
    for name, layout in held.layouts.items():
        dtype = REGISTRY.states[layout.sharding_id].config.param_dtype or module._parameters[name].dtype
        layouts[name] = dataclasses.replace(layout, dtype=dtype)
    held.set_layouts(layouts)
    if getattr(fn, "__qualname__", "") == TO_EMPTY_CONVERSION:
        await_initialization(list(shards.values()), REGISTRY.params[next(iter(shards.values()))])
    return out


def _same_device(target: torch.device, device: torch.device) -> bool:
    """Whether `target` names `device`; a device without an index (to_empty(device="cuda"), as
    torchtitan calls it) means the current one, which is the rank's."""
    return target.type == device.type and target.index in (None, device.index)

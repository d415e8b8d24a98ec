"""The `zeropp` torch.compile backend.

Dynamo hands over the FX graph of the user's step; AOTAutograd turns it into a joint
forward + backward graph; the "joint" passes run on it before the min-cut partitioner splits it;
the "lowering" passes run on each partitioned graph; Inductor compiles the result. The passes are
attached through Inductor's public custom-pass hooks (`joint_custom_post_pass`,
`post_grad_custom_pre_pass`), so Inductor keeps its own pipeline intact. With
`Config.inductor=False` (debug mode) the same passes run under AOTAutograd alone and the
rewritten graphs execute without Inductor.
"""

from __future__ import annotations

import functools
import itertools
import logging
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
from torch.distributed.tensor import DTensor

from ..config import Config, ConfigError
from ..notices import timed_compile
from ..passes import PASSES, GraphPass
from ..runtime.agreement import check_same_gathers
from ..runtime.collectives import gathers_into_given_output
from ..runtime.cuda_graphs import graphed_inner_compile
from ..runtime.layer_scope import running_layer
from ..runtime.ops import RUN_TIME_GATHERS, gather_param_args, param_gathers
from ..runtime.registry import REGISTRY, ShardingState
from ..sharding.added_parameters import added_after_shard, names_in_sharded_models
from ..sharding.initialization import check_initialized
from ..sharding.local_shards import local_shard_inputs, reading_local_shards
from ..torch_compat import (
    CustomGraphPass,
    aot_autograd,
    compile_fx,
    compile_fx_inner,
    dynamo_frame_id,
    inductor_mode_options,
)
from .compile_cache import PassCache, to_local_as_method
from .layer_graphs import record_layer_run
from .pass_manager import PassManager

log = logging.getLogger(__name__)  # TORCH_LOGS="zpp_compile" shows it
# Each Dynamo graph the backend compiles gets the next id ("g3": its graphs are g3.forward, g3.backward),
# in compile order, the same on every rank (they compile the same graphs in the same order).
_GRAPH_IDS = itertools.count()


def zeropp_backend(
    gm: fx.GraphModule, example_inputs: Sequence[Any], options: Mapping[str, Any] | None = None, *,
    mode: str | None = None, passes: Sequence[GraphPass] = PASSES,
) -> Callable[..., Any]:
    """torch.compile backend: `torch.compile(model, backend="zeropp", options={...})`.

    `options` overrides the model's Config for this compilation (same keys as Config); the fields
    that shard() acts on (`config.SHARD_FIELDS`) may only repeat the model's values. torch.compile's
    `mode` (which torch allows instead of `options`) sets Inductor's settings for that mode, its
    CUDA graphs as `Config.cuda_graphs` (skipped off CUDA, as Inductor skips them). `passes`
    replaces zeropp's list of passes (to add one, or to wrap one to inspect its graph):
    `torch.compile(model, backend=functools.partial(zeropp_backend, passes=[...]), options={...})`.
    """
    state = _sharding_state(gm, example_inputs)
    if mode is not None:
        options = _mode_options(mode, state.config if state is not None else Config(), example_inputs)
    if state is None:  # a graph without parameters (e.g. the loss after a graph break)
        config = Config.load(dict(options or {}))
        return compile_fx(gm, example_inputs) if config.inductor else _aot_eager(gm, example_inputs, None)
    config = state.config.for_compilation(options, state.topology.ranks_per_node) if options else state.config
    buckets_within_layers = config.bucket_size == "layer"
    config = config.with_layer_size(state.layer_nbytes)
    # A layer's own graph (Config.compile_layers_once) is compiled while that layer runs.
    one_layer = running_layer() is not None
    manager = PassManager(config, state.topology, f"g{next(_GRAPH_IDS)}", state.layers,
                          _frame(example_inputs), passes, buckets_within_layers, one_layer)
    if not any(p.name == "lower_collectives" for p in manager.passes):  # zeropp's IR ops run as they are
        RUN_TIME_GATHERS.unlowered_graphs = True
    # Before anything is compiled or run: every rank compiles the same collectives.
    check_same_gathers(gm, state.topology, config.compiled_apart_from(state.config.with_layer_size(state.layer_nbytes)),
                       manager.graph_id)
    to_local_as_method(gm)
    example_inputs, shard_positions = local_shard_inputs(gm, example_inputs)
    if not any(isinstance(x, DTensor) for x in example_inputs):
        manager.shard_inputs = (len(example_inputs), shard_positions)
    compiled = reading_local_shards(_compile(gm, example_inputs, config, state, manager), shard_positions)
    if one_layer:
        compiled = record_layer_run(compiled, manager.graph_id, manager.dump)
    return _checking_initialized(compiled, state)


def _frame(example_inputs: Sequence[Any]) -> int | None:
    """What identifies the graph's frame in the ledger (`GraphComm.frame`): the Python frame Dynamo
    compiles and the parameters it reads. Frames of one code are compiled for many modules (each
    module Dynamo compiles on its own is a call of nn.Module's), and only a recompilation for the
    same parameters replaces a graph."""
    frame = dynamo_frame_id()
    if frame is None:
        return None
    params = sorted(id(x) for x in example_inputs if isinstance(x, torch.Tensor) and x in REGISTRY.params)
    return hash((frame, *params)) & (2**63 - 1)


def _checking_initialized(compiled: Callable[..., Any], state: ShardingState) -> Callable[..., Any]:
    """`compiled`, first checking, while some of the model's shards wait for their initial values
    (to_empty() after shard), that they have them: `check_initialized`, as an eager forward does."""

    def run(*args: Any) -> Any:
        if REGISTRY.unset:
            check_initialized(state)
        return compiled(*args)

    return run


def _compile(gm: fx.GraphModule, example_inputs: Sequence[Any], config: Config, state: ShardingState,
             manager: PassManager) -> Callable[..., Any]:
    """AOTAutograd with the passes, then Inductor (or, in debug mode, the graphs as FX code)."""
    if not config.inductor:
        return _aot_eager(gm, example_inputs, manager)
    cache = PassCache.open(manager, gm, example_inputs, dict(config.inductor_options))
    patches = {
        "joint_custom_post_pass": _StageHook(manager, "joint", cache),
        "post_grad_custom_pre_pass": _StageHook(manager, "lowering", cache),
        # Inductor times every configuration of a kernel that has several at its first run in a
        # process with cold caches, and a kernel that writes a buffer larger than the memory the
        # process has spare (the embedding's gradient) has that buffer copied back from the host
        # in each timed run. Pointwise kernels get a second, smaller block, which in the timings
        # of zeropp's and FSDP2's graphs lost or tied every time (docs/performance.md); a
        # reduction whose registers limit its occupancy gets a second block size, and since
        # Inductor stores no choice for a kernel that began with one configuration, it times both
        # in every new process. Both keep Inductor's heuristic configuration (max_autotune still
        # times pointwise kernels' configurations).
        "triton.autotune_pointwise": False,
        "dynamic_scale_rblock": False,
    }
    if any(p.name == "schedule_overlap" for p in manager.passes):
        # Inductor's own memory-driven reordering would undo the prefetch order, whose memory
        # the schedule already bounds.
        patches["reorder_for_peak_memory"] = False
    if gathers_into_given_output(state.topology.device):
        # Inductor ends the life of an out= collective's input at its issue, not at its wait, and
        # would write another buffer into that memory while the gather still reads it; without
        # reuse every buffer keeps its memory.
        patches["allow_buffer_reuse"] = False
        patches["inplace_buffers"] = False
    patches.update(config.inductor_options)
    inner_compile = compile_fx_inner
    if config.cuda_graphs:
        _check_on_cuda(example_inputs)
        patches["triton.cudagraphs"] = True
        inner_compile = functools.partial(graphed_inner_compile, timeout_s=config.collective_timeout_s)
    compiled = compile_fx(gm, example_inputs, config_patches=patches,
                          inner_compile=_announced(inner_compile, manager.graph_id))
    if cache is not None:
        cache.restore(manager)  # the graphs Inductor served from its caches, without running the passes
    return compiled


def _announced(inner_compile: Callable[..., Any], graph_id: str) -> Callable[..., Any]:
    """Inductor's compilation of each graph AOTAutograd hands it (forward, then backward at the first
    backward), said on rank 0 with its time (`notices`): a cold first step compiles for minutes."""

    def compile_one(gm: fx.GraphModule, example_inputs: Sequence[Any], *args: Any, **kwargs: Any) -> Any:
        kind = "backward" if kwargs.get("is_backward") else "inference" if kwargs.get("is_inference") else "forward"
        return timed_compile(inner_compile, f"graph {graph_id}'s {kind}")(gm, example_inputs, *args, **kwargs)

    return compile_one


def _mode_options(mode: str, config: Config, example_inputs: Sequence[Any]) -> dict[str, Any]:
    """torch.compile's `mode` as zeropp options: Inductor's settings for that mode on top of the
    model's `inductor_options`, and its CUDA graphs (reduce-overhead, max-autotune) as zeropp's
    own, which watch their collectives (`Config.cuda_graphs`). For a graph off CUDA, the mode's
    CUDA graphs are skipped and the rest of it applies, as Inductor does with such a graph; only
    an explicit `Config.cuda_graphs=True` there is an error (`_check_on_cuda`)."""
    try:
        settings = inductor_mode_options(mode)
    except RuntimeError as error:
        raise ConfigError(f"torch.compile(..., backend='zeropp', mode={mode!r}): {error}") from None
    if not config.inductor:
        raise ConfigError(f"torch.compile(..., backend='zeropp', mode={mode!r}) sets Inductor's options, but the "
                          "model's Config has inductor=False (debug mode); drop mode= or inductor=False")
    cuda_graphs = settings.pop("triton.cudagraphs", False)
    options: dict[str, Any] = {"inductor_options": {**dict(config.inductor_options), **settings}}
    if cuda_graphs and _devices(example_inputs) != {"cuda"}:
        log.info("mode=%r: no CUDA graphs for a graph reading tensors on %s (they need CUDA); the rest of the mode "
                 "applies", mode, sorted(_devices(example_inputs) - {"cuda"}))
    elif cuda_graphs:
        options["cuda_graphs"] = True
    return options


def _check_on_cuda(example_inputs: Sequence[Any]) -> None:
    devices = _devices(example_inputs)
    if devices != {"cuda"}:
        raise RuntimeError(
            f"Config.cuda_graphs=True needs the model and its inputs on CUDA, but the compiled step reads tensors "
            f"on {sorted(devices - {'cuda'})}; move them to the GPU or set cuda_graphs=False"
        )


def _devices(example_inputs: Sequence[Any]) -> set[str]:
    """The device types of the graph's tensor inputs."""
    return {x.device.type for x in example_inputs if isinstance(x, torch.Tensor)}


def _sharding_state(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> ShardingState | None:
    """The state of the sharded model whose parameters the graph gathers; errors on unsharded ones."""
    ids = {gather_param_args(n).sharding_id for n in param_gathers(gm.graph)}
    states = {i: REGISTRY.states[i] for i in ids}
    _refuse_unsharded(example_inputs, reads_shards=bool(states))
    if len(states) > 1:
        raise RuntimeError("one compiled graph reads parameters of two separately sharded models; shard them together")
    return next(iter(states.values()), None)


def _refuse_unsharded(example_inputs: Sequence[Any], reads_shards: bool) -> None:
    """Raises on the parameters the graph reads that shard() never saw. Where the graph also reads a
    sharded model's shards, or a sharded model holds them, they were added after shard: trainable
    ones are refused as an eager forward refuses them (`added_parameters`), frozen ones run as plain
    inputs, as they do eagerly. Anywhere else the model was never sharded."""
    unsharded = [t for t in example_inputs if isinstance(t, nn.Parameter) and t not in REGISTRY.params]
    if not unsharded:
        return
    names = names_in_sharded_models(unsharded)
    if not reads_shards and not names:
        shapes = ", ".join(str(tuple(t.shape)) for t in unsharded[:4])
        raise RuntimeError(
            f"the zeropp backend got {len(unsharded)} parameter(s) that are not sharded (shapes {shapes}); "
            "call zpp_compile.shard(model, config) before torch.compile(model, backend='zeropp')"
        )
    # Under no_grad (evaluation) nothing would need averaging; the eager check also lets it run.
    trainable = [t for t in unsharded if t.requires_grad] if torch.is_grad_enabled() else []
    if trainable:
        # One that no sharded model holds (a module of its own beside the model) goes by its shape.
        raise added_after_shard([names.get(id(t), f"a parameter of shape {tuple(t.shape)} held by no sharded model")
                                 for t in trainable], "read by this compiled step")


class _StageHook(CustomGraphPass):
    """Inductor custom-pass hook that runs one stage of the pass manager."""

    def __init__(self, manager: PassManager, stage: str, cache: PassCache | None) -> None:
        self.manager, self.stage, self.cache = manager, stage, cache

    def __call__(self, graph: fx.Graph) -> None:
        self.manager.run(self.stage, graph)
        if self.cache is not None and self.stage == "lowering":
            self.cache.save(self.manager.graphs)

    def uuid(self) -> str | None:
        # None (no cache key) makes Inductor compile afresh, running every pass (for the dump).
        return self.cache.uuid if self.cache is not None else None


def _aot_eager(gm: fx.GraphModule, example_inputs: Sequence[Any], manager: PassManager | None) -> Callable:
    """Debug mode: AOTAutograd with the passes, graphs run as plain FX code (no Inductor)."""

    def partition(joint: fx.GraphModule, joint_inputs: Sequence[Any], **kwargs: Any):
        if manager is not None:
            manager.run("joint", joint.graph)
            joint.recompile()
        return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)

    def lower(graph_module: fx.GraphModule, _inputs: Sequence[Any]) -> Callable:
        if manager is not None:
            manager.run("lowering", graph_module.graph)
            graph_module.recompile()
        return make_boxed_func(graph_module)

    return aot_autograd(fw_compiler=lower, bw_compiler=lower, partition_fn=partition)(gm, example_inputs)

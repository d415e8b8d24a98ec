"""Every private torch API zeropp uses, and every check of what the installed torch can do.

zeropp is a torch.compile backend, and some of what it needs torch offers only privately: how
Inductor is entered and configured, Dynamo's and AOTAutograd's bookkeeping, DTensor's internals,
the fake process group of a dry run, the default process group's store.
All of it is reached through this module, each name with why, so that a torch upgrade that moves
one breaks here, by name, and `tests/test_torch_compat.py` (seconds, no process group) says which.
Where torch's behaviour differs between the versions zeropp runs on, a feature check below asks
the installed torch what it does; nothing compares version strings, except the warning at import
for a torch outside the supported range (`zpp_compile.supported_torch`).

Graph node meta keys read or written by the passes: "val" (the fake value of a node, FX's
convention that every torch graph pass relies on), and those torch gives meaning to, named here:
the module stacks Dynamo records (`NN_MODULE_STACK`, and `FWD_NN_MODULE_STACK` on backward
nodes), the partitioner's recompute policy, region ids and placement (`RECOMPUTE`,
`AC_GRAPH_ID`, `PARTITIONER_TAG`), Inductor's stride pinning
(`REALIZE_TO_STRIDES`), the user-visible outputs compile_fx marks (`USER_VISIBLE_OUTPUTS`), and
Dynamo's `EXAMPLE_VALUE`.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx

# How many graphs Dynamo compiles for one frame before it runs the frame eagerly; a layer's own
# frame (compile_layers_once) gets a cap of its own.
from torch._dynamo import config as dynamo_config

# Debug mode: the passes under AOTAutograd without Inductor (how torch builds such backends).
from torch._dynamo.backends.common import aot_autograd  # noqa: F401

# Each pass's time in torch's compile-time report, its graph in TORCH_TRACE (tlparse).
from torch._dynamo.utils import dynamo_timed  # noqa: F401

# Which Python frame a graph was compiled for (dynamo_frame_id).
from torch._guards import (
    CompileContext,
    detect_fake_mode,  # noqa: F401
)

# Checking Config.inductor_options' names and whether Inductor's caches are on; the caches'
# folder, where the communication ledger's record of a cached graph goes.
from torch._inductor import config as inductor_config  # noqa: F401

# Inductor, entered as a custom backend does. Public torch.compile hands a backend no way to
# patch Inductor's config for one compilation (the pass hooks, per-graph settings) or to wrap
# its inner compile (CUDA graphs); these are the functions torch's own backends call.
from torch._inductor.compile_fx import compile_fx, compile_fx_inner  # noqa: F401  (re-exported)

# The interface Inductor's custom-pass hooks take, with the uuid() its caches key on.
from torch._inductor.custom_graph_pass import CustomGraphPass  # noqa: F401

# Replacement subgraphs are traced with Inductor's decompositions and the graph's own fake mode,
# as Inductor's passes trace theirs.
from torch._inductor.decomposition import select_decomp_table  # noqa: F401

# Inductor's folder for a device's compiled Triton kernels (TRITON_CACHE_DIR when the user set it).
from torch._inductor.runtime.cache_dir_utils import triton_cache_dir

# Inductor's caches' folder (beside Config.inductor_options' check above).
from torch._inductor.runtime.runtime_utils import cache_dir as inductor_cache_dir  # noqa: F401

# Each pass's graph in TORCH_TRACE (tlparse), beside dynamo_timed above.
from torch._logging import trace_structured  # noqa: F401
from torch.distributed.tensor import DTensor

NN_MODULE_STACK = "nn_module_stack"
FWD_NN_MODULE_STACK = "fwd_nn_module_stack"
RECOMPUTE = "recompute"  # a torch.utils.checkpoint.CheckpointPolicy the min-cut partitioner obeys
# The min-cut partitioner's grouping of recomputed nodes (a checkpointed region's id) and its
# placement tag, with the value that places a node in backward.
AC_GRAPH_ID = "ac_graph_id"
PARTITIONER_TAG, IN_BACKWARD = "partitioner_tag", "is_backward"
REALIZE_TO_STRIDES = "inductor_realize_to_strides"
USER_VISIBLE_OUTPUTS = "user_visible_output_idxs"
EXAMPLE_VALUE = "example_value"

# The functional collectives Inductor lowers and overlaps (what torch.distributed's
# _functional_collectives module calls).
C10D_FUNCTIONAL = torch.ops._c10d_functional

# Names torch gives no other mark:
# Dynamo records `DTensor.to_local()` as a call of a closure of this name on some versions,
# which AOTAutograd's cache refuses (compile_cache.to_local_as_method rewrites it).
DYNAMO_TO_LOCAL_CLOSURE = "prim_to_local"
# The conversion nn.Module.to_empty() hands to _apply (after shard, it leaves shards unset).
TO_EMPTY_CONVERSION = "Module.to_empty.<locals>.<lambda>"
# Keyword arguments compile_fx passes its inner compile: which graph it is, and whether
# Inductor could keep CUDA graphs on for it.
INNER_COMPILE_IS_BACKWARD = "is_backward"
INNER_COMPILE_CUDAGRAPHS = "cudagraphs"


class ListedWithoutDynamoWalks:
    """A module class mixin: `named_parameters` and `named_buffers` overridden, calling on to the
    class's own, so every caller sees the same names and tensors.

    At every visit of a module, Dynamo walks every parameter and buffer under it (marking each a
    static input, recording its name for export) unless the module's class overrides those two
    methods (or is FSDP-managed, which also drops Dynamo's guards under it). A graph break at
    each layer (Config.compile_layers_once) makes Dynamo restart the model's nested frames, each
    visiting the root: tens of walks of the whole model per first step (docs/performance.md says
    what they cost). The walks are not needed: Dynamo marks a parameter static when a graph reads
    it, and export's names are no concern of a training step."""

    def named_parameters(self, *args: Any, **kwargs: Any) -> Any:
        return super().named_parameters(*args, **kwargs)  # type: ignore[misc]

    def named_buffers(self, *args: Any, **kwargs: Any) -> Any:
        return super().named_buffers(*args, **kwargs)  # type: ignore[misc]


def cache_kernels_beside_inductors(device_index: int) -> None:
    """Points Triton's compiled-kernel cache at Inductor's folder for the device, unless the user
    chose one (TRITON_CACHE_DIR), as Inductor does when it builds its first kernel. zeropp's
    quantization kernels launch from eager custom ops: in a restarted job, whose graphs come from
    Inductor's caches, they can launch before Inductor builds any kernel, and would look in, and
    compile into, Triton's default folder, which the first job (Inductor's variable set by then)
    never filled; every restart would compile them again."""
    if "TRITON_CACHE_DIR" not in os.environ:
        os.environ["TRITON_CACHE_DIR"] = triton_cache_dir(device_index)


def compile_program_with_inductor(function: Any, example_inputs: list[torch.Tensor]) -> Any:
    """`function` (a program of ATen and custom ops, `runtime.programs`) traced on fake copies of
    `example_inputs` and compiled by Inductor, as a function of tensors like them. Traced by
    make_fx, as torch's own tests hand Inductor a graph: public torch.compile would go through
    Dynamo, which a run-time op may be called under with its frame evaluation off."""
    from torch.fx.experimental.proxy_tensor import make_fx

    graph = make_fx(function, tracing_mode="fake")(*example_inputs)
    return compile_fx(graph, example_inputs, config_patches={"triton.autotune_pointwise": False})


def inductor_mode_options(mode: str) -> dict[str, Any]:
    """Inductor's settings for torch.compile(mode=...), which torch hands a custom backend by name only."""
    return dict(torch._inductor.list_mode_options(mode))


def dynamo_frame_id() -> int | None:
    """The id of the Python frame Dynamo is compiling (the same for each recompilation of it), so a
    recompiled graph replaces the earlier one in the communication report."""
    compile_id = CompileContext.current_compile_id()
    return compile_id.frame_id if compile_id is not None else None


def in_autograd_backward() -> bool:
    """Whether autograd is running a backward pass on this thread (an eager activation-checkpoint
    recompute reads weights there, outside any module's forward). torch has no public way to ask;
    the graph task id is what its engine uses (-1 outside backward)."""
    return graph_task_id() != -1


def graph_task_id() -> int:
    """The backward pass autograd runs on this thread (-1 outside backward): what tells a nested
    backward (an eager checkpoint's recompute) from the one around it."""
    return torch._C._current_graph_task_id()


def at_backward_end(callback: Any) -> None:
    """Runs `callback` once the backward pass running now has run every node: the hook FSDP2
    finishes its gradient reductions with. Only from inside a backward pass."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def accumulates_into_grad(param: torch.Tensor, accumulator: Any) -> bool:
    """Whether the backward pass running now accumulates into `param.grad` with nothing of the
    user's around it: not `torch.autograd.grad` (which hands gradients back instead) nor a
    backward whose `inputs=` leave it out, no hook on the parameter (registered with
    `register_hook` or `register_post_accumulate_grad_hook`), and no graph of the backward built
    (create_graph). Then zeropp may set `.grad` itself, later in the same backward pass, as
    autograd would have. `accumulator`: the node that accumulates `param`'s gradient, as the
    autograd node reading `param` finds it (`gradient_accumulators`); asked of the parameter
    instead (`get_gradient_edge`), it costs two views through the parameter's subclass (DTensor)
    dispatch for each parameter in each backward pass. torch asks its engine the first question
    only privately."""
    if accumulator is None or torch.is_grad_enabled() or param._backward_hooks or param._post_accumulate_grad_hooks:
        return False
    try:
        return torch._C._will_engine_execute_node(accumulator)
    except RuntimeError:  # asked of a leaf while torch.autograd.grad runs, which accumulates into none
        return False


def gradient_accumulators(ctx: Any) -> list[Any]:
    """For each input of the autograd function whose backward runs with `ctx`, the node its
    gradient goes to: a leaf's gradient accumulator (None for an input that needs no gradient)."""
    return [node for node, _ in ctx.next_functions]


# An FX node's target when it is an operator (ATen or custom), not a Python function.
OpOverload = torch._ops.OpOverload


def op_arguments(op: OpOverload) -> list[Any]:
    """The schema's arguments of an operator (names, types, whether written)."""
    return op._schema.arguments


def mutates_arguments(target: Any) -> bool:
    """Whether `target` is an operator that writes one of its arguments in place."""
    return isinstance(target, OpOverload) and target._schema.is_mutable


def dtensor_parts(param: DTensor) -> tuple[torch.Tensor, Any]:
    """A DTensor's local tensor and its spec, read without building anything: the compiled step
    reads every shard each step, and `to_local()` records an autograd node per parameter."""
    return param._local_tensor, param._spec


def viewed_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor `t` is a view of (`t` itself if it is none): a compiled step reads each shard
    through a view made for the call, and only the shard outlives it. torch has no public accessor."""
    return t if t._base is None else t._base


def write_count(t: torch.Tensor) -> int:
    """How often `t` was written in place (autograd's version counter, which torch exposes only as
    this attribute): what tells a parameter written since a moment from one that was not, and a
    gradient zeroed in place (`zero_grad(set_to_none=False)`) from one left alone."""
    return t._version


def dtensor_with_spec(local: torch.Tensor, spec: Any) -> DTensor:
    """A DTensor of `local` laid out as `spec` says, as `to_local()`'s backward makes a gradient;
    the public `DTensor.from_local` checks its arguments and builds a new spec, about five times
    the cost per parameter and step."""
    return DTensor(local, spec, requires_grad=False)


def frame_recompile_limit(limit: int) -> Any:
    """A context, reusable and nestable, in which Dynamo compiles a frame up to `limit` times (never
    fewer than torch's own setting when it is made; older torch names it cache_size_limit)."""
    key = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    return dynamo_config.patch(**{key: max(limit, getattr(dynamo_config, key))})


def run_frames_as_python(function: Any) -> None:
    """Dynamo runs every frame of `function` as Python without asking its frame callback, whose
    check of a frame it will not compile (a function under `torch.compiler.disable(recursive=False)`)
    it does not remember and runs again at every call; the frames `function` calls are compiled as
    before. torch's own `torch._dynamo.skip` does this, privately."""
    from torch._dynamo.eval_frame import skip_code

    skip_code(function.__code__)


def dtensor_cache_keys_stable() -> bool:
    """Whether AOTAutograd's cache keys a DTensor input the same in every process (else a
    restarted job traces the whole step again unless PYTHONHASHSEED is fixed)."""
    return hasattr(DTensor, "_stable_hash_for_caching")


def cuda_graph_unsafe_tags() -> tuple[torch.Tag, ...]:
    """The op tag that keeps an op out of Inductor's CUDA graphs, where torch has it."""
    return (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()


def registers_per_sm(device: torch.device) -> int:
    """A GPU's registers per SM; torch versions that do not report it run on GPUs that all have 64K."""
    return getattr(torch.cuda.get_device_properties(device), "regs_per_multiprocessor", 65536)


def node_module_stack(node: fx.Node) -> dict[str, Any] | None:
    """The module stack Dynamo recorded for a node (forward), or the one AOTAutograd copied to its
    backward counterpart."""
    return node.meta.get(NN_MODULE_STACK) or node.meta.get(FWD_NN_MODULE_STACK)


def default_store() -> dist.Store:
    """The key-value store every rank met at in `init_process_group` (the default group's). A rank
    waiting in a collective cannot ask its process group which ranks have not arrived;
    runtime.agreement has each rank record its arrival at a collective call in this store, so a
    waiting rank can name the missing ones. torch hands the store out only privately."""
    return dist.distributed_c10d._get_default_store()


def init_fake_process_group(rank: int, world_size: int) -> None:
    """Makes torch's fake process group the default: rank `rank` of `world_size` in this process
    alone, every collective returning at once and moving nothing (an all-gather repeats this
    rank's part), so a dry run compiles and runs one rank's graphs of that world. torch registers
    the backend and its store only under torch.testing, imported here so that zeropp's own import
    does not load it."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


class NamedProcessGroup(dist.ProcessGroup):
    """A process group written in Python (runtime.simulated_group's) that answers `group_name`.

    torch names a group by calling its private `_set_group_name` once the backend's creator has
    returned it (distributed_c10d._new_process_group_helper); the C++ getter then reads the name
    from the group's registered backend, which a Python group has none of, and raises "ProcessGroup
    name not set". Functional collectives, DeviceMesh and zeropp's topology all find a group by that
    name, so the name given is kept here and answered from Python (torch's threaded test group reads
    it from distributed_c10d's private world map instead)."""

    def _set_group_name(self, name: str) -> None:
        self._zeropp_group_name = name
        super()._set_group_name(name)

    @property
    def group_name(self) -> str:
        return self._zeropp_group_name


def serve_fake_backend(creator: Any) -> None:
    """Has `creator(common_options, backend_options)` serve the process groups torch's "fake"
    backend is asked for; where it returns None, torch's own fake creator serves the request, as
    before. Idempotent: a later call replaces the earlier creator.

    Why: zeropp tells a world of one process (rank 0 alone playing every rank) by the backend name
    "fake" (runtime.topology builds its agreement group over gloo otherwise, which cannot form in
    one process; runtime.agreement skips the store's arrival counts), and the simulated network's
    groups are such a world. torch registers its fake creator only under torch.testing, and names
    it privately; the registration itself is public (`Backend.register_backend`)."""
    from torch.testing._internal.distributed import fake_pg  # registers torch's creator first, once

    torch_creator = fake_pg._create_fake_pg

    def serve(common_options: Any, backend_options: Any) -> dist.ProcessGroup:
        group = creator(common_options, backend_options)
        return group if group is not None else torch_creator(common_options, backend_options)

    devices = list(dist.Backend.backend_capability.get(dist.Backend.FAKE, ["cpu", "cuda"]))
    dist.Backend.register_backend(dist.Backend.FAKE, serve, extended_api=True, devices=devices)


# The library holding route_all_gather_out_to_python_groups' kernels, once they are registered
# (a Library's registrations last as long as the object).
_ALL_GATHER_OUT_KERNELS: list[torch.library.Library] = []


def route_all_gather_out_to_python_groups() -> None:
    """Makes the functional `all_gather_into_tensor_out` reach a Python group's (NamedProcessGroup's)
    `all_gather_single`, on CPU and CUDA tensors; once per process, later calls do nothing.

    Why: torch's kernel of the op (Functional.cpp) calls the C++ `ProcessGroup::_allgather_base`,
    which the trampoline of a Python group (PyProcessGroup) does not hand to Python, as it does
    `all_gather_single` and every other op zeropp issues: the base sends it to the group's C++
    backend for the device, which a Python group has none of ("No backend type associated with
    device type cpu"). zeropp gathers into a given output on CPU (runtime.collectives.
    gathers_into_given_output). The kernels registered here take precedence over torch's
    CompositeExplicitAutograd one for these devices and, for every group that is not a Python
    group, do what it does: `_allgather_base`, then the work registered for `wait_tensor` (both
    private in Python)."""
    if _ALL_GATHER_OUT_KERNELS:
        return
    from torch._C._distributed_c10d import AllgatherOptions, _register_work, _resolve_process_group

    def all_gather_into_tensor_out(input: torch.Tensor, group_size: int, group_name: str, *,
                                   out: torch.Tensor) -> torch.Tensor:
        group = _resolve_process_group(group_name)
        gather = group.all_gather_single if isinstance(group, NamedProcessGroup) else group._allgather_base
        _register_work(out, gather(out, input, AllgatherOptions()))
        return out

    library = torch.library.Library("_c10d_functional", "IMPL")
    for device in ("CPU", "CUDA"):
        library.impl("all_gather_into_tensor_out", all_gather_into_tensor_out, device)
    _ALL_GATHER_OUT_KERNELS.append(library)


# The name of the kernel `gpu_spin` launches, as a profiler trace shows it (torch's ATen/cuda/Sleep.cu).
GPU_SPIN_KERNEL = "spin_kernel"


def gpu_spin(cycles: int) -> None:
    """Occupies the current CUDA stream for `cycles` of the GPU's clock (one thread spinning on
    clock64(), so the SMs stay free for other streams' kernels): how the simulated network makes a
    collective last its modeled time on the communication stream. torch's `_sleep` is private
    (its own tests use it for the same purpose)."""
    torch.cuda._sleep(int(cycles))


class _RefusedDataParallel:
    """Stands where DistributedDataParallel reads the parameters it should leave alone
    (`_ddp_params_and_buffers_to_ignore`, which DDP's `_set_params_and_buffers_to_ignore_for_model`
    sets and its constructor reads first): read there, it raises `error`."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def __iter__(self):
        raise self.error


def refuse_data_parallel(module: torch.nn.Module, error: Exception) -> None:
    """Wrapping `module` in DistributedDataParallel raises `error`, before DDP touches a parameter
    (it would fail later, inside a broadcast of its parameters, far from the cause)."""
    module._ddp_params_and_buffers_to_ignore = _RefusedDataParallel(error)

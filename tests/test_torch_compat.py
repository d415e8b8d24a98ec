"""The contract with torch: each private API, hook, config key and node meta key that zeropp
reaches through `zpp_compile.torch_compat` exists and behaves as zeropp relies on.

Seconds in all, one process, no ranks: a torch upgrade that moves one of them fails here, by name,
instead of deep inside a compilation. Graphs are traced with stand-in compilers (nothing is
lowered to kernels); DTensors live on a fake process group of two ranks in this process.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils.checkpoint import CheckpointPolicy

from zpp_compile import torch_compat as tc
from zpp_compile.compiler.backend import _StageHook
from zpp_compile.runtime.collectives import ALL_GATHERS
from zpp_compile.supported_torch import unsupported_torch_warning

aten = torch.ops.aten


@pytest.fixture(scope="module")
def mesh():
    """A 1-D mesh of two ranks on a fake process group (collectives do nothing), this process rank 0."""
    assert not dist.is_initialized(), "another test left a process group in this process"
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield init_device_mesh("cpu", (2,))
    dist.destroy_process_group()


def dynamo_graph(fn, *args) -> fx.GraphModule:
    """The graph Dynamo gives a backend for fn(*args)."""
    graphs = []

    def backend(gm, _inputs):
        graphs.append(gm)
        return gm

    torch.compiler.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return graphs[0]


def aot_graphs(fn, *args, partition_fn=None) -> dict[str, fx.GraphModule]:
    """The forward and backward graphs AOTAutograd gives its compilers for fn(*args), after
    `partition_fn` (the min-cut partitioner by default) split the joint graph."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition

    graphs = {}

    def compiler(name):
        def compile_(gm, _inputs):
            graphs[name] = gm
            return make_boxed_func(gm)
        return compile_

    torch.compiler.reset()
    backend = tc.aot_autograd(fw_compiler=compiler("forward"), bw_compiler=compiler("backward"),
                              partition_fn=partition_fn or min_cut_rematerialization_partition)
    torch.compile(fn, backend=backend, fullgraph=True)(*args).sum().backward()
    return graphs


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        return torch.tanh(self.linear(x))


def test_inductor_entry_points_take_what_the_backend_passes():
    compile_fx = inspect.signature(tc.compile_fx).parameters
    assert {"config_patches", "inner_compile"} <= compile_fx.keys()
    # runtime.cuda_graphs reads these keyword arguments of the inner compile.
    from torch._inductor.compile_fx import _CompileFxKwargs
    assert {tc.INNER_COMPILE_IS_BACKWARD, tc.INNER_COMPILE_CUDAGRAPHS} <= _CompileFxKwargs.__annotations__.keys()
    assert {"__call__", "uuid"} <= tc.CustomGraphPass.__abstractmethods__
    _StageHook(None, "joint", None).uuid()  # the hook zeropp installs is instantiable (abstract methods met)


def test_inductor_config_keys_zeropp_sets_or_reads_exist():
    known = tc.inductor_config.get_config_copy()  # what Config.inductor_options is checked against
    patched = ("joint_custom_post_pass", "post_grad_custom_pre_pass", "dynamic_scale_rblock",
               "triton.autotune_pointwise", "reorder_for_peak_memory", "allow_buffer_reuse", "inplace_buffers",
               "triton.cudagraphs")
    assert [key for key in patched if key not in known] == []
    with tc.inductor_config.patch(dict.fromkeys(patched[2:], False)):  # compile_fx's config_patches do this
        pass
    for key in ("force_disable_caches", "fx_graph_cache", "fx_graph_remote_cache"):  # read by compile_cache
        assert hasattr(tc.inductor_config, key), key
    assert isinstance(tc.inductor_cache_dir(), str)


def test_mode_options_name_cuda_graphs_and_refuse_unknown_modes():
    assert tc.inductor_mode_options("reduce-overhead").get("triton.cudagraphs") is True
    with pytest.raises(RuntimeError):  # zeropp's backend turns this error into a ConfigError
        tc.inductor_mode_options("no-such-mode")


def test_dynamo_marks_nodes_with_module_stack_and_example_value_and_frame_id():
    frames = []

    def backend(gm, _inputs):
        frames.append(tc.dynamo_frame_id())
        return gm

    block = Block()
    torch.compiler.reset()
    compiled = torch.compile(block, backend=backend)
    compiled(torch.randn(2, 4))
    compiled(torch.randn(3, 5, 4))  # a new rank: the same frame compiled again
    assert len(frames) == 2 and frames[0] == frames[1] and isinstance(frames[0], int)
    assert tc.dynamo_frame_id() is None  # outside a compilation

    graph = dynamo_graph(block, torch.randn(2, 4))
    linear = next(n for n in graph.graph.nodes if n.op == "call_module" or n.target is torch._C._nn.linear)
    assert "linear" in str(linear.meta[tc.NN_MODULE_STACK])
    assert isinstance(next(iter(graph.graph.find_nodes(op="placeholder"))).meta[tc.EXAMPLE_VALUE], torch.Tensor)


def test_aot_graphs_carry_values_backward_module_stacks_and_obey_recompute_marks():
    x = torch.randn(2, 4, requires_grad=True)
    graphs = aot_graphs(Block(), x)
    backward = graphs["backward"].graph
    assert all(isinstance(n.meta["val"], torch.Tensor) for n in backward.find_nodes(op="placeholder"))
    assert any(tc.FWD_NN_MODULE_STACK in n.meta or tc.NN_MODULE_STACK in n.meta for n in backward.nodes
               if n.op == "call_function")
    assert any(tc.node_module_stack(n) for n in backward.nodes if n.op == "call_function")

    # The partitioner obeys the recompute mark zeropp's passes put on a joint graph's node.
    from functorch.compile import min_cut_rematerialization_partition

    def recompute_tanh(joint, inputs, **kwargs):
        for node in joint.graph.find_nodes(op="call_function", target=aten.tanh.default):
            node.meta[tc.RECOMPUTE] = CheckpointPolicy.MUST_RECOMPUTE
        return min_cut_rematerialization_partition(joint, inputs, **kwargs)

    graphs = aot_graphs(Block(), x, partition_fn=recompute_tanh)
    assert graphs["backward"].graph.find_nodes(op="call_function", target=aten.tanh.default), \
        "a tanh marked MUST_RECOMPUTE was not recomputed in backward"


def test_compile_fx_marks_user_visible_outputs_before_inner_compile():
    seen = []

    def inner_compile(gm, example_inputs, **kwargs):
        output = next(iter(reversed(gm.graph.nodes)))
        seen.append((bool(kwargs.get(tc.INNER_COMPILE_IS_BACKWARD)), output.meta.get(tc.USER_VISIBLE_OUTPUTS)))
        from functorch.compile import make_boxed_func
        return make_boxed_func(gm)

    def backend(gm, inputs):
        return tc.compile_fx(gm, inputs, inner_compile=inner_compile)

    torch.compiler.reset()
    torch.compile(Block(), backend=backend)(torch.randn(2, 4, requires_grad=True)).sum().backward()
    assert [backward for backward, _ in seen] == [False, True]
    assert all(outputs is not None for _, outputs in seen), seen


def test_the_partitioner_reads_the_region_and_placement_marks():
    import torch._functorch.partitioners as partitioners  # where the min-cut partitioner reads them

    source = inspect.getsource(partitioners)
    assert f'"{tc.AC_GRAPH_ID}"' in source
    assert f'"{tc.PARTITIONER_TAG}"' in source and f'"{tc.IN_BACKWARD}"' in source


def test_inductor_reads_the_stride_mark():
    import torch._inductor.graph as inductor_graph  # where Inductor realizes a marked node with its strides

    assert f'"{tc.REALIZE_TO_STRIDES}"' in inspect.getsource(inductor_graph)


def test_a_function_torch_compile_skips_compiles_what_it_calls_as_frames_of_their_own():
    # What layer_graphs builds on: the caller's graph breaks at the skipped function, and the
    # frame it calls is compiled once, its code's graph reused for a second call.
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def layer(x, w):
        return torch.relu(x @ w)

    skipped = torch.compiler.disable(lambda x, w: layer(x, w), recursive=False)
    step = torch.compile(lambda x, w1, w2: skipped(skipped(x.sin(), w1), w2).sum(), backend=backend)
    x, w1, w2 = torch.randn(2, 3), torch.randn(3, 3), torch.randn(3, 3)
    torch.testing.assert_close(step(x, w1, w2), torch.relu(torch.relu(x.sin() @ w1) @ w2).sum())
    relus = [gm for gm in graphs if any(n.target is torch.relu for n in gm.graph.nodes)]
    assert len(relus) == 1 and len(graphs) == 3  # before, the layer's, after


def test_a_frames_compile_cap_is_raised_within_the_context():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    @torch.compile(backend=backend, dynamic=False)
    def scaled(x, factor):
        return x * factor

    torch.compiler.reset()
    x = torch.randn(2)
    with tc.frame_recompile_limit(16):
        for factor in range(12):  # a graph per constant, more than torch's default cap of 8
            torch.testing.assert_close(scaled(x, factor), x * factor)
    assert len(graphs) == 12
    torch.compiler.reset()


def test_dynamo_walks_the_parameters_of_a_module_unless_its_class_lists_them_itself():
    # What ListedWithoutDynamoWalks relies on: at a visit of a module, Dynamo walks every parameter
    # under it, marking each a static input, unless the class overrides the listing; seen here on
    # a parameter forward never reads (one it reads is marked when the graph reads it).
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = nn.Linear(3, 3), nn.Linear(3, 3)

        def forward(self, x):
            return self.used(x)

    class Listed(tc.ListedWithoutDynamoWalks, Model):
        pass

    x = torch.randn(2, 3)
    for cls, walked in ((Model, True), (Listed, False)):
        torch.compiler.reset()
        module = cls()
        torch.testing.assert_close(torch.compile(module, backend="eager")(x), module(x))
        assert hasattr(module.unused.weight, "_dynamo_static_input_type") == walked, cls.__name__
        assert hasattr(module.used.weight, "_dynamo_static_input_type"), cls.__name__
        assert list(module.named_parameters()) == list(nn.Module.named_parameters(module))
        assert list(module.named_buffers(prefix="m")) == list(nn.Module.named_buffers(module, prefix="m"))
    torch.compiler.reset()


def test_triton_keeps_kernels_in_inductors_folder_unless_the_user_chose_one(monkeypatch, tmp_path):
    """Where Inductor keeps a device's compiled Triton kernels (its cache folder's triton/<device>),
    zeropp's kernels go too; a TRITON_CACHE_DIR the user set is left as it is."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    tc.cache_kernels_beside_inductors(1)
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "inductor" / "triton" / "1")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    tc.cache_kernels_beside_inductors(0)
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "mine")


def test_functional_collectives_zeropp_issues_exist():
    for name in ("all_gather_into_tensor", "all_gather_into_tensor_out", "reduce_scatter_tensor",
                 "all_to_all_single", "wait_tensor"):
        assert hasattr(tc.C10D_FUNCTIONAL, name), name
    assert all(isinstance(op, tc.OpOverload) for op in ALL_GATHERS)


def test_operator_schemas_tell_in_place_and_random_ops():
    assert tc.mutates_arguments(aten.add_.Tensor) and not tc.mutates_arguments(aten.add.Tensor)
    assert not tc.mutates_arguments(torch.add)  # a Python function, not an operator
    names = [a.name for a in tc.op_arguments(aten._scaled_dot_product_flash_attention_for_cpu.default)]
    assert "dropout_p" in names  # checkpoint_activations tells random attention by it
    assert tc.cuda_graph_unsafe_tags() == () or all(isinstance(t, torch.Tag) for t in tc.cuda_graph_unsafe_tags())


def test_autograd_backward_is_detected_only_inside_backward():
    inside = []
    x = torch.randn(3, requires_grad=True)
    y = x * 2
    y.register_hook(lambda grad: inside.append(tc.in_autograd_backward()))
    assert not tc.in_autograd_backward()
    y.sum().backward()
    assert inside == [True]


def test_autograd_tells_a_backward_that_only_accumulates_and_runs_callbacks_at_its_end():
    param = nn.Parameter(torch.ones(3))
    seen = []

    class Reads(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            (accumulator,) = tc.gradient_accumulators(ctx)
            seen.append((tc.graph_task_id() != -1, tc.accumulates_into_grad(param, accumulator)))
            tc.at_backward_end(lambda: seen.append("end"))
            return grad

    def loss():
        return (Reads.apply(param) * 2).sum()

    loss().backward()
    torch.autograd.grad(loss(), param)
    loss().backward(create_graph=True)
    param.grad = None
    hook = param.register_post_accumulate_grad_hook(lambda p: None)
    loss().backward()
    hook.remove()
    hook = param.register_hook(lambda grad: grad)
    loss().backward()
    hook.remove()
    assert tc.graph_task_id() == -1
    assert seen == [(True, True), "end"] + [(True, False), "end"] * 4


def test_to_empty_hands_apply_the_conversion_zeropp_recognizes():
    seen = []
    block = Block()
    original = nn.Module._apply

    def apply(module, fn, *args, **kwargs):
        seen.append(getattr(fn, "__qualname__", ""))
        return original(module, fn, *args, **kwargs)

    nn.Module._apply = apply
    try:
        block.to_empty(device="cpu")
    finally:
        nn.Module._apply = original
    assert seen and seen[0] == tc.TO_EMPTY_CONVERSION


def test_dtensor_parts_and_spec_constructor(mesh):
    local = torch.randn(2, 3)
    param = nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)]))
    got_local, spec = tc.dtensor_parts(param)
    assert torch.equal(got_local, local)
    assert spec.placements == (Shard(0),) and tuple(spec.shape) == (4, 3)
    grad = tc.dtensor_with_spec(torch.ones(2, 3), spec)
    assert isinstance(grad, DTensor) and grad.placements == (Shard(0),) and grad.shape == (4, 3)
    assert not grad.requires_grad
    assert isinstance(tc.dtensor_cache_keys_stable(), bool)


def test_the_default_groups_store_is_reachable(mesh):
    # runtime.agreement counts the ranks inside a collective call there (Store.add, public).
    assert isinstance(tc.default_store(), dist.Store)


def test_a_shards_views_lead_back_to_it_and_a_dtensor_write_counts_on_the_parameter(mesh):
    local = torch.randn(2, 3)
    assert tc.viewed_tensor(local.view_as(local)) is local and tc.viewed_tensor(local) is local
    param = nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)]))
    before = tc.write_count(param)
    with torch.no_grad():
        param.mul_(2)
    assert tc.write_count(param) == before + 1


def test_dynamo_reads_a_dtensor_shard_as_to_local_or_the_known_closure(mesh):
    param = nn.Parameter(DTensor.from_local(torch.randn(2, 3), mesh, [Shard(0)]))
    graph = dynamo_graph(lambda p: p.to_local() * 2, param)
    reads = [n for n in graph.graph.nodes if n.op == "call_method" and n.target == "to_local"
             or n.op == "call_function" and getattr(n.target, "__name__", None) == tc.DYNAMO_TO_LOCAL_CLOSURE]
    assert len(reads) == 1, graph.graph


def test_fake_mode_and_decompositions_for_traced_replacements():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        value = torch.empty(2)
    assert tc.detect_fake_mode([value]) is mode
    from torch.fx.experimental.proxy_tensor import make_fx

    traced = make_fx(torch.addr, decomposition_table=tc.select_decomp_table())(torch.ones(2, 2), torch.ones(2),
                                                                              torch.ones(2))
    assert not traced.graph.find_nodes(op="call_function", target=aten.addr.default)  # decomposed


def test_compile_time_and_trace_hooks_take_zeropp_arguments():
    with tc.dynamo_timed("zeropp.contract_test"):
        pass
    inspect.signature(tc.trace_structured).bind("artifact", metadata_fn=dict, payload_fn=str)


def private_torch_uses(path) -> list[str]:
    """The private torch names a source file's code (not its strings or comments) reaches: a
    `_name` in a `from torch... import` statement or in a `torch.` attribute chain, and DTensor's
    and an operator's private fields."""
    import tokenize

    def private(names: list[str]) -> list[str]:
        return [name for name in names if name.startswith("_") and not name.endswith("__")]

    found = []
    statement: list[tokenize.TokenInfo] = []
    for token in tokenize.generate_tokens(open(path).readline):
        if token.type not in (tokenize.NEWLINE, tokenize.ENDMARKER):
            if token.type in (tokenize.NAME, tokenize.OP):
                statement.append(token)
            continue
        words = [t.string for t in statement]
        if words[:2] == ["from", "torch"] or words[:2] == ["import", "torch"]:
            found += [f"{path}:{statement[0].start[0]}: {name}" for name in private(words)]
        else:
            for i, word in enumerate(words):
                if word == "torch" and (i == 0 or words[i - 1] != "."):
                    chain = []
                    while i + 2 < len(words) and words[i + 1] == ".":
                        chain.append(words[i + 2])
                        i += 2
                    found += [f"{path}:{statement[0].start[0]}: torch.{name}" for name in private(chain)]
                elif word == "." and i + 1 < len(words) and words[i + 1] in FIELDS:
                    found.append(f"{path}:{statement[0].start[0]}: .{words[i + 1]}")
        statement = []
    return found


FIELDS = ("_local_tensor", "_spec", "_schema")  # DTensor's and an operator's private fields


def test_private_torch_apis_are_reached_only_through_torch_compat():
    import pathlib

    import zpp_compile

    root = pathlib.Path(zpp_compile.__file__).resolve().parent.parent
    sources = [p for folder in ("zpp_compile", "passes", "runtime") for p in sorted((root / folder).rglob("*.py"))]
    assert len(sources) > 30
    uses = [use for path in sources if path.name != "torch_compat.py" for use in private_torch_uses(path)]
    assert uses == [], "private torch APIs outside zpp_compile/torch_compat.py (move them there, with why)"
    assert private_torch_uses(root / "zpp_compile" / "torch_compat.py")  # the scan sees them where they are


def test_a_torch_outside_the_supported_range_is_named_with_the_range():
    for inside in ("2.13.0", "2.13.0+cpu", "2.14.1", "2.15.0+cu128"):
        assert unsupported_torch_warning(inside) is None, inside
    for outside in ("2.11.0", "2.12.1+cu126", "2.16.0.dev20261201"):
        message = unsupported_torch_warning(outside)
        assert message and f"this is torch {outside}" in message and "supports torch 2.13 to 2.15" in message
        assert 'pip install "torch>=2.13,<2.16"' in message, message
    # The range is pyproject.toml's requirement.
    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert '"torch>=2.13,<2.16",' in pyproject


class RecordingGroup(tc.NamedProcessGroup):
    """A Python process group whose collectives do nothing but say they were called."""

    def __init__(self, rank: int, size: int) -> None:
        super().__init__(rank, size)
        self.calls: list[str] = []

    def allreduce(self, tensors, opts=None):
        self.calls.append("allreduce")
        return DoneWork()

    def all_gather_single(self, output, input, opts=None):
        self.calls.append("all_gather_single")
        output.view(self.size(), -1).copy_(input.reshape(1, -1))
        return DoneWork()


class DoneWork(dist.Work):
    def wait(self, timeout=None):
        return True


def test_a_python_group_keeps_its_name_and_functional_collectives_reach_it(mesh):
    groups = []

    def creator(options, backend_options):
        groups.append(RecordingGroup(options.group_rank, options.group_size))
        return groups[-1]

    dist.Backend.register_backend("zeropp_contract_python_group", creator, extended_api=True, devices=["cpu"])
    group = dist.new_group([0, 1], backend="zeropp_contract_python_group")
    assert group is groups[0] and isinstance(group.group_name, str) and group.group_name
    x = torch.arange(3.0)
    C10D = tc.C10D_FUNCTIONAL
    C10D.wait_tensor(C10D.all_reduce(x, "sum", group.group_name))  # resolved by the name it keeps
    # The gather into a given output reaches a Python group only through the routed kernel; every
    # other group (the fake world's own) is served as torch's kernel serves it.
    tc.route_all_gather_out_to_python_groups()
    tc.route_all_gather_out_to_python_groups()  # once per process
    out = C10D.wait_tensor(C10D.all_gather_into_tensor_out(x, 2, group.group_name, out=torch.empty(6)))
    assert torch.equal(out, x.repeat(2)) and group.calls == ["allreduce", "all_gather_single"]
    world = dist.group.WORLD.group_name
    out = C10D.wait_tensor(C10D.all_gather_into_tensor_out(x, 2, world, out=torch.empty(6)))
    assert out.shape == (6,)
    dist.destroy_process_group(group)


def test_torchs_fake_backend_can_be_served_by_another_creator(mesh):
    from torch.testing._internal.distributed import fake_pg

    asked = []

    def creator(options, backend_options):
        asked.append(list(options.global_ranks_in_group))
        return RecordingGroup(options.group_rank, options.group_size) if backend_options == "mine" else None

    capability = list(dist.Backend.backend_capability["fake"])
    tc.serve_fake_backend(creator)
    try:
        theirs = dist.new_group([0, 1])  # the fake world's default backend
        mine = dist.new_group([0, 1], pg_options="mine")
        assert asked == [[0, 1], [0, 1]]
        assert isinstance(mine, RecordingGroup) and not isinstance(theirs, RecordingGroup)
        assert dist.get_backend(theirs) == "fake" and dist.get_backend(mine) == "fake"
        dist.destroy_process_group(mine)
        dist.destroy_process_group(theirs)
    finally:  # torch's own creator again
        dist.Backend.register_backend("fake", fake_pg._create_fake_pg, extended_api=True, devices=capability)


def test_a_gpu_spin_occupies_the_stream_for_its_cycles():
    assert callable(torch.cuda._sleep)
    if not torch.cuda.is_available():
        pytest.skip("the spin itself needs a CUDA GPU")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    tc.gpu_spin(10_000_000)  # about 5 ms at 2 GHz
    end.record()
    end.synchronize()
    assert 1 < start.elapsed_time(end) < 100


def test_a_frame_run_as_python_is_not_checked_by_dynamo_again_and_the_frames_it_calls_still_compile():
    """compile_layers_once calls each layer through a function Dynamo must not compile; unmarked,
    Dynamo's frame callback checks that function's frame anew at every call (host time per layer)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append({getattr(n.target, "__name__", n.target) for n in gm.graph.nodes
                       if n.op in ("call_function", "call_method")})
        return gm.forward

    def layer(x):
        return x.sin()

    def marked(x):
        return layer(x) + 1

    def unmarked(x):
        return layer(x) + 1

    tc.run_frames_as_python(marked)
    calls = {name: torch.compiler.disable(fn, recursive=False) for name, fn in (("marked", marked),
                                                                                ("unmarked", unmarked))}
    x = torch.ones(3)
    for name, call in calls.items():
        compiled = torch.compile(lambda x: call(x) * 2, backend=backend)
        compiled(x)
        torch._dynamo.eval_frame.reset_skip_reasons()
        for _ in range(3):
            out = compiled(x)
        checked = [r for r in torch._dynamo.eval_frame.get_skip_reasons() if r.startswith(f"{name} (")]
        assert len(checked) == (0 if name == "marked" else 3), checked
        torch.testing.assert_close(out, (x.sin() + 1) * 2)
    # The layer's frame was compiled as a graph of its own (sin), the functions calling it ran as
    # Python (their `+ 1` is in no graph), and the caller resumed in a graph after them (the
    # second caller's code is the first's: Dynamo's cache served it).
    assert graphs == [{"sin"}, {"mul"}]

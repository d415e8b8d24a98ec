"""The simulated network's process group: rank 0 of a world alone in this process, each collective
filling its outputs as runtime/simulated_group.py says and lasting the network model's time.

In-process, no ranks started: each test makes the world and destroys it (one default group per
process), timing on the CPU with time.monotonic, generously (the machine may be busy); the one GPU
test times a collective with CUDA events.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn

from zpp_compile.runtime.network_model import collective_seconds, network_from_preset
from zpp_compile.runtime.simulated_group import (
    BACKEND,
    SimulatedGroup,
    SimulatedWorld,
    current_world,
    init_simulated_world,
)
from zpp_compile.runtime.topology import one_process_world

C10D = torch.ops._c10d_functional
# A slow network: 1 MB/s inside a node (every op at that rate), 0.5 MB/s between nodes, so a few
# kilobytes take tens of milliseconds, far above the machine's noise.
SLOW = ("intra_busbw_gbyte_per_s=0.001,inter_busbw_gbyte_per_s=0.0005,"
        + ",".join(f"intra_{op}_factor=1" for op in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")))


@contextlib.contextmanager
def simulated(world_size: int = 4, ranks_per_node: int = 2, overrides: str = "", preset: str = "ib-100g",
              device: str = "cpu") -> Iterator[SimulatedWorld]:
    """A simulated world for the test's length, destroyed after it."""
    assert not dist.is_initialized(), "another test left a process group in this process"
    world = init_simulated_world(world_size, network_from_preset(preset, ranks_per_node, overrides), device=device)
    try:
        yield world
    finally:
        dist.destroy_process_group()


def seconds_of(world: SimulatedWorld, group: dist.ProcessGroup, op: str) -> float:
    return world.ledger.entries()[(group.group_name, op)].seconds


def test_every_group_of_the_world_is_simulated_with_its_own_members():
    with simulated() as world:
        assert current_world() is world and isinstance(dist.group.WORLD, SimulatedGroup)
        assert one_process_world()  # how zeropp tells a world of one process (module docstring)
        assert dist.get_backend_config() == "cpu:fake"  # only the device it times: zeropp's shards stay there
        inside, across = dist.new_group([0, 1]), dist.new_group([0, 2])
        explicit = dist.new_group([0, 3], backend=BACKEND)
        assert dist.new_group([1, 2]) is dist.GroupMember.NON_GROUP_MEMBER
        assert [g.ranks for g in (dist.group.WORLD, inside, across, explicit)] == [(0, 1, 2, 3), (0, 1), (0, 2), (0, 3)]
        assert all(isinstance(g, SimulatedGroup) and g.rank() == 0 for g in (inside, across, explicit))
        assert inside.getBackendName() == BACKEND
    assert current_world() is None

    # Outside a simulated world torch's fake backend is torch's own, and the simulated one refuses.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        assert not isinstance(dist.group.WORLD, SimulatedGroup) and current_world() is None
        with pytest.raises(RuntimeError, match="init_simulated_world"):
            dist.new_group([0, 1], backend=BACKEND)
    finally:
        dist.destroy_process_group()


def test_gathers_put_this_ranks_input_in_every_place():
    with simulated():
        x = torch.arange(6.0).view(2, 3)
        places = [torch.full_like(x, -1) for _ in range(4)]
        dist.all_gather(places, x)
        assert all(torch.equal(p, x) for p in places)
        out = torch.full((8, 3), -1.0)
        dist.all_gather_into_tensor(out, x)
        assert torch.equal(out, x.repeat(4, 1))
        work = dist.all_gather_into_tensor(out2 := torch.empty(8, 3), x, async_op=True)
        work.wait()
        assert torch.equal(out2, x.repeat(4, 1))
        with dist._coalescing_manager(async_ops=True) as coalesced:
            dist.all_gather_into_tensor(a := torch.empty(8, 3), x)
            dist.all_gather_into_tensor(b := torch.empty(8), x[0].new_ones(2))
        coalesced.wait()
        assert torch.equal(a, x.repeat(4, 1)) and torch.equal(b, torch.ones(8))
        gathered = [None] * 4
        dist.all_gather_object(gathered, {"rank": 0})
        assert gathered == [{"rank": 0}] * 4
        at_root = [torch.empty_like(x) for _ in range(4)]
        dist.gather(x, at_root, dst=0)
        assert all(torch.equal(p, x) for p in at_root)
        # The functional collectives of compiled graphs, eagerly: the same group methods.
        name = dist.group.WORLD.group_name
        assert torch.equal(C10D.wait_tensor(C10D.all_gather_into_tensor(x, 4, name)), x.repeat(4, 1))
        given = C10D.all_gather_into_tensor_out(x, 4, name, out=torch.empty(8, 3))
        assert torch.equal(C10D.wait_tensor(given), x.repeat(4, 1))
        first, second = C10D.all_gather_into_tensor_coalesced([x, x[0]], 4, name)
        assert torch.equal(C10D.wait_tensor(first), x.repeat(4, 1))
        assert torch.equal(C10D.wait_tensor(second), x[0].repeat(4))


def test_reductions_leave_this_ranks_values_and_scatters_give_its_own_chunk():
    with simulated():
        x = torch.arange(8.0)
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):  # unscaled either way (module docstring)
            own = torch.empty(2)
            dist.reduce_scatter_tensor(own, x, op=op)
            assert torch.equal(own, x[:2])
        chunk = torch.empty(2)
        dist.reduce_scatter(chunk, list(x.chunk(4)))
        assert torch.equal(chunk, x[:2])
        y = x.clone()
        dist.all_reduce(y, op=dist.ReduceOp.SUM)
        dist.all_reduce(y, op=dist.ReduceOp.AVG, async_op=True).wait()
        dist.all_reduce_coalesced([y], async_op=False)
        dist.broadcast(y, src=0)
        dist.broadcast(y, src=3)  # from another root: this rank's values stay
        assert torch.equal(y, x)
        scattered = torch.full((2,), -1.0)
        dist.scatter(scattered, list(x.chunk(4)), src=0)
        assert torch.equal(scattered, x[:2])
        dist.scatter(scattered, None, src=2)  # another root's chunk: zeros, never stale memory
        assert torch.equal(scattered, torch.zeros(2))
        objects = ["root's"]
        dist.broadcast_object_list(objects, src=0)
        assert objects == ["root's"]
        dist.barrier()
        name = dist.group.WORLD.group_name
        assert torch.equal(C10D.wait_tensor(C10D.reduce_scatter_tensor(x, "sum", 4, name)), x[:2])
        out = C10D.reduce_scatter_tensor_out(x, "avg", 4, name, out=torch.empty(2))
        assert torch.equal(C10D.wait_tensor(out), x[:2])
        assert torch.equal(C10D.wait_tensor(C10D.all_reduce(x, "sum", name)), x)
        assert torch.equal(funcol.all_reduce(x, "avg", dist.group.WORLD), x)


def test_all_to_alls_send_this_ranks_chunks_back_to_their_places():
    with simulated():
        x = torch.arange(8.0)
        out = torch.full((8,), -1.0)
        dist.all_to_all_single(out, x)
        assert torch.equal(out, x)
        # Uneven splits: each place gets the common part of its chunk, zeros after it.
        uneven = torch.full((9,), -1.0)
        dist.all_to_all_single(uneven, x, output_split_sizes=[3, 2, 2, 2], input_split_sizes=[2, 2, 2, 2])
        assert uneven.tolist() == [0, 1, 0, 2, 3, 4, 5, 6, 7]
        places = [torch.full((2,), -1.0) for _ in range(4)]
        dist.all_to_all(places, list(x.chunk(4)))
        assert torch.equal(torch.cat(places), x)
        name = dist.group.WORLD.group_name
        assert torch.equal(C10D.wait_tensor(C10D.all_to_all_single(x, [2] * 4, [2] * 4, name)), x)


def test_a_cpu_collective_waits_its_modeled_time():
    with simulated(world_size=2, overrides=SLOW) as world:
        x = torch.zeros(12_500)  # 50 kB: 50 ms at 1 MB/s
        modeled = collective_seconds(world.network, "all_reduce", (0, 1), 50_000)
        assert 0.045 < modeled < 0.06
        start = time.monotonic()
        work = dist.all_reduce(x, async_op=True)
        issued = time.monotonic() - start
        work.wait()
        waited = time.monotonic() - start
        assert issued < 0.5 * modeled  # the host goes on; it is the wait that waits
        assert 0.9 * modeled <= waited <= 1.5 * modeled, (waited, modeled)
        assert seconds_of(world, dist.group.WORLD, "all_reduce") == pytest.approx(modeled)
        # A synchronous call waits as well.
        start = time.monotonic()
        dist.all_reduce(x)
        assert 0.9 * modeled <= time.monotonic() - start <= 1.5 * modeled


def test_back_to_back_collectives_follow_each_other_on_the_channel():
    with simulated(world_size=2, overrides=SLOW) as world:
        x = torch.zeros(12_500)
        modeled = collective_seconds(world.network, "all_reduce", (0, 1), 50_000)
        start = time.monotonic()
        first, second = dist.all_reduce(x, async_op=True), dist.all_reduce(x.clone(), async_op=True)
        second.wait()
        both = time.monotonic() - start
        assert first.is_completed()  # the channel ran it first
        assert 0.9 * 2 * modeled <= both <= 1.5 * 2 * modeled, (both, modeled)
        entry = world.ledger.entries()[(dist.group.WORLD.group_name, "all_reduce")]
        assert entry.count == 2 and entry.input_bytes == 100_000 and entry.ranks == (0, 1)


def test_a_group_inside_a_node_uses_the_intra_node_link_and_one_across_nodes_the_inter_node_link():
    with simulated(world_size=4, ranks_per_node=2, overrides=SLOW) as world:
        inside, across = dist.new_group([0, 1]), dist.new_group([0, 2])
        shard = torch.zeros(2_500)  # 10 kB per rank
        for group in (inside, across):
            dist.all_gather_into_tensor(torch.empty(5_000), shard, group=group)
        intra = collective_seconds(world.network, "all_gather", (0, 1), 10_000)
        inter = collective_seconds(world.network, "all_gather", (0, 2), 10_000)
        assert seconds_of(world, inside, "all_gather") == pytest.approx(intra)
        assert seconds_of(world, across, "all_gather") == pytest.approx(inter)
        assert inter == pytest.approx(2 * intra, rel=0.01)  # half the bandwidth between nodes
        assert world.ledger.seconds(op="all_gather") == pytest.approx(intra + inter)
        assert {row["op"] for row in world.ledger.rows()} == {"all_gather"}


def test_collectives_of_another_device_than_the_worlds_take_no_time():
    # A CUDA run's object collectives and zeropp's agreement checks run on CPU tensors.
    with simulated(world_size=2, overrides=SLOW, device="cuda") as world:
        start = time.monotonic()
        dist.all_reduce(torch.zeros(12_500))
        gathered = [None, None]
        dist.all_gather_object(gathered, "digest")
        assert time.monotonic() - start < 0.03 and gathered == ["digest"] * 2
        assert world.ledger.seconds() == 0.0 and world.ledger.entries()[("0", "all_reduce")].count == 1


def test_a_compiled_zeropp_step_runs_over_the_simulated_world():
    import zpp_compile as zpp

    with simulated(world_size=4, ranks_per_node=2) as world:
        torch.manual_seed(0)
        config = zpp.Config(quantized_weights=True, hpz_partition_size=2, quantized_gradients=True, ranks_per_node=2,
                            weight_block_size=32, gradient_block_size=32)
        model = zpp.shard(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)), config)
        try:
            world.ledger.clear()  # what the step ran, not what shard did
            step = torch.compile(model, backend="zeropp", options={"inductor": False})
            loss = step(torch.randn(4, 16)).square().mean()
            loss.backward()
            assert torch.isfinite(loss)
            grads = [p.grad.to_local() for p in model.parameters()]
            assert len(grads) == 4 and all(torch.isfinite(g).all() for g in grads)
            ran = {(t.ranks, op) for (_, op), t in world.ledger.entries().items() if t.seconds > 0}
            assert {((0, 1, 2, 3), "all_gather"),  # qwZ's gathers of forward
                    ((0, 1), "all_gather"),  # hpZ's gathers from the secondary copy in backward
                    ((0, 1), "all_to_all"), ((0, 2), "all_gather")} <= ran, ran  # qgZ's two hops
        finally:
            zpp.reset_comm_report()
            torch.compiler.reset()


def test_an_fsdp2_step_runs_over_the_simulated_world():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with simulated(world_size=4, ranks_per_node=2) as world:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        mesh = init_device_mesh("cpu", (4,))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        loss = model(torch.randn(4, 8)).square().mean()
        loss.backward()
        assert torch.isfinite(loss)
        assert all(torch.isfinite(p.grad.to_local()).all() for p in model.parameters())
        ops = {op for (_, op), t in world.ledger.entries().items() if t.ranks == (0, 1, 2, 3) and t.seconds > 0}
        assert {"all_gather", "reduce_scatter"} <= ops, ops


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_gpu_collective_delays_the_waiting_stream_by_its_modeled_time():
    with simulated(world_size=2, overrides=SLOW, device="cuda") as world:
        x = torch.zeros(5_000, device="cuda")  # 20 kB: 20 ms at 1 MB/s
        dist.all_reduce(x)  # measures the GPU's clock, outside the timing
        torch.cuda.synchronize()
        modeled = collective_seconds(world.network, "all_reduce", (0, 1), 20_000)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        host = time.monotonic()
        work = dist.all_reduce(x, async_op=True)
        work.wait()
        assert time.monotonic() - host < 0.5 * modeled  # the host does not block, as with NCCL
        end.record()
        end.synchronize()
        assert start.elapsed_time(end) / 1e3 == pytest.approx(modeled, rel=0.1)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Block() for _ in range(3))
        self.head = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_layer_graphs_report_the_bytes_of_the_whole_step_graph_with_hpz_inside_nodes():
    # Two nodes of two ranks: hpZ's backward gathers stay inside the node. A layer graph's first
    # gather runs ahead of its call (prefetch_across_layers): the report must count it over the
    # group it gathers over, as the whole-step graph's (it once counted the world instead).
    import zpp_compile as zpp

    by_phase = {}
    with simulated(world_size=4, ranks_per_node=2):
        for layers_once in (False, True):
            torch.manual_seed(0)
            config = zpp.Config(quantized_weights=True, hpz_partition_size=2, quantized_gradients=True,
                                ranks_per_node=2, weight_block_size=32, gradient_block_size=32,
                                compile_layers_once=layers_once)
            model = zpp.shard(_Stack(), config)
            try:
                zpp.reset_comm_report()
                step = torch.compile(model, backend="zeropp", options={"inductor": False})
                step(torch.randn(4, 16)).square().mean().backward()
                by_phase[layers_once] = zpp.comm_report(model).by_phase()
            finally:
                zpp.reset_comm_report()
                torch.compiler.reset()
    assert by_phase[True]["backward weight gather"][1] == 0, by_phase  # inside the node only
    assert by_phase[True]["backward weight gather"][0] > 0, by_phase
    assert by_phase[True] == by_phase[False], by_phase


def test_shard_builds_its_groups_anew_for_a_default_group_made_again():
    # A notebook or a test suite destroys the default group and initializes another in the same
    # process: groups built for the first are gone with it.
    import zpp_compile as zpp

    for _ in range(2):
        with simulated(world_size=4, ranks_per_node=2):
            model = zpp.shard(nn.Linear(8, 8), zpp.Config(hpz_partition_size=2, ranks_per_node=2))
            try:
                step = torch.compile(model, backend="zeropp", options={"inductor": False})
                step(torch.randn(2, 8)).sum().backward()
                assert torch.isfinite(model.weight.grad.to_local()).all()
            finally:
                zpp.reset_comm_report()
                torch.compiler.reset()

"""A simulated network for rank 0 of an N-rank world, alone in one process.

`init_simulated_world(world_size, network)` makes this process rank 0 of `world_size` ranks over a
process group whose collectives move nothing between processes but take the time
`network_model.collective_seconds` gives for their op, their group's span (inside a node or across
nodes) and their bytes. Every group made later (`dist.new_group`: zeropp's intra-node, inter-node
and hpZ groups, device meshes, FSDP2's) is simulated too, with its own member ranks.

What the outputs hold (every rank is taken to hold what this rank holds, so nothing is left
uninitialized and a program runs on to plausible numbers):

- all-gather (list, into one tensor, coalesced): this rank's input in every rank's place;
- reduce-scatter (list, from one tensor, coalesced): this rank's own chunk of its input, whatever
  the op. A real SUM of equal ranks would be n times it; AVG, MIN, MAX give the chunk itself;
  PREMUL_SUM would scale it: every reduction here leaves values unscaled, so with SUM (or FSDP2's
  pre- and post-division) the numbers differ from a world of equal ranks by a factor;
- all-reduce (and coalesced), reduce: the tensor as it is (the same rule);
- all-to-all (list, single with or without splits): this rank's chunk j back in its output's
  place j; where split sizes differ, the common part is copied and the rest of the output zeroed;
- broadcast: the tensor as it is (from another root: this rank's own values, unchanged);
- scatter: this rank's chunk when it is the root, zeros otherwise; gather: the input in every
  rank's place at the root;
- barrier: nothing (timed as NCCL's barrier, an all-reduce of one float).

Gradients trained this way are not a real world's: each rank's batch stands for every rank's, and
sums are not multiplied by the world size. The simulation is of time, not of numbers.

Time. The process's collectives occupy one communication channel in issue order, as NCCL's
stream does: each starts when the channel is free and its inputs are ready, and lasts its modeled
seconds.

- On CUDA (the world's device): the output fill, then a spin of the modeled duration
  (`torch_compat.gpu_spin`), run on a communication stream of the device after everything issued
  on the current stream so far; `Work.wait()` makes the waiting stream wait for its end, and the
  host goes on, as with NCCL (a barrier's wait blocks the host, as NCCL's does). The spin counts
  the GPU's clock cycles; their rate is measured once per device (`cycles_per_second`). The
  fill's copies are real kernels on that stream and add their own (small) time to the modeled.
- On the CPU: outputs are filled at once; the channel is a modeled clock (time.monotonic), and
  `Work.wait()` sleeps until the collective's modeled end, so the program waits where it would;
  the sleeps add up to `SimulatedWorld.host_waited_seconds()`, the run's exposed communication.
- Collectives on tensors of another device than the world's (object collectives, zeropp's
  agreement checks: CPU tensors in a CUDA run) are filled at once and take no time.

`SimulatedWorld.ledger` records each group's collectives by op (count, bytes, charged seconds):
what ran, for a benchmark's exposed communication, unlike zpp_compile.reports.ledger, which reads what the
compiled graphs say they issue.

Naming: the world's groups are made under torch's backend name "fake" (`torch_compat.
serve_fake_backend`), by which zeropp tells a world of one process (`topology.one_process_world`:
it then builds its agreement group on the same backend instead of gloo, which cannot form in one
process), for the world's device type and the CPU only ("cpu:fake" for a CPU world on a machine
with GPUs), so that zeropp keeps its shards where the collectives are timed. They
report themselves as `BACKEND` (`getBackendName`), and `dist.new_group(backend=BACKEND)` makes one
explicitly. Torch's own fake groups are served as before whenever the default group is not a
simulated world's.

Every collective reaches a group of Python methods: torch.distributed's calls directly, those of
compiled graphs (`torch.ops._c10d_functional`) through torch's trampoline for Python groups, and
the functional all-gather into a given output (zeropp's on CPU), which that trampoline misses in
torch 2.13, through kernels of its own (`torch_compat.route_all_gather_out_to_python_groups`).

Not simulated: point-to-point ops (send, recv), which a world of one process has no peer for.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ..torch_compat import (
    GPU_SPIN_KERNEL,
    NamedProcessGroup,
    gpu_spin,
    route_all_gather_out_to_python_groups,
    serve_fake_backend,
)
from .network_model import Network, collective_seconds

BACKEND = "zeropp_simulated"
# What a profiler trace names the kernel a collective occupies the communication stream with on
# CUDA: a benchmark counts it as communication, as it counts NCCL's kernels.
COLLECTIVE_KERNEL = GPU_SPIN_KERNEL
BARRIER_BYTES = 4  # NCCL's barrier: an all-reduce of one float


@dataclass(frozen=True)
class Traffic:
    """What one group ran of one op: how many collectives, their bytes (each rank's input, the
    network model's convention) and the modeled seconds they were charged."""

    ranks: tuple[int, ...]
    count: int = 0
    input_bytes: int = 0
    seconds: float = 0.0


class CollectiveLedger:
    """Every collective a simulated world ran, by (group name, op); safe to read and write from
    several threads (zeropp's agreement checks run in one of their own)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[tuple[str, str], Traffic] = {}

    def record(self, group: str, ranks: tuple[int, ...], op: str, input_bytes: int, seconds: float) -> None:
        with self._lock:
            entry = self._entries.get((group, op), Traffic(ranks))
            self._entries[(group, op)] = replace(entry, count=entry.count + 1,
                                                 input_bytes=entry.input_bytes + input_bytes,
                                                 seconds=entry.seconds + seconds)

    def entries(self) -> dict[tuple[str, str], Traffic]:
        """A snapshot: (group name, op) to its traffic."""
        with self._lock:
            return dict(self._entries)

    def seconds(self, op: str | None = None, group: str | None = None) -> float:
        """Modeled seconds charged, of `op` and `group` where given, of all otherwise."""
        return sum(t.seconds for (g, o), t in self.entries().items() if op in (None, o) and group in (None, g))

    def rows(self) -> list[dict[str, Any]]:
        """The ledger as JSON-ready rows, one per group and op."""
        return [{"group": g, "ranks": list(t.ranks), "op": o, "count": t.count, "input_bytes": t.input_bytes,
                 "seconds": t.seconds} for (g, o), t in sorted(self.entries().items())]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


class HostChannel:
    """The communication channel of a CPU run: a modeled clock on which collectives follow each
    other in issue order."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free_at = 0.0  # time.monotonic() at which the last collective issued ends
        self._waited = 0.0

    def occupy(self, seconds: float) -> float:
        """Books a collective of `seconds` issued now (its inputs are ready: CPU ops run in
        order); returns the time.monotonic() at which it ends."""
        with self._lock:
            self._free_at = max(time.monotonic(), self._free_at) + seconds
            return self._free_at

    def wait_until(self, ends_at: float) -> None:
        """Sleeps until `ends_at`, adding the sleep to `waited_seconds`."""
        slept = max(0.0, ends_at - time.monotonic())
        time.sleep(slept)
        with self._lock:
            self._waited += slept

    def waited_seconds(self) -> float:
        """Seconds the program has stood waiting for this channel's collectives: a CPU run's
        exposed communication (what no computation hid)."""
        with self._lock:
            return self._waited


class DeviceChannel:
    """The communication channel of one GPU: a stream of its own, as NCCL's, on which each
    collective fills its outputs and then spins for its modeled time."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.cycles_per_second = measure_cycles_per_second(self.stream)

    def run(self, fill: Callable[[], None], seconds: float, tensors: Sequence[torch.Tensor]) -> torch.cuda.Event:
        """Fills and spins on the stream after all the current stream has been given (so the
        inputs are ready); returns the event of the collective's end."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            fill()
            if seconds > 0:
                gpu_spin(round(seconds * self.cycles_per_second))
            done = torch.cuda.Event()
            done.record(self.stream)
        for tensor in tensors:  # the caller's memory is not reused before the stream is done with it
            tensor.record_stream(self.stream)
        return done


# Two spins, timed with CUDA events: the slope between them is the clock's rate, without the
# launch's fixed cost. About 1 and 8 ms on a GPU of 2 GHz.
_SHORT_SPIN, _LONG_SPIN = 2**21, 2**24


def measure_cycles_per_second(stream: torch.cuda.Stream) -> float:
    """The rate of the clock `gpu_spin` counts on `stream`'s GPU, in cycles per second: two spins
    of different lengths timed with CUDA events, their difference in cycles over their difference
    in time (which cancels the launch's cost), after a spin that brings the clock up to speed.
    The SM clock may change later (power or heat limits); it is measured once per device."""
    with torch.cuda.stream(stream):
        gpu_spin(_LONG_SPIN)  # loads the kernel and lifts the clock from idle
        elapsed = []
        for cycles in (_SHORT_SPIN, _LONG_SPIN):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            gpu_spin(cycles)
            end.record(stream)
            end.synchronize()
            elapsed.append(start.elapsed_time(end) / 1e3)
    return (_LONG_SPIN - _SHORT_SPIN) / (elapsed[1] - elapsed[0])


class SimulatedWork(dist.Work):
    """One simulated collective: waiting for it waits for its modeled end (the host until it on
    the CPU; on CUDA the waiting stream, or the host for a barrier)."""

    def __init__(self, outputs: list[torch.Tensor], *, ends_at: float | None = None, channel: HostChannel | None = None,
                 done: torch.cuda.Event | None = None, blocks_host: bool = False) -> None:
        super().__init__()
        self._outputs = outputs
        self._ends_at = ends_at
        self._channel = channel
        self._done = done
        self._blocks_host = blocks_host

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self._done is not None:
            if self._blocks_host:
                self._done.synchronize()
            else:
                torch.cuda.current_stream().wait_event(self._done)
        elif self._ends_at is not None and self._channel is not None:
            self._channel.wait_until(self._ends_at)
        return True

    def is_completed(self) -> bool:
        if self._done is not None:
            return self._done.query()
        return self._ends_at is None or time.monotonic() >= self._ends_at

    def result(self) -> list[torch.Tensor]:
        return self._outputs

    def get_future(self) -> torch.futures.Future:
        """A future already done (its wait taken first, so its values are ready where it is read)."""
        self.wait()
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(self._outputs)
        return future


class SimulatedWorld:
    """The network, channels and ledger every simulated group of this process shares; made by
    `init_simulated_world`, reachable from any of its groups (`current_world()`), and readable
    after the process group is destroyed."""

    def __init__(self, world_size: int, network: Network, device: torch.device) -> None:
        self.world_size = world_size
        self.network = network
        self.device = device  # collectives on its type are timed; others take no time
        self.ledger = CollectiveLedger()
        self._host = HostChannel()
        self._lock = threading.Lock()
        self._device_channels: dict[torch.device, DeviceChannel] = {}

    def device_channel(self, device: torch.device) -> DeviceChannel:
        """The channel of a GPU, made (and its clock measured) at its first collective."""
        with self._lock:
            if device not in self._device_channels:
                self._device_channels[device] = DeviceChannel(device)
            return self._device_channels[device]

    def issue(self, group: SimulatedGroup, op: str, input_bytes: int, device: torch.device,
              fill: Callable[[], None], outputs: list[torch.Tensor], tensors: Sequence[torch.Tensor],
              *, model_as: str | None = None, blocks_host: bool = False) -> SimulatedWork:
        """Runs one collective of `group`: `fill` writes its outputs, and it is charged the
        modeled seconds of `model_as` (the network model's op; `op` itself by default) over the
        group's ranks when it runs on the world's device type, none otherwise."""
        timed = device.type == self.device.type
        seconds = collective_seconds(self.network, model_as or op, group.ranks, input_bytes) if timed else 0.0
        self.ledger.record(group.group_name, group.ranks, op, input_bytes, seconds)
        with torch.no_grad():
            if timed and device.type == "cuda":
                done = self.device_channel(device).run(fill, seconds, tensors)
                return SimulatedWork(outputs, done=done, blocks_host=blocks_host)
            fill()
        if not timed:
            return SimulatedWork(outputs)
        return SimulatedWork(outputs, ends_at=self._host.occupy(seconds), channel=self._host)

    def host_waited_seconds(self) -> float:
        """Seconds a CPU run has stood waiting for its collectives (`HostChannel.waited_seconds`);
        0 on CUDA, where the waiting is a stream's (a profiler trace shows it)."""
        return self._host.waited_seconds()


def _nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _apart_from(source: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    """`source`, copied where it shares memory with `output` (an in-place all-gather's input is its
    own place in the output, as FSDP2 issues it), so that filling `output` does not read what it
    writes."""
    return source.clone() if _shares_memory(source, output) else source


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors are views of one storage (the overlap an in-place collective has)."""
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _copy_chunk(output: torch.Tensor, chunk: torch.Tensor) -> None:
    """`chunk` into `output`; where their sizes differ (an all-to-all's uneven splits), the common
    part, and zeros after it."""
    if output.shape == chunk.shape:
        output.copy_(chunk)
        return
    flat, source = output.view(-1), chunk.reshape(-1)
    common = min(flat.numel(), source.numel())
    flat[:common].copy_(source[:common])
    flat[common:].zero_()


def _split(tensor: torch.Tensor, sizes: Sequence[int] | None, parts: int) -> list[torch.Tensor]:
    """An all-to-all buffer's chunks along dim 0: `sizes` rows each, or `parts` equal ones."""
    return list(tensor.split(list(sizes))) if sizes else list(tensor.chunk(parts))


class SimulatedGroup(NamedProcessGroup):
    """A process group of `ranks` (global ranks, this process's among them) in a simulated world.
    Method names are those torch's C++ ProcessGroup calls a Python group by (its pybind names:
    `all_gather_single` for `_allgather_base`, `reduce_scatter_single` for `_reduce_scatter_base`,
    `all_gather_single_coalesced` for `allgather_into_tensor_coalesced`, and so on), which both
    torch.distributed's eager calls and the functional collectives of compiled graphs reach."""

    def __init__(self, world: SimulatedWorld, ranks: Sequence[int], group_rank: int) -> None:
        super().__init__(group_rank, len(ranks))
        self.world = world
        self.ranks = tuple(ranks)
        self._rank = group_rank

    def getBackendName(self) -> str:
        return BACKEND

    def __repr__(self) -> str:
        return f"SimulatedGroup(ranks={self.ranks}, rank={self._rank})"

    def _issue(self, op: str, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor],
               fill: Callable[[], None], **kwargs: Any) -> SimulatedWork:
        tensors = [*inputs, *outputs]
        device = tensors[0].device if tensors else self.world.device
        return self.world.issue(self, op, _nbytes(inputs), device, fill, list(outputs), tensors, **kwargs)

    # All-gathers: this rank's input in every rank's place.

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
                  opts: Any = None) -> SimulatedWork:
        def fill() -> None:
            for places, tensor in zip(output_tensors, input_tensors):
                source = tensor.clone() if any(_shares_memory(tensor, p) for p in places) else tensor
                for place in places:
                    place.copy_(source)
        return self._issue("all_gather", input_tensors, [t for ts in output_tensors for t in ts], fill)

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]], input_list: list[torch.Tensor],
                            opts: Any = None) -> SimulatedWork:
        def fill() -> None:
            for places in output_lists:  # one list per rank, one place per input
                for place, tensor in zip(places, input_list):
                    place.copy_(tensor)
        return self._issue("all_gather", input_list, [t for ts in output_lists for t in ts], fill)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> SimulatedWork:
        return self.all_gather_single_coalesced([output], [input], opts)

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                    opts: Any = None) -> SimulatedWork:
        def fill() -> None:
            for output, tensor in zip(outputs, inputs):
                output.view(self.size(), -1).copy_(_apart_from(tensor, output).reshape(1, -1))
        return self._issue("all_gather", inputs, outputs, fill)

    # Reduce-scatters: this rank's own chunk of its input.

    def reduce_scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                       opts: Any = None) -> SimulatedWork:
        def fill() -> None:
            for output, chunks in zip(output_tensors, input_tensors):
                output.copy_(chunks[self._rank])
        return self._issue("reduce_scatter", [t for ts in input_tensors for t in ts], output_tensors, fill)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> SimulatedWork:
        return self.reduce_scatter_single_coalesced([output], [input], opts)

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> SimulatedWork:
        def fill() -> None:
            for output, tensor in zip(outputs, inputs):
                output.copy_(_apart_from(tensor, output).reshape(self.size(), -1)[self._rank].view(output.shape))
        return self._issue("reduce_scatter", inputs, outputs, fill)

    # Reductions to every rank or one: the tensors as they are.

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> SimulatedWork:
        return self._issue("all_reduce", tensors, tensors, lambda: None)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> SimulatedWork:
        return self._issue("all_reduce", tensors, tensors, lambda: None)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> SimulatedWork:
        # NCCL's reduce is a pipelined ring to the root, as its broadcast is from it.
        return self._issue("reduce", tensors, tensors, lambda: None, model_as="broadcast")

    # All-to-alls: this rank's chunk j back in its place j.

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                 opts: Any = None) -> SimulatedWork:
        def fill() -> None:
            for output, chunk in zip(output_tensors, input_tensors):
                _copy_chunk(output, chunk)
        return self._issue("all_to_all", input_tensors, output_tensors, fill)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int] | None,
                          input_split_sizes: list[int] | None, opts: Any = None) -> SimulatedWork:
        def fill() -> None:
            source = _apart_from(input, output)  # an all-to-all in place
            outs, ins = _split(output, output_split_sizes, self.size()), _split(source, input_split_sizes, self.size())
            for out_chunk, in_chunk in zip(outs, ins):
                _copy_chunk(out_chunk, in_chunk)
        return self._issue("all_to_all", [input], [output], fill)

    # One root to all and back.

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> SimulatedWork:
        return self._issue("broadcast", tensors, tensors, lambda: None)

    def scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                opts: Any = None) -> SimulatedWork:
        root = opts.rootRank if opts is not None else 0
        chunks = [t for ts in input_tensors for t in ts]

        def fill() -> None:
            for output in output_tensors:
                if root == self._rank:
                    output.copy_(input_tensors[0][self._rank])
                else:  # the root's chunks are not this rank's to know: zeros, never stale memory
                    output.zero_()
        # The root sends each peer its chunk, as an all-gather's ring moves one chunk per rank.
        return self._issue("scatter", output_tensors, output_tensors + chunks, fill, model_as="all_gather")

    def gather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
               opts: Any = None) -> SimulatedWork:
        def fill() -> None:
            for places, tensor in zip(output_tensors, input_tensors):  # the root's lists only
                for place in places:
                    place.copy_(tensor)
        places = [t for ts in output_tensors for t in ts]
        return self._issue("gather", input_tensors, places, fill, model_as="all_gather")

    def barrier(self, opts: Any = None) -> SimulatedWork:
        device = self.world.device
        return self.world.issue(self, "barrier", BARRIER_BYTES, device, lambda: None, [], [], model_as="all_reduce",
                                blocks_host=True)

    def send(self, *args: Any) -> SimulatedWork:
        raise NotImplementedError(_NO_POINT_TO_POINT)

    def recv(self, *args: Any) -> SimulatedWork:
        raise NotImplementedError(_NO_POINT_TO_POINT)

    def recv_anysource(self, *args: Any) -> SimulatedWork:
        raise NotImplementedError(_NO_POINT_TO_POINT)


_NO_POINT_TO_POINT = ("a simulated world runs rank 0 alone: point-to-point ops (send, recv: pipeline stages) have "
                      "no peer to meet; run them over a real world (torchrun), or leave pipeline parallelism out")


def init_simulated_world(world_size: int, network: Network, *, device: torch.device | str | None = None,
                         timeout: timedelta | None = None) -> SimulatedWorld:
    """Makes this process rank 0 of `world_size` ranks over a simulated network (the module's
    docstring says what the collectives fill and how long they take); `device` is the device whose
    collectives are timed (the current GPU where there is one, the CPU otherwise). Destroy it as
    any default group: `dist.destroy_process_group()`. Returns the world, whose `ledger` stays
    readable after that."""
    if dist.is_initialized():
        raise RuntimeError("init_simulated_world: a default process group exists in this process already; "
                           "call torch.distributed.destroy_process_group() first")
    if world_size < 1:
        raise ValueError(f"init_simulated_world: a world needs at least one rank, got {world_size}")
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    world = SimulatedWorld(world_size, network, torch.device(device))
    _register_backends()
    kwargs = {"timeout": timeout} if timeout is not None else {}
    # The store only meets torch's own bookkeeping: a HashStore, in memory, as one process needs.
    # The group serves the world's device type (and the CPU, for object collectives) only, so that
    # zeropp keeps shards on the device whose collectives are timed (runtime.topology.collective_device).
    devices = ["cpu"] if world.device.type == "cpu" else ["cpu", world.device.type]
    dist.init_process_group(",".join(f"{d}:{dist.Backend.FAKE}" for d in devices), store=dist.HashStore(), rank=0,
                            world_size=world_size, pg_options=world, **kwargs)
    return world


def current_world() -> SimulatedWorld | None:
    """The simulated world this process's default group belongs to, if it is one."""
    default = dist.group.WORLD if dist.is_initialized() else None
    return default.world if isinstance(default, SimulatedGroup) else None


def _register_backends() -> None:
    """The simulated groups' creator, under its own name and under torch's "fake" (which it serves
    only for a simulated world); registering again replaces the same creators."""
    dist.Backend.register_backend(BACKEND, _create_group, extended_api=True, devices=["cpu", "cuda"])
    serve_fake_backend(_group_of_a_simulated_world)
    route_all_gather_out_to_python_groups()


def _group_of_a_simulated_world(options: Any, backend_options: Any) -> SimulatedGroup | None:
    """The group torch asks for, where it belongs to a simulated world: the default group (given
    the world as its options by `init_simulated_world`) or a subgroup of a simulated default
    group; None otherwise (torch's own fake group then serves)."""
    world = backend_options if isinstance(backend_options, SimulatedWorld) else current_world()
    if world is None:
        return None
    ranks = list(options.global_ranks_in_group) or list(range(world.world_size))  # empty: the default group
    return SimulatedGroup(world, ranks, options.group_rank)


def _create_group(options: Any, backend_options: Any) -> SimulatedGroup:
    """The creator of `BACKEND`: a group of the simulated world of this process."""
    group = _group_of_a_simulated_world(options, backend_options)
    if group is None:
        raise RuntimeError(f"the {BACKEND!r} backend makes the groups of a simulated world: call "
                           "zpp_compile.runtime.simulated_group.init_simulated_world(world_size, network) first")
    return group

"""CUDA graphs around zeropp's compiled forward and backward graphs (Config.cuda_graphs).

A zeropp step is bound by the host: hundreds of kernel launches plus a few dozen collective and
quantization calls per step, each issued from Python. Captured once, a CUDA graph replays them
all with one call. zeropp wraps each graph Inductor compiles itself (as torchtitan does for
SimpleFSDP), so the collective timeout and the call-order checks below stay in its hands
(Inductor's own cudagraph trees captured these graphs too in a first trial: PERFORMANCE.md,
"CUDA graphs"). The first call runs normally
(warmup: Triton compiles, NCCL communicators come up); the second call captures and replays;
later calls copy the inputs that move (the batch, incoming gradients) into the captured ones and
replay.

Memory: a training forward and its backward share one memory pool. The activations the forward
saves are freed while the backward is captured, as in an ordinary backward, so the backward's
buffers reuse their memory; on later steps the forward's replay writes them there again. Hence:
- a forward may not run again before the backward of its previous call, nor a backward twice
  (retain_graph) for one forward: both would read overwritten memory, and both raise an error;
- outputs a user can hold on to (the loss, gradients) are copied out of the graph's memory after
  each replay, so they stay valid while later steps run (gradient accumulation included).
c10d's watchdog does not see captured collectives, so each replay is watched here: if it has not
finished after Config.collective_timeout_s, the process exits with a message naming the likely
cause, as c10d does for an eager collective.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import weakref
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch._inductor.compile_fx import compile_fx_inner

from .registry import REGISTRY


class ReplayWatch:
    """Exits the process when a replayed graph has not finished within `timeout_s`."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.pending: list[tuple[torch.cuda.Event, float, str]] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._run, name="zeropp-cuda-graph-watch", daemon=True).start()

    def watch(self, name: str) -> None:
        event = torch.cuda.Event()
        event.record()
        with self.lock:
            self.pending.append((event, time.monotonic(), name))

    def _run(self) -> None:
        while True:
            time.sleep(min(1.0, self.timeout_s / 10))
            with self.lock:
                self.pending = [p for p in self.pending if not p[0].query()]
                late = [p for p in self.pending if time.monotonic() - p[1] > self.timeout_s]
            if late:
                _, started, name = late[0]
                sys.stderr.write(
                    f"zeropp: the CUDA graph of {name} has not finished {time.monotonic() - started:.0f} s after "
                    f"its replay (Config.collective_timeout_s={self.timeout_s}); a peer rank likely died or hung "
                    "inside a collective. Exiting, as c10d's watchdog does for eager collectives.\n"
                )
                sys.stderr.flush()
                os._exit(1)


class CudaGraphState:
    """The process's capture stream, replay watch and graphs (kept in the registry; the graphs
    weakly, so that they go with the compiled code that owns them)."""

    def __init__(self, timeout_s: float) -> None:
        # One stream for every capture: graphs that share a pool must be captured on one stream.
        self.stream = torch.cuda.Stream()
        self.watch = ReplayWatch(timeout_s)
        self.graphs: weakref.WeakSet[GraphedCallable] = weakref.WeakSet()


class GraphedCallable:
    """A compiled graph (boxed calling convention) run as warmup, then capture, then replays."""

    def __init__(
        self, compiled: Callable[[list[Any]], Any], name: str, example_inputs: Sequence[Any],
        static_input_idxs: Sequence[int], user_outputs: Sequence[int], saves_activations: bool,
    ) -> None:
        self._boxed_call = True  # an instance attribute: AOTAutograd's wrappers copy __dict__, not the class
        self.compiled, self.name = compiled, name
        static = set(static_input_idxs)
        tensors = [i for i, x in enumerate(example_inputs) if isinstance(x, torch.Tensor)]
        self.static_inputs = [i for i in tensors if i in static]  # parameters, saved activations
        self.moving_inputs = [i for i in tensors if i not in static]  # the batch, incoming gradients
        self.user_outputs = set(user_outputs)
        self.saves_activations = saves_activations  # a training forward: its backward reads its outputs in place
        self.calls = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.pool: Any = None
        self.static_addresses: dict[int, int] = {}
        self.moving_buffers: dict[int, torch.Tensor] = {}  # the graph reads the moving inputs from these
        self.outputs: list[Any] = []
        self.activations: set[int] = set()  # for a forward: storages of the outputs its graph allocated
        self.forward: GraphedCallable | None = None  # for a backward: the forward whose outputs it reads
        self.backward_pending = False  # for a forward: its saved activations still await their backward

    def __call__(self, inputs: list[Any]) -> Any:
        self.calls += 1
        if self.calls == 1:
            return self.compiled(inputs)
        if self.graph is None:
            outputs = self._capture(inputs)
        else:
            self._check_order()
            self._load(inputs)
            outputs = self.outputs
        self.graph.replay()
        REGISTRY.cuda_graphs.watch.watch(self.name)
        if self.forward is not None:
            self.forward.backward_pending = False
        self.backward_pending = self.saves_activations
        return [x.clone() if i in self.user_outputs else x for i, x in enumerate(outputs)]

    def release(self) -> None:
        """Drops the captured graph and its memory; the next call captures again."""
        self.graph, self.pool, self.outputs, self.activations, self.forward = None, None, [], set(), None
        self.static_addresses, self.moving_buffers, self.backward_pending = {}, {}, False

    def _capture(self, inputs: list[Any]) -> list[Any]:
        """Captures the graph; returns this call's outputs (replayed by the caller)."""
        self.static_addresses = {i: inputs[i].data_ptr() for i in self.static_inputs}
        self.moving_buffers = {i: inputs[i].clone() for i in self.moving_inputs}
        captured = [self.moving_buffers.get(i, x) for i, x in enumerate(inputs)]
        inputs.clear()  # the compiled graph now holds the only references: it frees what it no longer needs
        own_storages = {_storage(x) for x in captured}
        if self.name == "backward":
            self.forward = _producer(own_storages)
        self.pool = self.forward.pool if self.forward is not None else torch.cuda.graph_pool_handle()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=self.pool, stream=REGISTRY.cuda_graphs.stream):
            outputs = list(self.compiled(captured))
        if self.saves_activations:  # not the inputs it passes through (parameters saved for backward)
            self.activations = {_storage(x) for x in outputs} - own_storages - {None}
        # The forward keeps no hold on the activations it saves: the backward's capture frees them.
        # It returns them on later calls through views that do not own their memory.
        self.outputs = [
            _unowned_view(x) if self.saves_activations and i not in self.user_outputs else x
            for i, x in enumerate(outputs)
        ]
        return outputs

    def _check_order(self) -> None:
        if self.backward_pending:
            raise RuntimeError(
                "zeropp (Config.cuda_graphs): the forward graph ran again before the backward of its previous "
                "call; the activations it saved live in the CUDA graph's memory and would be overwritten. Call "
                "backward before the next forward, run forward passes without a backward under torch.no_grad(), "
                "or set Config.cuda_graphs=False"
            )
        if self.forward is not None and not self.forward.backward_pending:
            raise RuntimeError(
                "zeropp (Config.cuda_graphs): the backward graph ran without a forward before it (a second "
                "backward through one forward, as with retain_graph=True); the activations it reads were freed "
                "by the first. Run the forward again, or set Config.cuda_graphs=False"
            )

    def _load(self, inputs: list[Any]) -> None:
        for i, buffer in self.moving_buffers.items():
            buffer.copy_(inputs[i])
        moved = [i for i, address in self.static_addresses.items() if inputs[i].data_ptr() != address]
        inputs.clear()
        if moved:
            raise RuntimeError(
                f"zeropp (Config.cuda_graphs): {len(moved)} input(s) of the captured {self.name} graph that must "
                "stay in place (parameters, saved activations) moved since the capture, e.g. a parameter replaced "
                "through .data or load_state_dict(assign=True). Update parameters in place (copy_), or call "
                "zpp_compile.release_cuda_graphs() after replacing them"
            )


class _DeviceMemory:
    """Raw device memory, exposed to torch.as_tensor without passing ownership."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False), "version": 3}


def _unowned_view(x: Any) -> Any:
    """A tensor over `x`'s memory that does not keep that memory allocated."""
    if not isinstance(x, torch.Tensor) or x.numel() == 0:
        return x
    storage = x.untyped_storage()
    raw = torch.as_tensor(_DeviceMemory(storage.data_ptr(), storage.nbytes()), device=x.device)
    return raw.view(x.dtype).as_strided(x.shape, x.stride(), x.storage_offset())


def _storage(x: Any) -> int | None:
    return x.untyped_storage().data_ptr() if isinstance(x, torch.Tensor) else None


def _producer(storages: set[int | None]) -> GraphedCallable | None:
    """The captured training forward whose graph allocated one of these storages (a backward's
    saved activations)."""
    for graphed in REGISTRY.cuda_graphs.graphs:
        if graphed.activations & storages:
            return graphed
    return None


def release_cuda_graphs() -> None:
    """Destroys every captured graph; a graphed function called again captures anew.

    Call it before torch.distributed.destroy_process_group(): NCCL does not destroy a communicator
    while a CUDA graph holding its collectives exists, so destroying the process group would wait
    forever (pytorch/pytorch#115388).
    """
    if REGISTRY.cuda_graphs is None:
        return
    torch.cuda.synchronize()
    for graphed in list(REGISTRY.cuda_graphs.graphs):
        graphed.release()


def graphed_inner_compile(
    gm: fx.GraphModule, example_inputs: Sequence[Any], *, timeout_s: float, **kwargs: Any
) -> GraphedCallable:
    """`compile_fx_inner`, its result run as a CUDA graph (pass as compile_fx's inner_compile)."""
    dynamic = [x for x in example_inputs if isinstance(x, torch.SymInt)
               or (isinstance(x, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in x.shape))]
    if dynamic:
        raise RuntimeError(
            "zeropp: Config.cuda_graphs needs static shapes, but this graph was compiled with dynamic ones; "
            "compile with torch.compile(model, backend='zeropp', dynamic=False)"
        )
    compiled = compile_fx_inner(gm, example_inputs, **kwargs)
    if REGISTRY.cuda_graphs is None:
        REGISTRY.cuda_graphs = CudaGraphState(timeout_s)
    output = next(iter(reversed(gm.graph.nodes)))
    # What the user can hold on to: the loss (forward), the gradients (backward); compile_fx marks
    # them on the graph's output node before calling inner_compile.
    user_outputs = output.meta.get("user_visible_output_idxs", range(len(output.args[0])))
    backward = kwargs.get("is_backward", False)
    graphed = GraphedCallable(
        compiled, "backward" if backward else "forward", example_inputs, kwargs.get("static_input_idxs", ()),
        user_outputs, saves_activations=not backward and not kwargs.get("is_inference", False),
    )
    REGISTRY.cuda_graphs.graphs.add(graphed)
    return graphed

"""CUDA graphs around zeropp's compiled graphs (Config.cuda_graphs), through Inductor's cudagraph trees.

A zeropp step is bound by the host: hundreds of kernel launches plus a few dozen collective and
quantization calls per step, each issued from Python. With Config.cuda_graphs the backend turns
on Inductor's cudagraph trees (`triton.cudagraphs`): each compiled forward and backward runs
normally first (warmup: Triton compiles, NCCL communicators come up), is captured on a later call
and replayed after that. All graphs of a device share one memory pool whose blocks are reused as
the tensors in them die, so the activations a forward saves are freed during its backward, as
without graphs. zeropp adds three things around each graph Inductor compiles for it:

- the outputs a user can hold (the loss, the gradients) are copied out of the pool after each
  call: the trees write the next step's tensors over that memory, so a loss kept for logging, or
  a gradient that the next micro-step accumulates into, would otherwise be overwritten;
- a watch on each call: c10d's watchdog does not see the collectives inside a graph, so a call
  that has not finished after Config.collective_timeout_s ends the process with a message, as
  c10d does for an eager collective;
- an error where Inductor cannot capture a graph, instead of running it without one unnoticed.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from ..torch_compat import INNER_COMPILE_CUDAGRAPHS, INNER_COMPILE_IS_BACKWARD, USER_VISIBLE_OUTPUTS, compile_fx_inner


class CallWatch:
    """Ends the process when a graph's call has not finished on the GPU within its timeout."""

    def __init__(self) -> None:
        self.pending: list[tuple[torch.cuda.Event, float, float, str]] = []  # event, deadline, timeout, name
        self.lock = threading.Lock()
        threading.Thread(target=self._run, name="zeropp-cuda-graph-watch", daemon=True).start()

    def watch(self, name: str, timeout_s: float) -> None:
        event = torch.cuda.Event()
        event.record()
        with self.lock:
            self.pending.append((event, time.monotonic() + timeout_s, timeout_s, name))

    def _run(self) -> None:
        while True:
            time.sleep(1.0)
            with self.lock:
                self.pending = [p for p in self.pending if not p[0].query()]
                late = [p for p in self.pending if time.monotonic() > p[1]]
            if late:
                _, _, timeout_s, name = late[0]
                sys.stderr.write(
                    f"zeropp: the CUDA graph of {name} has not finished {timeout_s:.0f} s after its call "
                    f"(Config.collective_timeout_s); a peer rank likely died or hung "
                    "inside a collective. Exiting, as c10d's watchdog does for eager collectives.\n"
                )
                sys.stderr.flush()
                os._exit(1)


@functools.cache
def _call_watch() -> CallWatch:
    """The process's one watch, made by the first graphed compilation."""
    return CallWatch()


class GraphedCallable:
    """A compiled graph (boxed calling convention) whose user-visible outputs leave the CUDA
    graph pool as copies, and whose calls are watched."""

    def __init__(
        self, compiled: Callable[[list[Any]], Any], name: str, user_outputs: Sequence[int], timeout_s: float
    ) -> None:
        self._boxed_call = True  # an instance attribute: AOTAutograd's wrappers copy __dict__, not the class
        self.compiled, self.name, self.user_outputs, self.timeout_s = compiled, name, set(user_outputs), timeout_s

    def __call__(self, inputs: list[Any]) -> list[Any]:
        outputs = self.compiled(inputs)
        _call_watch().watch(self.name, self.timeout_s)
        return [x.clone() if i in self.user_outputs and isinstance(x, torch.Tensor) else x
                for i, x in enumerate(outputs)]


def graphed_inner_compile(
    gm: fx.GraphModule, example_inputs: Sequence[Any], *, timeout_s: float, **kwargs: Any
) -> GraphedCallable:
    """`compile_fx_inner` under `triton.cudagraphs`, its result wrapped as the module docstring
    says (pass as compile_fx's inner_compile)."""
    name = "backward" if kwargs.get(INNER_COMPILE_IS_BACKWARD) else "forward"
    compiled = compile_fx_inner(gm, example_inputs, **kwargs)
    if not kwargs.get(INNER_COMPILE_CUDAGRAPHS):  # Inductor turns this flag off when it cannot capture
        info = getattr(compiled, "cudagraph_info", None)
        reasons = "; ".join(getattr(info, "cudagraph_fail_reasons", None) or ["see TORCH_LOGS=perf_hints"])
        raise RuntimeError(
            f"zeropp (Config.cuda_graphs): Inductor cannot run the {name} graph as a CUDA graph ({reasons}); "
            "remove what the reason names from the compiled step, or set Config.cuda_graphs=False"
        )
    _call_watch()  # started before the first call it watches
    output = next(iter(reversed(gm.graph.nodes)))
    # What the user can hold on to: the loss (forward), the gradients (backward); compile_fx marks
    # them on the graph's output node before calling inner_compile.
    user_outputs = output.meta.get(USER_VISIBLE_OUTPUTS, range(len(output.args[0])))
    return GraphedCallable(compiled, name, user_outputs, timeout_s)


def release_cuda_graphs() -> None:
    """Destroys every captured graph and resets torch.compile's caches (torch.compiler.reset()):
    a compiled step called afterwards compiles and captures anew.

    Call it before torch.distributed.destroy_process_group(): NCCL does not destroy a communicator
    while a CUDA graph holding its collectives exists, so destroying the process group would wait
    forever.
    """
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    torch.compiler.reset()  # also frees Inductor's cudagraph trees

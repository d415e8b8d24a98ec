"""FX programs that zeropp's run-time ops hold as Python source and run outside the graph that calls them.

A pass that hands part of a graph to a run-time op (`runtime.prefetch`,
`runtime.deferred_reductions`) gives it that part as the source FX writes for a graph
(`forward(self, *inputs)`); the op runs it with the names below, the only ones such source may use
beyond its inputs.

[Note: programs compiled by Inductor] Run as FX's Python, a program is one kernel per op: a bucket's
casts and copies are a launch and a pass over memory each, where Inductor, had the program stayed in
its graph, would have fused them into one kernel. `run_program(..., compiled=True)` (the ops ask for
it where the graph itself was compiled by Inductor) compiles the program once for each shape of its
inputs and runs Inductor's code: the same kernels the graph would have had. A deferred reduction's
end waits for collectives issued by the graph, its inputs: Inductor compiles those waits as it does
a graph's. Compiled programs are kept by this module for the process (a handful: one per layer graph
that holds a program, for each shape of its inputs), and Inductor's own caches serve them to a later
process.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import torch

from ..torch_compat import compile_program_with_inductor

PROGRAM_NAMES = {"torch": torch, "device": torch.device, "inf": math.inf, "nan": math.nan}

# Each program Inductor compiled, by its source and its inputs' shapes, strides, dtypes and
# devices: this module's own.
_COMPILED: dict[tuple, Callable[..., Any]] = {}


@functools.lru_cache(maxsize=None)
def program_function(program: str) -> Callable[..., Any]:
    """`program` (an FX graph's code) as a Python function of the graph's inputs."""
    namespace = dict(PROGRAM_NAMES)
    exec(compile(program, "<zeropp program>", "exec"), namespace)  # zeropp's own FX code
    return functools.partial(namespace["forward"], None)


def run_program(program: str, inputs: list[torch.Tensor], compiled: bool) -> Any:
    """`program`'s results on `inputs`: as Inductor's code where `compiled` (compiled at the first
    call with inputs of these shapes), else as FX's Python ([Note: programs compiled by Inductor])."""
    if not compiled:
        return program_function(program)(*inputs)
    key = (program, *((t.shape, t.stride(), t.dtype, t.device) for t in inputs))
    function = _COMPILED.get(key)
    if function is None:
        with torch.no_grad():
            function = compile_program_with_inductor(program_function(program), [t.detach() for t in inputs])
        _COMPILED[key] = function
    with torch.no_grad():
        results = function(*inputs)
    return tuple(results) if isinstance(results, list) else results  # Inductor's outputs: a list, FX's a tuple


def forget_compiled_programs() -> None:
    """Forgets the programs Inductor compiled in this process, as `torch.compiler.reset()` forgets
    Dynamo's graphs: the next call of each compiles it again (from Inductor's caches, where warm)."""
    _COMPILED.clear()


def compiled_programs() -> list[str]:
    """The programs Inductor has compiled in this process, in the order compiled (a program once
    for each shape of its inputs)."""
    return [key[0] for key in _COMPILED]

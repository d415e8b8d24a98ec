"""FX programs that zeropp's run-time ops hold as Python source and run outside Inductor's code.

A pass that hands part of a graph to a run-time op (`runtime.prefetch`,
`runtime.deferred_reductions`) gives it that part as the source FX writes for a graph
(`forward(self, *inputs)`); the op runs it with the names below, the only ones such source may use
beyond its inputs.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import torch

PROGRAM_NAMES = {"torch": torch, "device": torch.device, "inf": math.inf, "nan": math.nan}


@functools.lru_cache(maxsize=None)
def compiled_program(program: str) -> Callable[..., Any]:
    """`program` (an FX graph's code) as a function of the graph's inputs."""
    namespace = dict(PROGRAM_NAMES)
    exec(compile(program, "<zeropp program>", "exec"), namespace)  # zeropp's own FX code
    return functools.partial(namespace["forward"], None)

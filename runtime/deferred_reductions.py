"""`zpp::finish_reductions_later`: a graph's last gradient reductions, finished during the next graph's backward.

With Config.compile_layers_once the step is many graphs (each layer's, and those around the layers),
and each backward graph issues its last gradient reductions at its end: waited for there, nothing of
the graph is left to compute meanwhile, and the next graph's backward starts on the GPU only once
they end. This op holds the rest of such a graph as a program: the waits of those reductions (issued
in the graph, and running on the network library's stream) and what is computed from them up to the
graph's outputs (the division by the group size, the cuts into shards, qgZ's dequantization), run as
Inductor's code where the graph is (`runtime/programs.py`). The graph returns placeholders in place
of those gradients; the program runs when the next backward graph calls the op, once that graph's
own reductions are issued, or at the end of the backward pass, whichever comes first, so the
reductions run during the next graph's compute, as FSDP2's reduce-scatters run during the next
block's backward.

The placeholders go to `LocalShards`, the autograd node that hands each shard's gradient to its
parameter (`claim`). Where autograd would only accumulate the gradient into `.grad`, it hands none
on, and the finished gradient is accumulated there when its program has run, before the backward
pass returns. Anywhere else (torch.autograd.grad, a hook on the parameter, create_graph) the
reductions are finished at once and the gradient handed on, as without this op. Placeholders hold
NaN, so one used anywhere else would show in the results.
"""

from __future__ import annotations

import ast
import functools
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import torch

from ..torch_compat import at_backward_end, cuda_graph_unsafe_tags, graph_task_id
from .programs import run_program


@dataclass
class DeferredState:
    """What this module holds: the reductions whose ends have not run yet (in
    issue order), the placeholder gradients they handed out (by id, with the reduction and its
    result's index), and the end callback of each backward pass that issued some (by graph task
    id, weakly: autograd holds it while the pass runs)."""

    unfinished: list[Any] = field(default_factory=list)
    placeholders: dict[int, tuple[Any, Any, int]] = field(default_factory=dict)
    backward_ends: dict[int, weakref.ref] = field(default_factory=dict)
    deferred: int = 0  # gradients set on their parameters when their reduction finished
    finished: int = 0  # reductions finished


_STATE = DeferredState()  # this module's own: nothing else writes it


class DeferredCounts(NamedTuple):
    """`counts()`: what this module did since the process began, and what it holds now."""

    finished: int  # reductions finished
    deferred: int  # gradients set on their parameters when their reduction finished
    unfinished: int  # reductions whose ends have not run
    placeholders: int  # placeholder gradients handed out and not claimed
    backward_ends: int  # backward passes whose end is awaited


def counts() -> DeferredCounts:
    return DeferredCounts(_STATE.finished, _STATE.deferred, len(_STATE.unfinished), len(_STATE.placeholders),
                          len(_STATE.backward_ends))


@dataclass
class Unfinished:
    """A reduction whose end has not run: what its program reads (until it has run), the backward
    pass that issued it, its results once run, and for each claimed result what sets it on its
    parameter."""

    inputs: list[torch.Tensor] | None
    program: str
    compiled: bool  # the program runs as Inductor's code ([Note: programs compiled by Inductor])
    graph_task: int
    results: tuple[torch.Tensor, ...] | None = None
    claims: dict[int, Callable[[torch.Tensor], None]] = field(default_factory=dict)


@torch.library.custom_op("zpp::finish_reductions_later", mutates_args=(), tags=cuda_graph_unsafe_tags())
def finish_reductions_later(inputs: list[torch.Tensor], program: str, results: str,
                            compiled: bool) -> list[torch.Tensor]:
    """Placeholders for `results` (a tuple literal of (dtype name, shape) pairs), the outputs of
    `program` on `inputs`, which runs later (`finish_reductions`), as Inductor's code where
    `compiled` (else as FX's Python); the reductions left unfinished by the graphs before run now."""
    task = graph_task_id()
    if task == -1:
        raise RuntimeError("zpp::finish_reductions_later runs only in autograd's backward pass, where its "
                           "placeholders reach the parameters' gradients; this is a bug in zeropp, please report it")
    placeholders = [torch.full((), torch.nan, dtype=dtype, device=inputs[0].device).expand(shape)
                    for dtype, shape in _results(results)]
    finish_reductions()  # those of the graphs before this one: their collectives ran during its compute
    reduction = Unfinished(list(inputs), program, compiled, task)
    _STATE.unfinished.append(reduction)
    for index, placeholder in enumerate(placeholders):
        _STATE.placeholders[id(placeholder)] = (placeholder, reduction, index)
    if not _running(task):
        end = _BackwardEnd(task)
        _STATE.backward_ends[task] = weakref.ref(end)
        at_backward_end(end)
    return placeholders


@finish_reductions_later.register_fake
def _(inputs, program, results, compiled):
    return [inputs[0].new_empty((), dtype=dtype).expand(shape) for dtype, shape in _results(results)]


@functools.lru_cache(maxsize=None)
def _results(results: str) -> tuple[tuple[torch.dtype, tuple[int, ...]], ...]:
    return tuple((getattr(torch, dtype), tuple(shape)) for dtype, shape in ast.literal_eval(results))


def results_literal(values: list[torch.Tensor]) -> str:
    """`values`' dtypes and shapes, as the op takes them."""
    return repr(tuple((str(v.dtype).removeprefix("torch."), tuple(v.shape)) for v in values))


def finish_reductions() -> None:
    """Runs the end of every unfinished reduction, in the order they were issued (the same on
    every rank), and sets each gradient claimed already on its parameter, unless the backward
    pass that claimed it has failed since: as autograd would have left `.grad` (the user may well
    have cleared it since, to try again)."""
    unfinished, _STATE.unfinished = _STATE.unfinished, []
    for reduction in unfinished:
        results = run_program(reduction.program, reduction.inputs, reduction.compiled)
        reduction.inputs = None
        reduction.results = results if isinstance(results, tuple) else (results,)
        _STATE.finished += 1
        if _running(reduction.graph_task):
            for index, set_on_parameter in reduction.claims.items():
                set_on_parameter(reduction.results[index])
                _STATE.deferred += 1
        reduction.claims.clear()


def claim(grad: torch.Tensor, set_on_parameter: Callable[[torch.Tensor], None] | None) -> torch.Tensor | None:
    """`grad` as the parameter's gradient, for `LocalShards` to hand on: itself, unless it is a
    placeholder; a placeholder's gradient, finished now if it was not, where `set_on_parameter` is
    None; else None, and `set_on_parameter` gets the gradient once its reduction has finished."""
    found = _STATE.placeholders.pop(id(grad), None)
    if found is None:
        return grad
    _, reduction, index = found
    if reduction.results is None and set_on_parameter is not None:
        reduction.claims[index] = set_on_parameter
        return None
    if reduction.results is None:
        finish_reductions()
    return reduction.results[index]


def is_placeholder(grad: torch.Tensor) -> bool:
    return id(grad) in _STATE.placeholders


def _running(task: int) -> bool:
    """Whether backward pass `task` is still running: its end callback is alive until it has run
    (autograd drops the callbacks of a pass that fails)."""
    end = _STATE.backward_ends.get(task)
    return end is not None and end() is not None


class _BackwardEnd:
    """The end of one backward pass that issued reductions: finishes every reduction, then
    forgets the placeholders of every pass not running any more (a nested pass's end keeps those
    of the pass around it)."""

    def __init__(self, task: int) -> None:
        self.task = task

    def __call__(self) -> None:
        finish_reductions()
        del _STATE.backward_ends[self.task]
        _STATE.backward_ends = {task: end for task, end in _STATE.backward_ends.items() if end() is not None}
        _STATE.placeholders = {key: found for key, found in _STATE.placeholders.items()
                                 if found[1].graph_task in _STATE.backward_ends}


FINISH_REDUCTIONS_LATER = torch.ops.zpp.finish_reductions_later.default  # as graphs call it

"""realize_shared_values on small graphs: a costly value every layer reads (RoPE's cos and sin)
is marked to be stored, and Inductor computes it once."""

from __future__ import annotations

import re
from typing import Callable

import torch
import torch.fx as fx
from pass_graphs import run_pass

# ------------------------------------------------------------------ values shared by every layer


def shared_rope_step(positions: torch.Tensor, hidden: torch.Tensor, *weights: torch.Tensor) -> list[torch.Tensor]:
    """A "layer" per weight (a matmul, then RoPE's pointwise use of one cos and one sin of the
    positions), and values that should stay inlined: a cheap one read by every layer, a costly
    one read twice."""
    cos, sin = positions.cos(), positions.sin()
    cheap = positions * 2
    for weight in weights:
        hidden = hidden @ weight
        hidden = hidden * cos + torch.cat([-hidden[:, 2:], hidden[:, :2]], -1) * sin + cheap
    costly_pair = hidden.exp()
    return [costly_pair + 1, costly_pair * 2]


def rope_inputs() -> list[torch.Tensor]:
    return [torch.randn(8, 4), torch.randn(8, 4)] + [torch.randn(4, 4) for _ in range(6)]


def test_costly_values_read_by_every_layer_are_marked_to_be_stored():
    module = torch.fx.experimental.proxy_tensor.make_fx(shared_rope_step, tracing_mode="fake")(*rope_inputs())
    run_pass("realize_shared_values", module.graph)
    marked = {n.target for n in module.graph.nodes if n.meta.get("inductor_realize_to_strides")}
    assert marked == {torch.ops.aten.cos.default, torch.ops.aten.sin.default}


def test_inductor_computes_a_marked_value_once():
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.utils import run_and_get_code

    def compiled(marking: bool) -> str:
        def backend(gm: fx.GraphModule, example_inputs: list) -> Callable:
            if marking:
                run_pass("realize_shared_values", gm.graph, "inference")
            return compile_fx_inner(gm, example_inputs)

        torch._dynamo.reset()
        step = torch.compile(shared_rope_step, backend=torch._dynamo.backends.common.aot_autograd(fw_compiler=backend))
        with torch._inductor.config.patch(fx_graph_cache=False):  # its key does not cover the mark
            _, (code, *_) = run_and_get_code(step, *rope_inputs())
        return code

    def calls_computing_cos(code: str) -> int:  # Inductor names a kernel after the ops fused into it
        return len(re.findall(r"^\s+\w*_cos\w*(?:\.run)?\(", code, flags=re.MULTILINE))

    # Inductor computes cos inside every layer's kernel, unless it is marked to be stored.
    assert calls_computing_cos(compiled(marking=False)) == 6
    assert calls_computing_cos(compiled(marking=True)) == 1

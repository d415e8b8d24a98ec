"""How Inductor lowers a bucket's copies: kernels generated and time, one GPU.

    python examples/bench_bucket_copies.py      # GPU; writes $OUT/bench_bucket_copies.json if OUT is set

A full-precision bucket's copies are concatenations of padded pieces, one per member, that
zeropp hands to Inductor (`passes/fold_bucket_copies.py`, `passes/bucket_collectives.py`): the
join before a gather (each fp32 shard padded to its segment, cast to bf16), the split after it
(each member's weight cut out of the gathered rank-major rows) and the gradient rows before a
reduction (each gradient's rows padded to their segment, cast to fp32). Inductor lowers a
concatenation of at most `max_pointwise_cat_inputs` inputs (8 by default) as one kernel with
masked loads, a longer one as a kernel per input and the cast as one more. A Llama layer's bucket
has 9 members. This measures the three copies for a Llama-3.2-3B layer over 2 ranks with
Inductor's defaults, with that cap at 16 (for inputs of simple computation only, and for all),
with the join and gradient rows written as concatenations of at most 8 concatenations, and as
zeropp lowers them under Inductor (`buckets.side_by_side`: the pieces placed side by side in one
elementwise expression).
"""

from __future__ import annotations

import json
import os
import statistics

import torch
import torch._inductor.config as inductor_config
import torch.nn.functional as F
from torch._inductor import metrics

from zpp_compile.runtime.buckets import join_shards, side_by_side, split_rows

WORLD = 2
DIM, KV_DIM, FFN_DIM = 3072, 1024, 8192  # Llama-3.2-3B
# A decoder layer's parameters in bucket order: norm, q, k, v, o, norm, gate, up, down.
SHAPES = [(DIM,), (DIM, DIM), (KV_DIM, DIM), (KV_DIM, DIM), (DIM, DIM), (DIM,), (FFN_DIM, DIM), (FFN_DIM, DIM),
          (DIM, FFN_DIM)]
SIZES = [(s[0] + WORLD - 1) // WORLD * (s[1] if len(s) > 1 else 1) for s in SHAPES]  # elements per shard
SEGMENTS = [-(-s // 128) * 128 for s in SIZES]
SETTINGS = {
    "default": {},
    "simple16": {"max_pointwise_cat_inputs": 16},
    "all16": {k: 16 for k in ("max_pointwise_cat_inputs", "max_complex_pointwise_cat_inputs")
              if hasattr(inductor_config, k)},
}


def grouped_cat(parts: list[torch.Tensor], dim: int = 0, group: int = 8) -> torch.Tensor:
    """torch.cat of `parts` as concatenations of at most `group` inputs each."""
    while len(parts) > group:
        parts = [torch.cat(parts[i:i + group], dim) if len(parts[i:i + group]) > 1 else parts[i]
                 for i in range(0, len(parts), group)]
    return torch.cat(parts, dim)


def join(shards: list[torch.Tensor]) -> torch.Tensor:
    return join_shards(shards, SEGMENTS).to(torch.bfloat16)


def join_grouped(shards: list[torch.Tensor]) -> torch.Tensor:
    return grouped_cat([F.pad(s, (0, g - s.numel())) for s, g in zip(shards, SEGMENTS)]).to(torch.bfloat16)


def join_side_by_side(shards: list[torch.Tensor]) -> torch.Tensor:
    return side_by_side(shards, SEGMENTS).to(torch.bfloat16)


def split(rows: torch.Tensor) -> torch.Tensor:
    return split_rows(rows, SEGMENTS, SIZES)


def grad_rows(grads: list[torch.Tensor], cat=torch.cat) -> torch.Tensor:
    padded = [F.pad(g.view(WORLD, s), (0, seg - s)) for g, s, seg in zip(grads, SIZES, SEGMENTS)]
    return cat(padded, 1).reshape(-1).to(torch.float32)


def grad_rows_grouped(grads: list[torch.Tensor]) -> torch.Tensor:
    return grad_rows(grads, grouped_cat)


def grad_rows_side_by_side(grads: list[torch.Tensor]) -> torch.Tensor:
    pieces = [g.view(WORLD, s) for g, s in zip(grads, SIZES)]
    return side_by_side(pieces, SEGMENTS).reshape(-1).to(torch.float32)


def median_ms(fn, *args) -> float:
    for _ in range(3):
        fn(*args)
    torch.cuda.synchronize()
    times = []
    for _ in range(30):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*args)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("bench_bucket_copies.py times Inductor's GPU kernels: run it on a GPU")
    device = "cuda"
    shards = [torch.randn(s, device=device) for s in SIZES]
    rows = torch.randn(WORLD, sum(SEGMENTS), device=device, dtype=torch.bfloat16)
    grads = [torch.randn(WORLD * s, device=device, dtype=torch.bfloat16) for s in SIZES]
    cases = {"join": (join, (shards,)), "join_grouped": (join_grouped, (shards,)),
             "join_side_by_side": (join_side_by_side, (shards,)), "split": (split, (rows,)),
             "grad_rows": (grad_rows, (grads,)), "grad_rows_grouped": (grad_rows_grouped, (grads,)),
             "grad_rows_side_by_side": (grad_rows_side_by_side, (grads,))}
    results = {}
    for setting, patch in SETTINGS.items():
        for name, (fn, args) in cases.items():
            if setting != "default" and name.endswith(("grouped", "side_by_side")):
                continue
            torch._dynamo.reset()
            with inductor_config.patch(patch):
                metrics.reset()
                compiled = torch.compile(fn, fullgraph=True)
                out = compiled(*args)
                kernels = metrics.generated_kernel_count
                ms = median_ms(compiled, *args)
            inputs = args[0] if isinstance(args[0], list) else [args[0]]
            nbytes = sum(a.numel() * a.element_size() for a in inputs) + out.numel() * out.element_size()
            equal = torch.equal(out, fn(*args))
            results[f"{name}/{setting}"] = {"kernels": kernels, "ms": ms, "GB/s": nbytes / ms / 1e6, "equal": equal}
            print(f"{name:20s} {setting:8s} kernels {kernels:3d}  {ms:7.3f} ms  {nbytes / ms / 1e6:7.0f} GB/s  "
                  f"equal {equal}", flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_bucket_copies.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

"""fold_bucket_copies on small graphs: a bucket's join and split folded into its quantization and
dequantization, or placed side by side, changing no bit."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from pass_graphs import run_pass
from torch._inductor import metrics

from zpp_compile.runtime.buckets import side_by_side


def test_the_copy_in_is_folded_into_the_quantization():
    segments, B = (128, 64, 32), 32
    shards = [torch.randn(100), torch.randn(64), torch.randn(1)]

    def lowered(also_return_joined: bool) -> tuple[fx.GraphModule, list]:
        def step(*shards):
            joined = torch.ops.zpp.join_bucket(list(shards), list(segments))
            packed = torch.ops.zpp.quantize_weight(joined, B)
            return (packed, joined) if also_return_joined else packed
        module = torch.fx.experimental.proxy_tensor.make_fx(step, tracing_mode="fake")(*shards)
        expected = module(*shards)
        run_pass("fold_bucket_copies", module.graph)
        module.recompile()
        return module, expected

    module, expected = lowered(also_return_joined=False)
    assert torch.equal(module(*shards), expected)
    targets = [n.target for n in module.graph.nodes if n.op == "call_function"]
    assert targets == [torch.ops.zpp.quantize_bucket.default]
    # The joined shards used elsewhere too: the join becomes the shards placed side by side.
    module, expected = lowered(also_return_joined=True)
    assert all(torch.equal(a, b) for a, b in zip(module(*shards), expected))
    targets = {n.target for n in module.graph.nodes if n.op == "call_function"}
    assert torch.ops.zpp.quantize_weight.default in targets and torch.ops.aten.where.self in targets
    assert not targets & {torch.ops.zpp.quantize_bucket.default, torch.ops.zpp.join_bucket.default}


@pytest.mark.parametrize("rows", [1, 2])
def test_a_full_precision_join_is_one_kernel_with_its_cast_and_changes_no_bit(rows):
    # A Llama layer's bucket has 9 members: past 8, Inductor lowers a concatenation as a copy
    # per member into a buffer (and a second pass to cast it); placed side by side, it is one kernel.
    sizes = [3, 100, 25, 25, 100, 3, 250, 250, 250]
    segments = [-(-size // 16) * 16 + 16 * (i % 2) for i, size in enumerate(sizes)]
    pieces = [torch.randn(rows, size) for size in sizes]
    pieces[1][0, 0] = -0.0  # a zero's sign survives too

    def placed(*pieces):
        return side_by_side(list(pieces), segments).to(torch.bfloat16)

    expected = torch.cat([F.pad(p, (0, seg - p.shape[1])) for p, seg in zip(pieces, segments)], dim=1)
    torch._dynamo.reset()
    metrics.reset()
    out = torch.compile(placed, backend="inductor", fullgraph=True)(*pieces)
    assert metrics.generated_kernel_count == 1
    assert torch.equal(out.view(torch.int16), expected.to(torch.bfloat16).view(torch.int16))
    assert torch.equal(side_by_side(pieces, segments), expected)  # eagerly too


def test_the_copy_out_is_folded_into_the_dequantization():
    segments, sizes, R, B = (128, 64), (100, 64), 2, 32
    rows = [torch.cat([F.pad(torch.randn(size), (0, seg - size)) for seg, size in zip(segments, sizes)])
            for _ in range(R)]
    packed = torch.cat([torch.ops.zpp.quantize_weight(row, B) for row in rows])

    def lowered(also_return_values: bool) -> tuple[fx.GraphModule, list]:
        def step(packed):
            values = torch.ops.zpp.dequantize_weight(packed, sum(segments), B, torch.float32)
            weights = torch.ops.zpp.split_bucket(values, R, list(segments), list(sizes))
            return (weights, values) if also_return_values else weights
        module = torch.fx.experimental.proxy_tensor.make_fx(step)(packed)
        expected = module(packed)
        run_pass("fold_bucket_copies", module.graph)
        module.recompile()
        return module, expected

    module, expected = lowered(also_return_values=False)
    assert torch.equal(module(packed), expected)
    targets = [n.target for n in module.graph.nodes if n.op == "call_function"]
    assert targets == [torch.ops.zpp.dequantize_bucket.default]
    # Values used elsewhere too (hpZ keeping the dequantized copy): the split becomes plain copies.
    module, expected = lowered(also_return_values=True)
    assert all(torch.equal(a, b) for a, b in zip(module(packed), expected))
    targets = {n.target for n in module.graph.nodes if n.op == "call_function"}
    assert torch.ops.zpp.dequantize_weight.default in targets and torch.ops.aten.cat.default in targets
    assert not targets & {torch.ops.zpp.dequantize_bucket.default, torch.ops.zpp.split_bucket.default}



"""qgZ: the two-hop quantized gradient reduction, across real process groups."""

from __future__ import annotations

import math
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from distributed import device, run_ranks
from models import TinyTransformer, batches
from training import PER_RANK, STEPS, needs_4_ranks, relative_error, train

import zpp_compile as zpp
from zpp_compile.reports.ledger import LEDGER
from zpp_compile.runtime.collectives import all_to_all, all_to_all_between_nodes
from zpp_compile.runtime.ops import reduce_grad_quantized
from zpp_compile.runtime.topology import build_topology

pytestmark = pytest.mark.distributed  # every test here starts processes

BLOCK = 64
SIZES = [1, 7, 4097, 33 * 17]  # 33 x 17: a 2-D weight, flattened
TOPOLOGIES = [  # (world size, ranks per node): 2 nodes x 2, 2 nodes x 1, 1 node x 2
    pytest.param(4, 2, marks=needs_4_ranks),
    (2, 1),
    (2, 2),
]


def reduce(grad: torch.Tensor, numel: int, topology, intra_bits: int, inter_bits: int) -> torch.Tensor:
    return reduce_grad_quantized(
        grad.to(device()), math.ceil(numel / topology.world_size), torch.float32, topology.num_nodes,
        topology.ranks_per_node, topology.node, topology.intra_node.name, topology.inter_node.name, intra_bits,
        inter_bits, BLOCK,
    ).cpu()


def exact_slices(rank: int, world_size: int, ranks_per_node: int) -> None:
    """Gradients that quantize exactly at both hops: every rank sends the same integers, each
    block holding the largest code, so each hop's scale is a whole number and nothing rounds.
    The result must then be that gradient's own shard exactly: it proves each element reaches
    its owner and that the result is the mean (a sum, or sum / ranks per node, would differ)."""
    topology = build_topology(ranks_per_node, 0, 60.0)
    for bits in (8, 4):
        top = 2 ** (bits - 1) - 1
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for numel in SIZES:
                shard = math.ceil(numel / world_size)
                index = torch.arange(world_size * shard)
                grad = ((index * 5) % (2 * top + 1) - top).float()
                grad[(index % shard) % BLOCK == 0] = top
                result = reduce(grad.to(dtype), numel, topology, bits, bits)
                mine = grad[rank * shard:(rank + 1) * shard]
                assert torch.equal(result, mine), (bits, dtype, numel)


def two_node_exchange(rank: int, world_size: int) -> list[int]:
    topology = build_topology(1, 0, 60.0)  # 2 nodes x 1: the inter-node group is both ranks
    sent = (torch.arange(8, dtype=torch.uint8) + 10 * rank).view(4, 2).to(device())
    received = all_to_all_between_nodes(sent, 2, topology.inter_node.name, rank)
    assert torch.equal(received, all_to_all(sent, 2, topology.inter_node.name))
    return received.flatten().tolist()


def test_two_node_exchange_is_an_all_to_all(reduction_checks):
    # Rows 0-1 of each rank's (4, 2) buffer are its chunk for rank 0, rows 2-3 its chunk for rank 1.
    exchanged = [returned["exchange"] for returned in reduction_checks(2, 1)]
    assert exchanged == [[0, 1, 2, 3, 10, 11, 12, 13], [4, 5, 6, 7, 14, 15, 16, 17]]


@pytest.mark.parametrize("world_size, ranks_per_node", TOPOLOGIES)
def test_every_element_reaches_its_owner_as_the_mean(world_size, ranks_per_node, reduction_checks):
    reduction_checks(world_size, ranks_per_node)  # raises what exact_slices raised on a rank


def bounded_error(rank: int, world_size: int, ranks_per_node: int) -> None:
    """Random gradients (different on every rank): the result is within the error the block
    scales allow of a float64 mean: half a step per quantization, summed over the hops."""
    topology = build_topology(ranks_per_node, 0, 60.0)
    nodes, local = topology.num_nodes, ranks_per_node
    intra_bits, inter_bits = 8, 4
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for numel in SIZES:
            shard = math.ceil(numel / world_size)
            g = torch.Generator().manual_seed(numel)
            scale = torch.exp(torch.randn(world_size, world_size * shard, generator=g))  # varied magnitudes
            grads = (torch.randn(world_size, world_size * shard, generator=g) * scale).to(dtype)
            result = reduce(grads[rank], numel, topology, intra_bits, inter_bits).double()

            exact = grads.double()[:, rank * shard:(rank + 1) * shard]  # [ranks, shard]
            blocks = math.ceil(shard / BLOCK)

            def step_per_element(x: torch.Tensor, top: int) -> torch.Tensor:
                """Quantization step of each element's block: absmax / top."""
                x = F.pad(x, (0, blocks * BLOCK - shard)).view(*x.shape[:-1], blocks, BLOCK)
                return (x.abs().amax(-1, keepdim=True) / top).expand_as(x).reshape(*x.shape[:-2], -1)[..., :shard]

            first = step_per_element(exact, 2 ** (intra_bits - 1) - 1) if local > 1 else 0
            per_node = exact.view(nodes, local, shard).sum(1)
            second = step_per_element(per_node, 2 ** (inter_bits - 1) - 1) if nodes > 1 else 0
            if nodes == 1:  # one hop, in intra bits, over every rank
                bound = step_per_element(exact, 2 ** (intra_bits - 1) - 1).sum(0) / 2
            elif local == 1:  # one hop, in inter bits
                bound = step_per_element(exact, 2 ** (inter_bits - 1) - 1).sum(0) / 2
            else:
                # The second hop quantizes the dequantized partial sums, whose block maxima exceed
                # the exact ones by at most the first hop's error: 1% covers it.
                bound = first.sum(0) / 2 + 1.01 * second.sum(0) / 2
            bound = bound / world_size + 1e-6 * exact.abs().sum(0) / world_size
            error = (result - exact.mean(0)).abs()
            assert (error <= bound).all(), (dtype, numel, float((error - bound).max()))


@pytest.mark.parametrize("world_size, ranks_per_node", TOPOLOGIES)
def test_error_within_block_scale_bound(world_size, ranks_per_node, reduction_checks):
    reduction_checks(world_size, ranks_per_node)  # raises what bounded_error raised on a rank


def infinity_stays_visible(rank: int, world_size: int, ranks_per_node: int) -> None:
    topology = build_topology(ranks_per_node, 0, 60.0)
    shard = 4097
    grad = torch.randn(world_size * shard, generator=torch.Generator().manual_seed(rank))
    if rank == 0:
        grad[(world_size - 1) * shard + 10] = float("inf")  # in the last rank's shard
    result = reduce(grad, world_size * shard, topology, 8, 4)
    assert result.isfinite().all() == (rank != world_size - 1)
    assert torch.equal(reduce(torch.zeros(world_size * shard), world_size * shard, topology, 8, 4), torch.zeros(shard))


def test_infinity_in_one_gradient_is_visible_after_reduction(reduction_checks):
    reduction_checks(2, 1)  # raises what infinity_stays_visible raised on a rank


def all_reduction_checks(rank: int, world_size: int, ranks_per_node: int) -> dict:
    """The reduction checks of one topology, in turn on one spawned group; what each returns.
    A check that fails raises, and so fails every test of its topology."""
    returned = {"exact slices": exact_slices(rank, world_size, ranks_per_node),
                "bounded error": bounded_error(rank, world_size, ranks_per_node)}
    if (world_size, ranks_per_node) == (2, 1):
        returned["infinity"] = infinity_stays_visible(rank, world_size, ranks_per_node)
        returned["exchange"] = two_node_exchange(rank, world_size)
    return returned


@pytest.fixture(scope="module")
def reduction_checks() -> Callable[[int, int], list[dict]]:
    """Per rank, what `all_reduction_checks` of a topology returned: run once for all its tests."""
    ranks: dict[tuple[int, int], list[dict]] = {}

    def of_topology(world_size: int, ranks_per_node: int) -> list[dict]:
        if (world_size, ranks_per_node) not in ranks:
            ranks[world_size, ranks_per_node] = run_ranks(all_reduction_checks, world_size, ranks_per_node)
        return ranks[world_size, ranks_per_node]

    return of_topology


def qgz_training(rank: int, world_size: int, ranks_per_node: int, mode: str, options: dict) -> dict:
    config = zpp.Config(quantized_gradients=True, gradient_block_size=BLOCK, ranks_per_node=ranks_per_node, **options)
    data, mine = batches(STEPS, world_size, PER_RANK), slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    torch.manual_seed(0)
    model = zpp.shard(TinyTransformer().to(device()), config)
    train(model, data, torch.compile(model, backend="zeropp", options={"inductor": mode == "inductor"}), mine)
    final = zpp.full_state_dict(model)
    torch.manual_seed(0)
    reference = TinyTransformer().to(device())
    initial = {k: v.clone() for k, v in reference.state_dict().items()}
    train(reference, data)
    return {
        key: relative_error(final[key] - initial[key], value - initial[key])
        for key, value in reference.state_dict().items()
        if key != "pos"
    }


@pytest.mark.parametrize("world_size, ranks_per_node, mode, options", [
    pytest.param(4, 2, "aot", {}, marks=needs_4_ranks, id="4-2-aot"),
    # Through Inductor with hpZ's full local copy as well (test_hpz checks hpZ in the debug mode):
    # a wrong copy would move the updates by about 1.
    pytest.param(2, 1, "inductor", {"hpz_partition_size": 1}, id="2-1-inductor-hpz"),
])
def test_compiled_training_with_qgz_stays_near_reference(world_size, ranks_per_node, mode, options):
    errors = run_ranks(qgz_training, world_size, ranks_per_node, mode, options)[0]
    print("largest relative update error:", max(errors.items(), key=lambda kv: kv[1]))
    # INT4 on the inter-node hop: half a step is up to 7% of a block's largest gradient. Measured
    # 0.083 (2 x 2) and 0.098 (2 x 1) after 3 SGD steps; a misplaced shard gives about 1.
    assert max(errors.values()) < 0.2, errors


def gradient_bytes(rank: int, world_size: int) -> dict:
    """Inter-node bytes of the backward graph's gradient collectives: bf16 reduce-scatter vs qgZ."""
    out = {}
    for qgz in (False, True):
        torch.manual_seed(0)
        model = TinyTransformer(vocab=256, dim=256, heads=4, layers=2).to(device())
        zpp.shard(model, zpp.Config(quantized_gradients=qgz, param_dtype="bf16", reduce_dtype="bf16", ranks_per_node=2))
        compiled = torch.compile(model, backend="zeropp", options={"inductor": False})
        start = len(LEDGER.graphs)
        tokens, targets = batches(1, world_size, vocab=256)[0]
        compiled(tokens[:1].to(device()), targets[:1].to(device())).backward()
        backward = [g for g in LEDGER.graphs[start:] if g.kind == "backward"][0]
        out[qgz] = sum(c.inter_bytes for c in backward.collectives if c.op != "all_gather")
    return out


@needs_4_ranks
def test_qgz_cross_node_gradient_bytes():
    volume = run_ranks(gradient_bytes, 4)[0]
    ratio = volume[True] / volume[False]
    print("cross-node gradient bytes, qgZ / bf16 reduce-scatter:", ratio)
    assert 0 < ratio <= 0.26, ratio

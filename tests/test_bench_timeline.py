"""examples/bench.py's reading of a GPU timeline, on kernels written by hand: exposed
communication, compute time, the kernel breakdown, and the wait for the last rank to join a
collective."""

from __future__ import annotations

import itertools
import random
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

from bench import (  # noqa: E402
    breakdown_table,
    compute_time,
    exposed_and_peer_wait,
    exposed_communication,
    kernel_breakdown,
    nccl_durations,
    transfer_only,
    transfer_times,
)
from distributed import run_ranks  # noqa: E402


def brute_force_exposed(kernels: list[tuple[str, int, int]]) -> int:
    """Unit time steps in which some NCCL kernel runs and no other kernel does."""
    end = max(e for _, _, e in kernels)
    busy = lambda t, comm: any(s <= t < e and n.startswith("nccl") == comm for n, s, e in kernels)  # noqa: E731
    return sum(1 for t in range(end) if busy(t, True) and not busy(t, False))


def test_exposed_communication_is_comm_time_not_covered_by_compute():
    assert exposed_communication([("ncclDevKernel_AllGather", 0, 10), ("gemm", 2, 5), ("gemm", 4, 6)]) == 6
    assert exposed_communication([("gemm", 0, 10)]) == 0
    rng = random.Random(0)
    for _ in range(200):
        kernels = []
        for name in itertools.islice(itertools.cycle(["ncclKernel_ReduceScatter", "triton_quant", "gemm"]),
                                     rng.randint(1, 12)):
            start = rng.randint(0, 40)
            kernels.append((name, start, start + rng.randint(1, 15)))
        assert exposed_communication(kernels) == brute_force_exposed(kernels), kernels


# Rank 0 issues both collectives early; rank 1 joins the gather at 6 and the reduce at 22.
RANK_KERNELS = [
    [("ncclDevKernel_AllGather", 0, 10), ("gemm", 10, 15), ("ncclDevKernel_ReduceScatter", 15, 25), ("gemm", 18, 20)],
    [("ncclDevKernel_AllGather", 6, 10), ("gemm", 10, 15), ("ncclDevKernel_ReduceScatter", 22, 25)],
]


def test_compute_time_is_the_union_of_other_kernels():
    kernels = [("ncclDevKernel_AllGather", 0, 30), ("gemm", 2, 5), ("triton_poi", 4, 6), ("gemm", 10, 12)]
    assert compute_time(kernels) == 6  # 2-6 and 10-12; NCCL's 30 units count for nothing
    assert compute_time([("ncclDevKernel_ReduceScatter", 0, 9)]) == 0


def test_kernel_breakdown_sums_each_kind_per_step():
    kernels = [("ncclDevKernel_AllGather_RING_LL", 0, 30), ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT", 2, 6),
               ("sm90_xmma_gemm_bf16bf16_bf16f32", 6, 8), ("void pytorch_flash::flash_fwd_kernel<>", 8, 18),
               ("triton_poi_fused__to_copy_mul_0", 18, 20), ("qwz_quantize_kernel", 20, 21),
               ("void at::native::vectorized_elementwise_kernel<4, at::native::bfloat16_copy_kernel_cuda>", 21, 23),
               ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<>", 23, 27),
               ("void at::native::reduce_kernel<512, 1>", 27, 28)]
    ms = kernel_breakdown(kernels, steps=2)
    assert ms == pytest.approx({"nccl": 0.015, "matmul": 0.003, "attention": 0.005, "quantization": 0.0005,
                                "inductor": 0.001, "optimizer": 0.002, "copy and cast": 0.001, "other": 0.0005})
    row = {"name": "zero3", "kernel_ms_per_step": {kind: v * 1000 for kind, v in ms.items()}}
    rendered = breakdown_table([row, {"name": "fsdp2", "kernel_ms_per_step": None}])
    assert rendered.splitlines()[0].split()[:3] == ["kernel", "ms/step", "nccl"] and "fsdp2" not in rendered
    assert breakdown_table([{"name": "zero3", "kernel_ms_per_step": None}]) is None


def test_peer_wait_is_the_part_of_a_collective_before_the_last_rank_joined():
    rank0, rank1 = RANK_KERNELS
    everyone = [nccl_durations(rank0), nccl_durations(rank1)]
    assert transfer_times(rank0, everyone) == [4, 3] and transfer_times(rank1, everyone) == [4, 3]
    transfer = transfer_only(rank0, transfer_times(rank0, everyone))
    assert transfer == [("ncclDevKernel_AllGather", 6, 10), ("gemm", 10, 15), ("ncclDevKernel_ReduceScatter", 22, 25),
                        ("gemm", 18, 20)]
    # In NCCL alone: 0-10 and 15-18, 20-25 (18 units); moving data: 6-10 and 22-25 (7); waiting: 11.
    assert exposed_communication(rank0) == 18 and exposed_communication(transfer) == 7
    # A rank that ran a collective more or fewer has no partner to pair with.
    assert transfer_times(rank0, everyone + [nccl_durations(rank0[:2])]) is None


def exposed_and_peer_wait_on(rank: int, world_size: int) -> tuple[float, float]:
    return exposed_and_peer_wait(RANK_KERNELS[rank], wall_us=25.0)


@pytest.mark.distributed
def test_ranks_pair_their_collectives():
    assert run_ranks(exposed_and_peer_wait_on, 2) == [(7 / 25, 11 / 25), (7 / 25, 0.0)]



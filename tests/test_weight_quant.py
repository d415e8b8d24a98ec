"""qwZ weight quantization: Triton kernels (interpreter on CPU) vs torch twins vs float64 math.

Every check compares against something computed independently: the Triton kernel against the
torch twin (two implementations of one formula), both against float64 arithmetic or against
values written out from the spec.
"""

import functools
import math
import os
import subprocess
import sys

import pytest
import torch

from zpp_compile.runtime.buckets import member_starts
from zpp_compile.runtime.quantization import weight_ops as wq

# The interpreter computes inf * 0 in non-finite blocks (the result is overwritten) and numpy warns.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
needs_triton = pytest.mark.skipif(not wq.HAS_TRITON, reason="triton not installed")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
BITS = {4: torch.int32, 2: torch.int16}
# Slack on the half-step error bound, in quantization steps: 127/absmax, x*inv, the scale and
# code*scale are each rounded once (relative error <= 2**-24), which moves the result by at
# most ~127 * 4 * 2**-24 = 3.0e-5 steps; 2**-14 = 6.1e-5 covers it with room.
STEP_SLACK = 2.0**-14


KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the Triton interpreter


def on_kernel_device(launcher, *args, **kwargs) -> torch.Tensor:
    """Runs a Triton launcher on the GPU when there is one, else interpreted; result on the CPU."""
    args = [a.to(KERNEL_DEVICE) if isinstance(a, torch.Tensor) else a for a in args]
    return launcher(*args, **kwargs).cpu()


def weights(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random finite weights whose magnitude varies a lot from one 32-element group to the next."""
    g = torch.Generator().manual_seed(seed)
    groups = torch.exp(2 * torch.randn(n // 32 + 1, generator=g)).repeat_interleave(32)[:n]
    x = torch.randn(n, generator=g) * groups
    return x.clamp(-3e4, 3e4).to(dtype)  # finite in float16 too


def assert_same_values(a: torch.Tensor, b: torch.Tensor) -> None:
    """Bit-for-bit equality; NaN counts as equal to NaN (torch's own casts pick NaN payloads)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    nan = a.isnan()
    assert torch.equal(nan, b.isnan())
    bits = BITS[a.element_size()]
    assert torch.equal(a.view(bits)[~nan], b.view(bits)[~nan])


def unpack(packed: torch.Tensor, n: int, B: int):
    """Codes [nb, B] as int64 and scales [nb] as float64 from one packed chunk (spec layout)."""
    nb = math.ceil(n / B)
    assert packed.numel() == nb * B + 4 * nb
    codes = packed[: nb * B].view(torch.int8).long().view(nb, B)
    scales = packed[nb * B :].clone().view(torch.float32).double()
    return codes, scales


def float64_scales(x: torch.Tensor, B: int) -> torch.Tensor:
    """absmax/127 per block in float64 (finite blocks only)."""
    n = x.numel()
    nb = math.ceil(n / B)
    x64 = torch.nn.functional.pad(x.double(), (0, nb * B - n)).view(nb, B)
    return x64.abs().amax(dim=1) / 127


def test_packed_weight_bytes():
    assert wq.packed_weight_bytes(1, 64) == 64 + 4
    assert wq.packed_weight_bytes(64, 64) == 64 + 4
    assert wq.packed_weight_bytes(65, 64) == 128 + 8
    assert wq.packed_weight_bytes(4097, 256) == 17 * 256 + 17 * 4
    assert all(wq.packed_weight_bytes(n, B) % 4 == 0 for n in range(1, 300) for B in (32, 36, 64))


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B", [64, 256, 2048])
@pytest.mark.parametrize("n", [1, 7, 255, 4097])
def test_triton_matches_twin(dtype, B, n):
    x = weights(n, dtype, seed=n + B)
    if n > 200:  # a non-finite block among normal ones, and an all-zero block
        x[5], x[6], x[7] = float("nan"), float("inf"), float("-inf")
        if n >= 2 * B:
            x[B : 2 * B] = 0
    ept = 256 if n % 2 else None  # small tiles: many programs, masked rows in the last one
    ref = wq.quantize_weight_reference(x, B)
    tri = on_kernel_device(wq.quantize_weight_triton, x, B, elems_per_program=ept)
    assert torch.equal(ref, tri)

    # Two chunks, as after an all-gather of two ranks' shards.
    packed = torch.cat([ref, wq.quantize_weight_reference(weights(n, dtype, seed=7), B)])
    for out_dtype in {dtype, torch.float32}:
        assert_same_values(
            wq.dequantize_weight_reference(packed, n, B, out_dtype),
            on_kernel_device(wq.dequantize_weight_triton, packed, n, B, out_dtype, elems_per_program=ept),
        )


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B", [64, 256])
def test_triton_matches_twin_whole_tiles(dtype, B):
    """n a multiple of the program tile: the kernels' unmasked path (the one that runs at full
    size), with a non-finite block and a zero block in one tile and clean tiles elsewhere."""
    ept = 1024  # elements per program
    n = 4 * ept
    x = weights(n, dtype, seed=B)
    x[B + 3], x[B + 9], x[2 * B - 1] = float("nan"), float("inf"), float("-inf")
    x[2 * B : 3 * B] = 0
    x[3 * ept + 5] = float("-inf")  # a -inf-only block in the last tile
    ref = wq.quantize_weight_reference(x, B)
    assert torch.equal(ref, on_kernel_device(wq.quantize_weight_triton, x, B, elems_per_program=ept))
    packed = torch.cat([ref, wq.quantize_weight_reference(weights(n, dtype, seed=3), B)])
    for out_dtype in {dtype, torch.float32}:
        assert_same_values(
            wq.dequantize_weight_reference(packed, n, B, out_dtype),
            on_kernel_device(wq.dequantize_weight_triton, packed, n, B, out_dtype, elems_per_program=ept),
        )


@pytest.mark.parametrize("impl", ["twin", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B", [32, 128, 1024])
def test_error_within_half_step(impl, dtype, B):
    quant = (wq.quantize_weight_reference if impl == "twin"
             else functools.partial(on_kernel_device, wq.quantize_weight_triton))
    dequant = (wq.dequantize_weight_reference if impl == "twin"
               else functools.partial(on_kernel_device, wq.dequantize_weight_triton))
    n = 3001
    x = weights(n, dtype, seed=B)
    packed = quant(x, B)
    codes, scales = unpack(packed, n, B)
    scale64 = float64_scales(x, B)

    # The stored scale is absmax/127 correctly rounded to float32 (float64 -> float32 rounding
    # of a quotient by 127 cannot hit a float32 tie: its binary expansion repeats every 7 bits).
    assert torch.equal(scales.float(), scale64.float())
    assert codes.min() >= -127 and codes.max() <= 127  # -128 is reserved for NaN

    # Every code is the nearest integer to x/scale, and the dequantized value is within half a
    # step of the float64 input (plus the rounding slack justified at the top of this file).
    x64 = torch.nn.functional.pad(x.double(), (0, codes.numel() - n)).view_as(codes)
    assert ((codes - x64 / scale64[:, None]).abs() <= 0.5 + STEP_SLACK).all()
    y = dequant(packed, n, B, torch.float32).double()
    err = (y - x.double()).view(-1)
    bound = (scale64[:, None] * (0.5 + STEP_SLACK)).expand(-1, B).reshape(-1)[:n]
    assert (err.abs() <= bound).all()
    # Output in the input's dtype is the float32 result rounded by torch's own cast.
    assert_same_values(dequant(packed, n, B, dtype), y.float().to(dtype))


@pytest.mark.parametrize("impl", ["twin", pytest.param("triton", marks=needs_triton)])
def test_round_half_to_even(impl):
    quant = (wq.quantize_weight_reference if impl == "twin"
             else functools.partial(on_kernel_device, wq.quantize_weight_triton))
    # absmax 127 makes scale = inv = 1, so k + 0.5 is an exact tie.
    x = torch.tensor([127.0] + [k + 0.5 for k in range(-20, 20)] + [-126.5, 126.5])
    codes, scales = unpack(quant(x, 64), x.numel(), 64)
    assert scales.tolist() == [1.0]
    expected = [round(v) for v in x.tolist()]  # Python rounds half to even
    assert codes.view(-1)[: x.numel()].tolist() == expected
    assert codes.view(-1)[x.numel() :].eq(0).all()  # padding codes are 0


@pytest.mark.parametrize("impl", ["twin", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_zero_and_nonfinite_blocks(impl, dtype):
    quant = (wq.quantize_weight_reference if impl == "twin"
             else functools.partial(on_kernel_device, wq.quantize_weight_triton))
    dequant = (wq.dequantize_weight_reference if impl == "twin"
               else functools.partial(on_kernel_device, wq.dequantize_weight_triton))
    B = 32
    x = weights(6 * B, dtype, seed=3)
    x[0:B] = 0  # block 0: all zero
    x[B + 1], x[B + 2], x[B + 3] = float("inf"), float("-inf"), float("nan")  # block 1
    x[2 * B + 5] = float("nan")  # block 2: NaN only
    x[3 * B + 7] = float("-inf")  # block 3: -inf only
    x[4 * B : 5 * B] = torch.tensor(1e-37).to(dtype)  # block 4: below 2**-119 (fp32 only)
    # block 5: normal

    packed = quant(x, B)
    codes, scales = unpack(packed, x.numel(), B)
    assert scales[0] == 0 and codes[0].eq(0).all()
    assert scales[1:4].isinf().all() and (scales[1:4] > 0).all()
    assert codes[1, 1:4].tolist() == [127, -127, -128]
    assert codes[1, [0] + list(range(4, B))].eq(0).all()  # finite values in an inf block -> 0
    assert codes[2, 5] == -128 and codes[3, 7] == -127
    assert scales[4] == 0 and codes[4].eq(0).all()  # flushed (fp32, bf16) or exactly 0 (fp16)
    assert math.isfinite(scales[5]) and scales[5] > 0

    for out_dtype in (dtype, torch.float32):
        y = dequant(packed, x.numel(), B, out_dtype).float()
        assert y[:B].eq(0).all() and not y[:B].signbit().any()
        infs = x.float().isinf()
        assert torch.equal(y.isnan(), x.float().isnan())  # NaN stays NaN, no new NaN anywhere
        assert torch.equal(y.isinf(), infs) and torch.equal(y[infs], x.float()[infs])
        assert y[B : 4 * B][torch.isfinite(x[B : 4 * B].float())].eq(0).all()
        assert y[4 * B : 5 * B].eq(0).all()
        assert torch.isfinite(y[5 * B :]).all() and y[5 * B :].ne(0).any()


@pytest.mark.parametrize("impl", ["twin", pytest.param("triton", marks=needs_triton)])
def test_dequantize_inf_block_code_table(impl):
    """Hand-made packed bytes: in an inf-scale block -128 -> NaN, +-127 -> +-inf, others -> 0."""
    dequant = (wq.dequantize_weight_reference if impl == "twin"
               else functools.partial(on_kernel_device, wq.dequantize_weight_triton))
    B = 32
    codes = torch.zeros(2, B, dtype=torch.int8)
    codes[0, :5] = torch.tensor([-128, 127, -127, 5, 0], dtype=torch.int8)
    codes[1, :3] = torch.tensor([-127, 3, 127], dtype=torch.int8)
    scales = torch.tensor([float("inf"), 0.5])
    packed = torch.cat([codes.view(-1).view(torch.uint8), scales.view(torch.uint8)])
    y = dequant(packed, 2 * B, B, torch.float32)
    assert y[0].isnan() and y[1] == float("inf") and y[2] == float("-inf")
    assert y[3:B].eq(0).all()
    assert y[B : B + 3].tolist() == [-63.5, 1.5, 63.5] and y[B + 3 :].eq(0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_ops_round_trip_chunks(dtype):
    B, n, R = 128, 1000, 3  # n not a multiple of B: every chunk carries padding
    shards = [weights(n, dtype, seed=10 + r) for r in range(R)]
    packed = torch.cat([torch.ops.zpp.quantize_weight(s, B) for s in shards])
    assert packed.dtype == torch.uint8 and packed.numel() == R * wq.packed_weight_bytes(n, B)

    y = torch.ops.zpp.dequantize_weight(packed, n, B, torch.float32)
    assert y.shape == (R * n,)
    x = torch.cat(shards).double()
    bound = torch.cat([float64_scales(s, B).repeat_interleave(B)[:n] for s in shards]) * (0.5 + STEP_SLACK)
    assert ((y.double() - x).abs() <= bound).all()
    assert torch.equal(torch.ops.zpp.dequantize_weight(packed, n, B, dtype), y.to(dtype))
    if wq.HAS_TRITON:  # an independent implementation of the same bytes
        assert_same_values(y, on_kernel_device(wq.dequantize_weight_triton, packed, n, B, torch.float32))

    # A packed buffer that starts at an odd byte offset of its storage (not 4-aligned).
    base = torch.empty(packed.numel() + 1, dtype=torch.uint8)
    base[1:] = packed
    assert torch.equal(torch.ops.zpp.dequantize_weight(base[1:], n, B, torch.float32), y)
    if wq.HAS_TRITON:
        assert_same_values(on_kernel_device(wq.dequantize_weight_triton, base[1:], n, B, torch.float32), y)


BUCKET_LAYOUTS = [  # (segments, sizes) in blocks of 64: padding after some members, a member of one block
    ((256, 128, 64, 512), (250, 128, 1, 512)),
    ((1024, 1024), (1024, 1000)),
    # more members than one launch takes (wq.MAX_MEMBERS)
    ((64, 64, 128, 128, 64, 64, 192, 64, 64, 192), (64, 1, 128, 100, 64, 64, 192, 5, 64, 130)),
]


def bucket_of_shards(layout: tuple, R: int, dtype: torch.dtype) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
    """The gathered packed bytes of a bucket over R ranks (each rank quantizes its members'
    shards side by side, each padded to its segment) and the shards, shards[rank][member]."""
    segments, sizes = layout
    shards = [[weights(size, dtype, seed=7 * r + p) for p, size in enumerate(sizes)] for r in range(R)]
    rows = [torch.cat([torch.nn.functional.pad(x, (0, seg - x.numel())) for x, seg in zip(row, segments)])
            for row in shards]
    return torch.cat([wq.quantize_weight_reference(row, 64) for row in rows]), shards


def expected_members(shards: list[list[torch.Tensor]], dtype: torch.dtype) -> list[torch.Tensor]:
    """Each member's weight dequantized on its own (its shards are whole blocks of the bucket's
    rows, so their codes and scales are the bucket's)."""
    return [torch.cat([wq.dequantize_weight_reference(wq.quantize_weight_reference(row[p], 64), row[p].numel(), 64,
                                                      dtype) for row in shards])
            for p in range(len(shards[0]))]


def members_of(split: torch.Tensor, R: int, sizes: tuple) -> list[torch.Tensor]:
    """The members' weights in a split bucket, each starting 256-byte aligned."""
    starts, length = member_starts(R, list(sizes), split.element_size())
    assert split.numel() == length and all(start * split.element_size() % 256 == 0 for start in starts)
    return [split[start:start + R * size] for start, size in zip(starts, sizes)]


def assert_same_members(split: torch.Tensor, R: int, sizes: tuple, expected: list[torch.Tensor]) -> None:
    for member, want in zip(members_of(split, R, sizes), expected, strict=True):
        assert_same_values(member, want)


@pytest.mark.parametrize("layout", BUCKET_LAYOUTS, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_bucket_dequantized_into_member_layout(layout, dtype):
    segments, sizes = layout
    packed, shards = bucket_of_shards(layout, 3, torch.float32)
    expected = expected_members(shards, dtype)
    fused = torch.ops.zpp.dequantize_bucket(packed, segments, sizes, 64, dtype)
    assert_same_members(fused, 3, sizes, expected)
    # The op is the split of the plain dequantization, in one pass.
    values = torch.ops.zpp.dequantize_weight(packed, sum(segments), 64, dtype)
    assert torch.equal(torch.ops.zpp.split_bucket(values, 3, segments, sizes), fused)
    if wq.HAS_TRITON:
        kernel = on_kernel_device(wq.dequantize_bucket_triton, packed, segments, sizes, 64, dtype)
        assert_same_members(kernel, 3, sizes, expected)
        # Small tiles: several programs per member, the last one partly past the member's end.
        small = on_kernel_device(wq.dequantize_bucket_triton, packed, segments, sizes, 64, dtype,
                                 elems_per_program=128, num_warps=1)
        assert_same_members(small, 3, sizes, expected)


@pytest.mark.parametrize("layout", BUCKET_LAYOUTS, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_bucket_quantized_from_its_shards(layout, dtype):
    segments, sizes = layout
    # A rank's shards may be shorter than their members' size (the last rank's, of an uneven split).
    shards = [weights(size - (p % 2) * (size // 3), dtype, seed=p) for p, size in enumerate(sizes)]
    shards[0][3] = float("nan")  # a non-finite block beside finite ones
    # Each shard quantized on its own, padded to its segment (whole blocks), the codes then the scales.
    alone = [wq.quantize_weight_reference(torch.nn.functional.pad(shard, (0, segment - shard.numel())), 64)
             for shard, segment in zip(shards, segments)]
    codes = torch.cat([packed[:segment] for packed, segment in zip(alone, segments)])
    scales = torch.cat([packed[segment:] for packed, segment in zip(alone, segments)])
    expected = torch.cat([codes, scales])
    assert torch.equal(torch.ops.zpp.quantize_bucket(shards, segments, 64), expected)
    assert torch.equal(torch.ops.zpp.quantize_weight(torch.ops.zpp.join_bucket(shards, segments), 64), expected)
    if wq.HAS_TRITON:
        assert torch.equal(on_kernel_device(lambda *xs: wq.quantize_bucket_triton(list(xs), segments, 64), *shards),
                           expected)
        small = on_kernel_device(lambda *xs: wq.quantize_bucket_triton(list(xs), segments, 64, elems_per_program=128,
                                                                       num_warps=1), *shards)
        assert torch.equal(small, expected)


def test_bucket_layout_errors():
    packed, _ = bucket_of_shards(BUCKET_LAYOUTS[0], 2, torch.float32)
    with pytest.raises(ValueError, match="padded to whole blocks"):
        wq.dequantize_bucket_reference(packed, [250, 128, 64, 512], [250, 128, 1, 512], 64, torch.float32)
    with pytest.raises(ValueError, match="padded to whole blocks"):  # a block more than the member needs
        wq.dequantize_bucket_reference(packed, [256, 128, 128, 448], [250, 128, 1, 448], 64, torch.float32)
    with pytest.raises(ValueError, match="at least its size"):
        wq.quantize_bucket_reference([torch.ones(65), torch.ones(3)], [64, 64], 64)
    with pytest.raises(ValueError, match="one length"):
        wq.dequantize_bucket_reference(packed, [256, 128, 64, 512], [250, 128, 1], 64, torch.float32)


def test_fake_shapes_and_opcheck():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(1001, dtype=torch.bfloat16)
        p = torch.ops.zpp.quantize_weight(x, 256)
        assert p.shape == (wq.packed_weight_bytes(1001, 256),) and p.dtype == torch.uint8
        g = torch.empty(4 * p.numel(), dtype=torch.uint8)
        y = torch.ops.zpp.dequantize_weight(g, 1001, 256, torch.float16)
        assert y.shape == (4 * 1001,) and y.dtype == torch.float16

    x = weights(300, torch.float32, seed=1)
    p = wq.quantize_weight_reference(x, 64)
    torch.library.opcheck(torch.ops.zpp.quantize_weight.default, (x, 64))
    torch.library.opcheck(torch.ops.zpp.dequantize_weight.default, (torch.cat([p, p]), 300, 64, torch.bfloat16))
    packed, shards = bucket_of_shards(BUCKET_LAYOUTS[0], 2, torch.float32)
    torch.library.opcheck(torch.ops.zpp.quantize_bucket.default, (shards[0], list(BUCKET_LAYOUTS[0][0]), 64))
    torch.library.opcheck(torch.ops.zpp.dequantize_bucket.default,
                          (packed, list(BUCKET_LAYOUTS[0][0]), list(BUCKET_LAYOUTS[0][1]), 64, torch.bfloat16))


def test_bad_arguments():
    x = torch.randn(100)
    with pytest.raises(ValueError):
        wq.quantize_weight_reference(x, 30)  # not a multiple of 4
    with pytest.raises(ValueError):
        wq.quantize_weight_reference(x, 16)  # below 32
    with pytest.raises(ValueError):
        wq.quantize_weight_reference(x.view(10, 10), 64)
    with pytest.raises(ValueError):
        wq.quantize_weight_reference(x.double(), 64)
    p = wq.quantize_weight_reference(x, 64)
    with pytest.raises(ValueError):
        wq.dequantize_weight_reference(p[:-4], 100, 64, torch.float32)
    # A block size that is a multiple of 4 but no power of 2 works in the twin.
    y = wq.dequantize_weight_reference(wq.quantize_weight_reference(x, 96), 100, 96, torch.float32)
    assert ((y - x).abs() <= float64_scales(x, 96).repeat_interleave(96)[:100] * (0.5 + STEP_SLACK)).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B", [64, 256, 2048])
def test_cuda_kernels_match_twin(dtype, B):
    """The compiled kernels (native bf16 cast, div_rn, no FMA fusion) against the CPU twin."""
    n = (1 << 20) + 3
    x = weights(n, dtype, seed=B)
    x[11], x[12], x[13] = float("nan"), float("inf"), float("-inf")
    packed = torch.ops.zpp.quantize_weight(x.cuda(), B)
    assert torch.equal(packed.cpu(), wq.quantize_weight_reference(x, B))
    gathered = torch.cat([packed, packed])
    for out_dtype in {dtype, torch.float32}:
        assert_same_values(
            torch.ops.zpp.dequantize_weight(gathered, n, B, out_dtype).cpu(),
            wq.dequantize_weight_reference(gathered.cpu(), n, B, out_dtype),
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_cuda_bucket_kernels_match_twins(dtype):
    """Members of whole tiles (unmasked) beside padded ones, at the default block size: quantized
    from their shards, dequantized into their weights."""
    B, R = 2048, 2
    segments, sizes = [1 << 20, 3 * B, 1 << 18], [1 << 20, 3 * B - 5, (1 << 18) - B + 1]
    shards = [[weights(size, torch.float32, seed=r + size) for size in sizes] for r in range(R)]
    rows = [torch.cat([torch.nn.functional.pad(x, (0, seg - x.numel())) for x, seg in zip(row_shards, segments)])
            for row_shards in shards]
    packed = torch.cat([torch.ops.zpp.quantize_weight(row.cuda(), B) for row in rows])
    for row_shards, row in zip(shards, rows):  # quantized from the shards in place, or from the joined row
        assert torch.equal(torch.ops.zpp.quantize_bucket([s.cuda() for s in row_shards], segments, B).cpu(),
                           wq.quantize_weight_reference(row, B))
    expected = members_of(wq.dequantize_bucket_reference(packed.cpu(), segments, sizes, B, dtype), R, sizes)
    assert_same_members(torch.ops.zpp.dequantize_bucket(packed, segments, sizes, B, dtype).cpu(), R, sizes, expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_restarted_process_compiles_no_quantization_kernel_again(tmp_path):
    """The kernels one process compiled, the next finds: both keep them in Inductor's cache folder,
    whether or not Inductor has built a kernel before zeropp's first launch (in a job restarted
    from Inductor's caches it has not), and none in Triton's default folder."""
    script = ("import torch; from zpp_compile.runtime.quantization import weight_ops; "
              "x = torch.randn((1 << 16) + 3, device='cuda'); "
              "torch.ops.zpp.dequantize_weight(torch.ops.zpp.quantize_weight(x, 256), x.numel(), 256, x.dtype); "
              "torch.cuda.synchronize()")
    env = {name: value for name, value in os.environ.items() if name != "TRITON_CACHE_DIR"}
    env |= {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "TRITON_HOME": str(tmp_path / "home")}
    kept = tmp_path / "inductor" / "triton" / "0"

    def kernel_files() -> dict[str, int]:
        return {str(path): path.stat().st_mtime_ns for path in kept.rglob("*") if path.is_file()}

    subprocess.run([sys.executable, "-c", script], env=env, check=True)
    compiled = kernel_files()
    assert compiled, f"no compiled kernel under {kept}"
    subprocess.run([sys.executable, "-c", script], env=env, check=True)
    assert kernel_files() == compiled  # found, not compiled and written again
    assert not (tmp_path / "home" / ".triton" / "cache").exists()

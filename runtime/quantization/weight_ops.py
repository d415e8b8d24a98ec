"""qwZ's ops ``zpp::quantize_weight``, ``zpp::dequantize_weight``, ``zpp::quantize_bucket`` and
``zpp::dequantize_bucket``: their tuning, their Triton launchers and their registration.

qwZ: block-wise symmetric INT8 quantization of a flat weight shard, packed with its scales, so
that the weight all-gather moves about half the bytes of bf16. The code is split by role:

    weight_format.py    the packed format and its arithmetic (the spec), the torch twins,
                        the argument checks
    weight_kernels.py   the @triton.jit kernels and their tile layout
    weight_ops.py       this file: ELEMS_PER_THREAD, the launchers, the ops (the twins on
                        CPU, Triton on CUDA); the format's public names are re-exported here
    triton_common.py    what qwZ shares with qgZ (``grad_*.py``)
"""
from __future__ import annotations

import torch

from ..buckets import member_starts
from .triton_common import HAS_TRITON, aligned_u8, interpreting, launch_context, require_triton, triton
from .weight_format import (
    check_bucket_layout,
    check_dequantize_args,
    check_quantize_args,
    dequantize_bucket_reference,
    dequantize_weight_reference,
    packed_weight_bytes,
    quantize_bucket_reference,
    quantize_weight_reference,
)

if HAS_TRITON:
    from .weight_kernels import qwz_dequantize_kernel, qwz_quantize_kernel

__all__ = [
    "HAS_TRITON",
    "packed_weight_bytes",
    "quantize_weight",
    "dequantize_weight",
    "quantize_weight_reference",
    "dequantize_weight_reference",
    "quantize_weight_triton",
    "dequantize_weight_triton",
    "quantize_bucket",
    "quantize_bucket_reference",
    "quantize_bucket_triton",
    "dequantize_bucket",
    "dequantize_bucket_reference",
    "dequantize_bucket_triton",
]


# Default register tile per thread (elements), see _tile. Dequantize holds less: its fp32 output
# ran faster so (docs/performance.md, "Kernel design: what was measured").
ELEMS_PER_THREAD = {"quantize": 64, "dequantize": 32}


def _tile(kernel: str, block_size: int, nb: int, elems_per_program: int | None,
          num_warps: int | None) -> tuple[int, int, int]:
    """(ROWS blocks per program, warps, elements per thread): a power-of-2 tile of about
    elems_per_program elements (default: ELEMS_PER_THREAD[kernel] per thread with 4 warps)."""
    B = block_size
    warps = num_warps or 4
    elems = elems_per_program or warps * 32 * ELEMS_PER_THREAD[kernel]
    rows = max(1, elems // B)
    rows = 1 << (rows.bit_length() - 1)  # tl.arange needs a power of 2
    rows = min(rows, triton.next_power_of_2(nb))  # small inputs: don't compute masked rows
    ept = max(1, rows * B // (32 * warps))
    return rows, warps, ept


def _require_triton(block_size: int) -> None:
    require_triton("qwZ", block_size, triton_handles_block(block_size), "a power of 2")


def triton_handles_block(block_size: int) -> bool:
    """The kernels tile by powers of 2; the ops send other block sizes to the twins."""
    return block_size & (block_size - 1) == 0


# Members per launch (the kernels' argument slots); a bucket of more members takes several launches.
MAX_MEMBERS = 8


def _slots(values: list, filler: object) -> list:
    """`values` in the kernels' MAX_MEMBERS argument slots (the unused ones are never read)."""
    return list(values) + [filler] * (MAX_MEMBERS - len(values))


def _launch_quantize(shards: list[torch.Tensor], codes: torch.Tensor, scales: torch.Tensor, blocks: list[int],
                     B: int, elems_per_program: int | None, num_warps: int | None) -> None:
    """Quantizes each shard into its `blocks` blocks, the shards' blocks one after another in
    codes and scales; at most MAX_MEMBERS shards per launch."""
    first = 0
    for group in range(0, len(shards), MAX_MEMBERS):
        xs, nbs = shards[group:group + MAX_MEMBERS], blocks[group:group + MAX_MEMBERS]
        rows, warps, ept = _tile("quantize", B, max(nbs), elems_per_program, num_warps)
        # C: 16 codes (one 16-byte vector) per thread, B // ept threads per block
        C = min(B, 16 * max(1, B // max(ept, 16)))
        even = all(x.numel() == nb * B and nb % rows == 0 for x, nb in zip(xs, nbs))
        qwz_quantize_kernel[(triton.cdiv(max(nbs), rows), len(xs))](
            *_slots(xs, xs[0]), codes[first * B:], scales[first:], *_slots([x.numel() for x in xs], 0),
            *_slots(nbs, 0), BLOCK=B, ROWS=rows, C=C, M=len(xs), EVEN=even, INTERP=interpreting(),
            num_warps=warps, enable_fp_fusion=False,
        )
        first += sum(nbs)


def _launch_dequantize(packed: torch.Tensor, n: int, out: torch.Tensor, sizes: list[int], starts: list[int],
                       B: int, elems_per_program: int | None, num_warps: int | None) -> None:
    """Dequantizes each member (sizes[m] values per chunk of `packed`, whose chunks hold n values)
    to out[starts[m]:], chunk after chunk; at most MAX_MEMBERS members per launch."""
    packed = aligned_u8(packed)  # the scales are read as float32 words
    chunk = packed_weight_bytes(n, B)
    R = packed.numel() // chunk
    codes, words = packed.view(torch.int8), packed.view(torch.float32)
    V = 16 // out.element_size()
    G = min(16, B // V)
    first = 0
    for group in range(0, len(sizes), MAX_MEMBERS):
        ns, outs = sizes[group:group + MAX_MEMBERS], starts[group:group + MAX_MEMBERS]
        nbs = [(size + B - 1) // B for size in ns]
        rows, warps, _ = _tile("dequantize", B, max(nbs), elems_per_program, num_warps)
        qwz_dequantize_kernel[(triton.cdiv(max(nbs), rows), R, len(ns))](
            codes[first * B:], words[first:], out, chunk, chunk // 4, (n + B - 1) // B * B // 4,
            *_slots(ns, 0), *_slots(nbs, 0), *_slots(outs, 0), BLOCK=B, ROWS=rows, G=G, V=V, M=len(ns),
            EVEN=all(size % (rows * B) == 0 for size in ns),
            SOFT_BF16=(out.dtype == torch.bfloat16 and not packed.is_cuda), num_warps=warps,
        )
        first += sum(nbs)


def quantize_weight_triton(
    x: torch.Tensor,
    block_size: int,
    *,
    elems_per_program: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Triton quantize (CUDA, or CPU tensors under TRITON_INTERPRET=1); same bytes as the twin."""
    check_quantize_args(x, block_size)
    _require_triton(block_size)
    n, B = x.numel(), block_size
    nb = (n + B - 1) // B
    packed = torch.empty(packed_weight_bytes(n, B), dtype=torch.uint8, device=x.device)
    with launch_context(x):
        _launch_quantize([x.contiguous()], packed[: nb * B].view(torch.int8), packed[nb * B :].view(torch.float32),
                         [nb], B, elems_per_program, num_warps)
    return packed


def dequantize_weight_triton(
    packed: torch.Tensor,
    n: int,
    block_size: int,
    dtype: torch.dtype,
    *,
    elems_per_program: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Triton dequantize of R concatenated packed chunks; same values as the twin."""
    R = check_dequantize_args(packed, n, block_size, dtype)
    _require_triton(block_size)
    out = torch.empty(R * n, dtype=dtype, device=packed.device)
    if R > 0:
        with launch_context(packed):
            _launch_dequantize(packed, n, out, [n], [0], block_size, elems_per_program, num_warps)
    return out


def quantize_bucket_triton(
    shards: list[torch.Tensor],
    segments: list[int],
    block_size: int,
    *,
    elems_per_program: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Triton quantize of a bucket's shards joined side by side; same bytes as the twin. The
    shards are read in place: a segment is whole blocks, so each block holds one shard's values
    (and the padding to the segment's end, read as zeros)."""
    check_bucket_layout(segments, [s.numel() for s in shards], block_size, exact=False)
    for shard in shards:
        check_quantize_args(shard, block_size)
    _require_triton(block_size)
    B, n = block_size, sum(segments)
    packed = torch.empty(packed_weight_bytes(n, B), dtype=torch.uint8, device=shards[0].device)
    with launch_context(shards[0]):
        _launch_quantize([s.contiguous() for s in shards], packed[:n].view(torch.int8), packed[n:].view(torch.float32),
                         [segment // B for segment in segments], B, elems_per_program, num_warps)
    return packed


def dequantize_bucket_triton(
    packed: torch.Tensor,
    segments: list[int],
    sizes: list[int],
    block_size: int,
    dtype: torch.dtype,
    *,
    elems_per_program: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Triton dequantize of a gathered bucket into its members' layout; same values as the twin.
    Each member's values are written where `zpp::split_bucket` would copy them (the gaps between
    members stay unwritten)."""
    check_bucket_layout(segments, sizes, block_size, exact=True)
    n = sum(segments)
    R = check_dequantize_args(packed, n, block_size, dtype)
    _require_triton(block_size)
    starts, length = member_starts(R, sizes, dtype.itemsize)
    out = torch.empty(length, dtype=dtype, device=packed.device)
    if R > 0:
        with launch_context(packed):
            _launch_dequantize(packed, n, out, list(sizes), starts, block_size, elems_per_program, num_warps)
    return out


# ---------------------------------------------------------------------------------------------
# torch.library ops: twins as the default (CPU) kernels, Triton on CUDA.
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("zpp::quantize_weight", mutates_args=())
def quantize_weight(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """Quantizes a 1-D weight shard to packed INT8 blocks plus float32 scales (uint8 bytes)."""
    return quantize_weight_reference(x, block_size)


@quantize_weight.register_fake
def _(x, block_size):
    return x.new_empty(packed_weight_bytes(x.numel(), block_size), dtype=torch.uint8)


@torch.library.custom_op("zpp::dequantize_weight", mutates_args=())
def dequantize_weight(packed: torch.Tensor, n: int, block_size: int, dtype: torch.dtype) -> torch.Tensor:
    """Dequantizes R concatenated packed shards of n elements each to R*n values of `dtype`."""
    return dequantize_weight_reference(packed, n, block_size, dtype)


@dequantize_weight.register_fake
def _(packed, n, block_size, dtype):
    return packed.new_empty(packed.numel() // packed_weight_bytes(n, block_size) * n, dtype=dtype)


@torch.library.custom_op("zpp::quantize_bucket", mutates_args=())
def quantize_bucket(shards: list[torch.Tensor], segments: list[int], block_size: int) -> torch.Tensor:
    """`zpp::quantize_weight` of `zpp::join_bucket`, in one pass: each shard is quantized into
    its place, so the joined shards are never materialized."""
    return quantize_bucket_reference(shards, segments, block_size)


@quantize_bucket.register_fake
def _(shards, segments, block_size):
    return shards[0].new_empty(packed_weight_bytes(sum(segments), block_size), dtype=torch.uint8)


@torch.library.custom_op("zpp::dequantize_bucket", mutates_args=())
def dequantize_bucket(
    packed: torch.Tensor, segments: list[int], sizes: list[int], block_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """`zpp::split_bucket` of `zpp::dequantize_weight`, in one pass: each member's weight is
    written where the split would copy it, so the rank-major values are never materialized."""
    return dequantize_bucket_reference(packed, segments, sizes, block_size, dtype)


@dequantize_bucket.register_fake
def _(packed, segments, sizes, block_size, dtype):
    chunks = packed.numel() // packed_weight_bytes(sum(segments), block_size)
    return packed.new_empty(member_starts(chunks, sizes, dtype.itemsize)[1], dtype=dtype)


if HAS_TRITON:

    @quantize_weight.register_kernel("cuda")
    def _(x, block_size):
        launch = quantize_weight_triton if triton_handles_block(block_size) else quantize_weight_reference
        return launch(x, block_size)

    @dequantize_weight.register_kernel("cuda")
    def _(packed, n, block_size, dtype):
        launch = dequantize_weight_triton if triton_handles_block(block_size) else dequantize_weight_reference
        return launch(packed, n, block_size, dtype)

    @dequantize_bucket.register_kernel("cuda")
    def _(packed, segments, sizes, block_size, dtype):
        launch = dequantize_bucket_triton if triton_handles_block(block_size) else dequantize_bucket_reference
        return launch(packed, segments, sizes, block_size, dtype)

    @quantize_bucket.register_kernel("cuda")
    def _(shards, segments, block_size):
        launch = quantize_bucket_triton if triton_handles_block(block_size) else quantize_bucket_reference
        return launch(shards, segments, block_size)

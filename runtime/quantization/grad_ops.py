"""qgZ's ops ``zpp::qgz_quantize``, ``zpp::qgz_reduce_requantize`` and
``zpp::qgz_dequantize_reduce``: their tuning, their Triton launchers and their registration.

qgZ replaces the gradient reduce-scatter by a two-hop all-to-all of block-quantized pieces (ZeRO++
paper, section 3.3; ``ops.reduce_grad_quantized`` runs the hops). The code is split by role:

    grad_format.py      the packed format and its arithmetic (the spec), the torch twins, the
                        argument checks
    grad_tiles.py       @triton.jit tile helpers (layout, values -> codes, codes -> values) and
                        the table of what the kernels' helpers take
    grad_kernels.py     the three @triton.jit kernels, and why they are built as they are
    grad_ops.py         this file: TUNING, the launchers, the ops (the twins on CPU, Triton
                        on CUDA); the format's public names are re-exported here
    triton_common.py    what qgZ shares with qwZ (``weight_*.py``)
"""
from __future__ import annotations

import dataclasses

import torch

from ...torch_compat import registers_per_sm
from .grad_format import (
    DEFAULT_BLOCK_SIZE,
    check_bits,
    check_dtype,
    check_quantize_args,
    check_reduce_args,
    dequantize_pieces_ref,
    num_blocks,
    piece_bytes,
    qgz_dequantize_reduce_ref,
    qgz_quantize_ref,
    qgz_reduce_requantize_ref,
    quantize_pieces_ref,
    unpack_pieces,
)
from .triton_common import HAS_TRITON, aligned_u8, interpreting, launch_context, num_sms, require_triton, triton

if HAS_TRITON:
    from .grad_kernels import (
        qgz_dequantize_reduce_kernel,
        qgz_quantize_kernel,
        qgz_reduce_requantize_kernel,
    )

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "HAS_TRITON",
    "TUNING",
    "ReduceTuning",
    "piece_bytes",
    "num_blocks",
    "qgz_quantize",
    "qgz_reduce_requantize",
    "qgz_dequantize_reduce",
    "qgz_quantize_ref",
    "qgz_reduce_requantize_ref",
    "qgz_dequantize_reduce_ref",
    "qgz_quantize_triton",
    "qgz_reduce_requantize_triton",
    "qgz_dequantize_reduce_triton",
    "elems_per_thread",
    "triton_handles_block",
    "quantize_pieces_ref",
    "dequantize_pieces_ref",
    "unpack_pieces",
]

# Per kernel and input bits (dequantize_reduce: and bytes per output element): elements per
# program tile, warps per program, and U, the octets of one thread vector (see the tiles in
# grad_tiles.py). A thread holds tile_elems / (32 * num_warps) elements; reduce_requantize
# sizes its tiles by elems_per_thread (from prefetch_words) and runs programs_per_sm persistent
# programs per SM, all resident at once: the launcher caps registers to fit them (a program
# that does not fit starts when another ends and finishes alone). Its programs are one warp
# each, as many per SM as the best sweep of 4-warp programs had warps, without a tile's blocks
# split over warps (grad_kernels.py). l2_prefetch: whether a program asks L2 for the tile after
# the one in its registers (it pays with INT4 sources, not with INT8). Chosen by sweeps of
# examples/bench_grad_kernels.py; the GPU and the figures are in docs/performance.md ("Kernel design:
# what was measured").
TUNING = {
    "quantize": {4: dict(tile_elems=8192, num_warps=4, octets=2),
                 8: dict(tile_elems=8192, num_warps=4, octets=2)},
    "reduce_requantize": {4: dict(prefetch_words=32, num_warps=1, octets=4, programs_per_sm=8,
                              l2_prefetch=True),
                          8: dict(prefetch_words=32, num_warps=1, octets=4, programs_per_sm=12,
                              l2_prefetch=False)},
    "dequantize_reduce": {(4, 2): dict(tile_elems=4096, num_warps=4, octets=4),
                          (4, 4): dict(tile_elems=2048, num_warps=4, octets=2),
                          (8, 2): dict(tile_elems=2048, num_warps=4, octets=2),
                          (8, 4): dict(tile_elems=2048, num_warps=4, octets=2)},
}


def _tile(kernel: str, key, block_size: int, nb: int, tile_elems, num_warps):
    """(BPP blocks per tile, G threads per block, REP octet vectors per thread per block, U,
    warps); ``key`` indexes TUNING[kernel]."""
    _check_tuning(num_warps=num_warps, tile_elems=tile_elems)
    tune = TUNING[kernel][key]
    warps = num_warps or tune["num_warps"]
    opr = triton.next_power_of_2(block_size // 8)           # octets per block, padded
    U = tune["octets"]
    bpp = triton.next_power_of_2(max(1, (tile_elems or tune["tile_elems"]) // (8 * opr)))
    bpp = min(bpp, triton.next_power_of_2(nb))              # small inputs: no masked blocks
    per_thread = max(U, bpp * opr // (32 * warps))          # octets per thread in the tile
    per_row = min(opr, per_thread)                          # ... of one block
    return bpp, opr // per_row, per_row // U, U, warps


def _check_tuning(num_warps=None, **counts) -> None:
    """Launcher tuning keywords: None (the default) or a positive int; warps a power of 2 up to
    16 (Triton's limit)."""
    if num_warps is not None and (not isinstance(num_warps, int) or not 1 <= num_warps <= 16
                                  or num_warps & (num_warps - 1)):
        raise ValueError(f"num_warps must be a power of 2 from 1 to 16, got {num_warps}")
    for name, n in counts.items():
        if n is not None and (not isinstance(n, int) or n < 1):
            raise ValueError(f"{name} must be a positive int, got {n}")


def elems_per_thread(num_sources: int, in_bits: int) -> int:
    """Elements per thread of a qgz_reduce_requantize tile: the largest power of 2 in [16, 64]
    whose code words for all sources (num_sources * elems * in_bits / 32, held in registers
    while the previous tile is computed) fit TUNING's ``prefetch_words``, 32: INT4 sources, 64
    elements up to 4 sources, 32 for 8 (64 spilled); INT8 sources, 64 for 1 source, 32 for 2
    to 4, 16 from 5 on. 16 is one 16-byte vector of INT8 codes per thread, the floor."""
    words = TUNING["reduce_requantize"][in_bits]["prefetch_words"]
    e = max(1, words * 32 // (num_sources * in_bits))
    return max(16, min(64, 1 << (e.bit_length() - 1)))


def _register_cap(device: torch.device, programs_per_sm: int, warps: int) -> int:
    """Registers per thread that let ``programs_per_sm`` programs of ``warps`` warps be resident
    on one SM together (allocated in units of 8 per thread; at most 255)."""
    regs = registers_per_sm(device) if device.type == "cuda" else 65536
    return max(8, min(255, regs // (programs_per_sm * warps * 32) // 8 * 8))


def triton_handles_block(block_size: int) -> bool:
    """The kernels pair 8-element octets into 16-byte accesses, which needs an even number of
    octets per block; the ops send other block sizes to the twins."""
    return block_size % 16 == 0


def _require_triton(block_size: int) -> None:
    require_triton("qgZ", block_size, triton_handles_block(block_size), "a multiple of 16")


def _vec(esize: int) -> int:
    """Elements per 16-byte vector (at most the 8 of an octet)."""
    return min(8, 16 // esize)


def qgz_quantize_triton(grad: torch.Tensor, num_nodes: int, ranks_per_node: int, bits: int, block_size: int,
                        *, tile_elems: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """Triton launcher of ``zpp::qgz_quantize`` (CPU tensors work under TRITON_INTERPRET=1)."""
    _require_triton(block_size)
    S = check_quantize_args(grad, num_nodes, ranks_per_node, bits, block_size)
    grad = grad.contiguous()
    nb = num_blocks(S, block_size)
    P = num_nodes * ranks_per_node
    out = torch.empty(P * piece_bytes(S, block_size, bits), dtype=torch.uint8, device=grad.device)
    bpp, G, rep, U, warps = _tile("quantize", bits, block_size, nb, tile_elems, num_warps)
    # 16-bit inputs are read as int32 pairs (exact, cheap decode) when shards keep pairs aligned
    pairs = grad.element_size() == 2 and S % 2 == 0 and grad.data_ptr() % 4 == 0
    if grad.dtype == torch.float32:
        mode, x = 0, grad
    elif pairs:
        mode, x = (2 if grad.dtype == torch.bfloat16 else 3), grad.view(torch.int32)
    elif grad.dtype == torch.bfloat16:
        mode, x = 1, grad.view(torch.int16)     # the interpreter has no bfloat16 loads
    else:
        mode, x = 0, grad
    even = S % (bpp * block_size) == 0
    with launch_context(grad):
        qgz_quantize_kernel[(triton.cdiv(nb, bpp), P)](
            x, out.view(torch.int32), out.view(torch.float32), S, nb, num_nodes, ranks_per_node,
            BITS=bits, B=block_size, BPP=bpp, G=G, REP=rep, U=U, V=_vec(grad.element_size()),
            MODE=mode, EVEN=even, EMU=interpreting(), num_warps=warps, enable_fp_fusion=False)
    return out


@dataclasses.dataclass(frozen=True)
class ReduceTuning:
    """Overrides of ``TUNING["reduce_requantize"]`` for one launch of
    ``qgz_reduce_requantize_triton`` (None: the table's value).

    tile_elems: elements per tile (default elems_per_thread * 32 * num_warps); num_warps: warps
    per program; programs_per_sm: persistent programs per SM, split over the pieces, their
    registers capped so that all are resident at once; slow_chunk: tiles a program runs between
    two looks for tiles that need the slow path (1 to 32); l2_prefetch: whether a program asks L2
    for the tile after the one its registers prefetch (GPU only)."""

    tile_elems: int | None = None
    num_warps: int | None = None
    programs_per_sm: int | None = None
    slow_chunk: int = 32
    l2_prefetch: bool | None = None

    def __post_init__(self) -> None:
        _check_tuning(num_warps=self.num_warps, tile_elems=self.tile_elems,
                      programs_per_sm=self.programs_per_sm, slow_chunk=self.slow_chunk)
        if self.slow_chunk > 32:
            raise ValueError(f"slow_chunk must be at most 32 (one bit per tile), got {self.slow_chunk}")


def qgz_reduce_requantize_triton(recv: torch.Tensor, num_sources: int, num_pieces: int, shard_size: int,
                                 in_bits: int, out_bits: int, block_size: int, *,
                                 tuning: ReduceTuning | None = None, **overrides) -> torch.Tensor:
    """Triton launcher of ``zpp::qgz_reduce_requantize``. Tuning: ``tuning``, and any of its fields
    as keywords (``tile_elems=...``), which take precedence."""
    tune = dataclasses.replace(tuning or ReduceTuning(), **overrides)
    _require_triton(block_size)
    check_reduce_args(recv, num_sources, num_pieces, shard_size, in_bits, block_size)
    check_bits(out_bits, "out_bits")
    table = TUNING["reduce_requantize"][in_bits]
    warps = tune.num_warps or table["num_warps"]
    tile_elems = tune.tile_elems or elems_per_thread(num_sources, in_bits) * 32 * warps
    recv = aligned_u8(recv)
    nb = num_blocks(shard_size, block_size)
    out = torch.empty(num_pieces * piece_bytes(shard_size, block_size, out_bits),
                      dtype=torch.uint8, device=recv.device)
    bpp, G, rep, U, warps = _tile("reduce_requantize", in_bits, block_size, nb, tile_elems, warps)
    full_tiles = nb // bpp
    per_sm = tune.programs_per_sm or table["programs_per_sm"]
    programs = max(1, min(full_tiles, per_sm * num_sms(recv.device) // num_pieces))
    # the interpreter has no cache to ask (nor inline assembly)
    l2 = (table["l2_prefetch"] if tune.l2_prefetch is None else bool(tune.l2_prefetch)) and not interpreting()
    ob = block_size // 8
    with launch_context(recv):
        qgz_reduce_requantize_kernel[(programs, num_pieces)](
            recv.view(torch.int32), recv.view(torch.float32), out.view(torch.int32),
            out.view(torch.float32), num_pieces, nb, full_tiles, K=num_sources, IN_BITS=in_bits,
            OUT_BITS=out_bits, B=block_size, BPP=bpp, G=G, REP=rep, U=U,
            PAD=(ob & (ob - 1)) != 0, TAIL=(nb % bpp != 0), CHUNK=tune.slow_chunk,
            L2=l2, EMU=interpreting(), num_warps=warps,
            maxnreg=_register_cap(recv.device, per_sm, warps), enable_fp_fusion=False)
    return out


def qgz_dequantize_reduce_triton(recv: torch.Tensor, num_sources: int, shard_size: int, bits: int,
                                 block_size: int, dtype: torch.dtype, scale: float, *,
                                 tile_elems: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """Triton launcher of ``zpp::qgz_dequantize_reduce``."""
    _require_triton(block_size)
    check_reduce_args(recv, num_sources, 1, shard_size, bits, block_size)
    check_dtype(dtype)
    recv = aligned_u8(recv)
    nb = num_blocks(shard_size, block_size)
    out = torch.empty(shard_size, dtype=dtype, device=recv.device)
    bpp, G, rep, U, warps = _tile("dequantize_reduce", (bits, out.element_size()), block_size,
                                   nb, tile_elems, num_warps)
    encode = interpreting() and dtype == torch.bfloat16
    with launch_context(recv):
        qgz_dequantize_reduce_kernel[(triton.cdiv(nb, bpp),)](
            recv.view(torch.int32), recv.view(torch.float32),
            out.view(torch.int16) if encode else out, shard_size, nb, float(scale),
            K=num_sources, BITS=bits, B=block_size, BPP=bpp, G=G, REP=rep, U=U,
            EVEN=(shard_size % (bpp * block_size) == 0),
            ENCODE_BF16=encode, EMU=interpreting(), num_warps=warps, enable_fp_fusion=False)
    return out


# ---------------------------------------------------------------------------------------------
# torch.library ops
# ---------------------------------------------------------------------------------------------

@torch.library.custom_op("zpp::qgz_quantize", mutates_args=())
def qgz_quantize(grad: torch.Tensor, num_nodes: int, ranks_per_node: int, bits: int,
                 block_size: int) -> torch.Tensor:
    """Quantize a flat gradient of W*S elements into R*N packed pieces, chunk l (destination
    local rank) outer, node m inner; piece (l, m) holds shard m*R + l."""
    return qgz_quantize_ref(grad, num_nodes, ranks_per_node, bits, block_size)


@qgz_quantize.register_fake
def _(grad, num_nodes, ranks_per_node, bits, block_size):
    W = num_nodes * ranks_per_node
    S = grad.numel() // W
    return grad.new_empty((W * piece_bytes(S, block_size, bits),), dtype=torch.uint8)


@torch.library.custom_op("zpp::qgz_reduce_requantize", mutates_args=())
def qgz_reduce_requantize(recv: torch.Tensor, num_sources: int, num_pieces: int, shard_size: int,
                          in_bits: int, out_bits: int, block_size: int) -> torch.Tensor:
    """Per piece: float32 sum over sources of the dequantized pieces (one rounding per source),
    requantized to out_bits."""
    return qgz_reduce_requantize_ref(recv, num_sources, num_pieces, shard_size, in_bits, out_bits,
                                     block_size)


@qgz_reduce_requantize.register_fake
def _(recv, num_sources, num_pieces, shard_size, in_bits, out_bits, block_size):
    return recv.new_empty((num_pieces * piece_bytes(shard_size, block_size, out_bits),),
                          dtype=torch.uint8)


@torch.library.custom_op("zpp::qgz_dequantize_reduce", mutates_args=())
def qgz_dequantize_reduce(recv: torch.Tensor, num_sources: int, shard_size: int, bits: int,
                          block_size: int, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """[S] in dtype = (float32 sum over sources of the dequantized pieces) * scale."""
    return qgz_dequantize_reduce_ref(recv, num_sources, shard_size, bits, block_size, dtype, scale)


@qgz_dequantize_reduce.register_fake
def _(recv, num_sources, shard_size, bits, block_size, dtype, scale):
    return recv.new_empty((shard_size,), dtype=dtype)


if HAS_TRITON:
    # Other block sizes are only reachable by calling the ops directly (Config allows powers of 2).
    @qgz_quantize.register_kernel("cuda")
    def _(grad, num_nodes, ranks_per_node, bits, block_size):
        launch = qgz_quantize_triton if triton_handles_block(block_size) else qgz_quantize_ref
        return launch(grad, num_nodes, ranks_per_node, bits, block_size)

    @qgz_reduce_requantize.register_kernel("cuda")
    def _(recv, num_sources, num_pieces, shard_size, in_bits, out_bits, block_size):
        launch = qgz_reduce_requantize_triton if triton_handles_block(block_size) else qgz_reduce_requantize_ref
        return launch(recv, num_sources, num_pieces, shard_size, in_bits, out_bits, block_size)

    @qgz_dequantize_reduce.register_kernel("cuda")
    def _(recv, num_sources, shard_size, bits, block_size, dtype, scale):
        launch = qgz_dequantize_reduce_triton if triton_handles_block(block_size) else qgz_dequantize_reduce_ref
        return launch(recv, num_sources, shard_size, bits, block_size, dtype, scale)

"""Benchmark of the qgZ gradient kernels (runtime/quantization/grad_*.py) against device copy bandwidth.

    python examples/bench_grad_kernels.py                    # GPU: 256 MB gradient, N=2 x R=4
    python examples/bench_grad_kernels.py --json out.json    # also write the results as JSON
    python examples/bench_grad_kernels.py --quick            # tiny sizes; runs on CPU under
                                                             # TRITON_INTERPRET=1 (set here)
    python examples/bench_grad_kernels.py --sweep            # also try other tunings

What is measured, for a flat gradient of --size-mb MB (in its own dtype, bf16 and fp32) on an
emulated topology of N nodes x R ranks (W = N R, shard S = gradient / W elements), INT4 and INT8,
default block size; each kernel in the shape it has in the pipeline:

    quantize            reads the gradient (W S elements), writes W packed pieces
    reduce_requantize   reads R sources x N pieces, writes N pieces (bits in > out: 4>4, 8>8,
                        8>4)
    dequantize_reduce   reads N pieces, writes S elements in the gradient's dtype

Effective bandwidth = (bytes read + bytes written) / time, against a device-to-device copy
that moves the same bytes (read + written) as the kernel, the faster of the driver's memcpy and
a Triton copy (``bench_copy``): the fixed cost of a launch weighs on both alike. Every
measurement rotates over several
buffer sets whose total exceeds L2, and replays the launches from a CUDA graph so that the
Python launch cost does not show up as GPU idle time. Each row also says whether the Triton
kernel matched the torch twin bit for bit on an odd-sized input with inf / NaN / tiny values.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # must precede the kernels' definition

from zpp_compile.reports import text_table  # noqa: E402
from zpp_compile.runtime.quantization import grad_ops as gq  # noqa: E402

ESIZE = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}
DNAME = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


# ------------------------------------------------------------------------------------------
# timing
# ------------------------------------------------------------------------------------------

def time_calls(calls, iters: int, reps: int, cuda: bool) -> float:
    """Seconds per call; ``calls`` rotate over buffer sets."""
    for c in calls:                       # warm up: compile, allocator
        c()
    if not cuda:
        t = time.perf_counter()
        for i in range(iters):
            calls[i % len(calls)]()
        return (time.perf_counter() - t) / iters
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(iters):
            calls[i % len(calls)]()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / iters)
    del graph
    return best


def n_sets(bytes_per_set: int, l2_bytes: int) -> int:
    return max(2, min(8, -(-3 * l2_bytes // max(1, bytes_per_set))))


def l2_size() -> int:
    if torch.cuda.is_available():
        return getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 64 << 20)
    return 64 << 20


# ------------------------------------------------------------------------------------------
# inputs
# ------------------------------------------------------------------------------------------

def nasty(n: int, dtype, dev, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * torch.exp2(torch.randint(-20, 20, (n,), generator=gen))
    x[: n // 16] = 0
    x[n // 3], x[n // 3 + 1], x[n // 3 + 2] = float("inf"), float("-inf"), float("nan")
    x[n // 2: n // 2 + min(300, n // 8)] *= 1e-36
    return x.to(dtype).to(dev)


def out_bits_of(bits: int) -> tuple:
    """Requantization widths measured for an input width: INT8 sources go to INT8 or INT4."""
    return (4,) if bits == 4 else (8, 4)


def check_exact(dev, dtype, bits, B, N, R, S=20011, tunes=None) -> bool:
    """Triton == twin, bit for bit, for the three kernels on an odd-sized nasty input (several
    tiles per piece, some with inf / NaN / tiny scales, some without); ``tunes``: tuning
    keywords by kernel name."""
    tunes = tunes or {}
    W = N * R
    ok = True
    g = nasty(W * S, dtype, dev, seed=bits)
    a = gq.qgz_quantize_triton(g, N, R, bits, B, **tunes.get("quantize", {}))
    ok &= torch.equal(a, gq.qgz_quantize_ref(g, N, R, bits, B))
    for out_bits in out_bits_of(bits):
        red_t = gq.qgz_reduce_requantize_triton(a, R, N, S, bits, out_bits, B,
                                                **tunes.get("reduce_requantize", {}))
        red_r = gq.qgz_reduce_requantize_ref(a, R, N, S, bits, out_bits, B)
        ok &= torch.equal(red_t, red_r)
    recv = a[: N * gq.piece_bytes(S, B, bits)]
    d_t = gq.qgz_dequantize_reduce_triton(recv, N, S, bits, B, dtype, 1.0 / W,
                                          **tunes.get("dequantize_reduce", {}))
    d_r = gq.qgz_dequantize_reduce_ref(recv, N, S, bits, B, dtype, 1.0 / W)
    nan_t, nan_r = torch.isnan(d_t), torch.isnan(d_r)
    ints = torch.int32 if dtype == torch.float32 else torch.int16
    ok &= torch.equal(nan_t, nan_r) and torch.equal(d_t[~nan_t].view(ints), d_r[~nan_r].view(ints))
    return bool(ok)


def mark_exact(args, dev, rows, tunes=None) -> None:
    """Sets each row's "bit_exact" from check_exact (once per dtype and bits; None with
    --no-check)."""
    dtypes = {name: dtype for dtype, name in DNAME.items()}
    done = {}
    for r in rows:
        key = (r["dtype"], r["bits"])
        if key not in done:
            done[key] = None if args.no_check else check_exact(
                dev, dtypes[r["dtype"]], r["bits"], args.block_size, args.nodes, args.ranks,
                S=1001 if args.quick else 20011, tunes=tunes)
        r["bit_exact"] = done[key]


# ------------------------------------------------------------------------------------------
# the benchmark
# ------------------------------------------------------------------------------------------

if gq.HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _copy_kernel(src, dst, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)


def triton_copy(src: torch.Tensor, dst: torch.Tensor) -> None:
    """``dst[:] = src`` for contiguous 1-D int32 tensors: 1024 elements per program of 4 warps,
    two 16-byte vectors per thread."""
    n = src.numel()
    _copy_kernel[(triton.cdiv(n, 1024),)](src, dst, n, BLOCK=1024, num_warps=4)


def bench_copy(nbytes: int, dev, iters, reps, cuda, l2):
    """Bytes read + written per second by a device copy of ``nbytes`` (int32 elements): the
    faster of ``copy_`` (the driver's memcpy) and a plain Triton copy (two 16-byte vectors per
    thread). On an H200 the memcpy of some sizes streams at 2.8 TB/s instead of 4.2-4.3 (578,
    644, 650 and 1544 MB, wherever the buffers lie; 642, 772 and 1284 MB at full rate), which
    would flatter every kernel compared with it; the Triton copy ran at 4.22 TB/s at 644 MB and
    4.25 at 1284 MB."""
    k = n_sets(2 * nbytes, l2)
    n = max(1, nbytes // 4)
    src = [torch.full((n,), i, dtype=torch.int32, device=dev) for i in range(k)]
    dst = [torch.empty_like(s) for s in src]
    copies = [lambda s, d: d.copy_(s)]
    if cuda and gq.HAS_TRITON:
        copies.append(triton_copy)
    best = float("inf")
    for copy in copies:
        calls = [lambda s=s, d=d, copy=copy: copy(s, d) for s, d in zip(src, dst)]
        best = min(best, time_calls(calls, iters, reps, cuda))
    if cuda:
        assert all(torch.equal(s, d) for s, d in zip(src, dst)), "a copy went wrong"
    return 2 * 4 * n / best


def sweep_configs(kernel: str) -> list:
    """Tuning keywords that --sweep tries for a kernel. reduce_requantize: warps x elements
    per thread (programs of 16 warps per SM in all), then the persistent grid's programs per SM
    (one warp each, as the defaults), then with and without the L2 prefetch."""
    if kernel != "reduce_requantize":
        return [dict(tile_elems=tile, num_warps=warps)
                for tile in (2048, 4096, 8192, 16384) for warps in (4, 8)]
    cfgs = [dict(num_warps=warps, tile_elems=e * 32 * warps, programs_per_sm=max(1, 16 // warps))
            for warps in (1, 4, 8) for e in (16, 32, 64)]
    cfgs += [dict(programs_per_sm=p) for p in (4, 8, 12, 16)]
    cfgs += [dict(l2_prefetch=on) for on in (False, True)]
    return cfgs


def bench_kernels(args, dev, cuda, l2, kw=None, only=None):
    """Rows of the kernels (``only`` one of them) launched with tuning keywords ``kw``."""
    N, R, B = args.nodes, args.ranks, args.block_size
    W = N * R
    rows = []
    kw = kw or {}
    for dtype in (torch.bfloat16, torch.float32):
        es = ESIZE[dtype]
        S = max(1, int(args.size_mb * 2 ** 20) // es // W)
        S -= S % B if S > B else 0
        for bits in (4, 8):
            pb = gq.piece_bytes(S, B, bits)
            # quantize
            if only in (None, "quantize"):
                nbytes = W * S * es + W * pb
                k = n_sets(nbytes, l2)
                grads = [torch.randn(W * S, device=dev, dtype=dtype) for _ in range(k)]
                calls = [lambda g=g: gq.qgz_quantize_triton(g, N, R, bits, B, **kw)
                         for g in grads]
                t = time_calls(calls, args.iters, args.reps, cuda)
                rows.append(("quantize", dtype, (bits, bits), nbytes, t))
                packed = gq.qgz_quantize_triton(grads[0], N, R, bits, B)
                del grads, calls
            else:
                packed = gq.qgz_quantize_triton(torch.randn(W * S, device=dev, dtype=dtype),
                                                N, R, bits, B)
            # reduce_requantize: R sources x N pieces (a whole quantized gradient) -> N pieces
            for out_bits in (out_bits_of(bits) if only in (None, "reduce_requantize") else ()):
                nbytes = W * pb + N * gq.piece_bytes(S, B, out_bits)
                k = n_sets(nbytes, l2)
                recvs = [packed.clone() for _ in range(k)]
                calls = [lambda r=r: gq.qgz_reduce_requantize_triton(r, R, N, S, bits, out_bits, B,
                                                                     **kw) for r in recvs]
                t = time_calls(calls, args.iters, args.reps, cuda)
                rows.append(("reduce_requantize", dtype, (bits, out_bits), nbytes, t))
                del recvs, calls
            # dequantize_reduce: N pieces -> S elements
            if only in (None, "dequantize_reduce"):
                nbytes = N * pb + S * es
                k = n_sets(nbytes, l2)
                recvs = [packed[: N * pb].clone() for _ in range(k)]
                calls = [lambda r=r: gq.qgz_dequantize_reduce_triton(r, N, S, bits, B, dtype,
                                                                     1.0 / W, **kw)
                         for r in recvs]
                t = time_calls(calls, args.iters, args.reps, cuda)
                rows.append(("dequantize_reduce", dtype, (bits, bits), nbytes, t))
                del recvs, calls
            del packed
            if cuda:
                torch.cuda.empty_cache()
    out = []
    copy_bw = {}
    for name, dtype, (bits, out_bits), nbytes, t in rows:
        bw = nbytes / t
        if nbytes not in copy_bw:       # a copy of nbytes / 2 reads and writes nbytes
            copy_bw[nbytes] = bench_copy(nbytes // 2, dev, args.iters, args.reps, cuda, l2)
        out.append(dict(kernel=name, dtype=DNAME[dtype], bits=bits, out_bits=out_bits, block_size=B,
                        nodes=N, ranks_per_node=R, bytes=nbytes, time_us=t * 1e6,
                        TBps=bw / 1e12, copy_TBps=copy_bw[nbytes] / 1e12,
                        pct_copy=100 * bw / copy_bw[nbytes], tuning=kw))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size-mb", type=float, default=256.0, help="gradient size in MB (>= 256)")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks", type=int, default=4, help="ranks per node")
    p.add_argument("--block-size", type=int, default=gq.DEFAULT_BLOCK_SIZE)
    p.add_argument("--iters", type=int, default=20, help="launches per timed CUDA graph")
    p.add_argument("--reps", type=int, default=5, help="graph replays (best is kept)")
    p.add_argument("--quick", action="store_true", help="tiny sizes (CPU / interpreter smoke)")
    p.add_argument("--sweep", action="store_true", help="also try other tunings per kernel")
    p.add_argument("--no-check", action="store_true", help="skip the bit-exactness check")
    p.add_argument("--json", type=str, default=None)
    args = p.parse_args(argv)

    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    if args.quick:
        args.size_mb = min(args.size_mb, 0.0625)
        args.iters, args.reps = 2, 1
    if not cuda and not args.quick:
        print("no CUDA device: use --quick (the interpreter is far too slow for real sizes)")
        return 2
    t0 = time.perf_counter()
    l2 = l2_size()
    device = torch.cuda.get_device_name(0) if cuda else "cpu (TRITON_INTERPRET=1)"
    grad_bytes = int(args.size_mb * 2 ** 20)
    copy_bw = bench_copy(grad_bytes, dev, args.iters, args.reps, cuda, l2)

    rows = bench_kernels(args, dev, cuda, l2)
    mark_exact(args, dev, rows)

    print(f"device: {device}   gradient {args.size_mb:g} MB   topology {args.nodes} nodes x "
          f"{args.ranks} ranks   block {args.block_size}")
    print(f"copy of the gradient (read + write): {copy_bw / 1e12:.3f} TB/s; each row against a "
          f"copy of its own bytes (column copy)")
    cells = [(r["kernel"], r["dtype"], r["bits"] if r["out_bits"] == r["bits"] else f"{r['bits']}>{r['out_bits']}",
              f"{r['bytes'] / 2**20:.1f}", f"{r['time_us']:.1f}", f"{r['TBps']:.3f}", f"{r['copy_TBps']:.3f}",
              f"{r['pct_copy']:.1f}%", "-" if r["bit_exact"] is None else ("yes" if r["bit_exact"] else "NO"))
             for r in rows]
    print(text_table.render(("kernel", "in", "bits", "MB", "us", "TB/s", "copy", "% copy", "exact"), cells,
                            align="<<>>>>>><", gap=1))

    sweep = []
    if args.sweep:
        print("\nsweep (tuning keywords), % of copy (NO: not bit-exact):")
        for kernel in ("quantize", "reduce_requantize", "dequantize_reduce"):
            for kw in sweep_configs(kernel):
                res = bench_kernels(args, dev, cuda, l2, kw, only=kernel)
                mark_exact(args, dev, res, {kernel: kw})
                sweep += res
                cells = " ".join(f"{r['dtype']}/{r['bits']}>{r['out_bits']}:{r['pct_copy']:5.1f}"
                                 f"{' NO' if r['bit_exact'] is False else ''}" for r in res)
                print(f"  {kernel:<18} {' '.join(f'{k}={v}' for k, v in kw.items())}: {cells}")

    wall = time.perf_counter() - t0
    print(f"wall {wall:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=device, torch=torch.__version__, size_mb=args.size_mb,
                           nodes=args.nodes, ranks_per_node=args.ranks,
                           block_size=args.block_size, gradient_copy_TBps=copy_bw / 1e12,
                           tuning={k: {str(key): v for key, v in t.items()}
                                   for k, t in gq.TUNING.items()},
                           rows=rows, sweep=sweep, wall_s=wall), f, indent=1)
    ok = all(r["bit_exact"] is not False for r in rows + sweep)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Kernel benchmark: effective bandwidth of zeropp's Triton kernels as a % of device copy.

    python examples/bench_kernels.py                       # GPU, full sizes (< 60 s on an H200)
    python examples/bench_kernels.py --json results.json   # also write the results
    python examples/bench_kernels.py --quick               # CPU smoke test (TRITON_INTERPRET=1)
    python examples/bench_kernels.py --sweep               # tile / warp sweep at the default
                                                           # block (instead of the table)

Bandwidth = (bytes read + bytes written) / median time, the same accounting as the copy
baseline, so "% copy" says how close a kernel gets to the memory system's limit. Each case
rotates through several input buffers so that no run finds its input in L2.

To add kernels, write a function `my_cases(args) -> list[Case]` and append it to SECTIONS.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch

if not torch.cuda.is_available():  # read when kernels are defined, so before importing them
    os.environ.setdefault("TRITON_INTERPRET", "1")

from zpp_compile.runtime.quantization import weight_ops as wq  # noqa: E402

# The interpreter computes inf * 0 in non-finite blocks (overwritten afterwards); numpy warns.
warnings.filterwarnings("ignore", "invalid value encountered", RuntimeWarning)

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


@dataclass
class Case:
    """One measurement. `setup(sets)` allocates `sets` independent input sets and returns
    (run, bytes): run(i) launches the kernel on set i; bytes is read + written per launch."""

    name: str
    params: dict
    setup: Callable[[int], tuple[Callable[[int], object], int]]
    set_bytes: int  # bytes of one input set plus its output, to choose how many sets rotate
    results: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------


def rotation_sets(set_bytes: int, device: torch.device) -> int:
    """Enough buffer sets that their total is >= 4x L2, so each launch reads from DRAM."""
    if device.type != "cuda":
        return 2
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 << 20)
    return min(16, max(2, math.ceil(4 * l2 / max(set_bytes, 1))))


def time_median(run: Callable[[int], object], sets: int, device: torch.device, reps: int, iters: int) -> float:
    """Median seconds per launch over `reps` timings of `iters` back-to-back launches."""
    for i in range(sets):  # warm-up: compiles, and touches every buffer once
        run(i)
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize()
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for j in range(iters):
                run(j % sets)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / iters)
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            for j in range(iters):
                run(j % sets)
            times.append((time.perf_counter() - t0) / iters)
    return statistics.median(times)


def copy_bandwidth(nbytes: int, device: torch.device, reps: int, iters: int) -> dict:
    """Device-to-device copy of nbytes: the reference bandwidth (read + write)."""
    sets = rotation_sets(2 * nbytes, device)
    src = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(sets)]
    dst = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(sets)]
    t = time_median(lambda i: dst[i].copy_(src[i]), sets, device, reps, iters)
    return {"bytes": 2 * nbytes, "time_us": t * 1e6, "gbps": 2 * nbytes / t / 1e9}


# ---------------------------------------------------------------------------------------------
# section: qwZ weight quantization (runtime/quantization/weight_ops.py)
# ---------------------------------------------------------------------------------------------


def weight_quant_cases(args, device: torch.device) -> list[Case]:
    tile = {"elems_per_program": args.elems_per_program, "num_warps": args.num_warps}
    cases = []
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        esize = torch.empty((), dtype=dtype).element_size()
        n = args.numel
        for B in args.block_sizes:
            packed_bytes = wq.packed_weight_bytes(n, B)
            params = {"dtype": dtype_name, "block": B, "numel": n, "default": B == args.default_block}

            def quant_setup(sets, dtype=dtype, B=B, n=n, esize=esize, packed_bytes=packed_bytes):
                xs = [torch.randn(n, device=device, dtype=dtype) for _ in range(sets)]
                return (lambda i: wq.quantize_weight_triton(xs[i], B, **tile)), n * esize + packed_bytes

            cases.append(Case("qwz.quantize", dict(params), quant_setup, n * esize + packed_bytes))

            # Dequantize reads R chunks as after an all-gather of R ranks' shards.
            R = args.chunks
            shard = -(-n // R)
            chunk_bytes = wq.packed_weight_bytes(shard, B)

            def dequant_setup(sets, dtype=dtype, B=B, R=R, shard=shard, esize=esize, chunk_bytes=chunk_bytes):
                packs = []
                for _ in range(sets):
                    x = torch.randn(R * shard, device=device, dtype=dtype)
                    packs.append(torch.cat([wq.quantize_weight_triton(c, B) for c in x.split(shard)]))
                    del x
                run = lambda i: wq.dequantize_weight_triton(packs[i], shard, B, dtype, **tile)  # noqa: E731
                return run, R * chunk_bytes + R * shard * esize

            cases.append(
                Case("qwz.dequantize", dict(params, chunks=R), dequant_setup, R * (chunk_bytes + shard * esize))
            )
    return cases


def weight_quant_accuracy(args, device: torch.device) -> list[dict]:
    """Relative RMS error (vs float64) of a quantize/dequantize round trip on randn fp32 data."""
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(args.acc_numel, device=device, generator=g)
    x64 = x.double()
    rows = []
    for B in args.block_sizes:
        y = wq.dequantize_weight_triton(wq.quantize_weight_triton(x, B), x.numel(), B, torch.float32)
        rel = ((y.double() - x64).norm() / x64.norm()).item()
        rows.append({"block": B, "rel_rms": rel, "bytes_per_elem": wq.packed_weight_bytes(x.numel(), B) / x.numel()})
    return rows


SECTIONS: list[Callable] = [weight_quant_cases]  # add further kernel sections here

# (elements per program, warps) tried by --sweep; a thread holds elems / (32 * warps) elements
SWEEP = ((4096, 2), (4096, 4), (8192, 4), (8192, 8), (16384, 4), (16384, 8), (32768, 8))


def weight_quant_sweep(args, device: torch.device, copy: dict) -> list[dict]:
    """Every SWEEP config for quantize and dequantize at the default block, inputs shared."""
    B, n, R = args.default_block, args.numel, args.chunks
    rows = []
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        esize = torch.empty((), dtype=dtype).element_size()
        packed_bytes = wq.packed_weight_bytes(n, B)
        sets = rotation_sets(n * esize + packed_bytes, device)
        xs = [torch.randn(n, device=device, dtype=dtype) for _ in range(sets)]
        shard = -(-n // R)
        packs = [torch.cat([wq.quantize_weight_triton(c, B) for c in x.split(shard)]) for x in xs]
        qbytes = n * esize + packed_bytes
        dbytes = R * wq.packed_weight_bytes(shard, B) + R * shard * esize
        for ept, warps in (SWEEP[:2] if args.quick else SWEEP):
            tile = {"elems_per_program": ept, "num_warps": warps}
            tq = time_median(lambda i: wq.quantize_weight_triton(xs[i], B, **tile), sets, device, args.reps, args.iters)
            td = time_median(lambda i: wq.dequantize_weight_triton(packs[i], shard, B, dtype, **tile), sets, device,
                             args.reps, args.iters)
            for name, nbytes, t in (("qwz.quantize", qbytes, tq), ("qwz.dequantize", dbytes, td)):
                gbps = nbytes / t / 1e9
                rows.append({"name": name, "dtype": dtype_name, "block": B, "elems_per_program": ept,
                             "num_warps": warps, "time_us": t * 1e6, "gbps": gbps,
                             "pct_copy": 100 * gbps / copy["gbps"]})
                print(f"{name:<16} {dtype_name:<5} {ept:>7} {warps:>5} {t * 1e6:>10.1f} {gbps:>9.1f} "
                      f"{rows[-1]['pct_copy']:>6.1f}%")
        xs = packs = None  # freed before the cache is emptied
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------


def default_block() -> int:
    try:
        from zpp_compile.config import Config

        return int(Config.weight_block_size)
    except Exception:  # the config module may not be importable in a stripped-down tree
        return 256


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=int, default=1 << 28, help="elements per kernel input (default 2**28)")
    p.add_argument("--copy-mb", type=int, default=1024, help="MiB copied for the baseline")
    p.add_argument("--block-sizes", type=int, nargs="+", default=[64, 128, 256, 512, 1024, 2048])
    p.add_argument("--default-block", type=int, default=default_block())
    p.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=sorted(DTYPES))
    p.add_argument("--chunks", type=int, default=8, help="R: packed chunks read by dequantize")
    p.add_argument("--acc-numel", type=int, default=1 << 24, help="elements for the accuracy table")
    p.add_argument("--elems-per-program", type=int, default=None, help="Triton tile size (elements)")
    p.add_argument("--num-warps", type=int, default=None, help="Triton warps per program")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--iters", type=int, default=10, help="launches per timed rep")
    p.add_argument("--quick", action="store_true", help="tiny sizes (CPU smoke test)")
    p.add_argument("--sweep", action="store_true",
                   help="time the SWEEP tile / warp configs at the default block, print the best")
    p.add_argument("--json", metavar="PATH", help="write results as JSON")
    args = p.parse_args(argv)
    if args.default_block not in args.block_sizes:
        args.block_sizes = sorted(args.block_sizes + [args.default_block])
    if args.quick:
        args.numel, args.copy_mb, args.acc_numel = 5000, 1, 5000
        args.block_sizes = sorted({64, 2048, args.default_block})
        args.reps, args.iters = 2, 1
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (TRITON_INTERPRET)"
    import triton

    print(f"device: {name}   torch {torch.__version__}   triton {triton.__version__}")
    copy = copy_bandwidth(args.copy_mb << 20, device, args.reps, args.iters)
    print(f"copy: {args.copy_mb} MiB, {copy['time_us']:.1f} us, {copy['gbps']:.1f} GB/s (read + write)\n")

    if args.sweep:
        print(f"{'case':<16} {'dtype':<5} {'elems':>7} {'warps':>5} {'us':>10} {'GB/s':>9} {'% copy':>7}")
        rows = weight_quant_sweep(args, device, copy)
        print(f"\nbest per kernel (block {args.default_block}; default 4 warps x elements per thread "
              f"{wq.ELEMS_PER_THREAD}):")
        for kname in ("qwz.quantize", "qwz.dequantize"):
            default = 4 * 32 * wq.ELEMS_PER_THREAD[kname.split(".")[1]]
            for dt in args.dtypes:
                mine = [r for r in rows if r["name"] == kname and r["dtype"] == dt]
                b = max(mine, key=lambda r: r["pct_copy"])
                d = [r for r in mine if (r["elems_per_program"], r["num_warps"]) == (default, 4)]
                dd = f"   default {d[0]['pct_copy']:5.1f}%" if d else ""
                print(f"  {kname:<16} {dt:<5}: {b['pct_copy']:5.1f}% at elems {b['elems_per_program']} warps "
                      f"{b['num_warps']}{dd}")
        result = {"device": name, "copy": copy, "sweep": rows}
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
        return result

    print(f"{'case':<16} {'dtype':<5} {'block':>6} {'MiB r+w':>9} {'us':>10} {'GB/s':>9} {'% copy':>7}")
    cases = [c for section in SECTIONS for c in section(args, device)]
    for c in cases:
        sets = rotation_sets(c.set_bytes, device)
        run, nbytes = c.setup(sets)
        t = time_median(run, sets, device, args.reps, args.iters)
        del run
        if device.type == "cuda":
            torch.cuda.empty_cache()
        c.results = {"bytes": nbytes, "time_us": t * 1e6, "gbps": nbytes / t / 1e9}
        c.results["pct_copy"] = 100 * c.results["gbps"] / copy["gbps"]
        mark = "*" if c.params.get("default") else ""
        print(
            f"{c.name:<16} {c.params.get('dtype', ''):<5} {str(c.params.get('block', '')) + mark:>6} "
            f"{nbytes / 2**20:>9.1f} {t * 1e6:>10.1f} {c.results['gbps']:>9.1f} {c.results['pct_copy']:>6.1f}%"
        )
    print("(* = default block size)\n")

    acc = weight_quant_accuracy(args, device)
    print(f"{'block':>6} {'rel RMS err':>12} {'bytes/elem':>11}   (qwZ round trip, randn fp32, {args.acc_numel} elems)")
    for r in acc:
        print(f"{r['block']:>6} {r['rel_rms']:>12.3e} {r['bytes_per_elem']:>11.4f}")

    result = {
        "device": name,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "args": {k: v for k, v in vars(args).items() if k != "json"},
        "copy": copy,
        "cases": [{"name": c.name, **c.params, **c.results} for c in cases],
        "accuracy": acc,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"\nwrote {args.json}")
    return result


if __name__ == "__main__":
    main()

"""Train torchtitan's Llama 3 with zeropp in place of FSDP2: torchtitan's model, configurations and
initialization, in FSDP2's order (built on the meta device, sharded, `to_empty()`, then the model's
own `init_weights()`), compiled with the zeropp backend.

    torchrun --nproc_per_node=2 examples/torchtitan_llama.py                      # the debug model
    torchrun --nproc_per_node=2 examples/torchtitan_llama.py --flavor 1B --qwz --hpz 2 --qgz
    torchrun --nproc_per_node=2 examples/torchtitan_llama.py --zeropp ds_config.json

`--flavor` is any of torchtitan's Llama 3 sizes (debugmodel, 1B, 3B, 8B, 70B, 405B). The text is
the Python standard library's own source as bytes (token ids 0-255 of the model's vocabulary), so
it runs anywhere without a tokenizer or a download. Attention is torchtitan's FlexAttention on
GPUs; on CPUs, where FlexAttention has no backward, torchtitan's SDPA module (causal), which
`--attention sdpa` picks on GPUs too.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from gpt import batch, init_distributed, stdlib_bytes  # examples/gpt.py
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.llama3 import llama3_configs, model_registry

import zpp_compile as zpp


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", choices=llama3_configs, default="debugmodel")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--lr", type=float, default=8e-4)
    p.add_argument("--warmup", type=int, default=2, help="steps of linear warmup, then linear decay")
    p.add_argument("--attention", choices=["flex", "sdpa"], default=None,
                   help="torchtitan's FlexAttention (default on GPUs) or its SDPA module (causal; default on CPUs)")
    p.add_argument("--zeropp", help="a zeropp or DeepSpeed JSON config (the flags below apply on top)")
    p.add_argument("--qwz", action="store_true", help="quantized weight all-gather (INT8)")
    p.add_argument("--hpz", type=int, default=0, help="hpZ secondary group size (0: off)")
    p.add_argument("--qgz", action="store_true", help="quantized two-hop gradient reduction")
    return p.parse_args()


def build_on_meta(flavor: str, attention: str) -> torch.nn.Module:
    config = model_registry(flavor).model
    if attention == "sdpa":
        for layer in config.layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    with torch.device("meta"):
        return config.build()


def main() -> None:
    args = parse_args()
    device = init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    on_gpu = device.type == "cuda"
    config = zpp.Config.load(args.zeropp)
    flags = {"quantized_weights": args.qwz, "hpz_partition_size": args.hpz, "ranks_per_node": args.hpz,
             "quantized_gradients": args.qgz, "param_dtype": "bf16" if on_gpu and not config.param_dtype else None}
    config = config.updated({k: v for k, v in flags.items() if v})

    torch.manual_seed(0)
    attention = args.attention or ("flex" if on_gpu else "sdpa")
    model = build_on_meta(args.flavor, attention)
    zpp.shard(model, config)                 # in place of torchtitan's parallelize_fn (fully_shard)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=device)  # torchtitan's initialization, on the shards
    step_model = torch.compile(model, backend="zeropp")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, fused=on_gpu)
    decay_steps = max(1, args.steps - args.warmup)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / (args.warmup + 1), max(0.0, (args.steps - s) / decay_steps)))

    positions = torch.arange(args.seq, device=device).expand(args.batch, -1)
    masks = model.get_attention_masks(positions) if attention == "flex" else None  # its causal block mask
    data = stdlib_bytes(8_000_000)
    if rank == 0:
        print(f"torchtitan Llama 3 {args.flavor}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M "
              f"parameters, {world} ranks on {device.type}; qwZ {config.quantized_weights}, hpZ "
              f"{config.hpz_partition_size}, qgZ {config.quantized_gradients}", flush=True)
    start = time.perf_counter()
    for step in range(args.steps):
        x, y = batch(data, step, rank, world, args.batch, args.seq, seed=0)
        logits = step_model(x.to(device), attention_masks=masks)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.to(device).flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        if step == 0:
            start = time.perf_counter()  # the first step compiles; time the rest
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            speed = world * args.batch * args.seq * step / (time.perf_counter() - start) if step else 0.0
            print(f"step {step + 1}: loss {loss.item():.3f}, {speed:,.0f} tokens/s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

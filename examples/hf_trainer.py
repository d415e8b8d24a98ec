"""Train a Llama with HF's Trainer, sharded and compiled by zeropp: a standard Trainer script in
which two lines change (marked "zeropp:" below).

    torchrun --nproc_per_node=2 examples/hf_trainer.py                            # a small Llama, CPU or GPUs
    torchrun --nproc_per_node=2 examples/hf_trainer.py --zeropp ds_config.json    # your DeepSpeed ZeRO++ config
    torchrun --nproc_per_node=2 examples/hf_trainer.py --model PATH               # fine-tune a checkpoint
    torchrun --nproc_per_node=2 examples/hf_trainer.py --shape llama-1b --compare-loop

The model is built from a config with random weights (or loaded with `--model`), and trained on
byte-level text of the Python standard library's own source, present on every machine. `--zeropp`
takes a zeropp JSON config or a DeepSpeed one (its `zero_optimization` keys carry over); by
default GPUs compute in bf16 (Config.param_dtype, zeropp's mixed precision: the Trainer's own
`bf16` autocast is not needed). `--compare-loop` then trains the same model, config and batch
shape in a hand-written loop doing what the Trainer's step does (AdamW, clipping, cosine schedule)
and prints both throughputs, as a ratio.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import transformers
from gpt import stdlib_bytes  # examples/gpt.py

import zpp_compile as zpp
from zpp_compile.integrations.transformers import ZeroppTrainer

# Decoder shapes: width, layers, attention heads, key/value heads, MLP width, vocabulary.
SHAPES = {
    "small": (256, 4, 4, 2, 688, 256),
    "llama-1b": (2048, 16, 32, 8, 8192, 128256),  # Llama-3.2-1B
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=SHAPES, default="small", help="the model's shape (random weights)")
    p.add_argument("--model", help="a checkpoint to fine-tune instead (a from_pretrained path)")
    p.add_argument("--zeropp", help="a zeropp or DeepSpeed JSON config (default: bf16 compute on GPUs)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per micro-batch")
    p.add_argument("--accumulation", type=int, default=2, help="micro-batches per step")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--output-dir", default="hf_trainer_output")
    p.add_argument("--compare-loop", action="store_true", help="also time a hand-written loop; print the ratio")
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the throughput (compilation)")
    return p.parse_args()


class StdlibText(torch.utils.data.Dataset):
    """Windows of `seq` bytes of the standard library's source; a causal LM shifts the labels itself."""

    def __init__(self, seq: int, count: int) -> None:
        self.data = stdlib_bytes(8_000_000)
        self.starts = torch.randint(0, len(self.data) - seq, (count,), generator=torch.Generator().manual_seed(0))
        self.seq = seq

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        tokens = self.data[self.starts[index]:self.starts[index] + self.seq].long()
        return {"input_ids": tokens, "labels": tokens}


def build_model(args: argparse.Namespace) -> transformers.PreTrainedModel:
    if args.model:
        return transformers.AutoModelForCausalLM.from_pretrained(args.model)
    torch.manual_seed(0)
    dim, layers, heads, kv_heads, ffn, vocab = SHAPES[args.shape]
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=dim, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, intermediate_size=ffn, max_position_embeddings=args.seq,
        tie_word_embeddings=True, use_cache=False,
    )
    return transformers.LlamaForCausalLM(config)


def zeropp_config(args: argparse.Namespace) -> zpp.Config | str:
    return args.zeropp or zpp.Config(param_dtype="bf16" if torch.cuda.is_available() else None)


class Throughput(transformers.TrainerCallback):
    """Seconds of the steps after the first `warmup` (which include compilation)."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.start, self.seconds = warmup, 0.0, 0.0

    def on_step_end(self, args, state, control, **kwargs) -> None:
        if state.global_step in (self.warmup, state.max_steps) and torch.cuda.is_available():
            torch.cuda.synchronize()
        if state.global_step == self.warmup:
            self.start = time.perf_counter()
        elif state.global_step == state.max_steps:
            self.seconds = time.perf_counter() - self.start


def train_with_trainer(args: argparse.Namespace, dataset: StdlibText) -> float:
    training_args = transformers.TrainingArguments(
        output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=args.accumulation, learning_rate=args.lr, lr_scheduler_type="cosine",
        warmup_steps=args.steps // 10, logging_steps=10, save_strategy="no", report_to="none",
        use_cpu=not torch.cuda.is_available(), dataloader_drop_last=True,
    )
    throughput = Throughput(args.warmup)
    # zeropp: ZeroppTrainer in place of Trainer, and its config (a zpp.Config, a dict, or a DeepSpeed JSON).
    trainer = ZeroppTrainer(model=build_model(args), args=training_args, train_dataset=dataset,
                            callbacks=[throughput], zeropp=zeropp_config(args))
    trainer.train()
    trainer.save_model()  # consolidated safetensors: from_pretrained(args.output_dir) loads them
    return throughput.seconds


def train_with_loop(args: argparse.Namespace, dataset: StdlibText, device: torch.device) -> float:
    """The Trainer's step, hand-written: accumulation without sync, clipping, AdamW, cosine schedule."""
    model = zpp.shard(build_model(args).to(device), zeropp_config(args))
    step_model = torch.compile(model, backend="zeropp")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, fused=device.type == "cuda")
    schedule = transformers.get_cosine_schedule_with_warmup(optimizer, args.steps // 10, args.steps)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    start = 0.0
    for step in range(args.steps):
        if step == args.warmup:
            synchronize(device)
            start = time.perf_counter()
        for micro in range(args.accumulation):
            first = ((step * args.accumulation + micro) * world + rank) * args.batch
            batch = [dataset[i % len(dataset)] for i in range(first, first + args.batch)]
            tokens = torch.stack([sample["input_ids"] for sample in batch]).to(device)
            zpp.set_requires_gradient_sync(model, micro == args.accumulation - 1)
            (step_model(input_ids=tokens, labels=tokens).loss / args.accumulation).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
    synchronize(device)
    return time.perf_counter() - start


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    args = parse_args()
    if args.steps <= args.warmup:
        raise SystemExit(f"--steps {args.steps} must exceed --warmup {args.warmup} (the steps timed come after it)")
    dataset = StdlibText(args.seq, count=64 * args.steps * args.batch * args.accumulation)
    trainer_seconds = train_with_trainer(args, dataset)  # the Trainer sets up torch.distributed
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    tokens = (args.steps - args.warmup) * args.batch * args.accumulation * world * args.seq
    if rank == 0:
        print(f"Trainer: {tokens / trainer_seconds:,.0f} tokens/s over steps {args.warmup + 1}-{args.steps}")
    if args.compare_loop:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        loop_seconds = train_with_loop(args, dataset, device)
        if rank == 0:
            print(f"hand-written loop: {tokens / loop_seconds:,.0f} tokens/s; "
                  f"Trainer / loop = {loop_seconds / trainer_seconds:.3f}")
    if rank == 0:
        print(f"model saved to {os.path.abspath(args.output_dir)}")


if __name__ == "__main__":
    main()

"""One training step of a small MLP under zeropp, for the `zeropp` command's tests.

    torchrun --nproc_per_node=2 tests/cli_train.py CONFIG.json OUT_DIR

Writes OUT_DIR/ledger{rank}.json: this run's `zpp.comm_report().to_dict()`, `zpp.step_comm_bytes()`
and the model's parameter count, to compare with what `zeropp report` reads from the dump.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

import zpp_compile as zpp


def main() -> None:
    config_path, out = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    # Bias-free layers whose shards fill whole quantization blocks: the byte counts of
    # `zeropp explain`, which sees the model as one flat parameter, apply without small-tensor cases.
    model = nn.Sequential(nn.Linear(64, 128, bias=False), nn.GELU(), nn.Linear(128, 64, bias=False))
    params = sum(p.numel() for p in model.parameters())
    zpp.shard(model, zpp.Config.load(config_path))
    step_model = torch.compile(model, backend="zeropp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # An input that needs a gradient makes backward use (so re-gather) every weight, as explain
    # assumes; a first layer whose input needs none is never re-gathered.
    step_model(torch.randn(4, 64, requires_grad=True)).square().mean().backward()
    opt.step()
    rank = dist.get_rank()
    result = {"report": zpp.comm_report().to_dict(), "step_comm_bytes": list(zpp.step_comm_bytes()), "params": params}
    (out / f"ledger{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""An optimizer made before `shard()` is stopped at its first step: it holds parameters the model no
longer has.

`shard` gives every parameter of the model a new Parameter object, its shard (a DTensor), as
FSDP2's `fully_shard` does. An optimizer made before holds the old objects, which nothing reads
any more: its steps would move tensors the model no longer uses, and training would run, loss and
all, without the weights ever changing. torch has no hook for an optimizer's construction, but it
has one for every optimizer's step (`torch.optim.optimizer.register_optimizer_step_pre_hook`):
installed by the first `shard`, it raises at the first step of an optimizer that holds a
parameter `shard` replaced. Each optimizer is checked again only when its parameter count
changes (`add_param_group`), so a step pays one lookup.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from .initialization import listing

# The parameters `shard` replaced (weakly: gone with the last optimizer holding one), each with
# its qualified name in the model; the optimizers checked since, with the parameter count checked.
_replaced: WeakIdKeyDictionary = WeakIdKeyDictionary()
_checked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_hook: Any = None


def note_replaced(param: nn.Parameter, name: str) -> None:
    """`shard` replaced `param` (`name` in its model) by its shard."""
    global _hook
    _replaced[param] = name
    if _hook is None:
        _hook = register_optimizer_step_pre_hook(_refuse_replaced)


def _refuse_replaced(optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
    count = sum(len(group["params"]) for group in optimizer.param_groups)
    if _checked.get(optimizer) == count:
        return
    stale = [_replaced[p] for group in optimizer.param_groups for p in group["params"] if p in _replaced]
    if stale:
        raise RuntimeError(
            f"{type(optimizer).__name__} holds {len(stale)} parameter(s) that zpp_compile.shard has replaced by their "
            f"shards ({listing(stale)}): it was made before shard(), so its steps would never change the model. "
            "Make the optimizer after sharding: model = zpp_compile.shard(model, config), then "
            "optimizer = torch.optim.AdamW(model.parameters(), ...)"
        )
    _checked[optimizer] = count

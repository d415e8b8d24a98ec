"""Trainable parameters added to a sharded model after `shard` (PEFT's adapters from `get_peft_model`
on the sharded model, a new head): one refusal, for the eager forward and the compiled step alike.

shard() never saw them, so nothing reduces their gradients across ranks: every rank would train
its own values. The eager forward refuses them before it runs (`sharding._refuse_unsharded_trainable`),
the backend before it compiles a graph reading them (`backend._sharding_state`); both say what to do,
in the words below. Frozen ones are no danger (no gradient to average) and run as plain tensors.
"""

from __future__ import annotations

from typing import Iterable

import torch

from ..runtime.registry import REGISTRY
from .initialization import listing


def added_after_shard(names: list[str], whose: str) -> RuntimeError:
    """The error for trainable, unsharded parameters `names` (qualified names where known), `whose`
    saying where they were found ("of this sharded model", "read by this compiled step")."""
    return RuntimeError(
        f"zeropp: {len(names)} trainable parameter(s) {whose} are not sharded: "
        f"{listing(names)}. They were added after zpp_compile.shard, so their gradients would not be "
        "averaged across ranks and every rank would train its own values. Shard after adding them (e.g. "
        "model = peft.get_peft_model(model, lora_config), then zpp_compile.shard(model, config)), or freeze "
        "them with requires_grad_(False)"
    )


def names_in_sharded_models(params: Iterable[torch.Tensor]) -> dict[int, str]:
    """The qualified name of each of `params` (by id) that a model given to `shard` holds now, in the
    first such model that holds it. Walks every sharded model's parameters: for an error message only."""
    wanted = {id(p) for p in params}
    names: dict[int, str] = {}
    for model in list(REGISTRY.models.keys()):
        for name, param in model.named_parameters():
            if id(param) in wanted:
                names.setdefault(id(param), name)
    return names

"""Lightning with zeropp (`zpp_compile.integrations.lightning`) against the same loop run unsharded
in one process. Fabric (`ZeroppStrategy`): gradient accumulation through `fabric.no_backward_sync`,
`fabric.clip_gradients`, a cosine schedule; a checkpoint saved with `fabric.save` and resumed with
`fabric.load`; `fabric.load_raw` of a full state dict; an optimizer made before the model is set
up, refused. The Trainer (`ZeroppTrainerStrategy`): the same training through `accumulate_grad_batches`
and `gradient_clip_val`, and a `ModelCheckpoint` resumed by `fit(ckpt_path=...)`."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("lightning")
import lightning as L  # noqa: E402
from distributed import run_ranks  # noqa: E402
from models import TinyTransformer  # noqa: E402
from training import ADAM_FP32, LOGGED_FP32, assert_same_state  # noqa: E402

import zpp_compile as zpp  # noqa: E402
from zpp_compile.config import ConfigError  # noqa: E402
from zpp_compile.integrations.lightning import ZeroppStrategy, ZeroppTrainerStrategy  # noqa: E402

pytestmark = pytest.mark.distributed  # every test here starts processes

STEPS, SAVE_AT, MICRO_BATCHES, GLOBAL_BATCH, SEQ = 6, 3, 2, 4, 9
DEBUG_MODE = {"inductor": False}


def samples(steps: int = STEPS) -> torch.utils.data.TensorDataset:
    """The token sequences of `steps` steps, fixed by a seed."""
    tokens = torch.randint(0, 37, (steps * MICRO_BATCHES * GLOBAL_BATCH, SEQ + 1),
                           generator=torch.Generator().manual_seed(1))
    return torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])


def fabric_for(world_size: int, sharded: bool, compile_options: dict | None = None) -> L.Fabric:
    """Fabric in the test's ranks (already a process group; Lightning sees torchrun's variables)."""
    if not sharded:
        return L.Fabric(accelerator="cpu", devices=1)
    strategy = ZeroppStrategy(compile=compile_options is not None, compile_options=compile_options)
    return L.Fabric(accelerator="cpu", devices=world_size, strategy=strategy)


def fabric_run(rank: int, world_size: int, folder: str, sharded: bool, compile_options: dict | None = None,
               resume: str | None = None) -> dict:
    """The loop: per step 2 micro-batches (the first without gradient sync), clipping at 0.5, AdamW
    and a cosine schedule; saves at step 3, or starts from `resume`. Returns what each step logged
    (loss over all ranks, gradient norm) and the final parameters."""
    fabric = fabric_for(world_size, sharded, compile_options)
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup_module(TinyTransformer())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=2e-2, weight_decay=0.1))
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=STEPS)
    loader = fabric.setup_dataloaders(
        torch.utils.data.DataLoader(samples(), batch_size=GLOBAL_BATCH // fabric.world_size))
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0, "logged": []}
    if resume is not None:
        fabric.load(resume, state)
    batches = iter(loader)
    for step in range(STEPS):
        micro_batches = [next(batches) for _ in range(MICRO_BATCHES)]
        if step < state["step"]:
            continue
        loss_sum = torch.zeros(())
        for i, (x, y) in enumerate(micro_batches):
            with fabric.no_backward_sync(model, enabled=i < MICRO_BATCHES - 1):
                loss = model(x, y) / MICRO_BATCHES
                fabric.backward(loss)
            if sharded and i == 0:  # no_backward_sync acts: the gradient stays on the rank, unreduced
                assert not any(p.grad is not None and p.grad.to_local().any() for p in model.parameters())
            loss_sum += loss.detach()
        norm = fabric.clip_gradients(model, optimizer, max_norm=0.5)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        state["logged"].append((fabric.all_reduce(loss_sum, reduce_op="mean").item(), norm.full_tensor().item()
                                if hasattr(norm, "full_tensor") else norm.item()))
        state["step"] = step + 1
        if step + 1 == SAVE_AT and resume is None:
            fabric.save(f"{folder}/step-{SAVE_AT}", state)
    full = zpp.full_state_dict(model) if sharded else model.state_dict()
    return {"logged": state["logged"], "state": {k: v.clone() for k, v in full.items()}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lightning")
    reference = run_ranks(fabric_run, 1, str(root / "reference"), False)[0]
    straight = run_ranks(fabric_run, 2, str(root / "straight"), True, DEBUG_MODE)[0]
    return root, reference, straight


def test_fabric_loop_matches_the_unsharded_loop(runs):
    """2 ranks, compiled: the losses and global gradient norms of 6 steps, and the parameters."""
    _, reference, straight = runs
    assert len(straight["logged"]) == STEPS
    assert max(norm for _, norm in reference["logged"]) > 0.5  # clipping acts
    torch.testing.assert_close(straight["logged"], reference["logged"], **LOGGED_FP32)
    assert_same_state(straight["state"], reference["state"], **ADAM_FP32)


def test_fabric_checkpoint_resumes_bit_identical(runs):
    """The step-3 checkpoint (model, optimizer, scheduler, the step and the log so far) resumed by
    new processes ends bit-identical to the uninterrupted run."""
    root, _, straight = runs
    resumed = run_ranks(fabric_run, 2, str(root / "resumed"), True, DEBUG_MODE, str(root / "straight" / "step-3"),
                        fresh=True)[0]
    assert resumed["logged"] == straight["logged"]
    assert_same_state(resumed["state"], straight["state"], rtol=0, atol=0)


def setup_checks(rank: int, world_size: int, full_state_file: str) -> None:
    fabric = fabric_for(world_size, sharded=True)
    fabric.launch()
    model = TinyTransformer()
    with pytest.raises(ConfigError, match=r"set the model up first, then make the optimizer"):
        fabric.setup(model, torch.optim.AdamW(model.parameters()))
    model = fabric.setup_module(model)
    with pytest.raises(ConfigError, match=r"holds 1 parameter\(s\) that are not zeropp shards.*setup_module. returned"):
        fabric.setup_optimizers(torch.optim.AdamW([*model.parameters(), torch.nn.Parameter(torch.ones(3))]))
    fabric.load_raw(full_state_file, model)
    expected = torch.load(full_state_file, weights_only=True)
    assert_same_state(zpp.full_state_dict(model), expected, rtol=0, atol=0)
    # A strict load of an entry the checkpoint lacks fails before it changes the model.
    checkpoint = f"{full_state_file}.ckpt"
    fabric.save(checkpoint, {"model": model, "step": 1})
    with torch.no_grad():
        model.embed.weight.add_(1.0)
    changed = zpp.full_state_dict(model)
    with pytest.raises(KeyError, match=r"holds no \['epoch'\]"):
        fabric.load(checkpoint, {"model": model, "epoch": 0})
    assert_same_state(zpp.full_state_dict(model), changed, rtol=0, atol=0)
    state = {"model": model, "step": 0}
    fabric.load(checkpoint, state)
    assert state["step"] == 1
    assert_same_state(zpp.full_state_dict(model), expected, rtol=0, atol=0)


def test_fabric_setup_refuses_an_early_optimizer_and_loads_full_state_dicts_and_checkpoints(tmp_path):
    torch.manual_seed(5)
    path = tmp_path / "full.pt"
    torch.save(TinyTransformer().state_dict(), path)
    run_ranks(setup_checks, 2, str(path))


class TinyLightningModule(L.LightningModule):
    """The test transformer as a LightningModule; `zeropp`: the compile options of its sharded
    model, or None for the unsharded reference."""

    def __init__(self, zeropp: dict | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = TinyTransformer()
        self.zeropp = zeropp
        self.losses: list[torch.Tensor] = []

    def configure_model(self) -> None:
        if self.zeropp is not None:
            zpp.shard(self.model)
            self.model.compile(backend="zeropp", options=self.zeropp)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.zeropp is not None and batch_idx % MICRO_BATCHES:  # the micro-batch before ran under no_sync
            assert not any(p.grad is not None and p.grad.to_local().any() for p in self.parameters())
        loss = self.model(*batch)
        self.losses.append(loss.detach())
        return loss

    def configure_optimizers(self) -> dict:
        optimizer = torch.optim.AdamW(self.parameters(), lr=2e-2, weight_decay=0.1)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=STEPS)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def lightning_trainer_run(rank: int, world_size: int, folder: str, zeropp: dict | None,
                          resume: str | None = None) -> dict:
    """Trainer.fit: 6 steps of 2 accumulated micro-batches, clipping at 0.5, AdamW on a cosine
    schedule, a checkpoint every 3 steps (sharded runs); every micro-batch's loss on this rank and
    the final parameters."""
    sharded = zeropp is not None
    callbacks = [L.pytorch.callbacks.ModelCheckpoint(folder, every_n_train_steps=SAVE_AT, save_top_k=-1)]
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy=ZeroppTrainerStrategy() if sharded else "auto",
        max_steps=STEPS, accumulate_grad_batches=MICRO_BATCHES, gradient_clip_val=0.5, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=sharded,
        callbacks=callbacks if sharded else None, use_distributed_sampler=False,
    )
    module = TinyLightningModule(zeropp)
    # An epoch is 3 steps, so that a resume at step 3 starts an epoch, as the uninterrupted run does
    # there (a resume mid-epoch restarts the epoch's data); the samples in order (the Trainer's own
    # distributed sampler shuffles), each rank every other one.
    data = samples(SAVE_AT)
    sampler = torch.utils.data.DistributedSampler(data, world_size, rank, shuffle=False)
    loader = torch.utils.data.DataLoader(data, batch_size=GLOBAL_BATCH // world_size, sampler=sampler)
    trainer.fit(module, loader, ckpt_path=resume)
    state = zpp.full_state_dict(module.model) if sharded else module.model.state_dict()
    return {"losses": torch.stack(module.losses), "state": {k: v.clone() for k, v in state.items()}}


def test_lightning_trainer_matches_the_unsharded_trainer_and_resumes_bit_identical(tmp_path):
    """2 ranks, compiled: every micro-batch's loss (the ranks' halves averaged) and the final
    parameters against the unsharded Trainer; then the step-3 checkpoint resumed by a new Trainer
    in new processes ends bit-identical to the uninterrupted run."""
    reference = run_ranks(lightning_trainer_run, 1, str(tmp_path / "reference"), None)[0]
    straight = run_ranks(lightning_trainer_run, 2, str(tmp_path / "straight"), DEBUG_MODE)
    assert len(reference["losses"]) == STEPS * MICRO_BATCHES
    torch.testing.assert_close(torch.stack([r["losses"] for r in straight]).mean(0), reference["losses"],
                               **LOGGED_FP32)
    assert_same_state(straight[0]["state"], reference["state"], **ADAM_FP32)
    checkpoint = tmp_path / "straight" / f"epoch=0-step={SAVE_AT}.ckpt"
    assert (checkpoint / "zeropp").is_dir()
    resumed = run_ranks(lightning_trainer_run, 2, str(tmp_path / "resumed"), DEBUG_MODE, str(checkpoint),
                        fresh=True)
    for rank in range(2):
        assert torch.equal(resumed[rank]["losses"], straight[rank]["losses"][SAVE_AT * MICRO_BATCHES:])
    assert_same_state(resumed[0]["state"], straight[0]["state"], rtol=0, atol=0)


def test_lightning_takes_the_strategy_by_name():
    """After `import zpp_compile.integrations.lightning`, strategy="zeropp" in Fabric and the Trainer."""
    import lightning as L

    from zpp_compile.integrations.lightning import ZeroppStrategy, ZeroppTrainerStrategy

    fabric = L.Fabric(accelerator="cpu", devices=2, strategy="zeropp")
    assert type(fabric.strategy) is ZeroppStrategy and fabric.strategy.zeropp_config == zpp.Config()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="zeropp", logger=False, enable_checkpointing=False)
    assert type(trainer.strategy) is ZeroppTrainerStrategy

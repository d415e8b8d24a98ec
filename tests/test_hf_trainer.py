"""HF Trainer with zeropp (`zpp_compile.integrations.transformers`) against the same Trainer run
unsharded in one process, on a tiny HF Llama with tied embeddings: losses, gradient norms and
parameters through gradient accumulation, clipping and a cosine schedule; checkpoints resumed in
fresh processes, also at another world size; `save_model` output loaded by `from_pretrained`; TRL's
SFTTrainer with LoRA; 2 nodes x 2 with all three techniques; a DeepSpeed JSON config."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch
import torch.nn.functional as F
from distributed import run_ranks
from training import ADAM_FP32, LOGGED_FP32, assert_same_state, needs_4_ranks, relative_error

transformers = pytest.importorskip("transformers")  # every test here trains an HF model
import zpp_compile as zpp  # noqa: E402
from zpp_compile.config import ConfigError  # noqa: E402
from zpp_compile.integrations.transformers import ZeroppTrainer, ZeroppTrainerMixin, trainer_config  # noqa: E402

VOCAB, SEQ, SAMPLES, STEPS, SAVE_AT = 61, 16, 48, 6, 3
GLOBAL_BATCH = 4  # samples per micro-batch over all ranks; 2 micro-batches per step


def tiny_llama() -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=72, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ, tie_word_embeddings=True,
    )
    return transformers.LlamaForCausalLM(config)


def dataset() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=generator)
    return [{"input_ids": row, "labels": row} for row in tokens]


def arguments(output_dir: str, world_size: int, **overrides) -> transformers.TrainingArguments:
    values = dict(
        output_dir=output_dir, per_device_train_batch_size=GLOBAL_BATCH // world_size, gradient_accumulation_steps=2,
        max_steps=STEPS, learning_rate=2e-2, lr_scheduler_type="cosine", max_grad_norm=0.5, logging_steps=1,
        save_strategy="steps", save_steps=SAVE_AT, eval_strategy="steps", eval_steps=SAVE_AT,
        per_device_eval_batch_size=GLOBAL_BATCH // world_size, report_to="none", use_cpu=True, seed=0,
        dataloader_num_workers=0, disable_tqdm=True,
    )
    return transformers.TrainingArguments(**{**values, **overrides})


def history(trainer: transformers.Trainer) -> list[tuple[float, float]]:
    """(loss, grad_norm) of every logged step, then the evaluation losses."""
    log = trainer.state.log_history
    return ([(entry["loss"], entry["grad_norm"]) for entry in log if "loss" in entry]
            + [(entry["eval_loss"], 0.0) for entry in log if "eval_loss" in entry])


DEBUG_MODE = {"inductor": False}


def trainer_run(rank: int, world_size: int, output_dir: str, zeropp: dict | None, resume: str | None = None,
                overrides: dict | None = None) -> dict:
    """The unsharded Trainer (`zeropp=None`, one rank) or ZeroppTrainer with `zeropp`: its logged
    history and final parameters; ZeroppTrainer's model is also saved to `output_dir`/final."""
    args = arguments(output_dir, world_size, **(overrides or {}))
    kwargs = dict(model=tiny_llama(), args=args, train_dataset=dataset(),
                  eval_dataset=dataset()[:8] if args.eval_strategy != "no" else None)
    trainer = transformers.Trainer(**kwargs) if zeropp is None else ZeroppTrainer(**kwargs, zeropp=zeropp)
    trainer.train(resume_from_checkpoint=resume)
    state = trainer.model.state_dict() if zeropp is None else zpp.full_state_dict(trainer.model)
    if zeropp is not None:
        trainer.save_model(f"{output_dir}/final")
    return {"history": history(trainer), "state": {k: v.clone() for k, v in state.items()}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_trainer")
    reference = run_ranks(trainer_run, 1, str(root / "reference"), None)[0]
    straight = run_ranks(trainer_run, 2, str(root / "straight"), DEBUG_MODE)[0]
    return root, reference, straight


@pytest.mark.distributed
def test_trainer_matches_the_unsharded_trainer(runs):
    """Gradient accumulation 2, clipping (the norm is the global one: it is logged, and it clips),
    a cosine schedule, 6 steps: the logged losses and gradient norms, the evaluation losses after
    steps 3 and 6, and the parameters."""
    _, reference, straight = runs
    assert len(straight["history"]) == STEPS + 2
    assert max(norm for _, norm in reference["history"]) > 0.5  # clipping acts
    torch.testing.assert_close(straight["history"], reference["history"], **LOGGED_FP32)
    assert_same_state(straight["state"], reference["state"], **ADAM_FP32)


@pytest.mark.distributed
def test_save_model_output_loads_with_from_pretrained(runs):
    root, reference, _ = runs
    loaded = transformers.LlamaForCausalLM.from_pretrained(root / "straight" / "final")
    model = tiny_llama()
    model.load_state_dict(reference["state"])
    tokens = torch.stack([sample["input_ids"] for sample in dataset()[:4]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens).logits, model(tokens).logits, rtol=1e-4, atol=1e-5)


@pytest.mark.distributed
def test_resume_in_fresh_processes_same_and_other_world_size(runs):
    """The step-3 checkpoint of the 2-rank run, resumed by new processes: at 2 ranks the run ends
    bit-identical to the uninterrupted one; at 1 rank (the shards resharded) it ends as the
    unsharded reference does, within fp32 tolerance."""
    root, reference, straight = runs
    checkpoint = str(root / "straight" / f"checkpoint-{SAVE_AT}")
    same = run_ranks(trainer_run, 2, str(root / "resumed2"), DEBUG_MODE, checkpoint, fresh=True)[0]
    assert same["history"] == straight["history"]  # steps 1-3 and the first evaluation from the checkpoint
    assert_same_state(same["state"], straight["state"], rtol=0, atol=0)
    other = run_ranks(trainer_run, 1, str(root / "resumed1"), DEBUG_MODE, checkpoint, fresh=True)[0]
    torch.testing.assert_close(other["history"], reference["history"], **LOGGED_FP32)
    assert_same_state(other["state"], reference["state"], **ADAM_FP32)


ALL_THREE = {"quantized_weights": True, "weight_block_size": 32, "hpz_partition_size": 2, "quantized_gradients": True,
             "gradient_block_size": 32, "ranks_per_node": 2, **DEBUG_MODE}


def nan_loss_run(rank: int, world_size: int, output_dir: str, zeropp: dict | None) -> list[float]:
    """The logged losses of 3 steps whose third micro-batch (on every rank) has a NaN loss: the
    Trainer's NaN/Inf filter replaces it in the log (ZeroppTrainer applies it on the device)."""
    calls = itertools.count()

    def loss_with_a_nan(outputs, labels, num_items_in_batch=None) -> torch.Tensor:
        logits, targets = outputs.logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten()
        loss = F.cross_entropy(logits, targets, reduction="sum") / num_items_in_batch  # as HF's own losses
        return loss * float("nan") if next(calls) == 2 else loss

    args = arguments(output_dir, world_size, save_strategy="no", eval_strategy="no", max_steps=3)
    kwargs = dict(model=tiny_llama(), args=args, train_dataset=dataset(), compute_loss_func=loss_with_a_nan)
    trainer = transformers.Trainer(**kwargs) if zeropp is None else ZeroppTrainer(**kwargs, zeropp=zeropp)
    trainer.train()
    return [loss for loss, _ in history(trainer)]


@pytest.mark.distributed
def test_nan_losses_are_filtered_from_the_log_as_the_trainer_does(tmp_path):
    """Step 2's first micro-batch is NaN (its second is logged alone), and the NaN it puts in the
    parameters makes step 3 all NaN, logged as the mean since the last log: none."""
    reference = run_ranks(nan_loss_run, 1, str(tmp_path / "reference"), None)[0]
    sharded = run_ranks(nan_loss_run, 2, str(tmp_path / "sharded"), DEBUG_MODE)[0]
    assert len(sharded) == 3 and all(math.isfinite(loss) for loss in sharded) and sharded[2] == 0, sharded
    torch.testing.assert_close(sharded, reference, rtol=1e-5, atol=1e-6)


# SGD, whose steps scale with the gradient (Adam's would hide a wrongly scaled one).
SGD_STEPS = dict(optim="sgd", learning_rate=0.5, save_strategy="no", eval_strategy="no", max_steps=SAVE_AT)


@pytest.mark.distributed
@needs_4_ranks
def test_trainer_with_qwz_hpz_qgz_on_two_nodes_stays_near_the_reference(tmp_path):
    """4 ranks as 2 nodes x 2, all three techniques: the parameters' updates within the bound the
    qgZ tests hold (INT4 between nodes: relative error of each update under 0.2; a misplaced
    shard or a wrong scale gives about 1), the losses within 1%."""
    reference = run_ranks(trainer_run, 1, str(tmp_path / "reference"), None, None, SGD_STEPS)[0]
    quantized = run_ranks(trainer_run, 4, str(tmp_path / "all3"), ALL_THREE, None, SGD_STEPS)[0]
    initial = tiny_llama().state_dict()
    errors = {key: relative_error(quantized["state"][key] - initial[key], value - initial[key])
              for key, value in reference["state"].items()}
    assert max(errors.values()) < 0.2, errors
    torch.testing.assert_close([loss for loss, _ in quantized["history"]],
                               [loss for loss, _ in reference["history"]], rtol=1e-2, atol=0)


def test_another_compile_backend_in_the_training_arguments_is_refused_with_the_fix(tmp_path):
    args = arguments(str(tmp_path), 1, torch_compile=True, torch_compile_backend="aot_eager")
    with pytest.raises(ConfigError, match=r"backend 'aot_eager'.*drop torch_compile_backend"):
        ZeroppTrainer(model=tiny_llama(), args=args, train_dataset=dataset())


def test_deepspeed_json_configures_zeropp(tmp_path):
    """A DeepSpeed ZeRO++ config: its zero_optimization keys map over, "auto" and matching training
    settings pass, keys with no meaning here are named in one warning, other stages are errors."""
    args = arguments(str(tmp_path), 2, bf16=False)
    ds = {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 2, "gradient_clipping": 0.5,
        "bf16": {"enabled": "auto"}, "steps_per_print": 10,
        "zero_optimization": {"stage": 3, "zero_quantized_weights": True, "zero_hpz_partition_size": 2,
                              "zero_quantized_gradients": True, "overlap_comm": True,
                              "offload_param": {"device": "none"}},
    }
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(ds))
    with pytest.warns(UserWarning, match=r"no use for zero_optimization\.offload_param, steps_per_print;"):
        config = trainer_config(str(path), args)
    assert (config.quantized_weights, config.hpz_partition_size, config.quantized_gradients) == (True, 2, True)
    assert config.param_dtype is None
    with pytest.warns(UserWarning):
        assert trainer_config(ds, arguments(str(tmp_path), 2, bf16=True)).param_dtype == torch.bfloat16
    with pytest.raises(ConfigError, match=r"gradient_accumulation_steps=2, but TrainingArguments give "
                                          r"gradient_accumulation_steps = 4"):
        trainer_config(ds, arguments(str(tmp_path), 2, gradient_accumulation_steps=4))
    with pytest.raises(ConfigError, match=r"zero_optimization.stage=2; zeropp is ZeRO stage 3"):
        trainer_config({"zero_optimization": {"stage": 2}}, args)
    # The same file configures a hand-written loop too (the training keys then have no meaning).
    with pytest.warns(UserWarning, match="gradient_accumulation_steps, gradient_clipping"):
        assert zpp.Config.load(str(path)).quantized_gradients


def tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer over the tiny vocabulary (no download): SFTTrainer needs one with a pad token."""
    import tokenizers

    vocab = {f"t{i}": i for i in range(VOCAB - 2)} | {"<pad>": VOCAB - 2, "</s>": VOCAB - 1}
    model = tokenizers.models.WordLevel(vocab, unk_token="<pad>")
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer(model), pad_token="<pad>",
                                                eos_token="</s>")


def sft_run(rank: int, world_size: int, output_dir: str, sharded: bool) -> dict:
    """TRL's SFTTrainer with a LoRA config: SFTTrainer adds the adapters, then the mixin shards."""
    import datasets
    import peft
    import trl

    class ZeroppSFTTrainer(ZeroppTrainerMixin, trl.SFTTrainer):
        pass

    rows = torch.stack([sample["input_ids"] for sample in dataset()]) % (VOCAB - 2)
    data = datasets.Dataset.from_dict({"input_ids": rows.tolist()})
    args = trl.SFTConfig(**arguments(output_dir, world_size, save_strategy="no", eval_strategy="no").to_dict() | dict(
        max_length=SEQ + 1, packing=False, bf16=False, dataset_num_proc=None))
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    kwargs = dict(model=tiny_llama(), args=args, train_dataset=data, processing_class=tokenizer(), peft_config=lora)
    trainer = ZeroppSFTTrainer(**kwargs, zeropp=DEBUG_MODE) if sharded else trl.SFTTrainer(**kwargs)
    trainer.train()
    state = zpp.full_state_dict(trainer.model) if sharded else trainer.model.state_dict()
    return {"history": history(trainer), "lora": {k: v.clone() for k, v in state.items() if "lora_" in k},
            "frozen": {k: v.clone() for k, v in state.items() if k.endswith("q_proj.base_layer.weight")}}


@pytest.mark.distributed
def test_trl_sft_trainer_trains_lora_adapters_as_the_reference(tmp_path):
    reference = run_ranks(sft_run, 1, str(tmp_path / "reference"), False)[0]
    sharded = run_ranks(sft_run, 2, str(tmp_path / "sharded"), True)[0]
    assert len(sharded["history"]) == STEPS and len(reference["lora"]) == 8
    torch.testing.assert_close(sharded["history"], reference["history"], **LOGGED_FP32)
    assert_same_state(sharded["lora"], reference["lora"], **ADAM_FP32)
    assert_same_state(sharded["frozen"], reference["frozen"], rtol=0, atol=0)

"""`python -m zpp_compile.launch`: an HF training script written as HF's examples are, with no
zeropp in it (tests/scripts/run_clm.py), launched as DeepSpeed users launch theirs (torchrun, its
`--deepspeed ds_config.json`) trains sharded by zeropp, against the same script run plainly in one
process: at fp32 rounding with a ZeRO-3 config, near it with DeepSpeed's ZeRO++ tutorial config
(qwZ and qgZ quantize); and the launcher's mistakes are clear errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from extras import needs
from training import LOGGED_FP32

from zpp_compile import launch

SCRIPT = Path(__file__).parent / "scripts" / "run_clm.py"
GLOBAL_BATCH, STEPS = 4, 4
# DeepSpeed's ZeRO++ tutorial config, its hpZ partition sized to the test's node of 2 ranks (16 GPUs there).
ZERO_PLUS_PLUS = {"zero_optimization": {
    "stage": 3, "reduce_bucket_size": 10000000, "reduce_scatter": True,
    "zero_quantized_weights": True, "zero_hpz_partition_size": 2, "zero_quantized_gradients": True,
    "contiguous_gradients": True, "overlap_comm": True}}
ZERO3 = {"zero_optimization": {"stage": 3, "overlap_comm": True}, "train_micro_batch_size_per_gpu": "auto"}


def script_arguments(output_dir: Path, world_size: int) -> list[str]:
    return ["--output_dir", str(output_dir), "--per_device_train_batch_size", str(GLOBAL_BATCH // world_size),
            "--max_steps", str(STEPS), "--learning_rate", "1e-2", "--logging_steps", "1", "--save_strategy", "no",
            "--report_to", "none", "--use_cpu", "true", "--disable_tqdm", "true", "--seed", "0",
            "--dataloader_num_workers", "0"]


def losses(output_dir: Path) -> list[float]:
    """The losses the script's Trainer logged, from the state it saved (trainer_state.json)."""
    state = json.loads((output_dir / "trainer_state.json").read_text())
    return [entry["loss"] for entry in state["log_history"] if "loss" in entry]


def run(command: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return done


def launched(tmp_path: Path, name: str, deepspeed: dict) -> tuple[list[float], str]:
    """The script on 2 gloo ranks under torchrun through zeropp's launcher (Inductor off, for time)."""
    config = tmp_path / f"{name}.json"
    config.write_text(json.dumps(deepspeed))
    done = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                "-m", "zpp_compile.launch", "--zeropp-option", "inductor=false", str(SCRIPT),
                *script_arguments(tmp_path / name, 2), "--deepspeed", str(config)])
    return losses(tmp_path / name), done.stderr


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[float]:
    output = tmp_path_factory.mktemp("plain")
    run([sys.executable, str(SCRIPT), *script_arguments(output, 1)])
    return losses(output)


@pytest.mark.distributed
def test_an_hf_script_with_a_deepspeed_zero3_config_trains_as_the_plain_script(tmp_path, reference):
    sharded, said = launched(tmp_path, "zero3", ZERO3)
    assert "zeropp: Trainer trains its model sharded by zeropp, Config from" in said
    assert len(reference) == STEPS and reference[0] > reference[-1]
    torch.testing.assert_close(sharded, reference, **LOGGED_FP32)


@pytest.mark.distributed
def test_an_hf_script_with_the_zero_plus_plus_tutorial_config_trains_with_all_three(tmp_path, reference):
    quantized, said = launched(tmp_path, "zeropp", ZERO_PLUS_PLUS)
    assert "quantized_weights=True" in said and "quantized_gradients=True" in said, said[-3000:]
    assert "hpz_partition_size=2" in said
    torch.testing.assert_close(quantized, reference, rtol=1e-2, atol=0)  # INT8 weights, INT4 gradients
    assert quantized != reference  # the quantization acts


def test_the_launchers_mistakes_are_clear_errors(tmp_path, capsys):
    cases = [
        (["missing.py"], "missing.py: no such script"),
        (["--zeropp-option", "quantised_weights=1", str(SCRIPT)], "not zpp.Config fields"),
        ([str(SCRIPT), "--deepspeed"], "--deepspeed needs the DeepSpeed config's path"),
        ([str(SCRIPT), "--deepspeed", str(tmp_path / "absent.json")], "cannot read config file"),
        ([str(SCRIPT), "--deepspeed=a.json", "--deepspeed", "b.json"], "--deepspeed is given twice"),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit):
            launch.parse(argv)
        assert message in capsys.readouterr().err, argv


def test_the_script_keeps_its_arguments_without_deepspeed(tmp_path):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps(ZERO3))
    parsed = launch.parse(["--zeropp-option", "compile_layers_once=true", str(SCRIPT), "--max_steps", "2",
                           f"--deepspeed={config}", "--seed", "3"])
    assert parsed.arguments == ["--max_steps", "2", "--seed", "3"]
    assert parsed.deepspeed == ZERO3 and parsed.options == {"compile_layers_once": True}


@needs("transformers")
def test_a_script_that_makes_no_trainer_is_warned_about(tmp_path):
    script = tmp_path / "own_loop.py"
    script.write_text("import sys\nassert sys.argv[1:] == ['--lr', '1']\n")
    config = tmp_path / "ds.json"
    config.write_text(json.dumps(ZERO3))
    with pytest.warns(UserWarning, match=r"made no transformers.Trainer.*ds.json was never used"):
        launch.main([str(script), "--deepspeed", str(config), "--lr", "1"])


@needs("transformers")
def test_trainers_are_the_scripts_own_again_after_the_script(tmp_path):
    import transformers

    script = tmp_path / "makes_a_trainer.py"
    script.write_text("import transformers\n"
                      "made = transformers.Trainer.__new__(transformers.Trainer)\n"
                      "assert type(made).__mro__[1].__name__ == 'ZeroppTrainerMixin', type(made).__mro__\n")
    launch.main([str(script)])
    assert type(transformers.Trainer.__new__(transformers.Trainer)) is transformers.Trainer

    class Probe(transformers.Trainer):
        def __init__(self, value: int) -> None:
            self.value = value

    assert type(Probe(3)) is Probe and Probe(3).value == 3  # a constructor's arguments reach __init__ again

"""examples/compile_probe.py's variant specs and its handling of a failed launch (the launches themselves
run on GPUs, or slowly on CPU)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from extras import needs

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import compile_probe  # noqa: E402
from compile_probe import file_name, parse_args, zpp_config  # noqa: E402


def test_a_variant_spec_adds_config_fields_and_names_its_files():
    spec = 'zero3-layers@inductor_options={"combo_kernels": true}@bucket_size=1024'
    args = parse_args(["--variants", "fsdp2", "all3", spec])
    assert args.variants == ["fsdp2", "all3", spec]
    config = zpp_config(spec, world=2, compute=torch.bfloat16)
    assert config.compile_layers_once and config.bucket_size == 1024
    assert dict(config.inductor_options) == {"combo_kernels": True} and config.param_dtype == torch.bfloat16
    all3 = zpp_config("all3", world=4, compute=None)
    assert (all3.quantized_weights, all3.hpz_partition_size, all3.ranks_per_node) == (True, 2, 2)
    assert file_name(spec) == "zero3-layers@inductor_options=_combo_kernels_true_@bucket_size=1024"


@pytest.mark.parametrize("spec, message", [("zero4", "'zero4' is not one of"),
                                           ("fsdp2@bucket_size=1", "for zeropp's variants"),
                                           ("zero3@bucket=1", "unknown config key 'bucket'")])
def test_a_wrong_variant_spec_is_a_clear_error(spec, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--variants", spec])
    assert message in capsys.readouterr().err


def test_a_failed_launch_is_recorded_and_the_other_variants_still_run(monkeypatch, tmp_path, capsys):
    launched = []

    def launch(args, variant, layers, name, round_index, cache):
        launched.append((variant, name))
        if variant == "zero3":
            return {"variant": variant, "layers": layers, "launch": name, "failed": "exit status 1"}
        return {"variant": variant, "layers": layers, "launch": name, "first_step_s": 2.0, "first_step_cpu_s": 2.0,
                "ms_per_step": 10.0, "peak_gib": None, "mfu": None, "compile_times": {}, "caches": {}}

    monkeypatch.setattr(compile_probe, "launch", launch)
    out = tmp_path / "probe.json"
    with pytest.raises(SystemExit, match=r"failed.*zero3 \(2 layers, cold\)"):
        compile_probe.main(["--variants", "zero3", "fsdp2", "--layers", "2", "--json", str(out)])
    # The failed variant's warm launch is skipped (nothing was cached); the next variant runs both.
    assert launched == [("zero3", "cold"), ("fsdp2", "cold"), ("fsdp2", "warm")]
    saved = json.loads(out.read_text())
    assert [r.get("failed") for r in saved] == ["exit status 1", None, None]
    assert "failed (exit status 1)" in capsys.readouterr().out


def test_variants_take_turns_launch_by_launch_and_repeated_launches_have_medians(monkeypatch, capsys):
    launched, seconds = [], iter([5.0, 9.0, 2.0, 4.0, 3.0, 8.0, 1.0, 6.0])

    def launch(args, variant, layers, name, round_index, cache):
        launched.append((variant, name, round_index, cache.name.split("-")[2]))
        return {"variant": variant, "layers": layers, "launch": name, "first_step_s": next(seconds),
                "first_step_cpu_s": 1.0, "ms_per_step": 10.0, "peak_gib": None, "mfu": None, "compile_times": {},
                "caches": {}}

    monkeypatch.setattr(compile_probe, "launch", launch)
    compile_probe.main(["--variants", "fsdp2", "zero3", "--layers", "2", "--launches", "cold", "warm", "warm", "warm"])
    # Each variant keeps its own cache folder across its launches.
    assert launched == [("fsdp2", "cold", 0, "fsdp2"), ("zero3", "cold", 0, "zero3"),
                        ("fsdp2", "warm", 1, "fsdp2"), ("zero3", "warm", 1, "zero3"),
                        ("fsdp2", "warm", 2, "fsdp2"), ("zero3", "warm", 2, "zero3"),
                        ("fsdp2", "warm", 3, "fsdp2"), ("zero3", "warm", 3, "zero3")]
    out = capsys.readouterr().out
    assert "warm first step, median of 3: fsdp2 2 layers 2.0 s (from 1.0 to 3.0)" in out
    assert "warm first step, median of 3: zero3 2 layers 6.0 s (from 4.0 to 8.0)" in out
    assert "cold first step, median" not in out


def test_a_second_cold_launch_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--launches", "warm", "cold"])
    assert "'cold' can only be the first launch" in capsys.readouterr().err


@needs("transformers")
def test_a_simulated_worker_records_the_network_and_its_collectives_time(monkeypatch, tmp_path, capsys):
    """One launch's worker in this process (FSDP2 run eagerly: compilation is not what is checked)
    over a simulated world of 4 ranks in 2 nodes: its JSON keeps the model's parameters and the
    collectives' modeled time per step, of which the host waited no more than was charged; the table
    marks the run as simulated."""
    monkeypatch.setattr(torch, "compile", lambda model, **kwargs: model)
    out = tmp_path / "launch.json"
    try:
        compile_probe.main(["--worker", "--variant", "fsdp2", "--launch", "cold", "--out", str(out), "--layers", "1",
                            "--hidden", "32", "--heads", "2", "--vocab", "64", "--seq", "16", "--steps", "2",
                            "--fake-world", "4", "--ranks-per-node", "2", "--simulate-network", "ib-100g",
                            "--network-override", "inter_busbw_gbyte_per_s=0.01"])
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    result = json.loads(out.read_text())
    network = result["simulated_network"]
    assert network["preset"] == "ib-100g" and network["ranks_per_node"] == 2
    assert network["inter_busbw_gbyte_per_s"] == 0.01 and result["world"] == 4
    assert network["comm_ms_per_step"] > 1.0  # the shards of 4 ranks over 10 MB/s between nodes
    assert 0 <= network["exposed_ms_per_step"] <= network["comm_ms_per_step"] * 1.05 + 0.5
    assert result["ms_per_step"] >= network["exposed_ms_per_step"]
    table = compile_probe.table([{**result, "round": 0}])
    assert table.startswith("SIMULATED network") and "net ms" in table and "exposed ms" in table


@pytest.mark.parametrize(("argv", "message"), [
    (["--simulate-network", "ib-100g"], "give --fake-world N too"),
    (["--fake-world", "8", "--ranks-per-node", "3"], "does not divide the world of 8 ranks"),
    (["--fake-world", "8", "--simulate-network", "ib-100g", "--network-override", "speed=1"],
     "unknown network override 'speed'"),
])
def test_simulated_network_options_are_clear_errors(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err

"""The convergence study's statistics (per-seed paired gaps to plain ZeRO-3 and their 95% interval,
checked against the t-interval worked out by hand), and how launches of parts of a study, or a
stopped one, are resumed and merged; which bytes are held out, and the order training reads the rest."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))

from convergence import (  # noqa: E402
    interval,
    ordered_runs,
    parse_args,
    resumed_runs,
    study_settings,
    summarize,
    train_and_held_out,
    window_starts,
)
from gpt import STDLIB, python_sources, stdlib_sources, windows  # noqa: E402


def test_paired_gap_interval_is_students_t_over_the_seeds():
    # Three seeds: mean 0.02, sample sd 0.01, t(0.975, 2 df) = 4.3027, half width 4.3027 * 0.01 / sqrt(3).
    mean, low, high = interval([0.01, 0.02, 0.03])
    half = 4.3027 * 0.01 / math.sqrt(3)
    assert mean == pytest.approx(0.02, abs=1e-15)
    assert (low, high) == pytest.approx((0.02 - half, 0.02 + half), abs=1e-5)
    assert all(math.isnan(bound) for bound in interval([0.5])[1:])  # one seed: no interval


def run(seed: int, final: float, val: float) -> dict:
    return {"seed": seed, "losses": [9.0, final, final], "val_loss": val}


def test_summary_pairs_each_variant_with_zero3_seed_by_seed():
    # The seeds differ by far more than the variant does; pairing cancels the seed offsets.
    runs = {"zero3": [run(0, 1.0, 2.0), run(1, 1.5, 2.5), run(2, 2.0, 3.0)],
            "qgz": [run(0, 1.01, 2.02), run(1, 1.51, 2.52), run(2, 2.01, 3.02)]}
    table = summarize(runs, window=2)
    assert table["qgz"]["final_mean"] == pytest.approx(1.51)
    assert table["qgz"]["final_std"] == pytest.approx(0.5)
    assert table["qgz"]["final_gap"] == pytest.approx(0.01)
    assert table["qgz"]["final_gap_high"] - table["qgz"]["final_gap_low"] == pytest.approx(0.0, abs=1e-9)
    assert table["qgz"]["val_gap"] == pytest.approx(0.02)
    # Pairs are made by seed, not by position; a seed without zero3's run gives no pair.
    partial = summarize({"zero3": runs["zero3"][1:], "qgz": runs["qgz"]}, window=2)
    assert partial["qgz"]["final_gap"] == pytest.approx(0.01) and partial["qgz"]["seeds"] == [0, 1, 2]
    assert math.isnan(summarize({"qgz": runs["qgz"]}, window=2)["qgz"]["final_gap"])
    assert "grad_norm_mean" not in table["qgz"]  # runs recorded before gradient norms were


def test_summary_reports_the_gradient_norm_and_how_often_clipping_shortened_a_step():
    runs = {"zero3": [{**run(seed, 1.0, 2.0), "grad_norms": [0.5, 1.5, 0.9, 2.0]} for seed in (0, 1)]}
    runs["zero3"][1]["grad_norms"] = [0.5, 0.5, 0.5, 0.5]
    row = summarize(runs, window=2)["zero3"]
    assert row["grad_norm_mean"] == pytest.approx((1.225 + 0.5) / 2)
    assert row["clipped_fraction"] == pytest.approx((0.5 + 0.0) / 2)


def test_a_launch_may_run_any_part_of_the_study():
    args = parse_args(["--model", "llama", "--seeds", "0,1,2", "--variants", "qgz_int4"])
    assert (args.seeds, args.dim, args.layers, args.heads, args.kv_heads) == ([0, 1, 2], 768, 16, 12, 4)
    with pytest.raises(SystemExit):
        parse_args(["--variants", "zero3,int2"])


def test_launches_of_parts_are_merged_and_other_settings_refused(tmp_path):
    args = parse_args(["--seeds", "0,1", "--steps", "20"])
    settings = study_settings(args, world=2, bytes_read=1000)
    parts = {"zero3": [run(1, 1.5, 2.5), run(0, 1.0, 2.0)], "all3": [run(0, 1.01, 2.0)]}
    paths = []
    for name, seeded in parts.items():
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps({"settings": settings, "runs": {name: seeded}}))
    done = resumed_runs([str(p) for p in paths], settings)
    assert sorted(done) == [("all3", 0), ("zero3", 0), ("zero3", 1)]
    runs = ordered_runs(done, ["zero3", "qgz", "all3"], [0, 1])
    assert {name: [r["seed"] for r in seeded] for name, seeded in runs.items()} == {"zero3": [0, 1], "all3": [0]}
    with pytest.raises(ValueError, match="steps: 20 there, 30 here"):
        resumed_runs([str(paths[0])], study_settings(parse_args(["--steps", "30"]), world=2, bytes_read=1000))
    with pytest.raises(ValueError, match="world: 2 there, 4 here"):
        resumed_runs([str(paths[0])], study_settings(args, world=4, bytes_read=1000))
    with pytest.raises(ValueError, match="bytes_read: 1000 there, 900 here"):  # a Python with a smaller library
        resumed_runs([str(paths[0])], study_settings(args, world=2, bytes_read=900))


def test_held_out_bytes_are_every_tenth_file_and_never_trained_on():
    train, held_out = train_and_held_out(2_000_000)
    sources = stdlib_sources(2_000_000)
    assert len(train) + len(held_out) == sum(map(len, sources)) == 2_000_000
    assert 0.03 < len(held_out) / 2_000_000 < 0.3  # about a tenth (files differ in size)
    tenth = sources[9::10]
    assert bytes(held_out[:len(tenth[0])].to(torch.uint8).tolist()) == tenth[0]
    trained = bytes(train.to(torch.uint8).tolist())
    assert all(source not in trained for source in tenth if len(source) > 1000)
    assert torch.equal(train_and_held_out(2_000_000)[1], held_out)  # the same split every time


def test_training_reads_every_window_once_per_epoch_in_a_seeded_order():
    seq, n_bytes = 8, 8 * 50 + 5  # 50 windows of 8 bytes, each with its next byte as the last target
    starts = window_starts(n_bytes, seq, 120, seed=3)  # two epochs and a fifth
    assert starts.tolist()[:50] != list(range(0, 400, 8))  # shuffled
    for epoch in (starts[:50], starts[50:100]):
        assert sorted(epoch.tolist()) == list(range(0, 400, 8))  # every window once
    assert len(set(starts[100:].tolist())) == 20
    assert torch.equal(window_starts(n_bytes, seq, 120, seed=3), starts)
    assert not torch.equal(window_starts(n_bytes, seq, 120, seed=4), starts)
    data = torch.arange(n_bytes)
    x, y = windows(data, starts[:4], seq)
    assert torch.equal(x[:, 1:], y[:, :-1]) and torch.equal(x[:, 0], starts[:4])
    assert (y.max() < n_bytes).item()
    with pytest.raises(ValueError, match="no sequence of 8"):
        window_starts(8, seq, 1, seed=0)


def test_the_torch_corpus_goes_on_after_the_whole_standard_library():
    stdlib = sum(map(len, stdlib_sources(10**9)))
    train, held_out = train_and_held_out(stdlib + 300_000, "stdlib+torch")
    assert len(train) + len(held_out) == stdlib + 300_000
    sources = python_sources(stdlib + 300_000, [STDLIB, Path(torch.__file__).parent])
    torch_init = (Path(torch.__file__).parent / "__init__.py").read_bytes()
    assert any(source == torch_init[:len(source)] for source in sources[-400:])
    assert torch.equal(train_and_held_out(1_000_000, "stdlib+torch")[0], train_and_held_out(1_000_000)[0])

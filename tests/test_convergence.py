"""The convergence study's statistics: per-seed paired gaps to plain ZeRO-3 and their 95% interval,
checked against the t-interval worked out by hand."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))

from convergence import interval, parse_args, summarize  # noqa: E402


def test_paired_gap_interval_is_students_t_over_the_seeds():
    # Three seeds: mean 0.02, sample sd 0.01, t(0.975, 2 df) = 4.3027, half width 4.3027 * 0.01 / sqrt(3).
    mean, low, high = interval([0.01, 0.02, 0.03])
    half = 4.3027 * 0.01 / math.sqrt(3)
    assert mean == pytest.approx(0.02, abs=1e-15)
    assert (low, high) == pytest.approx((0.02 - half, 0.02 + half), abs=1e-5)
    assert all(math.isnan(bound) for bound in interval([0.5])[1:])  # one seed: no interval


def test_summary_pairs_each_variant_with_zero3_seed_by_seed():
    def run(final: float, val: float) -> dict:
        return {"losses": [9.0, final, final], "val_loss": val}

    # The seeds differ by far more than the variant does; pairing cancels the seed offsets.
    runs = {"zero3": [run(1.0, 2.0), run(1.5, 2.5), run(2.0, 3.0)],
            "qgz": [run(1.01, 2.02), run(1.51, 2.52), run(2.01, 3.02)]}
    table = summarize(runs, window=2)
    assert table["qgz"]["final_mean"] == pytest.approx(1.51)
    assert table["qgz"]["final_std"] == pytest.approx(0.5)
    assert table["qgz"]["final_gap"] == pytest.approx(0.01)
    assert table["qgz"]["final_gap_high"] - table["qgz"]["final_gap_low"] == pytest.approx(0.0, abs=1e-9)
    assert table["qgz"]["val_gap"] == pytest.approx(0.02)


def test_variants_must_include_the_reference():
    with pytest.raises(SystemExit):
        parse_args(["--variants", "qgz,all3"])
    args = parse_args(["--model", "llama", "--seeds", "0,1,2", "--variants", "zero3,qgz_int4"])
    assert (args.seeds, args.dim, args.layers, args.heads, args.kv_heads) == ([0, 1, 2], 768, 16, 12, 4)

"""The main job's closing summary: each phase's bytes against plain ZeRO-3, as ratios worked out
here from the same numbers."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))

from train_gpt import comm_summary, describe, phase_bytes, save_chart  # noqa: E402

import zpp_compile as zpp  # noqa: E402
from zpp_compile.reports.ledger import CommReport, CommRow  # noqa: E402

PHASES = ("forward weight gather", "backward weight gather", "gradient reduction")


def report(inter: tuple[int, int, int], baseline_inter: int) -> CommReport:
    rows = tuple(CommRow("g0.x", phase, "all_gather", (0, 1), "bfloat16", 0, n) for phase, n in zip(PHASES, inter))
    return CommReport(rows, 0, 0, baseline_inter, baseline_inter // 6)


def phase_cells(line: str, phase: str) -> list[str]:
    """The words of a phase's line of the summary after the phase's name."""
    assert line.split()[:len(phase.split())] == phase.split(), line
    return line.split()[len(phase.split()):]


def test_summary_states_each_phase_and_the_total_against_zero3():
    config = zpp.Config(quantized_weights=True, hpz_partition_size=1, quantized_gradients=True, param_dtype="bf16",
                        reduce_dtype="bf16")
    lines = comm_summary(report((1_681_000, 0, 860_000), 3 * 3_291_000), config, False, 2).splitlines()
    assert describe(config) == "ZeRO++ (qwZ + hpZ + qgZ)"
    assert "in this run's dtypes (bfloat16 weights, bfloat16 gradient reduction)" in lines[0], lines[0]
    # 1.681 / 3.291 = 0.511, 0 / 3.291 = 0, 0.860 / 3.291 = 0.261; in all 2.541 / 9.873 = 0.257.
    assert lines[1].split()[:2] == ["phase", "technique"], lines[1]
    for line, (phase, technique, ratio) in zip(lines[2:5], [(PHASES[0], "qwZ", "0.51x"), (PHASES[1], "hpZ", "0.00x"),
                                                            (PHASES[2], "qgZ", "0.26x")]):
        assert phase_cells(line, phase)[0] == technique, line
        assert phase_cells(line, phase)[5] == ratio, line  # after technique and two "<n> MB"
    assert lines[5].startswith("cross-node bytes per step 0.26x of ZeRO-3's (2.541 MB vs 9.873 MB), 0.26x of "
                               "ZeRO-3's in bf16 (the paper's baseline)"), lines[5]
    assert lines[5].endswith("all bytes 0.26x"), lines[5]


def test_the_zero3_run_in_fp32_reads_one_against_itself_and_two_against_bf16():
    # Plain ZeRO-3 with fp32 weights and an fp32 reduction moves twice the bf16 baseline's bytes.
    config = zpp.Config()
    lines = comm_summary(report((6_582_000, 6_582_000, 6_582_000), 3 * 3_291_000), config, False, 2).splitlines()
    assert "(float32 weights, float32 gradient reduction)" in lines[0], lines[0]
    assert all(phase_cells(line, phase)[5] == "1.00x" for line, phase in zip(lines[2:5], PHASES)), lines
    assert lines[5].startswith("cross-node bytes per step 1.00x of ZeRO-3's (19.746 MB vs 19.746 MB), 2.00x of "
                               "ZeRO-3's in bf16"), lines[5]


def test_summary_without_a_technique_or_a_baseline():
    config = zpp.Config()
    lines = comm_summary(report((10, 10, 10), 0), config, False, 2).splitlines()
    assert describe(config) == "plain ZeRO-3"
    assert all(phase_cells(line, phase)[0] == phase_cells(line, phase)[5] == "-"
               for line, phase in zip(lines[2:5], PHASES)), lines
    assert "per step - of ZeRO-3's" in lines[5] and lines[5].endswith("all bytes -")
    assert "no compiled step" in comm_summary(report((1, 1, 1), 3), config, True, 2)
    alone = comm_summary(report((0, 0, 0), 0), config, False, 1)
    assert alone.startswith("one rank: nothing is communicated") and "--nproc_per_node=2" in alone, alone


def test_the_chart_shows_the_loss_and_each_phases_bytes_against_zero3(tmp_path):
    config = zpp.Config(quantized_weights=True, hpz_partition_size=1, quantized_gradients=True)
    phases = phase_bytes(report((1_681_000, 0, 860_000), 3 * 3_291_000), config)
    # fp32 weights and reduction: plain ZeRO-3 moves twice the bf16 baseline's bytes in each phase.
    assert phases == [(PHASES[0], True, 0, 1_681_000, 0, 6_582_000), (PHASES[1], True, 0, 0, 0, 6_582_000),
                      (PHASES[2], True, 0, 860_000, 0, 6_582_000)]
    path = tmp_path / "run.png"
    save_chart(str(path), [5.5, 4.0, 3.0], phases, "test")
    if importlib.util.find_spec("matplotlib") is not None:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert not path.exists()

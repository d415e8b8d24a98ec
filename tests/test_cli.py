"""The `zeropp` command: dump, report, explain, passes, and its errors.

Two real launches (`zeropp dump torchrun --nproc_per_node=2 tests/cli_train.py`, gloo, 2 ranks
emulating 2 nodes, no Inductor) feed every check that needs a dump; the rest runs in-process.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import zpp_compile as zpp
from zpp_compile.cli import main
from zpp_compile.compiler.pass_manager import enabled_passes
from zpp_compile.passes import PASSES
from zpp_compile.reports.explain import predict
from zpp_compile.reports.schedule_image import can_draw

pytestmark = pytest.mark.distributed  # every test here starts processes

SCRIPT = Path(__file__).parent / "cli_train.py"
# All three techniques, 2 ranks as 2 emulated nodes (so every byte of ZeRO-3 would cross nodes).
PAPER = {"quantized_weights": True, "hpz_partition_size": 1, "quantized_gradients": True, "ranks_per_node": 1,
         "inductor": False}
# qwZ asked for in the config but its pass switched off from the command line.
NO_QWZ = {"quantized_weights": True, "quantized_gradients": True, "ranks_per_node": 1, "inductor": False}


def dump_run(folder: Path, options: dict, *zeropp_flags: str) -> Path:
    """`zeropp dump` of a 2-rank torchrun of the training script; returns the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(options))
    assert main(["dump", "--out", str(folder / "dump"), *zeropp_flags, "torchrun", "--standalone",
                 "--nproc_per_node=2", str(SCRIPT), str(folder / "config.json"), str(folder)]) == 0
    return folder


@pytest.fixture(scope="module")
def paper_run(tmp_path_factory) -> Path:
    return dump_run(tmp_path_factory.mktemp("paper"), PAPER)


@pytest.fixture(scope="module")
def no_qwz_run(tmp_path_factory) -> Path:
    return dump_run(tmp_path_factory.mktemp("no_qwz"), NO_QWZ, "--disable-pass", "quantize_weights")


def ledger(run: Path, rank: int) -> dict:
    return json.loads((run / f"ledger{rank}.json").read_text())


def report_json(run: Path, rank: int, capsys) -> dict:
    assert main(["report", str(run / "dump"), "--rank", str(rank), "--format", "json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_dump_has_before_and_after_of_every_enabled_pass(paper_run):
    passes = enabled_passes(zpp.Config(**PAPER))
    assert {p.name for p in passes} >= {"partition_hierarchically", "quantize_weights", "quantize_gradients"}
    for rank in (0, 1):
        folder = paper_run / "dump" / f"rank{rank}"
        for index, graph_pass in enumerate(p for p in passes if p.stage == "joint"):
            for part in ("before.py", "after.py", "summary.json"):
                assert (folder / f"g0.joint.joint.{index:02d}.{graph_pass.name}.{part}").is_file()
        for kind in ("forward", "backward"):
            for index, graph_pass in enumerate(p for p in passes if p.stage == "lowering"):
                for part in ("before.py", "after.py", "summary.json"):
                    assert (folder / f"g0.{kind}.lowering.{index:02d}.{graph_pass.name}.{part}").is_file()
            for part in ("lowered.py", "comm.json", "schedule.txt"):
                assert (folder / f"g0.{kind}.{part}").is_file()
            if can_draw():  # the schedule as a picture too, where matplotlib is installed
                assert (folder / f"g0.{kind}.schedule.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The qgZ pass's summary shows its rewrite: gradient reductions in, quantized exchanges out
    # (between two nodes, the all-to-all is an all-gather of the chunk for the other node).
    summary_file = next((paper_run / "dump" / "rank0").glob("g0.backward.*.quantize_gradients.summary.json"))
    summary = json.loads(summary_file.read_text())
    assert [r["op"] for r in summary["collectives_before"]] == ["zpp.reduce_grad"]
    after = [(r["op"], r["dtype"], r["of_gradient"]) for r in summary["collectives_after"]]
    assert after == [("all_gather", "uint8", True)]
    # One bucket per layer (the default): per layer one reduction, one quantize kernel, one exchange.
    assert summary["added"]["zpp.qgz_quantize.default"] == summary["removed"]["zpp.reduce_grad.default"] == 2
    schedule = (paper_run / "dump" / "rank0" / "g0.backward.schedule.txt").read_text()
    assert schedule.count(" issue ") == schedule.count(" wait ") == 2 and "compute" in schedule


@pytest.mark.parametrize("rank", [0, 1])
def test_report_totals_equal_the_ledger_of_the_same_run(paper_run, rank, capsys):
    from_dump, from_run = report_json(paper_run, rank, capsys), ledger(paper_run, rank)
    for key in ("intra_bytes", "inter_bytes", "baseline_intra_bytes", "baseline_inter_bytes", "secondary_bytes",
                "inter_ratio", "total_ratio", "phases", "collectives"):
        assert from_dump[key] == from_run["report"][key], key
    assert [from_dump["intra_bytes"], from_dump["inter_bytes"]] == from_run["step_comm_bytes"]
    # Plain bf16 ZeRO-3 on 2 nodes of 1 rank: 3 collectives, each receiving 2 bytes x half the
    # parameters (they divide evenly) from the other node.
    assert from_dump["baseline_inter_bytes"] == 3 * 2 * from_run["params"] // 2
    assert from_dump["baseline_intra_bytes"] == 0
    # qwZ's INT8 forward gather, no backward gather (hpZ keeps a full copy), qgZ's INT4 hop.
    ratio = {name: p["inter_bytes"] / p["baseline_inter_bytes"] for name, p in from_dump["phases"].items()}
    assert ratio["backward weight gather"] == 0
    assert 0.5 < ratio["forward weight gather"] < 0.52  # INT8 codes + one float32 scale per 256
    assert 0.25 < ratio["gradient reduction"] < 0.27
    assert 0 < from_dump["inter_ratio"] <= 0.26
    assert main(["report", str(paper_run / "dump"), "--rank", str(rank)]) == 0
    table = capsys.readouterr().out
    assert f"{from_dump['inter_bytes']:,}" in table and "partition_hierarchically" in table


@pytest.mark.parametrize("options, run", [
    (PAPER, "paper_run"), ({**NO_QWZ, "disable_passes": ["quantize_weights"]}, "no_qwz_run"),
])
def test_explain_predicts_what_the_ledger_measures(options, run, request):
    measured = ledger(request.getfixturevalue(run), 0)
    prediction = predict(zpp.Config(**options), measured["params"], 2, 1).to_dict()
    for predicted, phase in zip(prediction["phases"], measured["report"]["phases"].values()):
        for key in ("intra_bytes", "inter_bytes"):  # the script's layers fill whole blocks: no padding slack
            assert predicted[key] == pytest.approx(phase[key], rel=0.01), (predicted["phase"], key)


def test_disabling_a_pass_removes_its_rewrite_from_the_dump(paper_run, no_qwz_run):
    for run, quantized in ((paper_run, True), (no_qwz_run, False)):
        folder = run / "dump" / "rank0"
        assert any(folder.glob("*.quantize_weights.*")) == quantized
        assert ("zpp.quantize_weight" in (folder / "g0.forward.lowered.py").read_text()) == quantized
        comm = json.loads((folder / "g0.forward.comm.json").read_text())
        assert {c["dtype"] for c in comm["collectives"]} == ({"uint8"} if quantized else {"float32"})
    assert any((no_qwz_run / "dump" / "rank0").glob("*.quantize_gradients.summary.json"))  # the others still ran


def test_explain_computes_the_papers_table(tmp_path, capsys):
    config = tmp_path / "zeropp.json"  # DeepSpeed's names: hpZ over the 8 ranks of a node
    config.write_text(json.dumps({"zero_quantized_weights": True, "zero_hpz_partition_size": 8,
                                  "zero_quantized_gradients": True}))
    assert main(["explain", str(config), "--params", "1.3B", "--world", "32", "--ranks-per-node", "8"]) == 0
    total = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("total "))
    assert total.split()[1:3] == ["3.00M", "0.75M"]
    assert main(["explain", str(config), "--params", "1.3B", "--world", "32", "--ranks-per-node", "8",
                 "--format", "json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [p["paper_m"] for p in result["phases"]] == [0.5, 0.0, 0.25]
    assert result["baseline_total"]["paper_m"] == 3.0
    # Per rank, as the ledger counts: ZeRO-3 receives (n-1)/n of 3M, 24/32 of it from other nodes.
    m = 2 * 1_300_000_000
    assert result["baseline_total"]["inter_bytes"] == pytest.approx(3 * m * 24 / 32, rel=1e-6)
    assert result["phases"][1]["inter_bytes"] == 0


def test_passes_lists_every_pass_in_order(capsys):
    assert main(["passes"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines if not line.startswith(" ")] == [p.name for p in PASSES]
    assert max(map(len, lines)) <= 100, lines  # wrapped, continued under the summary
    assert main(["--wide", "passes"]) == 0
    wide = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in wide] == [p.name for p in PASSES]
    for line, graph_pass in zip(wide, PASSES):  # a whole sentence each, never cut at a docstring's line end
        assert line.endswith(graph_pass.summary) and graph_pass.summary.endswith("."), line


def test_explain_keeps_within_100_columns_unless_wide(tmp_path, capsys):
    config = tmp_path / "zeropp.json"
    config.write_text(json.dumps({"quantized_weights": True, "hpz_partition_size": 8, "quantized_gradients": True}))
    command = ["explain", str(config), "--params", "3B", "--world", "16", "--ranks-per-node", "8"]
    assert main(command) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(map(len, lines)) <= 100, lines
    assert next(line for line in lines if line.startswith("total ")).split()[3:] == ["7.875", "9.000", "6.665",
                                                                                   "1.620"]
    assert any("in GB: what each rank receives" in line for line in lines), lines
    assert main(["--wide", *command]) == 0
    wide = capsys.readouterr().out.splitlines()
    assert "7,875,000,000" in next(line for line in wide if line.startswith("total ")), wide


EXPLAIN = ["explain", "--params", "1B", "--world"]


def exit_status(argv: list[str]) -> int:
    """main's exit status, whether returned or raised (argparse's own errors exit)."""
    try:
        return main(argv)
    except SystemExit as done:
        return done.code


@pytest.mark.parametrize("argv, message", [
    (EXPLAIN + ["2", "--ranks-per-node", "1", "{config}"], "unknown config key 'quantized_weight'"),
    (EXPLAIN + ["2", "--ranks-per-node", "1", "{missing}"], "cannot read config file"),
    (EXPLAIN + ["2", "--ranks-per-node", "1", "{binary}"], "is not a JSON text file"),
    (EXPLAIN + ["6", "--ranks-per-node", "4", "{config_ok}"], "multiple of the ranks per node"),
    (EXPLAIN + ["6", "--ranks-per-node", "2", "{config_rpn4}"],
     "the config's ranks_per_node=4 ({config_rpn4}) does not divide --world 6, and overrides --ranks-per-node 2"),
    (EXPLAIN + ["0", "--ranks-per-node", "1", "{config_ok}"], "--world 0 must be a positive number of ranks"),
    (["explain", "--params", "1e400", "--world", "2", "{config_ok}"], "'1e400' is not a finite parameter count"),
    (["explain", "--params", "inf", "--world", "2", "{config_ok}"], "'inf' is not a finite parameter count"),
    (["explain", "--params", "nan", "--world", "2", "{config_ok}"], "'nan' is not a finite parameter count"),
    (["explain", "--world", "2", "{config_ok}"], "the following arguments are required: --params"),
    (["report", "{missing}"], "is not a folder"),
    (["report", "{empty}"], "no graph dump"),
    (["dump", "--disable-pass", "quantise_weights", "{script}"], "no such pass"),
    (["dump", "{missing}.py"], "not found"),
])
def test_user_mistakes_are_one_line_errors(tmp_path, capsys, argv, message):
    (tmp_path / "bad.json").write_text('{"quantized_weight": true}')
    (tmp_path / "ok.json").write_text("{}")
    (tmp_path / "rpn4.json").write_text('{"ranks_per_node": 4}')
    (tmp_path / "binary.json").write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff")
    (tmp_path / "empty").mkdir()
    (tmp_path / "script.py").write_text("")
    names = dict(config=tmp_path / "bad.json", config_ok=tmp_path / "ok.json", config_rpn4=tmp_path / "rpn4.json",
                 binary=tmp_path / "binary.json", missing=tmp_path / "missing", empty=tmp_path / "empty",
                 script=tmp_path / "script.py")
    assert exit_status([arg.format(**names) for arg in argv]) != 0
    err = capsys.readouterr().err
    assert message.format(**names) in err and err.startswith("zeropp ") and len(err.strip().splitlines()) == 1, err


def damaged(run: Path, tmp_path: Path, suffix: str, damage) -> Path:
    """A copy of rank 0's dump of `run` with its first `suffix` file replaced by `damage(its JSON)`."""
    folder = tmp_path / "dump" / "rank0"
    shutil.copytree(run / "dump" / "rank0", folder)
    target = sorted(folder.glob(f"*{suffix}"))[0]
    replacement = damage(json.loads(target.read_text()))
    target.write_bytes(replacement if isinstance(replacement, bytes) else json.dumps(replacement).encode())
    return tmp_path / "dump"


@pytest.mark.parametrize("suffix, damage, message", [
    (".comm.json", lambda v: b"\x89PNG\r\n\x1a\n\x00\xff", "'utf-8' codec can't decode byte 0x89"),
    (".comm.json", lambda v: {k: x for k, x in v.items() if k != "collectives"}, "'collectives' is missing"),
    (".comm.json", lambda v: [v], "expected a JSON object, got list"),
    (".comm.json", lambda v: {**v, "collectives": [{**v["collectives"][0], "inter_bytes": "8320"}]},
     "collectives[0]: 'inter_bytes' must be int, got '8320'"),
    (".comm.json", lambda v: {**v, "collectives": [{**v["collectives"][0], "dtype": "nn"}]},
     "collectives[0]: 'dtype' must name a torch dtype, got 'nn'"),
    (".comm.json", lambda v: {**v, "model": {**v["model"], "world_size": 0}}, "model: 'world_size' must be at least 1"),
    (".comm.json", lambda v: {**v, "secondary_bytes": None}, "'secondary_bytes' must be int, got None"),
    (".summary.json", lambda v: {**v, "added": ["zpp.quantize_weight"]}, "'added' must be dict"),
    (".summary.json", lambda v: {**v, "collectives_after": [{}]}, "collectives_after[0]: 'count' is missing"),
    (".summary.json", lambda v: "not a summary", "expected a JSON object, got str"),
])
def test_a_damaged_dump_is_a_one_line_error(paper_run, tmp_path, capsys, suffix, damage, message):
    for flags in ([], ["--format", "json"]):
        assert main(["report", str(damaged(paper_run, tmp_path / str(len(flags)), suffix, damage)), *flags]) == 1
        err = capsys.readouterr().err
        assert err.startswith("zeropp report: error: ") and "is not a zeropp dump file" in err, err
        assert message in err and len(err.strip().splitlines()) == 1, err


def test_a_failing_script_gives_its_exit_status_and_a_clear_message(tmp_path, capfd):
    script = tmp_path / "fails.py"
    script.write_text("raise SystemExit(3)\n")
    assert main(["dump", "--out", str(tmp_path / "d"), str(script)]) == 3
    err = capfd.readouterr().err
    assert "zeropp dump: error:" in err and "exited with status 3" in err and "Traceback" not in err

"""The pass manager reports each pass through `logging` (TORCH_LOGS="+zpp_compile") and through
torch's structured trace (TORCH_TRACE / tlparse), beside Inductor's own graphs."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch
import torch.fx as fx

import zpp_compile as zpp
from zpp_compile.compiler import pass_observers
from zpp_compile.compiler.pass_manager import PassManager
from zpp_compile.passes import PASSES
from zpp_compile.runtime.topology import Group, Topology


def one_rank() -> Topology:
    world = Group("0", (0,))
    return Topology(0, 1, 1, torch.device("cpu"), world, world, world, None, None)


def test_every_pass_is_logged_and_traced(caplog, monkeypatch):
    traced = []
    monkeypatch.setattr(pass_observers, "trace_structured",
                        lambda kind, metadata_fn, payload_fn: traced.append((kind, metadata_fn(), payload_fn())))
    # One of zeropp's ops, as any graph of a sharded model has.
    graph = fx.symbolic_trace(lambda x: torch.ops.zpp.quantize_weight.default(torch.relu(x) + 1, 32)).graph
    manager = PassManager(zpp.Config(), one_rank(), "g5")
    with caplog.at_level(logging.DEBUG, logger="zpp_compile.compiler.pass_observers"):
        manager.run("lowering", graph)
    # A graph without a joint stage (inference) gets the joint passes first.
    ran = [(f"g5.{'joint' if p.stage == 'joint' else 'forward'}", p.name) for p in manager.passes]
    assert {stage for stage, _ in ran} == {"g5.joint", "g5.forward"}
    ours = [r for r in caplog.records if r.name == "zpp_compile.compiler.pass_observers"]
    assert [tuple(r.getMessage().split(",")[0].split(": ")) for r in ours] == ran
    assert [meta["name"] for _, meta, _ in traced] == [f"zeropp_{graph}_{name}" for graph, name in ran]
    assert all(kind == "artifact" and "relu" in code for kind, _, code in traced)


def test_a_graph_without_zeropp_ops_is_left_alone():
    # As the body of a layer compiled once (Config.compile_layers_once), which Inductor compiles on its own.
    graph = fx.symbolic_trace(lambda x: torch.relu(x) + 1).graph
    code = graph.python_code("self").src
    manager = PassManager(zpp.Config(quantized_weights=True, quantized_gradients=True), one_rank(), "g5")
    manager.run("joint", graph)
    manager.run("lowering", graph)
    assert graph.python_code("self").src == code
    assert manager.graphs == [] and not manager.joint_done and manager.secondary_bytes == 0


def test_every_pass_has_a_graph_level_test():
    # A pass's test on a small graph of its own is named test_<pass>__<what it does> (the joint and
    # the lowering passes' files) or is a file of its own, tests/test_<pass>.py; a pass added to
    # PASSES needs one. Bucketing and the overlap schedule are tested in test_schedule.py.
    tests = Path(__file__).parent
    files = sorted(tests.glob("test_*.py"))
    named = {m for f in files for m in re.findall(r"^def test_(\w+?)__", f.read_text(), re.MULTILINE)}
    own_files = {f.stem.removeprefix("test_") for f in files}
    in_test_schedule = {"bucket_collectives", "schedule_overlap"}
    missing = {p.name for p in PASSES} - named - own_files - in_test_schedule
    assert not missing, missing

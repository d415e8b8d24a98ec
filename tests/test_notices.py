"""Signs of life: a graph's compilation is said on rank 0 when it starts and when it ends, with its
time, on stderr where the program set up no logging, through its handlers where it did."""

from __future__ import annotations

import logging
import warnings

import torch.fx as fx

from zpp_compile import notices
from zpp_compile.compiler.backend import _announced
from zpp_compile.runtime.job import warn_for_the_job


def test_a_graphs_compilation_is_announced_with_its_time(capsys, monkeypatch):
    monkeypatch.setattr(notices.logger, "handlers", [])
    monkeypatch.setattr(notices.logger, "propagate", True)
    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # a program that set up no logging
    compiled = []
    inner = lambda gm, inputs, **kwargs: compiled.append(kwargs) or "compiled"  # noqa: E731
    assert _announced(inner, "g7")(fx.GraphModule({}, fx.Graph()), [], is_backward=True) == "compiled"
    assert compiled == [{"is_backward": True}]
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "zeropp: compiling graph g7's backward", lines
    assert lines[1].startswith("zeropp: compiled graph g7's backward in ") and lines[1].endswith(" s"), lines


def test_a_program_with_logging_set_up_gets_the_notices_through_its_handlers(caplog, capsys, monkeypatch):
    monkeypatch.setattr(notices.logger, "handlers", [])
    monkeypatch.setattr(notices.logger, "propagate", True)
    with caplog.at_level(logging.INFO, logger="zpp_compile.notices"):
        _announced(lambda gm, inputs, **kwargs: None, "g1")(fx.GraphModule({}, fx.Graph()), [])
    assert [r.getMessage() for r in caplog.records][0] == "compiling graph g1's forward"
    assert capsys.readouterr().err == ""


def test_a_warning_every_rank_would_give_is_given_by_rank_0_alone(monkeypatch):
    # Before a process group exists the launcher's RANK decides (torchrun and accelerate set it).
    monkeypatch.setenv("RANK", "1")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_for_the_job("said once per job")
    assert caught == []
    for rank in ("0", None):  # rank 0, or no launcher: one process
        if rank is None:
            monkeypatch.delenv("RANK")
        else:
            monkeypatch.setenv("RANK", rank)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            warn_for_the_job("said once per job", stacklevel=1)
        assert [str(w.message) for w in caught] == ["said once per job"]
        assert caught[0].filename == __file__  # stacklevel=1: this line, as warnings.warn counts it

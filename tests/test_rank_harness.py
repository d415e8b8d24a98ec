"""The test harness's own promise (tests/distributed.py): a rank that dies in native code is never
passed over. Its call runs again on new processes; a crash that comes back fails the test with
where each rank died, one that does not is listed for the session's summary."""

from __future__ import annotations

import ctypes
import os

import distributed
import pytest
from distributed import run_ranks

pytestmark = pytest.mark.distributed


def segfault_on_rank_0(rank: int, world_size: int, marker: str | None) -> int:
    """Rank 0 reads address 0 (a real segmentation fault) the first time, or every time without a
    `marker` file to leave; every rank returns its rank otherwise."""
    if rank == 0 and (marker is None or not os.path.exists(marker)):
        if marker is not None:
            open(marker, "w").close()
        ctypes.string_at(0)
    return rank


def test_a_rank_crashing_once_is_run_again_and_listed(tmp_path):
    crashes_before = len(distributed.NATIVE_CRASHES)
    assert run_ranks(segfault_on_rank_0, 2, str(tmp_path / "crashed")) == [0, 1]
    listed = distributed.NATIVE_CRASHES[crashes_before:]
    del distributed.NATIVE_CRASHES[crashes_before:]  # made on purpose: not for the session's summary
    assert len(listed) == 1
    assert "rank 0 died in native code while running segfault_on_rank_0" in listed[0]
    # Where it died: faulthandler's stack, or (a library replaced its handler) the signal.
    assert ("Segmentation fault" in listed[0] and "in segfault_on_rank_0" in listed[0]
            or "killed by SIGSEGV" in listed[0]), listed[0]
    assert "passed when run again on new processes" in listed[0]


def faulthandler_elsewhere_then_segfault_on_rank_0(rank: int, world_size: int, marker: str) -> int:
    """As `segfault_on_rank_0`, after pointing faulthandler away from the harness's file (as torch's
    elastic error handler does) for a rank's later calls."""
    import faulthandler

    faulthandler.enable(file=open(os.devnull, "w"))
    return segfault_on_rank_0(rank, world_size, marker)


def test_a_crash_is_found_when_faulthandler_was_pointed_elsewhere(tmp_path):
    crashes_before = len(distributed.NATIVE_CRASHES)
    assert run_ranks(faulthandler_elsewhere_then_segfault_on_rank_0, 2, str(tmp_path / "crashed")) == [0, 1]
    listed = distributed.NATIVE_CRASHES[crashes_before:]
    del distributed.NATIVE_CRASHES[crashes_before:]
    assert len(listed) == 1 and "rank 0 died in native code" in listed[0]
    assert "killed by SIGSEGV" in listed[0], listed[0]


def test_a_rank_crashing_every_time_fails_with_where_it_died():
    crashes_before = len(distributed.NATIVE_CRASHES)
    with pytest.raises(AssertionError, match="and again on new processes") as failure:
        run_ranks(segfault_on_rank_0, 2, None)
    assert str(failure.value).count("Segmentation fault") + str(failure.value).count("killed by SIGSEGV") == 2
    assert len(distributed.NATIVE_CRASHES) == crashes_before

"""Test-wide setup: Triton kernels run in the interpreter when no GPU is present; the environment
the test ranks start with is settled before any starts.

TRITON_INTERPRET is read when a kernel is defined, so it is set here, before any test module
imports zpp_compile.
"""
import importlib.util
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Triton is a dependency on Linux, and its interpreter needs numpy: if either is missing the
# kernel tests would quietly skip, so stop here instead.
if sys.platform == "linux":
    missing = [name for name in ("triton", "numpy") if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportError(f"the tests need {missing}: pip install -e '.[test]'")

# How many kernels each test rank compiles at once. On CPU, Inductor compiles its C++ kernels from
# a thread each (one g++ per kernel, no worker processes); the ranks of a test compile the same
# kernels, and a file lock per kernel makes one rank wait while another compiles it: with two
# threads, both cores compile. On GPUs, Triton kernels compile in a pool of worker processes,
# which each test's ranks would start anew: there they compile one at a time.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1" if torch.cuda.is_available() else "2")

# On CPU, test ranks have Inductor write scalar C++ kernels instead of vectorized ones. What the
# tests check (the graphs our passes leave, the collectives, the numbers against the float64
# reference) is the same either way, while choosing the vector tiling and compiling its templates
# takes about a quarter of an Inductor-mode test's time. GPUs run Triton kernels, unaffected; the
# README's main job keeps Inductor's default. Read when Inductor's config is first imported (below).
if not torch.cuda.is_available():
    os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")

# Inductor sets its cache folder's variable on first use when unset. Set here (to the same folder),
# a compilation in the test process leaves the environment that decides how ranks start
# (tests/distributed.py) as it was; changed, every later rank would start as a new interpreter.
from torch._inductor.runtime.runtime_utils import cache_dir  # noqa: E402  (after TRITON_INTERPRET)

cache_dir()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before a test's fixtures are set up: whether it may start ranks. The fast tier (`pytest -m
    "not distributed"`) stays fast only while every test that starts processes is marked."""
    import distributed

    distributed.UNMARKED_TEST = None if item.get_closest_marker("distributed") else item.nodeid


def pytest_terminal_summary(terminalreporter) -> None:
    """Test ranks that died in native code in a call that then passed on new processes
    (tests/distributed.py): said at the end, with where each died."""
    import distributed

    if distributed.NATIVE_CRASHES:
        terminalreporter.section("test ranks that died in native code (their tests passed when run again)")
        for crash in distributed.NATIVE_CRASHES:
            terminalreporter.write_line(crash)

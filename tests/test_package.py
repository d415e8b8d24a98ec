"""What the installed package says of itself: its version, and that it carries its type annotations."""

from __future__ import annotations

import re
from pathlib import Path

import zpp_compile


def test_version_is_the_projects():
    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert zpp_compile.__version__ == re.search(r'^version = "([^"]+)"', pyproject, re.MULTILINE).group(1)


def test_the_package_is_marked_typed():
    assert (Path(zpp_compile.__file__).parent / "py.typed").is_file()
    assert 'zpp_compile = ["py.typed"]' in (Path(__file__).parents[1] / "pyproject.toml").read_text()


def test_the_command_line_help_loads_no_torch():
    """`zeropp --help` answers without importing torch (seconds otherwise): the package loads its
    exports at their first use, and each command its own modules."""
    import subprocess
    import sys

    script = ("import sys\nfrom zpp_compile import cli\ntry:\n    cli.main(['--help'])\nexcept SystemExit:\n    pass\n"
              "assert 'torch' not in sys.modules, 'torch was imported'\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Inspect what the zeropp compiler does" in done.stdout


def test_the_exports_load_at_their_first_use():
    import zpp_compile as zpp
    from zpp_compile import _api

    assert set(zpp.__all__) <= set(dir(zpp))
    assert [name for name in zpp.__all__ if name != "__version__"] == _api.__all__
    assert all(getattr(zpp, name) is getattr(_api, name) for name in _api.__all__)
    assert zpp.shard.__module__ == "zpp_compile.sharding.shard" and zpp.Config.__name__ == "Config"


def test_a_torch_outside_the_range_is_warned_about_at_import_without_importing_it():
    import subprocess
    import sys

    script = ("import importlib.metadata as m, sys, warnings\n"
              "real = m.version\n"
              "m.version = lambda name: '2.11.0+cu130' if name == 'torch' else real(name)\n"
              "with warnings.catch_warnings(record=True) as seen:\n"
              "    warnings.simplefilter('always')\n"
              "    import zpp_compile\n"
              "assert 'torch' not in sys.modules\n"
              "print([str(w.message) for w in seen])\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "zeropp supports torch 2.13 to 2.15; this is torch 2.11.0+cu130" in done.stdout

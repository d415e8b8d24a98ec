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

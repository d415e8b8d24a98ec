"""The packages of the test extras (`pip install -e ".[test]"`: transformers, peft, Lightning,
torchtitan, ...): a test that needs one skips where it is missing, naming it, so that the rest run
with only the package, torch and pytest installed."""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

import pytest


def _installed(name: str) -> bool:
    return importlib.util.find_spec(name.partition(".")[0]) is not None


def optional(name: str) -> ModuleType | None:
    """The module `name`, imported; None where its package is not installed."""
    return importlib.import_module(name) if _installed(name) else None


def needs(*names: str) -> pytest.MarkDecorator:
    """Skips the test unless every package of `names` is installed."""
    missing = [name for name in names if not _installed(name)]
    return pytest.mark.skipif(bool(missing), reason=f"needs {', '.join(missing)} (pip install -e '.[test]')")

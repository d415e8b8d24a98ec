"""Which layer's own graph runs or compiles now (Config.compile_layers_once).

Written only by `zpp_compile.compiler.layer_graphs`, through `running` around each layer's forward; read
by the backend (a graph compiled meanwhile is that layer's own) and by the weight prefetch (its
predictions follow layers). A layer is (sharding id, qualified name).
"""

from __future__ import annotations

import contextlib
from typing import Iterator


class _Scope:
    layer: tuple[int, str] | None = None


_SCOPE = _Scope()  # this module's own: `running` alone changes it


def running_layer() -> tuple[int, str] | None:
    """The layer whose forward runs or compiles now; None outside every layer's."""
    return _SCOPE.layer


@contextlib.contextmanager
def running(layer: tuple[int, str]) -> Iterator[None]:
    """`layer` is the running layer until the block ends (a layer inside a layer restores the outer)."""
    outer, _SCOPE.layer = _SCOPE.layer, layer
    try:
        yield
    finally:
        _SCOPE.layer = outer

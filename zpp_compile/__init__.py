"""zeropp: ZeRO++ (qwZ, hpZ, qgZ) as a torch.compile backend.

    model = zpp_compile.shard(model, zpp_compile.Config(quantized_weights=True, ...))
    step_model = torch.compile(model, backend="zeropp")

The names below come from `zpp_compile._api`, loaded at the first use of any of them (PEP 562):
`import zpp_compile` alone loads no torch, so the `zeropp` command's help answers at once.
"""

import importlib
from importlib import metadata
from typing import Any

from .runtime.job import warn_for_the_job
from .supported_torch import unsupported_torch_warning

try:
    __version__ = metadata.version("zeropp")
except metadata.PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

_torch: str | None
try:
    _torch = metadata.version("torch")
except metadata.PackageNotFoundError:  # a torch without metadata (built in place): nothing to compare
    _torch = None
if _torch is not None and (_warning := unsupported_torch_warning(_torch)) is not None:
    warn_for_the_job(_warning, stacklevel=2)  # once per job, at import: where the user chose the torch

__all__ = [
    "__version__", "Config", "ConfigError", "CommReport", "shard", "is_sharded", "full_state_dict", "step_comm_bytes",
    "secondary_copy_bytes", "comm_report", "set_requires_gradient_sync", "no_sync",
    "release_cuda_graphs", "save_checkpoint", "load_checkpoint", "CheckpointError", "load_full_state_dict",
    "RankMismatchError", "reset_comm_report",
]


# What `_api` gives besides the exports: the sharding registry (tests read it).
_ALSO_FROM_API = ("REGISTRY",)


def __getattr__(name: str) -> Any:
    """An export (or `_ALSO_FROM_API`), from `_api`, loaded at the first use of one. Any other name
    is no attribute, so that `from zpp_compile import cli` imports that submodule alone."""
    if name not in __all__ and name not in _ALSO_FROM_API:
        raise AttributeError(f"module 'zpp_compile' has no attribute {name!r}")
    # import_module finds a module being imported in sys.modules; `from . import _api` would ask the
    # package for the attribute, which is this function, again.
    value = getattr(importlib.import_module("zpp_compile._api"), name)
    globals()[name] = value  # later reads find it without coming here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

"""Rank 0 speaks for the job: a warning every rank would give alike (the same config, graphs or
script) is given once, by rank 0, and so is each of zeropp's notices (`zpp_compile.notices`).

Plain Python: the package's import warns through it before torch is loaded.
"""

from __future__ import annotations

import os
import sys
import warnings

# This process's rank, set by torchrun and `accelerate launch` before any process group exists.
LAUNCHER_RANK_ENV = "RANK"


def speaks_for_the_job() -> bool:
    """Whether this process is rank 0: of the default process group, or before there is one, of the
    launcher (or no launcher started it: one process)."""
    dist = sys.modules.get("torch.distributed")  # not imported yet: no process group can exist
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get(LAUNCHER_RANK_ENV, "0").strip() in ("0", "")


def warn_for_the_job(message: str, category: type[Warning] = UserWarning, stacklevel: int = 2) -> None:
    """`warnings.warn` on rank 0 alone, for a warning every rank would give alike: a job of 64 ranks
    says it once. `stacklevel` counts from the caller, as `warnings.warn` counts it."""
    if speaks_for_the_job():
        warnings.warn(message, category, stacklevel=stacklevel + 1)

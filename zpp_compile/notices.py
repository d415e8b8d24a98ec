"""What a user waits on, said on rank 0 (`runtime.job`): a first step that compiles for minutes says so.

Each notice is one line on the `zpp_compile.notices` logger at INFO, from rank 0 alone (every rank
compiles the same graphs). Where the program has set up no logging at all (the root logger has no
handler), the lines go to stderr through a handler of zeropp's own, as Lightning and transformers
print theirs; a program that sets logging up gets them through its own handlers instead.
`logging.getLogger("zpp_compile.notices").setLevel(logging.WARNING)` silences them.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any, Callable

from .runtime.job import speaks_for_the_job

logger = logging.getLogger(__name__)


def notice(message: str, *args: Any) -> None:
    """Says `message % args` on rank 0."""
    if not speaks_for_the_job():
        return
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("zeropp: %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False  # a root handler set up later would print each line twice
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    logger.info(message, *args)


def timed_compile(compile_graph: Callable[..., Any], what: str) -> Callable[..., Any]:
    """`compile_graph`, saying when it starts compiling `what` ("graph g0's forward") and how long it took."""

    def compiling(*args: Any, **kwargs: Any) -> Any:
        notice("compiling %s", what)
        start = time.perf_counter()
        compiled = compile_graph(*args, **kwargs)
        notice("compiled %s in %.1f s", what, time.perf_counter() - start)
        return compiled

    return compiling

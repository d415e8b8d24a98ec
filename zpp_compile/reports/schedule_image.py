"""A dump's overlap schedule as a picture (`<graph>.schedule.png` beside `schedule.txt`): each
collective a bar from where the graph issues it to where it waits for it, in graph order, over the
compute the graph runs meanwhile. Needs matplotlib; without it the dump holds the text alone."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import NamedTuple

COLORS = {"all_gather": "tab:blue", "reduce_scatter": "tab:orange", "all_to_all": "tab:green"}


class Span(NamedTuple):
    """One collective: the graph's node index issuing it, the one waiting for it (None where this
    graph does not wait: a gather issued one call ahead, a reduction finished by a later graph)."""

    issued: int
    waited: int | None
    op: str
    label: str  # its group and dtype


def can_draw() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def write_schedule_image(path: Path, title: str, spans: list[Span], compute: list[int], nodes: int) -> None:
    """Draws `spans` (one row each, in issue order) above a row of `compute`'s node indices."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = len(spans) + 1
    fig, ax = plt.subplots(figsize=(min(4 + nodes / 25, 24), 1.2 + 0.28 * rows))
    ax.vlines(compute, -0.35, 0.35, color="dimgray", linewidth=0.6)
    for row, span in enumerate(spans, start=1):
        color = COLORS.get(span.op, "tab:purple")
        if span.waited is None:
            ax.plot([span.issued], [row], marker=">", color=color)
        else:
            ax.barh(row, max(span.waited - span.issued, 0.6), left=span.issued, height=0.6, color=color)
    ax.set_yticks(range(rows), ["compute", *(f"{s.op} {s.label}" for s in spans)], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(-1, nodes)
    ax.set_xlabel("node index in graph order (a bar: issued ... waited; an arrow: waited for in another graph)",
                  fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

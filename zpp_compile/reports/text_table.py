"""Plain-text tables, as the command line, the reports and the examples print them."""

from __future__ import annotations

import textwrap
from typing import Any, Iterable, Sequence

WIDTH = 100  # columns the command line keeps to unless asked for more (`zeropp --wide`)


def render(headers: Sequence[str] | None, rows: Iterable[Sequence[Any]], align: str = "", gap: int = 2,
           width: int | None = None) -> str:
    """`rows` under `headers` (none when None) as lines of text: every column as wide as its
    widest cell, columns `gap` spaces apart, each aligned as its character in `align` says ("<"
    left, ">" right, "^" centred; columns past its end are left-aligned), no space at a line's end.
    With `width`, a left-aligned last column (prose) is wrapped, its lines continued under it, so
    that lines keep within `width` where the other columns leave it room.

    Cells are shown as `str` shows them: a caller formats its numbers (thousands separators,
    decimals, units) before they come here."""
    lines = [[str(cell) for cell in row] for row in ([headers] if headers is not None else []) + list(rows)]
    columns = max((len(line) for line in lines), default=0)
    align = align.ljust(columns, "<")
    room = None
    if width is not None and columns and align[columns - 1] == "<":
        start = sum(max((len(line[c]) for line in lines if c < len(line)), default=0) + gap for c in range(columns - 1))
        room = width - start if width - start >= 20 else None
    widths = [max((len(_fill(line[c], room)[0]) if c == columns - 1 and room else len(line[c]))
                  for line in lines if c < len(line)) for c in range(columns)]
    out = []
    for line in lines:
        wrapped = _fill(line[-1], room) if room and len(line) == columns else None
        cells = [f"{cell:{align[c]}{widths[c]}}" for c, cell in enumerate(line[:-1] if wrapped else line)]
        out.append((" " * gap).join([*cells, *(wrapped or [])[:1]]).rstrip())
        indent = " " * (sum(widths[:-1]) + gap * (columns - 1))
        out += [indent + more for more in (wrapped or [])[1:]]
    return "\n".join(out)


def _fill(text: str, room: int | None) -> list[str]:
    return textwrap.wrap(text, room, break_on_hyphens=False) or [""] if room else [text]


def prose(text: str, width: int | None) -> str:
    """`text` wrapped at `width` columns (as it is, without one)."""
    return textwrap.fill(text, width, break_on_hyphens=False) if width else text

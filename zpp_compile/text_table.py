"""Plain-text tables, as the command line, the reports and the examples print them."""

from __future__ import annotations

from typing import Any, Iterable, Sequence


def render(headers: Sequence[str] | None, rows: Iterable[Sequence[Any]], align: str = "", gap: int = 2) -> str:
    """`rows` under `headers` (none when None) as lines of text: every column as wide as its
    widest cell, columns `gap` spaces apart, each aligned as its character in `align` says ("<"
    left, ">" right, "^" centred; columns past its end are left-aligned), no space at a line's end.

    Cells are shown as `str` shows them: a caller formats its numbers (thousands separators,
    decimals, units) before they come here."""
    lines = [[str(cell) for cell in row] for row in ([headers] if headers is not None else []) + list(rows)]
    widths = [max(len(line[column]) for line in lines if column < len(line))
              for column in range(max((len(line) for line in lines), default=0))]
    align = align.ljust(len(widths), "<")
    return "\n".join((" " * gap).join(f"{cell:{align[column]}{widths[column]}}" for column, cell in enumerate(line))
                     .rstrip() for line in lines)

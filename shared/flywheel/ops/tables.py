"""Text tables and sizes as the commands print them (``flywheel status``, ``flywheel eval``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def table(rows: Sequence[Sequence[Any]], headers: Sequence[str] | None = None) -> str:
    """Aligned columns: numbers to the right, text to the left."""
    text = ([list(headers)] if headers else []) + [[str(v) for v in row] for row in rows]
    num_columns = len(text[0])
    widths = [max(len(row[i]) for row in text) for i in range(num_columns)]
    numeric = [bool(rows) and all(isinstance(row[i], int | float) for row in rows) for i in range(num_columns)]
    lines = ("  ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in zip(row, widths, numeric, strict=True))
             for row in text)
    return "\n".join(line.rstrip() for line in lines)


def size(num_bytes: int) -> str:
    if num_bytes < 1024:
        return f"{num_bytes} B"
    value = num_bytes / 1024
    for unit in ("KiB", "MiB"):
        if value < 1024:
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"

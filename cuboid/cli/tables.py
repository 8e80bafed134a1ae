"""Plain-text tables for the commands (``cuboid info``, ``cuboid plans``) and the benchmarks.

Its own module so that the commands import it from one place below them all
(``cli`` registers ``plans_cmd``, which prints with it: no import circle).
"""
from __future__ import annotations

from typing import Sequence


def table(rows: Sequence[Sequence[str]], header: Sequence[str]) -> str:
    """``rows`` under ``header`` in left-aligned columns two spaces apart, a dashed rule under the header."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def count(n: int) -> str:
    """A count with its digits grouped and its size: ``30,532,122,624 (30.5B)``."""
    for size, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= size:
            return f"{n:,} ({n / size:.3g}{unit})"
    return f"{n:,}"

"""Plain-text tables for command-line reports (the trainer's profile, the scaling model, the
benchmarks). Imports nothing of jitkern, so every layer may use it."""
from __future__ import annotations


def format_table(headers, rows) -> str:
    """Rows as an aligned plain-text table: cells right-aligned, a dashed line under the headers."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def print_table(headers, rows) -> None:
    """Print rows as an aligned plain-text table."""
    print(format_table(headers, rows))

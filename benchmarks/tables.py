"""Benchmark rows as the Markdown tables the docs show."""

from __future__ import annotations


def markdown(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """One line per row; ``columns`` are (the row's key, the column's title, its format), right-aligned."""
    lines = [
        "| " + " | ".join(title for _, title, _ in columns) + " |",
        "|" + "|".join("---:" for _ in columns) + "|",
    ]
    lines += ["| " + " | ".join(fmt.format(row[key]) for key, _, fmt in columns) + " |" for row in rows]
    return "\n".join(lines)

"""Names both sides give to groups of islands (multislice: ``rm.groups``)."""

from __future__ import annotations

from collections.abc import Iterable


def group_name(islands: Iterable[int]) -> str:
    """A group's name: its islands, sorted, joined by "+" (``0+1``)."""
    return "+".join(str(i) for i in sorted(set(islands)))

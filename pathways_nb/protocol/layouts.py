"""Default array layouts, answered by the proxy from its own knowledge.

The stock client treats the reply to ``get_default_layout`` as infallible: an
error there aborts the user's whole process (``statusor.cc: Attempting to
fetch value instead of handling error``), and it asks before every new shape it
compiles for or transfers. So the answer must never depend on a worker that
may be gone. On CPU and GPU the default layout of every array is row-major
(minor-to-major ``{rank-1, ..., 0}``, no tiling), which the proxy writes
itself; other platforms (TPU tiles its layouts) are asked once per
(dtype, shape, device kind, memory kind) and remembered, and while their
island is down the proxy answers row-major: any program that would use it
fails anyway, with the island's error, and the client lives.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

ROW_MAJOR_PLATFORMS = frozenset({"cpu", "cuda", "rocm", "gpu"})


def row_major(rank: int) -> bytes:
    """The serialized PjRt layout of a dense row-major array of ``rank`` dimensions, e.g. ``b"{1,0}"``."""
    return ("{" + ",".join(str(d) for d in range(rank - 1, -1, -1)) + "}").encode()


class LayoutBook:
    """Layouts learned from workers, by what decides them; thread-safe."""

    def __init__(self, capacity: int = 65536):
        self._capacity = capacity
        self._known: dict[tuple, bytes] = {}
        self._lock = threading.Lock()

    def known(self, platform: str, key: tuple) -> bool:
        """Whether ``layout`` answers without asking a worker."""
        if platform in ROW_MAJOR_PLATFORMS:
            return True
        with self._lock:
            return (platform, *key) in self._known

    def layout(
        self, platform: str, key: tuple, dims: Sequence[int], ask: Callable[[], bytes], fallback_on: type[Exception]
    ) -> bytes:
        """The layout for ``key`` (dtype, dims, device kind, memory kind) on ``platform``; never raises ``fallback_on``.

        ``ask()`` queries a worker; if it fails with ``fallback_on`` (the worker is gone), the row-major
        layout is answered and not remembered, so the real one is asked for once the worker is back.
        """
        if platform in ROW_MAJOR_PLATFORMS:
            return row_major(len(dims))
        with self._lock:
            known = self._known.get((platform, *key))
        if known is not None:
            return known
        try:
            layout = ask()
        except fallback_on:
            return row_major(len(dims))
        with self._lock:
            if len(self._known) >= self._capacity:
                self._known.clear()
            self._known[(platform, *key)] = layout
        return layout

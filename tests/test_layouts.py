"""Default layouts: which the proxy answers itself, and which it learns from a worker once.

The stock client aborts the user's process on an error reply to ``get_default_layout``,
and the proxy's event loop must never wait for a worker: so the book says beforehand
whether an answer needs a worker (the proxy then asks off its loop), and a worker
that is gone yields the row-major layout, never an error.
"""

from __future__ import annotations

import pytest

from pathways_nb.protocol.errors import Unavailable
from pathways_nb.protocol.layouts import LayoutBook, row_major

TILED = b"{1,0:T(8,128)}"


def test_cpu_and_gpu_layouts_are_known_without_a_worker():
    book = LayoutBook()
    for platform in ("cpu", "cuda", "rocm"):
        assert book.known(platform, ("kind", 11, (3, 4), ""))
        assert book.layout(platform, ("kind", 11, (3, 4), ""), (3, 4), _never_asked, Unavailable) == b"{1,0}"


def test_a_tiled_platform_is_asked_once_per_key_and_then_known():
    book, asked = LayoutBook(), []
    key = ("TPU v5", 11, (8, 128), "")

    def ask() -> bytes:
        asked.append(key)
        return TILED

    assert not book.known("tpu", key)
    assert book.layout("tpu", key, (8, 128), ask, Unavailable) == TILED
    assert book.known("tpu", key) and not book.known("tpu", ("TPU v5", 11, (16, 128), ""))
    assert book.layout("tpu", key, (8, 128), _never_asked, Unavailable) == TILED
    assert asked == [key]


def test_a_gone_worker_gives_row_major_and_is_asked_again_later():
    book = LayoutBook()
    key = ("TPU v5", 11, (2, 3, 4), "")

    def gone() -> bytes:
        raise Unavailable("island 0 is down")

    assert book.layout("tpu", key, (2, 3, 4), gone, Unavailable) == row_major(3) == b"{2,1,0}"
    assert not book.known("tpu", key)  # not remembered: the real layout is asked for once the worker is back
    assert book.layout("tpu", key, (2, 3, 4), lambda: TILED, Unavailable) == TILED


def test_other_errors_are_not_hidden():
    with pytest.raises(ZeroDivisionError):
        LayoutBook().layout("tpu", ("k", 11, (1,), ""), (1,), lambda: 1 // 0, Unavailable)


def _never_asked() -> bytes:
    raise AssertionError("a worker was asked for a layout the proxy knows")

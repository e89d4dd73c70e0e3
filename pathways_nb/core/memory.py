"""Handing freed memory back to the operating system.

glibc keeps freed blocks in its arenas, so a server whose sessions have ended
still looks as big as at its peak. Servers call ``release_free_memory()``
when a session's arrays are gone, so that their size follows their use.
"""

from __future__ import annotations

import ctypes
import functools


@functools.cache
def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (musl, macOS): nothing to trim
        return None


def release_free_memory() -> None:
    """Returns the allocator's free memory to the OS (``malloc_trim``); a no-op where there is none."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)

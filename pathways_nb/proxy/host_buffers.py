"""One session's host buffers: bytes uploaded by the client or staged for it to read.

``HostBufferStore`` RPCs and ``make_array_*`` requests race: the request can
arrive before its upload has finished. A consumer asks for the buffer with
``take()`` and gets a ``Pending`` that resolves when the bytes are stored, or
fails after the upload time-out with an error that names the handle.
"""

from __future__ import annotations

import threading

from pathways_nb.dataflow import Pending
from pathways_nb.protocol.errors import DeadlineExceeded, InvalidRequest, NotFound, Unavailable
from pathways_nb.proxy.deadlines import Deadlines


class HostBuffers:
    """Host buffers by client-chosen handle, for one session."""

    def __init__(self, deadlines: Deadlines, upload_timeout_s: float):
        self._deadlines = deadlines
        self._upload_timeout_s = upload_timeout_s
        self._lock = threading.Lock()
        self._stored: dict[int, memoryview] = {}
        self._waiting: dict[int, Pending] = {}
        self._closed_reason: str | None = None

    def store(self, handle: int, data: memoryview) -> None:
        """Keeps ``data`` under ``handle``, or hands it to the request waiting for it."""
        with self._lock:
            if self._closed_reason is not None:
                raise Unavailable(self._closed_reason)
            if handle in self._stored:
                raise InvalidRequest(f"host buffer {handle} is already stored; handles are used once")
            waiter = self._waiting.pop(handle, None)
            if waiter is None:
                self._stored[handle] = data
        if waiter is not None:
            waiter.resolve(data)

    def take(self, handle: int) -> Pending:
        """The buffer under ``handle``, removed from the store, now or once it is uploaded."""
        pending = Pending()
        with self._lock:
            if self._closed_reason is not None:
                pending.fail(Unavailable(self._closed_reason))
                return pending
            data = self._stored.pop(handle, None)
            if data is None:
                if handle in self._waiting:
                    pending.fail(InvalidRequest(f"host buffer {handle} is already used by another request"))
                    return pending
                self._waiting[handle] = pending
        if data is not None:
            pending.resolve(data)
            return pending
        timer = self._deadlines.call_later(self._upload_timeout_s, lambda: self._expire(handle, pending))
        pending.on_done(lambda _value, _error: timer.cancel())
        return pending

    def read(self, handle: int) -> memoryview:
        """The stored buffer, left in place (``HostBufferLookup``)."""
        with self._lock:
            try:
                return self._stored[handle]
            except KeyError:
                raise NotFound(f"no host buffer {handle} in this session") from None

    def delete(self, handle: int) -> None:
        with self._lock:
            if self._stored.pop(handle, None) is None:
                raise NotFound(f"no host buffer {handle} in this session")

    def close(self, reason: str) -> None:
        """Drops every buffer and fails every request still waiting for one."""
        with self._lock:
            self._closed_reason = reason
            waiting, self._waiting = self._waiting, {}
            self._stored.clear()
        for pending in waiting.values():
            pending.fail(Unavailable(reason))

    def _expire(self, handle: int, pending: Pending) -> None:
        with self._lock:
            if self._waiting.get(handle) is not pending:
                return
            del self._waiting[handle]
        pending.fail(
            DeadlineExceeded(
                f"the upload of host buffer {handle} did not arrive within "
                f"{self._upload_timeout_s:g} s; the client may have lost its connection. "
                "Retry the transfer, or raise the server's --host_buffer_timeout"
            )
        )

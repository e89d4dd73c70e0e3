"""One session's host buffers: bytes uploaded by the client or staged for it to read.

``HostBufferStore`` RPCs and ``make_array_*`` requests race: the request can
arrive before its upload has finished. A consumer asks for the buffer with
``take()`` and gets a ``Pending`` that resolves when the bytes are stored, or
fails after the upload time-out with an error that names the handle.

A download is staged (``stage``) as soon as ``CopyToHostBuffer`` arrives,
before its bytes are read: the request is answered at once, and the client's
``HostBufferLookup`` waits for the bytes (``ready``). The stock client sends
the lookup only after that answer, so answering first overlaps the read (a
worker's round trip, in a cluster) with the client's own round trip.

Every byte a session holds here counts against its host-buffer quota:
an upload from the moment it starts (``reserve``, before any memory is
allocated), a download from the moment it is staged, a stored buffer until
it is taken, deleted or the session ends.

A client on the proxy's host may upload through shared memory instead
(``HostBufferReadFromDisk``): it writes ``<its directory>/lt_<handle>`` and the
proxy maps that file (``read_from_disk``). The session accepts the directory
the client names only if it lies in this user's private root and holds the
secret the client sent (docs/design.md, "Shared-memory transfers").
"""

from __future__ import annotations

import asyncio
import hmac
import os
import stat
from pathlib import Path

from pathways_nb.core import session_options, shared_memory
from pathways_nb.core.dataflow import Pending
from pathways_nb.core.loop import Later, call_on
from pathways_nb.protocol.errors import (
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidRequest,
    NotFound,
    RequestError,
    Unavailable,
)
from pathways_nb.proxy.context import Quota
from pathways_nb.proxy.worker_link import OUTBOX


class HostBuffers:
    """Host buffers by client-chosen handle, for one session; owned by the session's event loop.

    Every method runs on ``loop``, and so does every change of the store and of its quota. The
    one piece of work another thread does is a staged download's read, which ends wherever the
    read does (a wait-pool thread, or the loop): it hands its bytes to the loop (``stage``).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, upload_timeout_s: float, quota: Quota):
        """``loop``: the owner (the server's), where upload time-outs run too."""
        self._loop = loop
        self._upload_timeout_s = upload_timeout_s
        self.quota = quota
        # handle -> (bytes, how many bytes of the quota they hold)
        self._stored: dict[int, tuple[memoryview, int]] = {}
        self._waiting: dict[int, Pending] = {}
        # Downloads staged and still being read.
        self._reading: dict[int, _Staged] = {}
        # Buffers that could not be kept (an upload over the quota, a failed read), until taken or deleted.
        self._failed: dict[int, RequestError] = {}
        self._closed_reason: str | None = None
        # The client's shared upload directory, once accepted; else why not.
        self._shared_directory: Path | None = None
        self._shared_refusal = "the client named no shared directory"

    def use_shared_directory(self, attributes: dict) -> None:
        """Accepts the upload directory the client named in its session options, if it is provably shared."""
        named = _text(attributes.get(session_options.SHARED_DIRECTORY))
        if not named:
            return
        directory = Path(named)
        own_key = session_options.shared_memory_key()
        if not own_key:
            self._shared_refusal = (
                f"this server takes nothing through shared memory ({shared_memory.ENABLE_ENV}=0, "
                "or no private shared-memory directory on its host)"
            )
        elif _text(attributes.get(session_options.SHARED_HOST)) != own_key:
            self._shared_refusal = "the client runs on another host"
        elif not shared_memory.contains(directory) or not _holds_secret(
            directory, _text(attributes.get(session_options.SHARED_SECRET)).encode()
        ):
            self._shared_refusal = f"{directory} is not a private directory of the client's that this server sees"
        else:
            self._shared_directory = directory

    def read_from_disk(self, handle: int, size: int) -> None:
        """Keeps the client's file ``lt_<handle>`` (``size`` bytes, mapped, then removed) under ``handle``.

        Never raises: the stock client drops its whole session when this RPC fails, so a problem of
        one buffer (its file, the quota, a refused directory) fails the array made from it instead.
        """
        directory = self._shared_directory
        try:
            if directory is None:
                raise FailedPrecondition(
                    f"host buffer {handle} was sent through a shared directory, but this session has none "
                    f"({self._shared_refusal}). The IFRT client decides this once per process, from "
                    "IFRT_PROXY_GRPC_LARGE_TRANSFER_OPTIMIZATION_THRESHOLD_BYTES: unset it, or set "
                    f"{shared_memory.ENABLE_ENV}=0, before the process first connects"
                )
            path = directory / f"lt_{handle}"
            try:
                if size < 0:
                    raise InvalidRequest(f"negative buffer size {size} for host buffer {handle}")
                reserved = self.reserve(size, f"the upload of host buffer {handle}")
                try:
                    data = shared_memory.take(path, size, keep=OUTBOX)
                except shared_memory.NotShared as e:
                    self.release(reserved)
                    raise DataLoss(f"host buffer {handle} could not be read from shared memory: {e}") from None
                self.store(handle, data, reserved)
            finally:
                path.unlink(missing_ok=True)  # not taken: nobody else removes it
        except RequestError as e:
            self.fail(handle, e)

    def reserve(self, nbytes: int, for_what: str) -> int:
        """Counts ``nbytes`` against the quota before they are allocated (RESOURCE_EXHAUSTED if over it)."""
        if self._closed_reason is not None:
            raise Unavailable(self._closed_reason)
        return self.quota.take(nbytes, for_what)

    def release(self, reserved: int) -> None:
        """Gives back a reservation whose bytes were never stored (a failed upload or read)."""
        self.quota.give(reserved)

    def store(self, handle: int, data: memoryview, reserved: int = 0) -> None:
        """Keeps ``data`` under ``handle``, or hands it to the request waiting for it.

        The buffer holds the ``reserved`` bytes of the quota until it leaves the
        store; if it cannot be stored, they are given back here.
        """
        if self._closed_reason is not None or handle in self._stored or handle in self._reading:
            self.quota.give(reserved)
            if self._closed_reason is not None:
                raise Unavailable(self._closed_reason)
            raise InvalidRequest(f"host buffer {handle} is already stored; handles are used once")
        waiter = self._waiting.pop(handle, None)
        if waiter is None:
            self._stored[handle] = (data, reserved)
            return
        self.quota.give(reserved)
        waiter.resolve(data)

    def fail(self, handle: int, error: RequestError) -> None:
        """The upload under ``handle`` cannot be kept: the request that takes it fails with ``error``.

        The stock client drops its whole session when an upload RPC fails, so a problem of one
        buffer (a quota) is reported through the array made from it instead.
        """
        waiter = self._waiting.pop(handle, None)
        if waiter is None:
            self._failed[handle] = error
        else:
            waiter.fail(error)

    def stage(self, handle: int, reserved: int) -> Pending:
        """A download under ``handle`` whose bytes are still being read: resolve (or fail) the returned pending.

        The reader may do so from any thread; the bytes (or the error) reach the store on the loop.
        Until then ``ready(handle)`` gives what to wait for; the ``reserved`` bytes stay counted
        until the buffer is deleted (or given back at once if the read fails).
        """
        if self._closed_reason is not None or self._known(handle):
            self.quota.give(reserved)
            if self._closed_reason is not None:
                raise Unavailable(self._closed_reason)
            raise InvalidRequest(f"host buffer {handle} is already in use; handles are used once")
        reading, staged = Pending(), _Staged(reserved)
        self._reading[handle] = staged
        reading.on_done(lambda data, error: call_on(self._loop, self._read_done, handle, staged, data, error))
        return reading

    def _known(self, handle: int) -> bool:
        return handle in self._stored or handle in self._reading or handle in self._failed

    def _read_done(self, handle: int, staged: _Staged, data, error: BaseException | None) -> None:
        if self._reading.get(handle) is not staged:
            return  # deleted (or the session closed) meanwhile: its bytes were given back then
        del self._reading[handle]
        if error is None:
            self._stored[handle] = (data, staged.reserved)
        else:
            self._failed[handle] = error if isinstance(error, RequestError) else DataLoss(str(error))
            self.quota.give(staged.reserved)
        staged.wake()

    def ready(self, handle: int) -> Pending | None:
        """What a lookup of a staged download waits for: done once its bytes (or its error) are stored.

        None if there is nothing to wait for (stored, failed, or unknown: ``read`` says which).
        """
        staged = self._reading.get(handle)
        if staged is None:
            return None
        if staged.landed is None:
            staged.landed = Pending()
        return staged.landed

    def take(self, handle: int) -> Pending:
        """The buffer under ``handle``, removed from the store, now or once it is uploaded."""
        pending = Pending()
        if self._closed_reason is not None:
            pending.fail(Unavailable(self._closed_reason))
            return pending
        failed = self._failed.pop(handle, None)
        if failed is not None:
            pending.fail(failed)
            return pending
        stored = self._stored.pop(handle, None)
        if stored is not None:
            data, reserved = stored
            self.quota.give(reserved)
            pending.resolve(data)
            return pending
        if handle in self._waiting:
            pending.fail(InvalidRequest(f"host buffer {handle} is already used by another request"))
            return pending
        self._waiting[handle] = pending
        timer = Later(self._loop, self._upload_timeout_s, lambda: self._expire(handle, pending))
        pending.on_done(lambda _value, _error: timer.cancel())
        return pending

    def read(self, handle: int) -> memoryview:
        """The stored buffer, left in place (``HostBufferLookup``); a failed read raises its error."""
        if self._closed_reason is not None:
            raise Unavailable(self._closed_reason)
        stored = self._stored.get(handle)
        if stored is not None:
            return stored[0]
        failed = self._failed.get(handle)
        if failed is not None:
            raise failed
        if handle in self._reading:
            raise FailedPrecondition(f"host buffer {handle} is still being read; wait for it (ready)")
        raise NotFound(f"no host buffer {handle} in this session")

    def delete(self, handle: int) -> None:
        """Drops the buffer; a download still being read is dropped now, and its bytes when they arrive."""
        stored = self._stored.pop(handle, None)
        reading = self._reading.pop(handle, None)
        failed = self._failed.pop(handle, None)
        if stored is None and reading is None and failed is None:
            raise NotFound(f"no host buffer {handle} in this session")
        if stored is not None:
            self.quota.give(stored[1])
        if reading is not None:
            self.quota.give(reading.reserved)
            reading.wake()  # a lookup that waited for it finds it gone

    def close(self, reason: str) -> None:
        """Drops every buffer and fails every request still waiting for one."""
        self._closed_reason = reason
        waiting, self._waiting = self._waiting, {}
        stored, self._stored = self._stored, {}
        reading, self._reading = self._reading, {}
        self._failed.clear()
        self.quota.give(sum(reserved for _data, reserved in stored.values()))
        self.quota.give(sum(staged.reserved for staged in reading.values()))
        for pending in waiting.values():
            pending.fail(Unavailable(reason))
        for staged in reading.values():
            staged.wake(Unavailable(reason))
        if self._shared_directory is not None:
            # A client killed mid-upload leaves files nobody reads: gone with its directory.
            shared_memory.reap_stale()

    def _expire(self, handle: int, pending: Pending) -> None:
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


class _Staged:
    """A download still being read: the bytes it holds of the quota, and what lookups wait for (made when asked)."""

    __slots__ = ("landed", "reserved")

    def __init__(self, reserved: int):
        self.reserved = reserved
        self.landed: Pending | None = None

    def wake(self, error: RequestError | None = None) -> None:
        """Wakes the lookups that wait: the store has the bytes or the error, or no longer the buffer."""
        if self.landed is None:
            return
        if error is None:
            self.landed.resolve(None)
        else:
            self.landed.fail(error)


def _text(value) -> str:
    """An attribute the client sent as a string (``attributes.to_dict`` decodes them; raw bytes too)."""
    if value is None:
        return ""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _holds_secret(directory: Path, secret: bytes) -> bool:
    """Whether ``directory/owner`` is a file of this user holding ``secret``: the client's directory, seen here."""
    if not secret:
        return False
    try:
        descriptor = os.open(directory / "owner", os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        info = os.fstat(descriptor)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_size > 256:
            return False
        return hmac.compare_digest(os.read(descriptor, 256), secret)
    finally:
        os.close(descriptor)

"""Values that arrive later, and work chained onto them.

Neither the proxy nor a worker ever waits on its request stream: a request
whose inputs are not there yet (an upload still on its way, an array another
worker is sending, a program waiting for its own inputs) is chained onto them
with ``run_after``, and finishes where its owner says (``schedule``: on the
server's event loop, which owns its session's state). An ``ArrayRecord`` is what
a server knows about one array handle: metadata at once, the device value or the
error that stopped it later; every later use of a failed handle reports the
original message.

``Pending`` is the one future of the data path: array values, replies of workers,
readiness, statuses. It is resolved once, from any thread; ``wait_on_loop`` is the
one place it meets asyncio, and ``Pending.wait`` the one place a pool thread
blocks on it.
"""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

from pathways_nb.core.loop import call_on
from pathways_nb.protocol import dtypes
from pathways_nb.protocol.errors import FailedPrecondition, RequestError, as_request_error
from pathways_nb.protocol.shardings import IfrtSharding

Callback = Callable[[Any, BaseException | None], None]


class Pending:
    """A value or an error, delivered once; callbacks run on the delivering thread."""

    __slots__ = ("_callbacks", "_done", "_lock", "error", "value")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done = False
        self.value: Any = None
        self.error: BaseException | None = None
        self._callbacks: list[Callback] = []

    @property
    def done(self) -> bool:
        return self._done

    def on_done(self, callback: Callback) -> None:
        """Calls ``callback(value, error)`` now if done, else when done."""
        with self._lock:
            if not self._done:
                self._callbacks.append(callback)
                return
        callback(self.value, self.error)

    def wait(self, timeout_s: float | None = None) -> Any:
        """Blocks until done (never call it on an event loop), then returns the value or raises the error.

        Raises ``TimeoutError`` if not done within ``timeout_s``.
        """
        if not self._done:
            arrived = threading.Event()
            self.on_done(lambda _value, _error: arrived.set())
            if not arrived.wait(timeout_s):
                raise TimeoutError(f"not done within {timeout_s:g} s")
        if self.error is not None:
            raise self.error
        return self.value

    def resolve(self, value: Any) -> bool:
        return self._finish(value, None)

    def fail(self, error: BaseException) -> bool:
        return self._finish(None, error)

    def _finish(self, value: Any, error: BaseException | None) -> bool:
        with self._lock:
            if self._done:
                return False
            self.value, self.error, self._done = value, error, True
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback(value, error)
        return True


def fulfil(pending: Pending, work: Callable[[], Any]) -> None:
    """Resolves ``pending`` with ``work()``, or fails it with the error ``work`` raised."""
    try:
        value = work()
    except Exception as error:  # noqa: BLE001 - delivered to the pending's callbacks
        pending.fail(as_request_error(error))
        return
    pending.resolve(value)


async def wait_on_loop(pending: Pending) -> None:
    """Waits, on the running event loop, until ``pending`` is resolved or failed (by any thread)."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def finish() -> None:
        if not done.done():  # (a cancelled wait)
            done.set_result(None)

    pending.on_done(lambda _value, _error: call_on(loop, finish))
    await done


def when_all(pendings: Sequence[Pending], callback: Callable[[BaseException | None], None]) -> None:
    """Calls ``callback(first_error_or_None)`` once every pending is done."""
    if not pendings:
        callback(None)
        return
    remaining = [len(pendings)]
    errors: list[BaseException] = []
    lock = threading.Lock()

    def one_done(_value: Any, error: BaseException | None) -> None:
        with lock:
            if error is not None:
                errors.append(error)
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            callback(errors[0] if errors else None)

    for pending in pendings:
        pending.on_done(one_done)


# Guards the reader counts of every ArrayRecord (held only for a few operations at a time).
_READS = threading.Lock()


class ArrayRecord:
    """An array of a session: metadata now, device value or error when known."""

    __slots__ = (
        "_delete_after_reads",
        "_pending",
        "_read_waiters",
        "_readers",
        "_release",
        "deleted",
        "error",
        "kind",
        "shape",
        "sharding",
        "value",
    )

    def __init__(self, kind: int, shape: tuple[int, ...], sharding: IfrtSharding | None, value=None):
        self.kind = kind
        self.shape = shape
        self.sharding = sharding
        self.value = value
        self.error: RequestError | None = None
        self.deleted = False
        self._pending: Pending | None = None if value is not None else Pending()
        # Gives the array's bytes back to its session's quota; called once, when the memory is no longer held.
        self._release: Callable[[], None] | None = None
        # Reads of the value under way on other threads: a deletion waits for them (deleting a buffer
        # that a host view still references is a CHECK failure in XLA, which aborts the process).
        self._readers = 0
        self._delete_after_reads = False
        # Records that become ready once no read is under way (a program that donates this array waits).
        self._read_waiters: list[ArrayRecord] = []

    @classmethod
    def failed(
        cls, kind: int, shape: tuple[int, ...], sharding: IfrtSharding | None, error: RequestError
    ) -> ArrayRecord:
        record = cls(kind, shape, sharding)
        record.fail(error)
        return record

    @classmethod
    def gate(cls, pending: Pending) -> ArrayRecord:
        """A record with no value that is ready when ``pending`` is, failed with its error (work chains onto it)."""
        record = cls(0, (), None)
        pending.on_done(
            lambda _value, error: record.set(None) if error is None else record.fail(as_request_error(error))
        )
        return record

    @property
    def nbytes(self) -> int:
        """Bytes the value takes on its devices, per copy (tokens, host strings: none); raises for unknown dtypes."""
        if self.kind in (dtypes.TOKEN_KIND, dtypes.STRING_KIND):
            return 0
        return math.prod(self.shape) * dtypes.to_numpy(self.kind).itemsize

    def hold(self, release: Callable[[], None]) -> None:
        """Calls ``release`` once the value's memory is freed (deleted, donated, failed or forgotten)."""
        self._release = release

    def free(self) -> None:
        """The value no longer holds memory this record answers for (it was forgotten or donated)."""
        release, self._release = self._release, None
        if release is not None:
            release()

    @property
    def ready(self) -> bool:
        """True once the value or the error is known."""
        return self._pending is None or self._pending.done

    @property
    def pending(self) -> Pending:
        """Done when the value or the error is known."""
        if self._pending is None:
            self._pending = Pending()
            self._pending.resolve(self.value)
        return self._pending

    def set(self, value) -> None:
        self.value = value
        if self._pending is not None:
            self._pending.resolve(value)

    def replace(self, value) -> None:
        """Another form of the ready value (a suspended session's array in host memory, and on its device again):
        the record lets go of the old one, whose memory is freed once nothing reads it."""
        self.value = value
        self._pending = None

    def fail(self, error: RequestError) -> None:
        self.error = error
        self.free()
        if self._pending is None:
            self._pending = Pending()
        self._pending.fail(error)

    def delete(self) -> None:
        """Frees the device memory now, or as soon as the value exists."""
        self.deleted = True
        self.free()
        if self.ready:
            self._delete_value()
        else:
            self.pending.on_done(lambda _value, _error: self._delete_value())

    def _delete_value(self) -> None:
        if self.value is None:
            return
        with _READS:
            if self._readers:
                self._delete_after_reads = True
                return
        self.value.delete()

    @property
    def is_deleted(self) -> bool:
        return self.deleted or (self.value is not None and self.value.is_deleted())

    def live(self) -> Any:
        """The value, for work that reads it; a clear error if the array was deleted (or donated) first."""
        if self.is_deleted:
            raise FailedPrecondition(
                f"a {list(self.shape)} array was deleted (or donated to a program) before this request read it"
            )
        return self.value

    def read(self, read: Callable[[Any], Any]) -> Any:
        """``read(value)`` off the request stream: a deletion that races it is FAILED_PRECONDITION, not a crash."""
        value = self._start_read()
        try:
            return read(value)
        except RuntimeError as error:  # jax: "Array has been deleted"
            failure = self._deleted_while_read(error)
            if failure is error:
                raise
            raise failure from error
        finally:
            self.end_read()

    def read_later(self, read: Callable[[Any], Pending]) -> Pending:
        """``read(value)`` whose result arrives later: a deletion waits until it has arrived."""
        value = self._start_read()
        try:
            reading = read(value)
        except BaseException:
            self.end_read()
            raise
        result = Pending()

        def arrived(host: Any, error: BaseException | None) -> None:
            self.end_read()
            if error is None:
                result.resolve(host)
            else:
                result.fail(self._deleted_while_read(error))

        reading.on_done(arrived)
        return result

    def _deleted_while_read(self, error: BaseException) -> BaseException:
        """The error to report for a failed read: FAILED_PRECONDITION if a deletion raced it."""
        if self.is_deleted:
            return FailedPrecondition(
                f"a {list(self.shape)} array was deleted (or donated to a program) while it was being read"
            )
        return error

    def _start_read(self) -> Any:
        with _READS:
            value = self.live()
            self._readers += 1
        return value

    def begin_read(self) -> None:
        """Holds the value for a reader that starts later (a program's argument, from when it is issued).

        Until ``end_read``, a deletion waits, and so does a program that donates the array
        (``reads_done``): the reader finds the value it was given, as an IFRT program's arguments
        stay alive until it has run.
        """
        with _READS:
            self._readers += 1

    def end_read(self) -> None:
        with _READS:
            self._readers -= 1
            last = not self._readers
            deferred = last and self._delete_after_reads
            waiters, self._read_waiters = (self._read_waiters, []) if last else ([], self._read_waiters)
        if deferred and self.value is not None:
            self.value.delete()
        for waiter in waiters:
            waiter.set(None)

    def reads_done(self) -> ArrayRecord:
        """A record that is ready once no read of this one is under way (now, if none is)."""
        gate = ArrayRecord(0, (), None)
        with _READS:
            if self._readers:
                self._read_waiters.append(gate)
                return gate
        gate.set(None)
        return gate


# Runs a callable where the state it touches lives (a server's event loop: ``core.loop.call_on``).
Schedule = Callable[[Callable[[], None]], None]


def run_after(
    inputs: Sequence[ArrayRecord],
    work: Callable[[], None],
    schedule: Schedule,
    outputs: Sequence[ArrayRecord] = (),
    on_error: Callable[[RequestError], None] | None = None,
) -> None:
    """Runs ``work`` once every input has its value.

    If the inputs are ready, ``work`` runs now and a failure (of an input or
    of ``work``) raises here, so the request's reply can carry it. If not,
    ``work`` runs later, handed to ``schedule`` by whichever thread delivers the
    last input, and a failure goes to ``on_error``. Either way each output
    record receives the failure.
    """

    def fail_outputs(error: BaseException) -> RequestError:
        failure = as_request_error(error)
        for record in outputs:
            if not record.ready:
                record.fail(failure)
        return failure

    if all(record.ready for record in inputs):
        try:
            for record in inputs:
                if record.error is not None:
                    raise record.error
            work()
        except Exception as error:
            fail_outputs(error)
            raise
        return

    def run_later(input_error: BaseException | None) -> None:
        try:
            if input_error is not None:
                raise input_error
            work()
        except Exception as error:  # noqa: BLE001 - delivered to the dependents
            failure = fail_outputs(error)
            if on_error is not None:
                on_error(failure)

    when_all([record.pending for record in inputs], lambda error: schedule(lambda: run_later(error)))

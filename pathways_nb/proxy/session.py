"""One client connection: its arrays, programs and futures, and the serving of its requests.

Requests are served in arrival order on the server's event loop, and none of
them waits: work whose inputs are not ready is chained onto them (``after``),
and work that must wait for a device runs on the shared pools
(``in_background``). Both finish on the loop, which alone touches the session's
state, so no lock is shared between the loop and the pool threads; they reply
through ``reply``, which may send replies out of order, as the protocol allows.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Executor
from typing import Any

from pathways_nb.core import session_options
from pathways_nb.core.dataflow import ArrayRecord, Pending, run_after
from pathways_nb.core.events import event
from pathways_nb.core.loop import call_on
from pathways_nb.core.memory import release_free_memory
from pathways_nb.core.runtime_api import DeviceSession
from pathways_nb.protocol import schema
from pathways_nb.protocol.errors import (
    FailedPrecondition,
    InvalidRequest,
    NotFound,
    RequestError,
    Unavailable,
    Unimplemented,
    as_request_error,
)
from pathways_nb.proxy import dispatch
from pathways_nb.proxy.context import ProxyContext, Quota
from pathways_nb.proxy.host_buffers import HostBuffers
from pathways_nb.proxy.suspension import Suspension
from pathways_nb.proxy.versions import Negotiated

_LOGGER = logging.getLogger(__name__)

# Handles the server makes start here; the client keeps its own below 2**48.
SERVER_HANDLE_BASE = 1 << 48


class Session:
    """The server side of one ``IfrtSession`` stream."""

    def __init__(
        self,
        session_id: int,
        version: Negotiated,
        context: ProxyContext,
        send: Callable[[Any], None],
        init_attributes: dict | None = None,
    ):
        self.session_id = session_id
        self.version = version
        self.context = context
        # Made on the loop that serves it: every change of the session's state happens there.
        self.loop = asyncio.get_running_loop()
        # The session's devices, from ``open_devices`` (the init request).
        self._devices: DeviceSession | None = None
        self._opening: asyncio.Task | None = None
        # Its devices lent by a cluster: suspended and resumed (None: a single-process proxy's, or none yet).
        self.suspension: Suspension | None = None
        # What the client sent as ClientConnectionOptions.initialization_data.
        self.init_attributes = init_attributes or {}
        self.events = context.events.sink(self.tenant)
        # The output of the client connection this session belongs to (None: it sent no secret, and
        # nobody could read it): what its code beside the devices writes, and the context of its calls.
        self.output = context.outputs.open(self.tenant, self.secret)
        self.messages = schema.load()
        limits = context.limits
        self.host_buffers = HostBuffers(
            self.loop,
            limits.host_buffer_timeout_s,
            Quota("host buffers", limits.session_host_buffer_bytes, "--session_host_buffer_bytes"),
        )
        self.device_bytes = Quota("device memory", limits.session_device_bytes, "--session_device_bytes")
        self.arrays: dict[int, ArrayRecord] = {}
        self.programs: dict[int, Any] = {}
        # Per device, the results of the latest XLA program on it: a non-XLA program runs after them.
        self.latest_work: dict[int, list[ArrayRecord]] = {}
        # Per device, the results of the latest non-XLA program on it: the next one runs after them too
        # (XLA programs in between do not wait for it, so ``latest_work`` alone would lose the order).
        self.latest_nonxla_work: dict[int, list[ArrayRecord]] = {}
        self.futures: dict[int, Pending] = {}
        self.closed = False
        self._send = send
        self._server_handles = itertools.count(SERVER_HANDLE_BASE)
        self.requests_served = 0

    # -- devices ---------------------------------------------------------------------------

    def open_devices(self, done: Callable[[DeviceSession | None, RequestError | None], None]) -> None:
        """Gets this session's devices, then ``done(devices, error)`` on the loop.

        The allocation is awaited on the loop (a cluster may make the session queue for minutes): a
        session waiting for devices holds no thread, and no other session waits behind it.
        """
        if self._devices is not None:
            done(self._devices, None)  # init again: the same devices, not a second allocation
            return
        if self._opening is not None:
            raise FailedPrecondition("this session is already waiting for its devices: send init once, first")
        started = time.time()

        async def allocate() -> DeviceSession:
            with self.context.activities.track("wait", "waiting for devices", self.tenant):
                output = self.output.add if self.output is not None else None
                runtime = self.context.runtime
                return await runtime.open_session(self.session_id, self.init_attributes, self.events, output)

        def opened(task: asyncio.Task) -> None:
            if task.cancelled():
                return  # the session ended meanwhile
            error = task.exception()
            if error is not None:
                done(None, as_request_error(error))
                return
            devices = task.result()
            if self.closed:
                devices.release()
                done(None, Unavailable("the session ended while it waited for devices"))
                return
            waited = time.time() - started
            if waited > 0.05:
                self.events(event("wait", "waiting for devices", devices.device_ids, started, started + waited))
            self._devices = devices
            self.suspension = Suspension.of(self, devices)
            done(devices, None)

        self._opening = self.loop.create_task(allocate())
        self._opening.add_done_callback(opened)

    @property
    def runtime(self) -> DeviceSession:
        if self._devices is None:
            raise FailedPrecondition("the session has no devices yet: send init first")
        return self._devices

    @property
    def device_ids(self) -> tuple[int, ...]:
        return self.runtime.device_ids

    @property
    def has_devices(self) -> bool:
        return self._devices is not None

    @property
    def tenant(self) -> str:
        """Who the client said it is (``connect(tenant=...)``), or a name for the session."""
        value = self.init_attributes.get(session_options.TENANT, b"")
        text = value.decode(errors="replace") if isinstance(value, bytes) else str(value)
        return text or f"session-{self.session_id}"

    @property
    def secret(self) -> bytes:
        """The per-connection secret its client sent (``pathways_nb.connect`` makes one; empty: none)."""
        value = self.init_attributes.get(session_options.SECRET, b"")
        return value if isinstance(value, bytes) else str(value).encode()

    # -- serving ---------------------------------------------------------------------------

    def handle(self, request) -> None:
        """Serves one ``IfrtRequest``; its reply goes out now or later."""
        op_id = request.request_metadata.op_id
        kind = request.WhichOneof("request")
        handler = dispatch.HANDLERS.get(kind) if kind else None
        if _LOGGER.isEnabledFor(logging.DEBUG):
            _LOGGER.debug("session %d op %d: %s", self.session_id, op_id, _short(request))
        if self.suspension is not None and self.suspension.holds(request, kind):
            return  # served once the session runs again
        self.requests_served += 1
        if handler is None:
            self.reply_error(op_id, Unimplemented(_unimplemented_message(kind)))
            return
        body = getattr(request, kind)
        try:
            result = handler.function(self, body, op_id)
        except Exception as error:  # noqa: BLE001 - every failure becomes the reply's status
            failure = as_request_error(error)
            if handler.outputs is not None:
                self.fail_handles(handler.outputs(body), failure)
            self.reply_error(op_id, failure)
            return
        if result is not dispatch.DEFERRED:
            self.reply(op_id, handler.response_field, result)

    def reply(self, op_id: int, field: str, body) -> None:
        response = self.messages.proxy.IfrtResponse()
        response.response_metadata.op_id = op_id
        getattr(response, field).CopyFrom(body)
        self._send(response)

    def reply_error(self, op_id: int, error: BaseException) -> None:
        failure = as_request_error(error)
        response = self.messages.proxy.IfrtResponse()
        response.response_metadata.op_id = op_id
        response.response_metadata.status.code = failure.code
        response.response_metadata.status.message = failure.message
        self._send(response)

    # -- handles ---------------------------------------------------------------------------

    def server_handle(self) -> int:
        return next(self._server_handles)

    def record(self, handle: int) -> ArrayRecord:
        try:
            return self.arrays[handle]
        except KeyError:
            raise NotFound(
                f"unknown array handle {handle} in session {self.session_id}: the array was "
                "destroyed, or belongs to another session"
            ) from None

    def records(self, handles: Iterable[int]) -> list[ArrayRecord]:
        return [self.record(handle) for handle in handles]

    def add_array(self, handle: int, record: ArrayRecord) -> int:
        self._check_free([handle])
        self.arrays[handle] = record
        return handle

    def add_new_arrays(
        self, handles: Sequence[int], records: Sequence[ArrayRecord], for_what: str, credit: int = 0
    ) -> None:
        """Adds arrays a request makes, counted against the session's device memory first (or refused).

        ``credit``: bytes of inputs the same request frees (donates). Each record
        gives its bytes back when it is deleted, donated, failed or destructed.
        """
        self._check_free(handles)
        sizes = [record.nbytes for record in records]
        self.device_bytes.take(sum(sizes), for_what, credit)
        for handle, record, nbytes in zip(handles, records, sizes, strict=True):
            record.hold(lambda n=nbytes: call_on(self.loop, self.device_bytes.give, n))  # freed on any thread
            self.arrays[handle] = record

    def _check_free(self, handles: Sequence[int]) -> None:
        for handle in handles:
            if handle == 0:
                raise InvalidRequest("0 is not a valid array handle")
            if handle in self.arrays:
                raise InvalidRequest(f"array handle {handle} is already in use in this session")
        if len(set(handles)) != len(handles):
            raise InvalidRequest(f"a request names the same result handle twice: {list(handles)}")

    def fail_handles(self, handles: Iterable[int], error: RequestError) -> None:
        """Makes each client-chosen handle hold ``error`` (used when its request failed)."""
        for handle in handles:
            record = self.arrays.get(handle)
            if record is None:
                self.arrays[handle] = ArrayRecord.failed(0, (), None, error)
            elif not record.ready:
                record.fail(error)

    def program(self, handle: int):
        try:
            return self.programs[handle]
        except KeyError:
            raise NotFound(f"unknown loaded executable handle {handle} in session {self.session_id}") from None

    def add_future(self, pending: Pending, handle: int | None = None) -> int:
        handle = handle or self.server_handle()
        self.futures[handle] = pending
        return handle

    def take_future(self, handle: int) -> Pending:
        try:
            return self.futures.pop(handle)
        except KeyError:
            raise NotFound(f"unknown future handle {handle}; each future can be checked once") from None

    # -- chaining work ---------------------------------------------------------------------

    def on_loop(self, function: Callable[[], None]) -> None:
        """Runs ``function`` on the session's loop (now, if this is it), unless the session has ended by then."""
        call_on(self.loop, self._unless_closed, function)

    def _unless_closed(self, function: Callable[[], None]) -> None:
        if not self.closed:
            function()

    def after(
        self,
        inputs: Sequence[ArrayRecord],
        work: Callable[[], None],
        outputs: Sequence[ArrayRecord] = (),
        on_error: Callable[[RequestError], None] | None = None,
    ) -> None:
        """Runs ``work`` on the loop once every input has its value (see ``dataflow.run_after``)."""
        run_after(inputs, work, self.on_loop, outputs, on_error)

    def when_done(self, pending: Pending, done: Callable[[Any, BaseException | None], None]) -> None:
        """Calls ``done(value, error)`` on the loop once ``pending`` is done (by whichever thread does it)."""
        pending.on_done(lambda value, error: self.on_loop(lambda: done(value, error)))

    def in_background(
        self,
        work: Callable[[], Any],
        done: Callable[[Any, RequestError | None], None],
        pool: Executor | None = None,
    ) -> None:
        """Runs blocking ``work`` on ``pool`` (the wait pool), then hands ``done(result, error)`` to the loop."""

        def run() -> None:
            try:
                result, error = work(), None
            except Exception as failure:  # noqa: BLE001 - delivered to ``done``
                result, error = None, as_request_error(failure)
            self.on_loop(lambda: done(result, error))

        (pool or self.context.wait_pool).submit(run)

    # -- ending ----------------------------------------------------------------------------

    def close(self, reason: str) -> None:
        """Frees everything the session holds; late replies are dropped (on the loop)."""
        if self.closed:
            return
        self.closed = True
        if self._opening is not None:
            self._opening.cancel()  # a session still queued for devices stops asking
        if self.suspension is not None:
            self.suspension.close()
        arrays, self.arrays = self.arrays, {}
        self.programs.clear()
        self.latest_work.clear()
        self.latest_nonxla_work.clear()
        futures, self.futures = self.futures, {}
        self.host_buffers.close(reason)
        for record in arrays.values():
            if record.value is not None and not record.value.is_deleted():
                record.delete()  # after any read of it under way on another thread
        del futures, arrays
        if self._devices is not None:
            self._devices.release()
        if self.output is not None:
            self.context.outputs.release(self.output)
        release_free_memory()


def _short(request) -> str:
    text = str(request).replace("\n", " ")
    return text if len(text) < 400 else text[:400] + "..."


def _unimplemented_message(kind: str | None) -> str:
    if kind is None:
        return "the request names no operation; this server needs a request from the IFRT proxy client"
    return f"{kind} is not implemented by the pathways-nb proxy server"

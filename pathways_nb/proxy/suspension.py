"""Suspending and resuming one client session: its devices go to others while it waits, and come back.

A suspended session keeps everything but its devices: its arrays wait in its workers' host memory
(``worker.suspended``), its compiled programs stay loaded there, its handles stay valid in the
client. Its client is never told: a request that arrives while the session is suspended is held,
in order, and resumes it; once it has devices again, the held requests are served as if they had just
arrived. The client sees latency, never an error. A request that only lets something go (an array or a
program deleted, as Python's garbage collector does at any time) resumes nothing: it needs no device,
and an idle notebook must not take its devices back because a variable went away. Once the session is
suspended, a request that lets arrays go is served at once (the workers drop those arrays' host copies,
memory and files, then), and so is a check of a future that is done (the client checks an array's
deletion); a program's deletion is held until the session runs.

It resumes on the devices it had where it can (its arrays are there), else on others of the same shape
(virtual devices: ``ClusterSession.relocate`` moves its arrays between workers, its programs compile
there at their first use, and its client's device ids stay what they were). A move that did not hold (a
new worker died on the way) is undone, as the old workers still hold the copies, and made again.

Who suspends: the session's client or an operator (``Observe.ControlSessions``); the resource
manager, through the session's allocation (``Wanted``), when a request of a higher priority waits
for its devices (preemption), or when one waits and the session has been idle for the cluster's
``--suspend_idle_after`` (or always, with ``--suspend_idle_always``), or when an operator drains a host
of its devices (then it resumes elsewhere at once, as does a suspended session whose arrays are there).

All of it runs on the proxy's loop and never waits there: the workers' answers and the allocation
are awaited, and a request costs the running session one comparison and one clock read.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from pathways_nb.core.dataflow import ArrayRecord, Pending, wait_on_loop
from pathways_nb.core.events import event
from pathways_nb.core.retry import Backoff, Retry
from pathways_nb.protocol.errors import RequestError, as_request_error
from pathways_nb.proxy.cluster_session import ClusterSession
from pathways_nb.proxy.context import ProxyContext
from pathways_nb.rpc import cluster_pb2 as pb

_LOGGER = logging.getLogger(__name__)


# How often a resuming session moves to other devices when a new worker dies on the way (the old workers still
# hold its arrays' host copies, so it asks for devices again and moves again); the last time, what did not arrive
# is lost, as it is when any worker dies.
MOVE_ATTEMPTS = 5

# Requests that only let go of something: held while the session is suspended, but never the reason it resumes.
_LETS_GO = frozenset(
    {
        "destruct_array_request",
        "delete_array_request",
        "loaded_executable_destruct_request",
        "loaded_executable_delete_request",
    }
)
# Of those, the ones a suspended session serves at once.
_LETS_ARRAYS_GO = frozenset({"destruct_array_request", "delete_array_request"})


class SuspendableSession(Protocol):
    """What a suspension needs of its session (``proxy.session.Session``, which makes it, is one): its loop and
    context, its arrays and futures, and serving a held request or failing it. The session knows its suspension;
    the suspension knows only this much of the session."""

    session_id: int
    loop: asyncio.AbstractEventLoop
    context: ProxyContext
    arrays: dict[int, ArrayRecord]
    futures: dict[int, Pending]
    closed: bool
    events: Callable[[Any], None]

    @property
    def tenant(self) -> str: ...

    def handle(self, request) -> None: ...

    def reply_error(self, op_id: int, error: BaseException) -> None: ...


class State(enum.Enum):
    running = "running"
    queued = "queued"  # suspended, and waiting for its devices again
    suspending = "suspending"
    suspended = "suspended"
    resuming = "resuming"  # its devices are back; its arrays are moving onto them


class Suspension:
    """One session's state (running, suspended, ...) and the moves between them."""

    def __init__(self, session: SuspendableSession, devices: ClusterSession):
        self._session = session
        self._devices = devices
        self.state = State.running
        self.reason = ""
        self.since = time.time()
        self.last_request = time.monotonic()
        self.suspended_bytes = 0
        self._cause = ""  # why it was suspended and why it resumes, while it waits for its devices
        # Requests that arrived while the session was not running, served in order once it is.
        self._held: collections.deque = collections.deque()
        self._move: asyncio.Task | None = None  # the suspend or resume under way
        self._wanted = pb.Wanted()
        allocation = devices.allocation
        self._idle_after_s = allocation.suspend_idle_after_s
        self._idle_always = allocation.suspend_idle_always
        self._idle_timer: asyncio.TimerHandle | None = None
        devices.on_wanted(self._on_wanted)
        devices.on_drain(self._check_drain)
        self._watch_idle()

    @classmethod
    def of(cls, session: SuspendableSession, devices: Any) -> Suspension | None:
        """The suspension of a session whose devices a cluster lends (None for a single-process proxy's)."""
        return cls(session, devices) if isinstance(devices, ClusterSession) else None

    # -- requests --------------------------------------------------------------------------

    def holds(self, request, kind: str | None) -> bool:
        """Whether ``request`` (of oneof field ``kind``) waits for the session to run; then it is held, and a
        suspended session resumes unless the request only lets something go."""
        self.last_request = time.monotonic()
        if self.state is State.running:
            return False
        if self.state is State.suspended and self._move is None and self._needs_no_devices(request, kind):
            return False
        self._held.append(request)
        if self.state is State.suspended and self._move is None and kind not in _LETS_GO:
            self._start(self._resume("a request arrived"))
        return True

    def _held_one_that_resumes(self) -> bool:
        return any(request.WhichOneof("request") not in _LETS_GO for request in self._held)

    def _needs_no_devices(self, request, kind: str | None) -> bool:
        """Whether a suspended session serves ``request`` at once: it lets arrays go, or checks a finished future."""
        if kind in _LETS_ARRAYS_GO:
            return True
        if kind == "check_future_request":
            pending = self._session.futures.get(request.check_future_request.future_handle)
            return pending is None or pending.done
        return False

    def _serve_held_that_need_no_devices(self) -> None:
        """Serves the held requests that need no devices, once the session is suspended with nothing else to do."""
        if self.state is not State.suspended or self._move is not None:
            return
        held, self._held = self._held, collections.deque()
        for request in held:
            if self._needs_no_devices(request, request.WhichOneof("request")):
                self._session.handle(request)
            else:
                self._held.append(request)

    @property
    def idle_s(self) -> float:
        return time.monotonic() - self.last_request

    # -- moves -----------------------------------------------------------------------------

    async def suspend(self, reason: str) -> None:
        """Suspends the session (if it runs), returning once it is suspended (or moving again)."""
        if self.state is State.running and self._move is None:
            self._start(self._suspend(reason))
        await self._settled()

    async def resume(self, reason: str) -> None:
        """Resumes the session (if it is suspended), returning once it runs again."""
        if self.state is State.suspended and self._move is None:
            self._start(self._resume(reason))
        await self._settled()
        if self.state is State.queued or self.state is State.resuming:
            await self._settled()

    async def _settled(self) -> None:
        """Returns once no move is under way (a failed one is logged by ``_moved``, not raised here)."""
        while self._move is not None:
            await asyncio.wait({self._move})

    def _start(self, move) -> None:
        self._move = task = self._session.loop.create_task(move)
        task.add_done_callback(self._moved)

    def _moved(self, task: asyncio.Task) -> None:
        if self._move is task:
            self._move = None
        if not task.cancelled() and task.exception() is not None:
            _LOGGER.error("session %d: %s", self._session.session_id, task.exception(), exc_info=task.exception())
        if self._session.closed:
            return
        if self.state is State.suspended and self._held_one_that_resumes():
            self._start(self._resume("a request arrived"))
        else:
            self._serve_held_that_need_no_devices()
            self._check_drain()

    def _enter(self, state: State, reason: str) -> None:
        self.state, self.reason, self.since = state, reason, time.time()
        _LOGGER.info("session %d (%s): %s %s", self._session.session_id, self._session.tenant, state.value, reason)

    async def _suspend(self, reason: str) -> None:
        session = self._session
        self._enter(State.suspending, reason)
        started = time.time()
        nbytes = self._array_bytes()
        with session.context.activities.track("suspend", f"suspending ({reason})", session.tenant, nbytes):
            await self._on_workers(self._devices.suspend_on_workers(), "suspending")
        self._devices.give_back_devices()
        self.suspended_bytes = nbytes
        self._enter(State.suspended, reason)
        session.events(event("suspend", f"suspended: {reason}", self._devices.device_ids, started, time.time(), nbytes))

    def _array_bytes(self) -> int:
        arrays = self._session.arrays.values()
        return sum(
            record.nbytes for record in arrays if record.ready and record.error is None and not record.is_deleted
        )

    async def _resume(self, reason: str) -> None:
        session = self._session
        self.suspended_bytes = self._array_bytes()  # (less what was let go meanwhile)
        self._cause = cause = f"{self.reason}; resuming: {reason}"
        started = time.time()
        backoff = None
        for attempt in range(1, MOVE_ATTEMPTS + 1):
            self._enter(State.queued, f"{self._cause}; waiting for its devices")
            if backoff is not None:
                await asyncio.sleep(backoff)
            with session.context.activities.track("wait", "resuming: waiting for its devices", session.tenant):
                lease = await self._devices_again()
            if lease is None:
                return
            self._enter(State.resuming, reason)
            self._devices.take_devices(lease)
            with session.context.activities.track("resume", "resuming", session.tenant, self.suspended_bytes):
                values = [record.value for record in session.arrays.values() if record.ready and record.error is None]
                move = self._devices.relocate(values)
                await self._on_workers(move.asked, "moving to other devices")
                failure = move.failure()
                if not failure or attempt == MOVE_ATTEMPTS:  # the last time, what did not arrive is lost
                    self._devices.drop_links(move.old_links)
                    await self._on_workers(self._devices.resume_on_workers(), "resuming")
                    break
                self._devices.move_back(move)
                self._devices.give_back_devices()
            _LOGGER.warning("session %d: moving to other devices failed (%s); again", session.session_id, failure)
            self._cause = f"{cause}; moving again ({failure})"
            backoff = Backoff().after(backoff)
        session.events(
            event("resume", f"resumed: {reason}", self._devices.device_ids, started, time.time(), self.suspended_bytes)
        )
        self.suspended_bytes = 0
        self._wanted = pb.Wanted()
        self._enter(State.running, "")
        self._watch_idle()
        held, self._held = self._held, collections.deque()
        for request in held:
            session.handle(request)

    async def _devices_again(self):
        """The session's devices, allocated again (waiting in the queue, and for a resource manager that restarts);
        None if they can never be (the error goes to the held requests)."""
        session = self._session
        retry = Retry(f"resuming session {session.session_id}")
        while True:
            try:
                return await session.context.runtime.allocate(
                    session.session_id, self._devices.allocation_request(), self._on_waiting
                )
            except RequestError as error:
                try:
                    wait_s = retry.failed(error)
                except RequestError as permanent:  # its devices are gone for good, or it is refused
                    self._fail_held(permanent)
                    self._enter(State.suspended, f"cannot resume: {permanent.message}")
                    return None
                _LOGGER.warning("session %d: resuming: %s; trying again in %.1f s", session.session_id, error, wait_s)
                await asyncio.sleep(wait_s)

    async def _on_workers(self, asked, doing: str) -> None:
        """Waits for each worker's answer; one that failed lost what it held, as its death would have."""
        for link, pending in asked:
            await wait_on_loop(pending)
            if pending.error is not None:
                error = as_request_error(pending.error)
                _LOGGER.warning("session %d: %s on %s: %s", self._session.session_id, doing, link.describe(), error)

    def _on_waiting(self, waiting: pb.Waiting) -> None:
        self.reason = f"{self._cause}; {waiting.reason}"

    def _fail_held(self, error: RequestError) -> None:
        held, self._held = self._held, collections.deque()
        for request in held:
            self._session.reply_error(request.request_metadata.op_id, error)

    # -- the resource manager's wishes and idleness --------------------------------------------

    def _on_wanted(self, wanted: pb.Wanted) -> None:
        """A waiting request wants the session's devices (or, ``by`` empty, no longer does)."""
        self._wanted = wanted
        if not wanted.by or self.state is not State.running or self._move is not None:
            return
        if wanted.drain:
            self._start(self._suspend(f"{wanted.by}"))
        elif wanted.preempt:
            self._start(self._suspend(f"preempted by {wanted.by}"))
        else:
            self._check_idle()

    def _watch_idle(self) -> None:
        """Checks again once the session could have been idle long enough (where the cluster suspends idle ones)."""
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        if self._idle_after_s > 0 and self.state is State.running and not self._session.closed:
            wait_s = max(0.05, self._idle_after_s - self.idle_s)
            self._idle_timer = self._session.loop.call_later(wait_s, self._check_idle)

    def _check_idle(self) -> None:
        self._idle_timer = None
        if self._idle_after_s <= 0 or self.state is not State.running or self._move is not None:
            return
        if self._session.closed:
            return
        idle_s = self.idle_s
        if idle_s >= self._idle_after_s and (self._wanted.by or self._idle_always):
            why = f"idle for {_duration(idle_s)}" + (f" while {self._wanted.by} waited" if self._wanted.by else "")
            self._start(self._suspend(why))
            return
        self._watch_idle()

    def _check_drain(self) -> None:
        """A suspended session whose arrays are on a host being drained resumes elsewhere (or waits to)."""
        if self.state is not State.suspended or self._move is not None or self._session.closed:
            return
        hosts = self._devices.draining_hosts()
        if hosts:
            self._start(self._resume(f"{', '.join(hosts)} is being drained"))

    # -- ending ----------------------------------------------------------------------------

    def close(self) -> None:
        """The session ended: stop any move and any timer (its devices and arrays go with the session)."""
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        if self._move is not None:
            self._move.cancel()
        self._held.clear()

    @property
    def physical_device_ids(self) -> tuple[int, ...]:
        return self._devices.physical_device_ids

    def info(self) -> dict[str, Any]:
        """The session's state for ``SessionInfo``."""
        return {
            "state": self.state.value,
            "state_reason": self.reason,
            "idle_s": self.idle_s,
            "suspended_bytes": self._array_bytes() if self.state is State.suspended else self.suspended_bytes,
            "state_since": self.since,
            "priority": self._devices.options.priority,  # (a single-process proxy's sessions have none)
        }


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"

"""This process's own device and host trace, taken with jaxlib's profiler, written where xprof reads it.

A worker (and the proxy, and the resource manager) traces itself when a client asks for a profile
(``worker.profiles``): one trace at a time per process, as jaxlib allows, started and stopped by
the trace's id. On stop it writes the XSpace as
``<directory>/plugins/profile/<session>/<name>.xplane.pb``, the layout TensorBoard's profile plugin
and ``xprof --logdir <directory>`` read, where ``name`` says which process of the cluster it is
(``island0-host1``: the hosts of one machine share a hostname, so the hostname cannot). A trace
given a longest duration stops and writes by itself when that runs out; its stop then reports what
was written instead of failing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pathways_nb.core.storage import StorageRoot
from pathways_nb.protocol.errors import FailedPrecondition, InvalidRequest

_LOGGER = logging.getLogger(__name__)

XPLANE_SUFFIX = ".xplane.pb"


@dataclass(frozen=True)
class TraceOptions:
    """What to record: jaxlib's host tracer level (0-3), Python calls, XLA's advanced options."""

    host_tracer_level: int = 2
    python_tracer: bool = False
    advanced: dict = field(default_factory=dict)
    max_duration_s: float = 0.0  # 0: until stopped


@dataclass(frozen=True)
class Written:
    """A trace kept: where (None: in memory), its bytes, and how long the stop and write took."""

    path: Path | None
    nbytes: int
    seconds: float
    xspace: bytes = b""


Writer = Callable[[bytes], Written]


@dataclass
class _Trace:
    trace_id: str
    owner: str
    started: float
    session: object  # jaxlib's ProfilerSession
    write: Writer
    timer: threading.Timer | None = None


class ProcessProfiler:
    """The one trace this process may take at a time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._trace: _Trace | None = None
        # Traces that stopped by themselves (their longest duration ran out): id -> what was written.
        self._ended: dict[str, Written | BaseException] = {}

    @property
    def running(self) -> str | None:
        """Who holds the running trace (None: none runs)."""
        with self._lock:
            return self._trace.owner if self._trace is not None else None

    def start(self, trace_id: str, owner: str, options: TraceOptions, name: str, write: Writer) -> None:
        """Starts tracing this process; ``write(xspace)`` keeps the trace when it stops (``stop``, or its duration)."""
        with self._lock:
            if self._trace is not None:
                since = time.strftime("%H:%M:%S", time.localtime(self._trace.started))
                raise FailedPrecondition(
                    f"a trace is already running on {name} (taken by {self._trace.owner} since {since}); "
                    "one trace at a time: stop it first (jax.profiler.stop_trace())"
                )
            trace = _Trace(trace_id, owner, time.time(), _profiler_session(options), write)
            if options.max_duration_s > 0:
                trace.timer = threading.Timer(options.max_duration_s, self._stop_by_itself, (trace_id,))
                trace.timer.daemon = True
                trace.timer.start()
            self._trace = trace

    def stop(self, trace_id: str, name: str) -> Written:
        """Stops the trace ``trace_id`` and writes it; one that ended by itself reports what it wrote."""
        with self._lock:
            trace = self._trace
            if trace is None or trace.trace_id != trace_id:
                ended = self._ended.pop(trace_id, None)
                if ended is None:
                    raise FailedPrecondition(
                        f"no trace of this request is running on {name}"
                        + (f" (another one, taken by {trace.owner}, is)" if trace is not None else "")
                        + "; start one first (jax.profiler.start_trace())"
                    )
                if isinstance(ended, BaseException):
                    raise ended
                return ended
            self._trace = None
        if trace.timer is not None:
            trace.timer.cancel()
        started = time.monotonic()
        written = trace.write(trace.session.stop())
        return Written(written.path, written.nbytes, time.monotonic() - started, written.xspace)

    def abort(self, trace_id: str) -> None:
        """Ends the trace ``trace_id`` without keeping it, if it runs (its start failed elsewhere)."""
        with self._lock:
            trace = self._trace
            self._ended.pop(trace_id, None)
            if trace is None or trace.trace_id != trace_id:
                return
            self._trace = None
        if trace.timer is not None:
            trace.timer.cancel()
        trace.session.stop()

    def _stop_by_itself(self, trace_id: str) -> None:
        with self._lock:
            trace = self._trace
            if trace is None or trace.trace_id != trace_id:
                return
            self._trace = None
        try:
            self._ended[trace_id] = trace.write(trace.session.stop())
        except Exception as error:
            _LOGGER.exception("writing the trace %s after its longest duration failed", trace_id)
            self._ended[trace_id] = error


def session_location(location: str, session_name: str) -> str:
    """Where xprof finds the files of one trace session under a log directory."""
    return f"{location.rstrip('/')}/plugins/profile/{session_name}"


def storage_writer(storage: StorageRoot, location: str, session_name: str, name: str) -> tuple[Path, Writer]:
    """The session directory of ``location`` under ``storage`` (made now, so a bad place fails the start),
    and a writer of ``<name>.xplane.pb`` there."""
    directory = storage.directory(session_location(location, session_name))

    def write(xspace: bytes) -> Written:
        started = time.monotonic()
        path = storage.write(storage.directory(str(directory)), name + XPLANE_SUFFIX, xspace)
        return Written(path, len(xspace), time.monotonic() - started)

    return directory, write


def check_session_name(session_name: str) -> str:
    """A trace session's name as a directory name (xprof lists runs by it), or a clear error."""
    if (
        not session_name
        or len(session_name) > 200
        or session_name in (".", "..")
        or any(c in session_name for c in "/\\\0")
    ):
        raise InvalidRequest(
            f"trace session name {session_name!r} cannot name a directory; use letters, digits, '_' and '-'"
        )
    return session_name


def _profiler_session(options: TraceOptions):
    # jaxlib's own module, not jax's: a resource manager that never loaded jax starts tracing in
    # well under a second instead of importing all of jax first (seconds on a busy machine).
    from jaxlib import _profiler

    profile_options = _profiler.ProfileOptions()
    profile_options.host_tracer_level = options.host_tracer_level
    profile_options.python_tracer_level = 1 if options.python_tracer else 0
    if options.advanced:
        profile_options.advanced_configuration = dict(options.advanced)
    try:
        return _profiler.ProfilerSession(profile_options)
    except Exception as error:
        raise FailedPrecondition(f"jaxlib's profiler did not start: {error}") from error


# This process's profiler (jaxlib allows one session per process).
PROFILER = ProcessProfiler()


def in_memory(xspace: bytes) -> Written:
    """A writer that keeps the trace for whoever stops it (the resource manager hands it to the proxy)."""
    return Written(None, len(xspace), 0.0, xspace)

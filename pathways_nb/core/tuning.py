"""Every tuning constant of pathways-nb, in one place, each with the environment variable that sets it.

Sizes, delays and time-outs that a server or the client picks are declared here and nowhere else,
and so are the switches between two ways of doing one thing (which event loop the servers run), so
that an operator finds them all in one table (docs/api.md, "Tuning", which tests/test_docs.py checks
against this registry) and sets any of them the same way: ``PATHWAYS_<NAME>`` in the environment of
the process that uses it (a launcher's children inherit its environment). A value is read once, at
its first use; a variable that does not parse as the setting's type (or, for a switch, is not one of
its choices) stops the process with an error that names it. Read a setting with ``.value``
(``bool(setting)`` is refused: it would always be true). Flags that choose a cluster's shape or a
session's limits stay flags of their command (docs/cli.md); these are the knobs behind them.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T", int, float, str)

_PREFIX = "PATHWAYS_"


@dataclass(frozen=True)
class Setting(Generic[T]):
    """One tuning constant: its name, default and what it is for; a switch (a ``str`` default) names its
    ``choices``."""

    name: str
    default: T
    help: str
    choices: tuple[str, ...] = ()
    _cached: list = field(default_factory=list, repr=False, compare=False)

    @property
    def env_var(self) -> str:
        return _PREFIX + self.name.upper()

    @property
    def value(self) -> T:
        """The environment's value if set, else the default (read once)."""
        if not self._cached:
            self._cached.append(self._read())
        return self._cached[0]

    def _read(self) -> T:
        text = os.environ.get(self.env_var)
        if text is None or not text.strip():
            return self.default
        kind = type(self.default)
        if kind is str:
            if text.strip() not in self.choices:
                raise ValueError(
                    f"{self.env_var}={text!r} is not one of {', '.join(self.choices)}; unset it for its default, "
                    f"{self.default}"
                )
            return text.strip()
        try:
            value = kind(text.strip()) if kind is float else int(text.strip(), 0)
        except ValueError:
            raise ValueError(
                f"{self.env_var}={text!r} is not {'an integer' if kind is int else 'a number'}; "
                f"unset it or give a value like its default, {self.default}"
            ) from None
        if value < 0:
            raise ValueError(f"{self.env_var}={text!r} is negative; {self.name} must be >= 0")
        return value

    @contextlib.contextmanager
    def overridden(self, value: T) -> Iterator[None]:
        """This process reads ``value`` inside the block (tests; children read their environment)."""
        saved = list(self._cached)
        self._cached[:] = [value]
        try:
            yield
        finally:
            self._cached[:] = saved

    def __bool__(self) -> bool:
        raise TypeError(f"a Setting is always true; did you mean {self.name}.value?")


SETTINGS: dict[str, Setting] = {}


def _define(name: str, default: T, help: str, choices: tuple[str, ...] = ()) -> Setting[T]:
    if name in SETTINGS:
        raise ValueError(f"the tuning setting {name} is defined twice")
    if isinstance(default, str) and default not in choices:
        raise ValueError(f"the switch {name}'s default, {default}, is not one of its choices {choices}")
    setting = Setting(name, default, help, choices)
    SETTINGS[name] = setting
    return setting


# -- moving bytes ----------------------------------------------------------------------------------

# The stock client takes any size (its channels set no receive limit) and joins the messages into one
# buffer, so fewer messages are not fewer copies; messages of 32 MiB and more are fresh mappings on both
# sides (glibc's largest mmap threshold): 64 MiB ones cost twice the CPU of 1-4 MiB ones (measured).
MESSAGE_CHUNK_BYTES = _define(
    "message_chunk_bytes",
    (4 << 20) - 64,
    "bytes of array data per gRPC message (uploads to workers, downloads, pushes between workers, profiles): "
    "just under gRPC's default 4 MiB receive limit, which the stock client and other clients keep",
)
# Cheaper than a hop to a thread that waits for the value, which costs a notebook's float(f(x)) a good
# part of its time.
READ_AT_ONCE_BYTES = _define(
    "read_at_once_bytes",
    64 << 10,
    "a computed value of at most this size is read on the thread that asks, with no hop to a thread that waits",
)
# Copying an upload (to a device, a shared-memory file, or gRPC chunks) on the loop would hold every
# other session's requests for as long; smaller ones are put at once, which costs less than the hop.
OFF_LOOP_BYTES = _define(
    "off_loop_bytes",
    1 << 20,
    "uploads of at least this size are put on the devices by a pool thread, never on a server's event loop",
)
# Below it, bytes that can ride in a message already being sent cost less there than a file does.
SHARED_MEMORY_MIN_BYTES = _define(
    "shared_memory_min_bytes",
    64 << 10,
    "arrays of at least this size travel between processes of one host as files in shared memory",
)
# Measured on 2 loaded cores (a device_put): 64 KiB 3.5 ms through a file, 2-3 ms over gRPC; 1 MiB
# 4.5 ms and 5.9 ms.
CLIENT_SHARED_MEMORY_BYTES = _define(
    "client_shared_memory_bytes",
    1 << 20,
    "a notebook on the proxy's host writes uploads of at least this size to shared memory (the stock client's "
    "large-transfer threshold)",
)
FORGET_DELAY_S = _define(
    "forget_delay_s",
    0.02,
    "arrays the client dropped wait at most this long to ride along with the next command to their worker",
)
EXECUTOR_MAX_ANSWER_BYTES = _define(
    "executor_max_answer_bytes",
    256 << 20,
    "the largest answer a colocated Python executor may send its worker in one message",
)
# As Orbax's chunk_byte_size: it bounds what one write holds in memory and lets TensorStore compress
# chunks in parallel.
CHECKPOINT_MAX_CHUNK_BYTES = _define(
    "checkpoint_max_chunk_bytes", 64 << 20, "a checkpoint chunk is halved while it is larger than this"
)
CHECKPOINT_IN_FLIGHT_BYTES = _define(
    "checkpoint_in_flight_bytes", 256 << 20, "bytes a worker has on their way to storage at once while it saves"
)

# -- waiting and noticing ------------------------------------------------------------------------------

RELINK_AFTER_S = _define(
    "relink_after_s",
    5.0,
    "a session opens a new stream to a worker this long after the old one broke, if the cluster still finds "
    "that worker healthy",
)
# A launcher reports a dead process within milliseconds; a vanished host takes seconds and is not waited for.
LOSS_CAUSE_WAIT_S = _define(
    "loss_cause_wait_s",
    0.5,
    "how long a broken stream to a worker waits for the cluster to say why the worker went down",
)
LOSS_EXPLAIN_WAIT_S = _define(
    "loss_explain_wait_s",
    2.0,
    "how long a failed read on an island of several hosts waits to learn which host was lost",
)
EVENTS_DELAY_S = _define(
    "events_delay_s", 0.05, "timeline events with no reply to go with leave a worker at most this late"
)
SESSION_END_EVENTS_WAIT_S = _define(
    "session_end_events_wait_s",
    10.0,
    "how long a session's end waits for the timeline events of programs it dispatched that are still running",
)
EARLY_PUSH_WAIT_S = _define(
    "early_push_wait_s",
    10.0,
    "how long an array pushed by a peer waits for its session's stream from the proxy to open",
)
PART_REPORT_TIMEOUT_S = _define(
    "part_report_timeout_s",
    30.0,
    "how long an island's host 0 waits for another host to report that its part of a step ran",
)
FORGET_PROGRAM_WAIT_S = _define(
    "forget_program_wait_s",
    30.0,
    "a program no session holds is forgotten by its workers once they read what came before, or this long after",
)
EARLIER_WORK_WAIT_S = _define(
    "earlier_work_wait_s",
    600.0,
    "how long a plugin or custom-call execution waits for the session's earlier work on its devices",
)
PROGRAM_CHECK_TIMEOUT_S = _define(
    "program_check_timeout_s", 120.0, "how long the program checker's child may take to read one program"
)
PROGRAM_CHECK_REMEMBERED = _define(
    "program_check_remembered", 4096, "programs the checker remembers (by digest) as read or refused"
)
OBSERVE_WATCH_INTERVAL_S = _define(
    "observe_watch_interval_s", 0.2, "how often the proxy sends a watching notebook what changed"
)
LOAD_REPORT_INTERVAL_S = _define(
    "load_report_interval_s",
    1.0,
    "the shortest interval between two load reports of a worker (longer in big clusters)",
)
LOAD_MEASURE_SHARE = _define(
    "load_measure_share", 0.01, "the share of a worker's time that measuring its load may take"
)
CLIENT_PING_INTERVAL_S = _define(
    "client_ping_interval_s", 5.0, "keepalive pings on a quiet client connection to the resource manager"
)
# The resource manager's own default is 3 s. On one machine a launcher sees every process that dies at
# once, so the keepalive only finds a stopped one; and all processes share the same cores: on a busy
# 2-core machine a live worker's threads went unscheduled for up to 6 s, and with 3 s it was called dead.
ONE_MACHINE_WORKER_TIMEOUT_S = _define(
    "one_machine_worker_timeout_s",
    10.0,
    "the default --worker_timeout of clusters on one machine (LocalCluster, pathways-nb up)",
)
CONNECT_TIMEOUT_S = _define("connect_timeout_s", 60.0, "the default time-out of pathways_nb.connect")
# A proxy on this host answers in 3-20 ms (measured), one that is not ours at once (UNIMPLEMENTED); only a
# server that never answers costs this, and the process then uses gRPC.
CONNECT_REFUSED_RETRY_S = _define(
    "connect_refused_retry_s",
    2.0,
    "pathways_nb.connect tries an address that refuses connections this long (a server just starting) before failing",
)
PROBE_TIMEOUT_S = _define(
    "probe_timeout_s", 0.5, "how long the client asks a proxy whether it shares this host, at most"
)
# Orbax's default (CloudPathwaysArrayHandler(timeout=None)).
PERSISTENCE_TIMEOUT_S = _define("persistence_timeout_s", 3600.0, "a checkpoint request's time-out when it names none")

# -- colocated Python ----------------------------------------------------------------------------------

EXECUTOR_START_TIMEOUT_S = _define(
    "executor_start_timeout_s", 120.0, "how long a colocated Python executor may take to start"
)
EXECUTOR_STOP_GRACE_S = _define(
    "executor_stop_grace_s", 5.0, "how long a stopped executor gets to end before it is killed"
)
EXECUTOR_EXIT_REPORT_WAIT_S = _define(
    "executor_exit_report_wait_s", 10.0, "how long a worker waits for the host's report of why an executor ended"
)
EXECUTOR_LOG_TAIL_LINES = _define(
    "executor_log_tail_lines", 20, "lines of an executor's output quoted when it fails to start or dies"
)

EXECUTOR_VERSION_TIMEOUT_S = _define(
    "executor_version_timeout_s", 60.0, "how long a colocated host's start waits to learn its executors' Python version"
)

# -- colocated Python's output (docs/colocated_python.md, "Output") -------------------------------------

OUTPUT_RATE_LINES_S = _define(
    "output_rate_lines_s",
    100.0,
    "lines a second a session's executor on one host may sustain; more are dropped and counted",
)
OUTPUT_BURST_LINES = _define("output_burst_lines", 1000, "lines a session's executor on one host may write at once")
OUTPUT_MAX_LINE_CHARS = _define(
    "output_max_line_chars", 8192, "a line (or logging record) longer than this is cut, saying by how much"
)
OUTPUT_HOST_BUFFER_LINES = _define(
    "output_host_buffer_lines", 2000, "lines a host holds for its worker while the worker's stream is busy"
)
OUTPUT_DROP_REPORT_INTERVAL_S = _define(
    "output_drop_report_interval_s", 5.0, "lines dropped over a bound are reported when their call ends, or this often"
)
OUTPUT_HISTORY_LINES = _define(
    "output_history_lines", 5000, "the latest lines of a client connection the proxy keeps (%pathways logs)"
)
OUTPUT_HISTORY_BYTES = _define("output_history_bytes", 4 << 20, "the most bytes of text those lines may take")
OUTPUT_WORKER_HISTORY_LINES = _define(
    "output_worker_history_lines", 1000, "the workers' latest lines about a connection's programs the proxy keeps"
)
OUTPUT_BATCH_DELAY_S = _define(
    "output_batch_delay_s", 0.05, "a host waits this long for more of an executor's lines, to send them in one message"
)
OUTPUT_DRAIN_WAIT_S = _define("output_drain_wait_s", 2.0, "how long a host waits for an ending executor's last lines")
OUTPUT_CALL_WAIT_S = _define(
    "output_call_wait_s",
    1.0,
    "how long an answered call waits for its output to be all on its way before it is answered",
)
OUTPUT_WATCH_INTERVAL_S = _define(
    "output_watch_interval_s", 0.1, "how often the proxy sends a client what its code beside the devices wrote"
)

# -- scheduling ----------------------------------------------------------------------------------------

GANG_MAX_IN_FLIGHT = _define(
    "gang_max_in_flight",
    2,
    "programs over several hosts in flight at once on a host (more can deadlock XLA's CPU collectives)",
)
GANG_ALONE_AHEAD = _define(
    "gang_alone_ahead", 4, "steps a tenant alone on an island is handed out ahead of their end on every host"
)
SHARE_IDLE_AFTER_S = _define(
    "share_idle_after_s",
    0.25,
    "a tenant of shared devices whose programs have all ended counts as busy this long (its client's wait for results)",
)
GROUP_FORM_TIMEOUT_S = _define(
    "group_form_timeout_s",
    120.0,
    "how long the member processes of a group of islands may take to start and join their runtime",
)
MAX_PROGRAM_BYTES = _define("max_program_bytes", 4 << 20, "the largest plugin or custom-call program text")

# -- retries and the event loops -----------------------------------------------------------------------

RETRY_INITIAL_S = _define(
    "retry_initial_s", 0.25, "the first wait before a call to another server (registration, watch) is retried"
)
RETRY_MAX_S = _define("retry_max_s", 5.0, "retries back off (doubling, with jitter) up to this wait")
LOOP_TICK_S = _define("loop_tick_s", 0.05, "how often each server's loop watchdog checks that its loop turns")
LOOP_STALL_S = _define(
    "loop_stall_s",
    0.25,
    "an event loop that has not turned for this long is stalled: the watchdog logs where it is and counts it",
)

# Measured in docs/performance.md (issue 35): uvloop's loop costs the proxy's and the worker's loop threads
# less per step. asyncio's is there to compare with, and to rule uvloop out when a loop misbehaves.
EVENT_LOOP = _define(
    "event_loop",
    "uvloop",
    "each server's event loop: uvloop (libuv's, which schedules callbacks in C) or asyncio (the standard library's)",
    choices=("uvloop", "asyncio"),
)

# -- the client ------------------------------------------------------------------------------------------

# client/batch_flusher.py: the stock client's flusher wakes every 50 µs (13% of a core) for as long as it lives.
BATCH_FLUSHER = _define(
    "batch_flusher",
    "idle",
    "idle: the stock client's thread that sends batched deletions runs only on otherwise idle cores (SCHED_IDLE; "
    "with CAP_SYS_NICE also 2 ms of timer slack); stock: it is left as the stock client made it",
    choices=("idle", "stock"),
)

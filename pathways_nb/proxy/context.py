"""What every session of one proxy server shares: devices, thread pools, caches, limits."""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from pathways_nb.core.events import EventLog
from pathways_nb.core.runtime_api import ProgramInfo, Runtime
from pathways_nb.protocol.errors import ResourceExhausted
from pathways_nb.proxy.activities import Activities
from pathways_nb.proxy.connection_output import ConnectionOutputs


@dataclass(frozen=True)
class ProxyLimits:
    """Time-outs and sizes an operator may tune (``pathways-nb proxy --help``)."""

    host_buffer_timeout_s: float = 60.0
    compile_cache_entries: int = 256
    compile_threads: int = 2
    wait_threads: int = 8
    # Per-session byte limits; 0 means no limit (``pathways-nb proxy`` picks defaults from the machine).
    session_host_buffer_bytes: int = 0
    session_device_bytes: int = 0


class Quota:
    """Bytes a session may hold of one resource, taken before anything is allocated.

    ``take`` refuses with RESOURCE_EXHAUSTED (naming the limit, what was asked,
    what is in use and the flag that raises it) instead of letting one tenant
    exhaust the server; whoever took bytes gives them back with ``give``.

    Owned by its session's event loop: both are called there (another thread that frees
    what a quota counts hands ``give`` to the loop, ``core.loop.call_on``).
    """

    def __init__(self, what: str, limit: int, flag: str):
        self.what = what
        self.limit = limit
        self.flag = flag
        self.in_use = 0

    def take(self, nbytes: int, for_what: str, credit: int = 0) -> int:
        """Counts ``nbytes`` as used, or raises ``ResourceExhausted``; ``credit`` bytes are about to be freed."""
        if self.limit and self.in_use - credit + nbytes > self.limit:
            raise ResourceExhausted(
                f"{for_what} needs {_size(nbytes)} of {self.what}, but this session already holds "
                f"{_size(self.in_use)} of its {_size(self.limit)} limit ({self.flag}). Free what you no "
                f"longer need (delete arrays, x.delete()), or start the server with a larger {self.flag} "
                "(0 means no limit)"
            )
        self.in_use += nbytes
        return nbytes

    def give(self, nbytes: int) -> None:
        self.in_use -= nbytes


def _size(nbytes: int) -> str:
    """Bytes for people: exact below 1 KiB, else in the largest unit that keeps a number >= 1."""
    value, unit = float(nbytes), "bytes"
    for larger in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        if value < 1024:
            break
        value, unit = value / 1024, larger
    return f"{nbytes} bytes" if unit == "bytes" else f"{value:.1f} {unit}"


class CompileCache:
    """Compiled programs by (program, devices, options) digest, least recently used evicted.

    Sessions share it: a notebook that reconnects, or a second notebook running
    the same model, gets the executable without compiling again.

    Only the compile pool's threads (``compile_threads``) touch it, never an event loop: its lock
    is between those threads alone.
    """

    def __init__(self, entries: int):
        self._entries = entries
        self._programs: OrderedDict[tuple, ProgramInfo] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @staticmethod
    def key(program: bytes, options: bytes, device_ids: tuple[int, ...]) -> tuple:
        return (hashlib.sha256(program).digest(), hashlib.sha256(options).digest(), device_ids)

    def get(self, key: tuple) -> ProgramInfo | None:
        with self._lock:
            program = self._programs.get(key)
            if program is None:
                self.misses += 1
                return None
            self.hits += 1
            self._programs.move_to_end(key)
            return program

    def __len__(self) -> int:
        return len(self._programs)

    def put(self, key: tuple, program: ProgramInfo) -> None:
        with self._lock:
            self._programs[key] = program
            self._programs.move_to_end(key)
            while len(self._programs) > self._entries:
                self._programs.popitem(last=False)


class ProxyContext:
    """Shared by all sessions of a server; closed once when the server stops."""

    def __init__(self, runtime: Runtime, limits: ProxyLimits | None = None):
        self.runtime = runtime
        self.limits = limits or ProxyLimits()
        self.compile_pool = ThreadPoolExecutor(self.limits.compile_threads, thread_name_prefix="pathways-compile")
        # Blocking waits on device work (reading arrays back, readiness checks) run here so
        # that no session stream ever waits for a device.
        self.wait_pool = ThreadPoolExecutor(self.limits.wait_threads, thread_name_prefix="pathways-wait")
        self.compile_cache = CompileCache(self.limits.compile_cache_entries)
        self.events = EventLog()
        self.activities = Activities()
        # What each client connection's code beside the devices wrote, for that connection alone.
        self.outputs = ConnectionOutputs()

    def close(self) -> None:
        self.runtime.close()
        self.compile_pool.shutdown(wait=False, cancel_futures=True)
        self.wait_pool.shutdown(wait=False, cancel_futures=True)

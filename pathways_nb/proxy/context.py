"""What every session of one proxy server shares: devices, thread pools, caches, limits."""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from pathways_nb.events import EventLog
from pathways_nb.proxy.activities import Activities
from pathways_nb.proxy.deadlines import Deadlines
from pathways_nb.runtime_api import ProgramInfo, Runtime


@dataclass(frozen=True)
class ProxyLimits:
    """Time-outs and sizes an operator may tune (``pathways-nb proxy --help``)."""

    host_buffer_timeout_s: float = 60.0
    compile_cache_entries: int = 256
    compile_threads: int = 2
    wait_threads: int = 8


class CompileCache:
    """Compiled programs by (program, devices, options) digest, least recently used evicted.

    Sessions share it: a notebook that reconnects, or a second notebook running
    the same model, gets the executable without compiling again.
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
        self.deadlines = Deadlines()
        self.compile_pool = ThreadPoolExecutor(self.limits.compile_threads, thread_name_prefix="pathways-compile")
        # Blocking waits on device work (reading arrays back, readiness checks) run here so
        # that no session stream ever waits for a device.
        self.wait_pool = ThreadPoolExecutor(self.limits.wait_threads, thread_name_prefix="pathways-wait")
        self.compile_cache = CompileCache(self.limits.compile_cache_entries)
        self.events = EventLog()
        self.activities = Activities()

    def close(self) -> None:
        self.runtime.close()
        self.compile_pool.shutdown(wait=False, cancel_futures=True)
        self.wait_pool.shutdown(wait=False, cancel_futures=True)
        self.deadlines.close()

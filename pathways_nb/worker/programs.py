"""A worker's compiled programs, by the ids the proxy gives them, shared by all its sessions.

A program is known from the moment its ``Compile`` command is read: commands
after it on the same stream (an ``Execute`` the proxy sent without waiting for
the compile) are chained onto it as onto an array still arriving. ``Programs``,
the table by id, belongs to the worker's event loop (no lock): the compile runs
on the pool and hands its program back to the loop, which records it.

Compiles are cached by content (``CompileCache``), so a second proxy (or a proxy
restarted) compiling the same program for the same devices gets it at once. The
cache is the pool's: only compiles read and fill it, and letting a program go
is handed to the pool as well.
"""

from __future__ import annotations

import hashlib
import threading

from pathways_nb.core.dataflow import ArrayRecord
from pathways_nb.protocol.errors import NotFound, RequestError
from pathways_nb.worker.runtime import LocalRuntime, Program


class Programs:
    """Compiled programs by id (loop-owned): records whose value is the Program, or whose error is its compile's."""

    def __init__(self) -> None:
        self._by_id: dict[int, ArrayRecord] = {}

    def expect(self, program_id: int) -> ArrayRecord:
        """Notes a compile of ``program_id`` on its way (in stream order, before it runs); its record.

        The same id may come on several streams (sessions that first ran the program at once);
        the first compile that finishes gives it to all.
        """
        record = self._by_id.get(program_id)
        if record is None or record.error is not None:
            record = self._by_id[program_id] = ArrayRecord(0, (), None)
        return record

    @staticmethod
    def compiled(record: ArrayRecord, program: Program) -> None:
        """A compile expected as ``record`` made ``program``."""
        if not record.ready:
            record.set(program)

    @staticmethod
    def failed(record: ArrayRecord, error: RequestError) -> None:
        if not record.ready:
            record.fail(error)

    def record(self, program_id: int) -> ArrayRecord:
        """The program as a record: its value now, or once its compile (already on its way) is done."""
        try:
            return self._by_id[program_id]
        except KeyError:
            raise NotFound(f"program {program_id} is not compiled on this worker (it may have restarted)") from None

    def get(self, program_id: int) -> Program:
        """The compiled program; NotFound if it is unknown or still compiling."""
        record = self.record(program_id)
        if record.error is not None:
            raise record.error
        if record.value is None:
            raise NotFound(f"program {program_id} is still compiling on this worker")
        return record.value

    def forget(self, program_id: int) -> Program | None:
        """Drops a program no one runs any more; work still waiting for its compile fails instead of waiting forever.

        Returns the program if no other id names it (the compile cache may let it go: ``CompileCache.evict``).
        """
        record = self._by_id.pop(program_id, None)
        if record is not None and not record.ready:
            record.fail(NotFound(f"program {program_id} was dropped before its compile finished"))
        program = record.value if record is not None else None
        if program is not None and all(r.value is not program for r in self._by_id.values()):
            return program
        return None


class CompileCache:
    """Programs by content (their StableHLO, options and devices), for the pool's compiles.

    Used only off the loop: its lock is shared by pool threads alone.
    """

    def __init__(self, runtime: LocalRuntime) -> None:
        self.runtime = runtime
        self._by_content: dict[tuple, Program] = {}
        self._lock = threading.Lock()

    def compile(self, stablehlo: bytes, options: bytes, device_ids: tuple[int, ...]) -> Program:
        """The program, compiled now or earlier (blocks: a pool thread)."""
        key = (hashlib.sha256(stablehlo).digest(), hashlib.sha256(options).digest(), device_ids)
        with self._lock:
            program = self._by_content.get(key)
        if program is not None:
            return program
        program = self.runtime.compile(stablehlo, options, device_ids)
        with self._lock:
            return self._by_content.setdefault(key, program)

    def evict(self, program: Program) -> None:
        """Lets ``program`` go (a pool thread): no id names it any more."""
        with self._lock:
            for key, cached in list(self._by_content.items()):
                if cached is program:
                    del self._by_content[key]

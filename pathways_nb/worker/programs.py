"""A worker's compiled programs, by the ids the proxy gives them, shared by all its sessions.

Compiles are cached by content, so a second proxy (or a proxy restarted)
compiling the same program for the same devices gets it at once. A program
is known from the moment its ``Compile`` command is read: commands after it
on the same stream (an ``Execute`` the proxy sent without waiting for the
compile) are chained onto it as onto an array still arriving.
"""

from __future__ import annotations

import hashlib
import threading

from pathways_nb.core.convert import program_to_proto
from pathways_nb.core.dataflow import ArrayRecord
from pathways_nb.protocol.errors import NotFound, as_request_error
from pathways_nb.rpc import cluster_pb2 as pb
from pathways_nb.worker.runtime import LocalRuntime, Program


class Programs:
    def __init__(self, runtime: LocalRuntime):
        self.runtime = runtime
        # By id: a record whose value is the compiled Program (or whose error is the compile's).
        self._by_id: dict[int, ArrayRecord] = {}
        self._by_content: dict[tuple, Program] = {}
        self._lock = threading.Lock()

    def expect(self, program_id: int) -> None:
        """Notes a compile of ``program_id`` on its way (in stream order, before it runs).

        The same id may come on several streams (sessions that first ran the program at once);
        the first compile that finishes gives it to all.
        """
        with self._lock:
            self._entry(program_id)

    def _entry(self, program_id: int) -> ArrayRecord:
        record = self._by_id.get(program_id)
        if record is None or record.error is not None:
            record = self._by_id[program_id] = ArrayRecord(0, (), None)
        return record

    def compile(
        self, program_id: int, stablehlo: bytes, options: bytes, device_ids: tuple[int, ...]
    ) -> pb.CompiledProgram:
        key = (hashlib.sha256(stablehlo).digest(), hashlib.sha256(options).digest(), device_ids)
        with self._lock:
            program = self._by_content.get(key)
            record = self._entry(program_id)
        if program is None:
            try:
                program = self.runtime.compile(stablehlo, options, device_ids)
            except Exception as error:
                if not record.ready:
                    record.fail(as_request_error(error))
                raise
        with self._lock:
            program = self._by_content.setdefault(key, program)
        if not record.ready:
            record.set(program)
        return program_to_proto(program)

    def record(self, program_id: int) -> ArrayRecord:
        """The program as a record: its value now, or once its compile (already on its way) is done."""
        with self._lock:
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

    def forget(self, program_id: int) -> None:
        """Drops a program no one runs any more; work still waiting for its compile fails instead of waiting forever."""
        with self._lock:
            record = self._by_id.pop(program_id, None)
            if record is not None and not record.ready:
                record.fail(NotFound(f"program {program_id} was dropped before its compile finished"))
            program = record.value if record is not None else None
            if program is not None and all(r.value is not program for r in self._by_id.values()):
                for key, cached in list(self._by_content.items()):
                    if cached is program:
                        del self._by_content[key]

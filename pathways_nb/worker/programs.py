"""A worker's compiled programs, by the ids the proxy gives them, shared by all its sessions.

Compiles are cached by content, so a second proxy (or a proxy restarted)
compiling the same program for the same devices gets it at once.
"""

from __future__ import annotations

import hashlib
import threading

from pathways_nb.protocol.errors import NotFound
from pathways_nb.rpc import cluster_pb2 as pb
from pathways_nb.rpc.convert import program_to_proto
from pathways_nb.worker.runtime import LocalRuntime, Program


class Programs:
    def __init__(self, runtime: LocalRuntime):
        self.runtime = runtime
        self._by_id: dict[int, Program] = {}
        self._by_content: dict[tuple, Program] = {}
        self._lock = threading.Lock()

    def compile(
        self, program_id: int, stablehlo: bytes, options: bytes, device_ids: tuple[int, ...]
    ) -> pb.CompiledProgram:
        key = (hashlib.sha256(stablehlo).digest(), hashlib.sha256(options).digest(), device_ids)
        with self._lock:
            program = self._by_content.get(key)
        if program is None:
            program = self.runtime.compile(stablehlo, options, device_ids)
        with self._lock:
            self._by_content.setdefault(key, program)
            self._by_id[program_id] = program
        return program_to_proto(program)

    def get(self, program_id: int) -> Program:
        with self._lock:
            try:
                return self._by_id[program_id]
            except KeyError:
                raise NotFound(f"program {program_id} is not compiled on this worker (it may have restarted)") from None

    def forget(self, program_id: int) -> None:
        with self._lock:
            program = self._by_id.pop(program_id, None)
            if program is not None and program not in self._by_id.values():
                for key, cached in list(self._by_content.items()):
                    if cached is program:
                        del self._by_content[key]

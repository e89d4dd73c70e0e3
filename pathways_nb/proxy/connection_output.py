"""What a client connection's code beside the devices wrote, held by the proxy for that connection alone.

Workers send their sessions' output with their replies (``ReplyBatch.output``: colocated Python's lines,
bounded on each host, and the workers' own lines about the session's programs). The proxy stamps each
line with its island and host, numbers it, and keeps the connection's latest ones
(``tuning.OUTPUT_HISTORY_LINES``): the observe API hands them to the client that made the
calls, and to nobody else. A connection is named by its tenant and the per-connection secret its
session options carried (``pathways_nb.connect`` makes one); a session without a secret (a stock
client) has no connection output: nobody could read it. The connection's current context (the
notebook cell its calls come from, ``SwitchOutputContext``) is stamped on its colocated calls as the
proxy receives them, and comes back on their lines.

All of it lives on the proxy's event loop, which owns it: the worker links' readers add lines, sessions
open and release their connection's output, Executes read its context and the observe API reads its
lines, all there. Nothing else touches it, so it takes no lock.
"""

from __future__ import annotations

import collections
import hmac
from collections.abc import Callable, Sequence

from pathways_nb.core import colocated_output, tuning
from pathways_nb.rpc import cluster_pb2 as pb

# A context is a client's name for where its calls come from; longer ones are cut.
MAX_CONTEXT_CHARS = 200

# Where a session's output goes on the proxy: ``(island, host_index, lines)``.
HostLineSink = Callable[[int, int, Sequence[pb.OutputLine]], None]


class ConnectionOutput:
    """One connection's latest lines, numbered in the order the proxy received them, and its current context."""

    def __init__(
        self,
        tenant: str,
        secret: bytes,
        history_lines: int | None = None,
        history_bytes: int | None = None,
    ):
        self.tenant = tenant
        self.secret = secret
        self.context = ""
        self.sessions = 0  # open sessions of the connection (it is forgotten when none is left)
        self._history_lines = tuning.OUTPUT_HISTORY_LINES.value if history_lines is None else history_lines
        self._history_bytes = tuning.OUTPUT_HISTORY_BYTES.value if history_bytes is None else history_bytes
        self._lines: collections.deque[pb.OutputLine] = collections.deque()
        self._bytes = 0
        self._worker_lines: collections.deque[pb.OutputLine] = collections.deque(
            maxlen=tuning.OUTPUT_WORKER_HISTORY_LINES.value
        )
        self._sequence = 0

    @property
    def latest(self) -> int:
        """The number of the latest line of its code beside the devices (0: none yet)."""
        return self._sequence

    @property
    def closed(self) -> bool:
        return self.sessions <= 0

    def switch(self, context: str) -> None:
        """The context of the connection's calls from now on."""
        self.context = context[:MAX_CONTEXT_CHARS]

    def add(self, island: int, host_index: int, lines: Sequence[pb.OutputLine]) -> None:
        """Lines a worker (of ``island``, ``host_index``) sent for one of the connection's sessions."""
        for line in lines:
            line.island, line.host_index = island, host_index
            if line.stream == colocated_output.WORKER:
                self._worker_lines.append(line)
                continue
            self._sequence += 1
            line.sequence = self._sequence
            self._lines.append(line)
            self._bytes += len(line.text)
        while self._lines and (len(self._lines) > self._history_lines or self._bytes > self._history_bytes):
            self._bytes -= len(self._lines.popleft().text)

    def after(self, sequence: int) -> pb.OutputLines:
        """The lines after number ``sequence`` that it still holds (the latest line always)."""
        lines = [line for line in self._lines if line.sequence > sequence]
        return pb.OutputLines(lines=lines, latest=self._sequence)

    def worker_lines(self) -> pb.OutputLines:
        """The workers' latest lines about the connection's programs."""
        return pb.OutputLines(lines=list(self._worker_lines), latest=self._sequence)


class ConnectionOutputs:
    """The proxy's connections with output, by tenant and secret."""

    def __init__(self) -> None:
        self._outputs: list[ConnectionOutput] = []

    def open(self, tenant: str, secret: bytes) -> ConnectionOutput | None:
        """The output of the connection a new session belongs to (None for a session that sent no secret)."""
        if not secret:
            return None
        output = self._find(tenant, secret)
        if output is None:
            output = ConnectionOutput(tenant, secret)
            self._outputs.append(output)
        output.sessions += 1
        return output

    def release(self, output: ConnectionOutput) -> None:
        """One of its sessions ended; the last one's end forgets its output."""
        output.sessions -= 1
        if output.closed and output in self._outputs:
            self._outputs.remove(output)

    def find(self, tenant: str, secret: bytes) -> ConnectionOutput | None:
        """The output of the connection that ``tenant`` and ``secret`` name (None: no such connection here)."""
        if not tenant or not secret:
            return None
        return self._find(tenant, secret)

    def _find(self, tenant: str, secret: bytes) -> ConnectionOutput | None:
        for output in self._outputs:
            if output.tenant == tenant and hmac.compare_digest(output.secret, secret):
                return output
        return None

"""What an executor writes, as its host reads it: bounded, counted, and sent on to its worker in batches.

The host reads three pipes of each executor as fast as they fill (a pipe left full would stall the
tenant's code): its stdout and stderr, where anything may write (C libraries, processes it starts,
``os.write``), and its records pipe, where its Python writes lines and logging records tagged with
their calls (``pathways_nb.colocated.executor.output``). Nothing goes to disk. Lines within the session's budget
(``core.colocated_output``: the same the executor keeps, enforced here) wait for the worker, at most
``tuning.OUTPUT_HOST_BUFFER_LINES`` of them; the others are counted per call and reported, as one line, when that
call ends or every ``tuning.OUTPUT_DROP_REPORT_INTERVAL_S``. The last lines, whatever the budget, stay for the
report of an executor that fails to start or dies (``tail``). Lines of the executor's own stdout and
stderr belong to its latest call.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import time
from collections.abc import AsyncIterator

from pathways_nb.core import colocated_output, tuning
from pathways_nb.core.colocated_output import LineBudget
from pathways_nb.rpc import cluster_pb2 as pb

_LOGGER = logging.getLogger(__name__)

_READ_BYTES = 1 << 16
_RAW = {colocated_output.STDOUT, colocated_output.STDERR}


class ExecutorOutput:
    """One executor's output on its host (see the module's docstring); lives on the host's event loop."""

    def __init__(self, budget: LineBudget | None = None, buffer_lines: int | None = None):
        self._budget = budget or LineBudget()
        self._buffer_lines = tuning.OUTPUT_HOST_BUFFER_LINES.value if buffer_lines is None else buffer_lines
        self._tail: collections.deque[tuple[str, bytes]] = collections.deque(
            maxlen=tuning.EXECUTOR_LOG_TAIL_LINES.value
        )
        self._pending: list[pb.OutputLine] = []
        self._calls_done: list[int] = []
        # Lines dropped, per (call, context), with why, and since when the oldest count waits to be reported.
        self._dropped: dict[tuple[str, str], tuple[int, str]] = {}
        self._dropped_since = 0.0
        self._call = ("", "")  # (name, context) of the executor's latest call
        self._changed = asyncio.Event()
        self._readers: list[asyncio.Task] = []
        self._pipes: list[asyncio.BaseTransport] = []

    async def read(self, stdout: int, stderr: int, records: int) -> None:
        """Starts reading the executor's stdout, stderr and records pipe (the read ends: closed here in the end,
        even if a process the executor started still holds the other end)."""
        loop = asyncio.get_running_loop()
        for descriptor, stream in ((stdout, colocated_output.STDOUT), (stderr, colocated_output.STDERR), (records, "")):
            reader = asyncio.StreamReader()
            pipe, _ = await loop.connect_read_pipe(
                lambda reader=reader: asyncio.StreamReaderProtocol(reader), os.fdopen(descriptor, "rb", buffering=0)
            )
            self._pipes.append(pipe)
            self._readers.append(asyncio.ensure_future(self._read(reader, stream)))

    async def drained(self, timeout_s: float | None = None) -> None:
        """Waits (bounded) until the pipes have ended, then stops reading them."""
        if self._readers:
            await asyncio.wait(
                self._readers, timeout=tuning.OUTPUT_DRAIN_WAIT_S.value if timeout_s is None else timeout_s
            )
        self.close()

    def close(self) -> None:
        for reader in self._readers:
            reader.cancel()
        for pipe in self._pipes:
            pipe.close()

    async def _read(self, reader: asyncio.StreamReader, stream: str) -> None:
        """Reads one pipe to its end: ``stream`` stdout or stderr, or "" for the records pipe."""
        partial = b""
        while True:
            chunk = await reader.read(_READ_BYTES)
            if not chunk:
                break
            lines = (partial + chunk).split(b"\n")
            partial = lines.pop()
            while len(partial) > 4 * tuning.OUTPUT_MAX_LINE_CHARS.value:  # no newline in sight: cut it into lines
                lines.append(partial[: 4 * tuning.OUTPUT_MAX_LINE_CHARS.value])
                partial = partial[4 * tuning.OUTPUT_MAX_LINE_CHARS.value :]
            self._lines(stream, lines)
        if partial:
            self._lines(stream, [partial])

    def _lines(self, stream: str, lines: list[bytes]) -> None:
        self._tail.extend((stream, line) for line in lines[-tuning.EXECUTOR_LOG_TAIL_LINES.value :])
        if stream in _RAW:
            self._raw(stream, lines)
        else:
            for line in lines:
                self._record(line)
        if self._pending or self._calls_done or self._dropped:
            self._changed.set()

    def _raw(self, stream: str, lines: list[bytes]) -> None:
        """Lines written to the executor's stdout or stderr: its latest call's."""
        name, context = self._call
        now = time.time()
        taken = self._budget.take(len(lines))
        for line in lines[:taken]:
            text = colocated_output.cut(line.decode("utf-8", errors="replace"))
            self._keep(pb.OutputLine(stream=stream, text=text, call=name, context=context, time=now))
        self._drop((name, context), len(lines) - taken, self._why())

    def _record(self, line: bytes) -> None:
        """One line of the records pipe (text lines over the budget are counted unread)."""
        if line.startswith(colocated_output.LINE_PREFIX) and not self._budget.take():
            self._drop(self._call, 1, self._why())
            return
        record = colocated_output.read_record(line)
        if record is None:
            return
        try:
            if "stream" in record:
                self._keep(_output_line(record))
            elif "dropped" in record:
                self._drop((str(record["call"]), str(record["context"])), int(record["dropped"]), str(record["why"]))
            elif "began" in record:
                self._call = (str(record["call"]), str(record["context"]))
            elif "ended" in record:
                self._calls_done.append(int(record["ended"]))
        except (KeyError, TypeError, ValueError) as error:  # the tenant's process wrote it: nothing to trust
            _LOGGER.debug("an executor wrote a malformed record (%s): %r", error, line[:200])

    def _keep(self, line: pb.OutputLine) -> None:
        if line.stream not in (*_RAW, colocated_output.LOG):
            return
        if len(self._pending) >= self._buffer_lines:
            self._drop((line.call, line.context), 1, f"the host held {self._buffer_lines:,} lines for a busy worker")
            return
        self._pending.append(line)

    def _drop(self, call: tuple[str, str], lines: int, why: str) -> None:
        if lines <= 0:
            return
        if not self._dropped:
            self._dropped_since = time.monotonic()
        count, _ = self._dropped.get(call, (0, why))
        self._dropped[call] = (count + lines, why)

    def _why(self) -> str:
        return colocated_output.over_budget(self._budget.rate, self._budget.burst)

    def take(self, final: bool = False) -> pb.OutputBatch | None:
        """The lines ready for the worker (None: none), with the drop counts due (all of them if ``final``)."""
        waited = time.monotonic() - self._dropped_since
        due = final or self._calls_done or waited >= tuning.OUTPUT_DROP_REPORT_INTERVAL_S.value
        if not (self._pending or self._calls_done or (due and self._dropped)):
            return None
        batch = pb.OutputBatch(lines=self._pending, calls_done=self._calls_done)
        if due:
            for (name, context), (count, why) in self._dropped.items():
                batch.lines.add(stream=colocated_output.STDERR, call=name, context=context, dropped=count, text=why)
            self._dropped = {}
        self._pending, self._calls_done = [], []
        return batch

    async def batches(self, ended: asyncio.Future) -> AsyncIterator[pb.OutputBatch]:
        """Batches for the worker until the executor has ``ended`` and its pipes are drained."""
        while not ended.done():
            changed = asyncio.ensure_future(self._changed.wait())
            await asyncio.wait(
                [changed, ended],
                timeout=tuning.OUTPUT_DROP_REPORT_INTERVAL_S.value,
                return_when=asyncio.FIRST_COMPLETED,
            )
            changed.cancel()
            if not self._calls_done and not ended.done():
                await asyncio.sleep(tuning.OUTPUT_BATCH_DELAY_S.value)  # more lines may come: one message for them all
            self._changed.clear()  # (no await until ``take``: a line after it sets it again)
            batch = self.take()
            if batch is not None:
                yield batch
        await self.drained()
        batch = self.take(final=True)
        if batch is not None:
            yield batch

    def tail(self) -> str:
        """The executor's last lines (whatever the budget), as people read them."""
        lines = []
        for stream, line in self._tail:
            if stream in _RAW:
                lines.append(line.decode("utf-8", errors="replace"))
                continue
            record = colocated_output.read_record(line)
            if record is not None and "stream" in record:
                written = _output_line(record)
                lines.append(colocated_output.text_of(written.stream, written.text, written.level, written.logger))
        return "\n".join(lines)


def _output_line(record: dict) -> pb.OutputLine:
    """A text record of the records pipe as an ``OutputLine`` (its fields checked: the tenant's process wrote it)."""
    return pb.OutputLine(
        stream=str(record["stream"]),
        text=colocated_output.cut(str(record["text"])),
        level=int(record.get("level", 0)),
        logger=str(record.get("logger", ""))[:200],
        call=str(record["call"])[:200],
        context=str(record["context"])[:200],
        time=float(record["time"]),
    )

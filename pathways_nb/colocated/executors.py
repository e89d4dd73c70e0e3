"""The worker's side of colocated Python: one executor per session, asked of the host's supervisor.

The worker never runs a tenant's Python: it asks its host's ``ColocatedHost`` for an executor the
first time a session runs a colocated program, keeps that ``Executor`` call open for the
session's life (ending it stops the executor), and sends the session's calls to the executor one
at a time, in order. What the executor writes comes on the host's call, bounded by the host
(``colocated.host_output``); the worker hands it to the session's stream to the proxy, and answers
a call only once the call's output is on its way (the host says when it has all of it), so that a
client that waited for a call's results finds its output at the proxy. An executor that dies fails
the call it was running with what the host saw (signal or exit status, its last output); the next
call starts a new one. Nothing an executor does reaches the worker but its answers (parsed
messages), the host's batches of its output, and the files it names in its own directory, which the
worker reads without mapping them.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

from pathways_nb.colocated import arrays as colocated_arrays
from pathways_nb.core import tuning
from pathways_nb.core.convert import error_of
from pathways_nb.core.security import ClusterCredentials
from pathways_nb.protocol.errors import FailedPrecondition, InvalidRequest, RequestError, Unavailable
from pathways_nb.rpc import cluster_pb2 as pb
from pathways_nb.rpc import cluster_pb2_grpc

_LOGGER = logging.getLogger(__name__)

_MESSAGE_OPTIONS = [
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", tuning.EXECUTOR_MAX_ANSWER_BYTES.value),
]


class ExecutorDied(RequestError):
    """The session's executor ended during a call: the call fails, the next one starts a new executor.

    ABORTED, not DATA_LOSS: pathwaysutils' elastic mode would read DATA_LOSS as a slice that went down.
    """

    code = 10  # ABORTED


@dataclass(frozen=True)
class ResultShape:
    """What a result must be: dtype kind, global shape, and the shape of each of its shards."""

    kind: int
    shape: tuple[int, ...]
    shard_shape: tuple[int, ...]


@dataclass(frozen=True)
class ArrayShards:
    """One array for (or from) an executor: its dtype kind, global shape, and this host's shards by device."""

    kind: int
    shape: tuple[int, ...]
    shards: dict[int, np.ndarray]  # cluster id of a colocated CPU device -> its shard


@dataclass(eq=False)
class _Running:
    """A started executor: where it listens, and how it ended once the host says so."""

    events: grpc.Future  # the host's Executor call (a stream of events)
    started: pb.ExecutorStarted
    channel: grpc.Channel
    stub: cluster_pb2_grpc.ColocatedExecutorStub
    programs: set[bytes] = field(default_factory=set)  # digests of the programs it has loaded
    exit: pb.ExecutorExit | None = None
    ended: threading.Event = field(default_factory=threading.Event)
    # The latest call whose output the host has sent (OutputBatch.calls_done), and who waits for it.
    output_through: int = 0
    output_arrived: threading.Condition = field(default_factory=threading.Condition)

    @property
    def directory(self) -> Path:
        return Path(self.started.directory)


LineSink = Callable[[Sequence[pb.OutputLine]], None]


class SessionExecutor:
    """One session's executor on this host (``device_ids``: the cluster ids of the host's colocated CPU devices).

    What it writes goes to ``output`` (the session's stream to the proxy; None: nowhere).
    """

    def __init__(
        self,
        host: cluster_pb2_grpc.ColocatedHostStub,
        session: str,
        tenant: str,
        device_ids: Sequence[int],
        describe_host: str,
        output: LineSink | None,
    ):
        self._host = host
        self._request = pb.ExecutorRequest(session=session, tenant=tenant, device_ids=device_ids)
        self._describe_host = describe_host
        self._output = output
        self._lock = threading.Lock()  # one call at a time: the session's order
        self._running: _Running | None = None
        self._closed = False
        self._calls = itertools.count(1)

    def run(
        self,
        name: str,
        digest: bytes,
        text: bytes,
        args: Sequence[ArrayShards],
        results: Sequence[ResultShape],
        client: dict[str, str],
        context: str = "",
    ) -> list[ArrayShards]:
        """Runs one program on the executor (started if needed); its results, or a ``RequestError``.

        Each result is checked against ``results`` before its bytes are read. ``context``: the client's
        output context of the call, which tags what the call writes.
        """
        with self._lock:
            if self._closed:
                raise FailedPrecondition("the session ended: its colocated Python executor is gone")
            running = self._running or self._start()
            call = pb.ColocatedCall(
                name=name,
                program_digest=digest,
                program=b"" if digest in running.programs else text,
                client_python=client.get("python", ""),
                client_jax=client.get("jax", ""),
                client_cloudpickle=client.get("cloudpickle", ""),
                call=next(self._calls),
                context=context,
            )
            owner = running.started.uid
            for arg in args:
                message = call.args.add(dtype_kind=arg.kind, shape=arg.shape)
                for device_id, host in arg.shards.items():
                    message.shards.append(colocated_arrays.encode(device_id, host, running.directory, owner))
            try:
                result = running.stub.Run(call)
            except grpc.RpcError as error:
                raise self._lost(running, name, error) from None
            running.programs.add(digest)
            with running.output_arrived:
                running.output_arrived.wait_for(
                    lambda: running.output_through >= call.call or running.ended.is_set(),
                    tuning.OUTPUT_CALL_WAIT_S.value,
                )
            if result.HasField("error"):
                raise error_of(result.error)
            if len(result.results) != len(results):
                raise InvalidRequest(
                    f"{name} returned {len(result.results)} arrays, its output specs say {len(results)}"
                )
            return [
                self._decoded(output, expected, running.directory)
                for output, expected in zip(result.results, results, strict=True)
            ]

    @staticmethod
    def _decoded(output: pb.ColocatedArray, expected: ResultShape, directory: Path) -> ArrayShards:
        if output.dtype_kind != expected.kind or tuple(output.shape) != expected.shape:
            raise InvalidRequest(
                f"a result of kind {output.dtype_kind} {list(output.shape)}; the output spec says kind "
                f"{expected.kind} {list(expected.shape)}"
            )
        shards = {
            shard.device_id: colocated_arrays.decode(shard, expected.kind, directory, False, expected.shard_shape)
            for shard in output.shards
        }
        return ArrayShards(expected.kind, expected.shape, shards)

    def _start(self) -> _Running:
        try:
            events = self._host.Executor(self._request)
            first = next(events)
        except grpc.RpcError as error:
            raise Unavailable(
                f"the colocated Python host of {self._describe_host} could not start an executor: {error.details()}"
            ) from None
        if not first.HasField("started"):
            events.cancel()
            raise Unavailable(f"the colocated Python host of {self._describe_host} did not start an executor")
        channel = grpc.insecure_channel(first.started.address, options=_MESSAGE_OPTIONS)
        running = _Running(events, first.started, channel, cluster_pb2_grpc.ColocatedExecutorStub(channel))
        threading.Thread(
            target=self._follow, args=(running,), name=f"pathways-executor-{first.started.pid}", daemon=True
        ).start()
        self._running = running
        _LOGGER.info("session %s: colocated Python executor pid %d", self._request.session, first.started.pid)
        return running

    def _follow(self, running: _Running) -> None:
        """Reads the host's events until the call ends: its output, and an ``exited`` one says how the executor died."""
        try:
            for event in running.events:
                if event.HasField("output"):
                    self._arrived(running, event.output)
                elif event.HasField("exited"):
                    running.exit = event.exited
        except grpc.RpcError as error:  # the host ended the call: the executor is gone (its exit said how, if it could)
            _LOGGER.info("the executor's host ended its call: %s", error.code().name)
        with running.output_arrived:
            running.ended.set()
            running.output_arrived.notify_all()

    def _arrived(self, running: _Running, batch: pb.OutputBatch) -> None:
        """Hands a batch of the executor's output on; a call it completes may then be answered."""
        if batch.lines and self._output is not None:
            try:
                self._output(list(batch.lines))
            except Exception:  # (a session stream that just closed): the executor's later events still count
                _LOGGER.exception("session %s: the executor's output could not be handed on", self._request.session)
        if batch.calls_done:
            with running.output_arrived:
                running.output_through = max(running.output_through, *batch.calls_done)
                running.output_arrived.notify_all()

    def _lost(self, running: _Running, name: str, error: grpc.RpcError) -> RequestError:
        """The error for a call whose executor stopped answering; the next call starts a new executor."""
        running.ended.wait(tuning.EXECUTOR_EXIT_REPORT_WAIT_S.value)
        self._end(running)
        if running.exit is None:
            how = f"stopped answering ({error.code().name}: {error.details()})"
            tail = ""
        else:
            how, tail = running.exit.description, running.exit.log_tail
        return ExecutorDied(
            f"the colocated Python executor of this session on {self._describe_host} {how} while running {name}; "
            "its objects and globals are gone, and the next call starts a new executor"
            + (f". Its last output:\n{tail}" if tail else "")
        )

    def _end(self, running: _Running) -> None:
        running.events.cancel()
        running.channel.close()
        if self._running is running:
            self._running = None

    def close(self) -> None:
        """Stops the executor (the host ends it when its call ends); later calls are refused."""
        self._closed = True
        running = self._running
        if running is not None:
            self._end(running)


class ColocatedHostLink:
    """The worker's channel to its host's ``ColocatedHost`` (``unix:PATH``), and its sessions' executors."""

    def __init__(self, address: str, credentials: ClusterCredentials, describe_host: str):
        self.address = address
        self._channel = credentials.channel(address)
        self._stub = cluster_pb2_grpc.ColocatedHostStub(self._channel)
        self._describe_host = describe_host
        # The sessions' executors: the pool threads that run calls make them, and a session's end stops its
        # executor on this link's own thread (the worker's loop hands it over), so the loop never takes the lock.
        self._lock = threading.Lock()
        self._executors: dict[str, SessionExecutor] = {}
        self._ends = ThreadPoolExecutor(1, thread_name_prefix="pathways-executor-ends")

    def executor(
        self, session: str, tenant: str, device_ids: Sequence[int], output: LineSink | None = None
    ) -> SessionExecutor:
        """The session's executor (made on first use; started at its first call), writing to ``output``."""
        with self._lock:
            executor = self._executors.get(session)
            if executor is None:
                executor = self._executors[session] = SessionExecutor(
                    self._stub, session, tenant, device_ids, self._describe_host, output
                )
            return executor

    def end_session(self, session: str) -> None:
        """The session ended (the worker's loop says so): its executor stops, on this link's thread."""
        self._ends.submit(self._end_session, session)

    def _end_session(self, session: str) -> None:
        with self._lock:
            executor = self._executors.pop(session, None)
        if executor is not None:
            executor.close()

    def close(self) -> None:
        self._ends.shutdown(wait=True)  # (the sessions' ends first: none is left to a thread that is gone)
        with self._lock:
            executors, self._executors = list(self._executors.values()), {}
        for executor in executors:
            executor.close()
        self._channel.close()

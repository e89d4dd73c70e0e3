"""Harnesses for testing pathways-nb and code built on it: servers in subprocesses, a raw wire client.

``proxy_process()`` starts ``pathways-nb proxy`` on a free port and stops it
(and checks it is gone) afterwards. ``WireSession`` speaks the IFRT proxy
protocol directly, request by request, for tests that must send what the
stock client never would (unknown handles, malformed bytes, half uploads),
and for many sessions from one process (``benchmarks/sessions.py``), which
the stock client, one session per process, cannot open. ``python_script()``
runs a client in a process of its own, and ``wait_until()`` is how a test
waits for anything: for a condition, with a deadline, never for a fixed time.
"""

from __future__ import annotations

import contextlib
import functools
import os
import queue
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable, Collection, Iterable, Iterator
from typing import TypeVar

import grpc

from pathways_nb.core.exit_status import exit_description
from pathways_nb.core.wait import wait_until  # (the one wait: library code waits with it too)
from pathways_nb.launch.processes import ChildServer
from pathways_nb.protocol import schema
from pathways_nb.testing import stall_guard
from pathways_nb.testing.wire_requests import (  # noqa: F401 - SESSION_METADATA_KEY, STORE_METADATA_KEY: for tests
    SERVICE,
    SESSION_METADATA_KEY,
    STORE_METADATA_KEY,
    WireRequests,
    expect_reply,
    read_status_checked,
)

T = TypeVar("T")


@contextlib.contextmanager
def proxy_process(devices: int = 4, *extra_args: str, startup_timeout_s: float = 60.0) -> Iterator[ChildServer]:
    """Runs ``pathways-nb proxy`` on a free port for the duration of the block."""
    server = ChildServer("proxy", ["proxy", "--server_port", "0", "--devices", str(devices), *extra_args])
    try:
        server.start(startup_timeout_s)
        stall_guard.watch_server(server, f"pathways-nb proxy at {server.address}")
        yield server
    finally:
        stall_guard.stopping(server)
        server.close()


class WireSession(WireRequests):
    """One IFRT proxy session driven by hand: send requests, read replies by op id."""

    def __init__(self, address: str, protocol_version: int = 25, serdes_version: int = 0):
        super().__init__(protocol_version, serdes_version)
        self.channel = grpc.insecure_channel(address.removeprefix("grpc://"))
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        stream = self.stub(self.channel, "IfrtSession")
        self._responses = stream(iter(self._requests.get, None), metadata=self.session_metadata())
        self.init_response = self.call("init_request", self.messages.proxy.InitRequest()).init_response
        self.session_id = self.init_response.session_id

    def send_raw(self, data: bytes) -> None:
        """Puts arbitrary bytes on the stream as one message."""
        self._requests.put(data)

    def send(self, kind: str, body) -> int:
        op_id, data = self.request(kind, body)
        self._requests.put(data)
        return op_id

    def receive(self):
        """The next reply on the stream (in the server's order)."""
        return next(self._responses)

    def call(self, kind: str, body):
        """Sends one request and returns its reply (other replies must not be outstanding)."""
        op_id = self.send(kind, body)
        return expect_reply(self.receive(), op_id)

    def store_host_buffer(self, handle: int, data: bytes, declared_size: int | None = None) -> None:
        """Uploads ``data`` under ``handle`` (``HostBufferStore``), in 1 MiB chunks."""
        store = self.stub(self.channel, "HostBufferStore")
        size = len(data) if declared_size is None else declared_size
        store(iter(self.store_chunks(data)), metadata=self.store_metadata(handle, size))

    def lookup_host_buffer(self, handle: int) -> bytes:
        lookup = self.stub(self.channel, "HostBufferLookup")
        return b"".join(chunk.data for chunk in lookup(self.lookup_request(handle)))

    def delete_host_buffer(self, handle: int) -> None:
        delete = self.stub(self.channel, "HostBufferDelete")
        delete(self.delete_request(handle))

    # -- arrays and programs, as the stock client asks for them ----------------------------

    def make_array(self, handle: int, value, device: int) -> None:
        """Uploads ``value`` (a numpy array) and makes it array ``handle`` on ``device`` (the host buffer
        gets the same handle)."""
        self.store_host_buffer(handle, value.tobytes())
        self.call("make_array_from_host_buffer_request", self.value_request(handle, value, device))

    def read_array(self, array_handle: int, host_handle: int) -> bytes:
        """The bytes of an array, through host buffer ``host_handle`` (deleted afterwards)."""
        response = self.call("copy_to_host_buffer_request", self.copy_request(array_handle, host_handle))
        read_status_checked(response, array_handle)
        data = self.lookup_host_buffer(host_handle)
        self.delete_host_buffer(host_handle)
        return data

    def compile(self, program: tuple[bytes, bytes]):
        """The CompileResponse for ``program`` (from ``lowered_program``)."""
        return self.call("compile_request", self.compile_request(program))

    def execute(self, executable: int, args: list[int], results: list[int]):
        return self.call("loaded_executable_execute_request", self.execute_request(executable, args, results))

    def destruct(self, handles: list[int]) -> None:
        """Forgets arrays, as the client does when it drops them."""
        self.call("destruct_array_request", self.destruct_request(handles))

    def close(self) -> None:
        self._requests.put(None)
        self.channel.close()

    def __enter__(self) -> WireSession:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def open_sessions(address: str, token: str | None = None) -> set[int]:
    """The ids of the sessions the proxy at ``address`` holds now."""
    from pathways_nb.client.observe import Observer

    observer = Observer(address, token=token)
    try:
        return {session.session_id for session in observer.state().sessions}
    finally:
        observer.close()


def long_callback_stalls(stats: Iterable, longer_than_s: float = 0.5, since: float = 0.0) -> dict[str, list[tuple]]:
    """The times a server's loop ran one callback for more than ``longer_than_s`` (what the loop discipline
    forbids), that ended after ``since`` (``time.time()``), by process: each (seconds, its innermost frames).

    ``stats``: ``pb.LoopStats`` as ``LocalCluster.loop_stats()`` or ``local_cluster.loop_stats`` read them. Stalls
    outside callbacks (the loop's thread waiting for a CPU on a loaded machine) are not the servers' doing.
    """
    found: dict[str, list[tuple]] = {}
    for process, stall in stall_guard.callback_stalls(stats, longer_than_s, since):
        found.setdefault(process, []).append((round(stall.seconds, 2), stall.where.splitlines()[-2:]))
    return found


def wait_until_sessions_end(
    address: str, token: str | None = None, besides: Collection[int] = (), timeout_s: float = 60.0
) -> None:
    """Polls the proxy until only the sessions ``besides`` are left (and, if none is, no allocation).

    A client that disconnected or died is ended by the proxy a moment later: what the servers hold
    is measured after that, not after a fixed time. ``TimeoutError`` after ``timeout_s``.
    """
    from pathways_nb.client.observe import Observer

    observer = Observer(address, token=token)

    def open_sessions_and_allocations() -> tuple[list[int], list[str]]:
        state = observer.state()
        left = [s.session_id for s in state.sessions if s.session_id not in besides]
        return left, [allocation.tenant for allocation in state.allocations]

    try:
        wait_until(
            open_sessions_and_allocations,
            timeout_s,
            f"only the sessions {sorted(besides)} left (and, with none, no allocation)",
            holds=lambda seen: not seen[0] and (besides or not seen[1]),
            interval_s=0.1,
        )
    finally:
        observer.close()


@functools.cache
def other_users_python() -> str | None:
    """A Python of this one's version with which users other than this one can run an executor of this
    installation, where this process is root; None where there is none.

    Colocated Python executors run as users of their own only with such an interpreter, and only where
    they can read this installation too (a venv under ``/root``, or a clone in a directory of mode 0700,
    is closed to them): the host's own probe decides. Tests pass it as ``colocated_python_executable``
    and expect tenants kept apart exactly when it is not None.
    """
    from pathways_nb.colocated.host import choose_policy

    candidate = f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"
    if os.geteuid() != 0 or not os.access(candidate, os.X_OK):
        return None
    return candidate if choose_policy(candidate).separate_users else None


def lowered_program(function, example, device_ids: list[int]) -> tuple[bytes, bytes]:
    """``function`` lowered for arguments like ``example`` on ``device_ids``, as the stock client sends it
    in a CompileRequest: (the portable StableHLO artifact, the serialized XlaCompileOptions)."""
    import jax
    import numpy as np
    from jax._src.interpreters import mlir
    from jax._src.lib import xla_client
    from jaxlib.mlir.dialects import stablehlo

    lowered = jax.jit(function).lower(jax.ShapeDtypeStruct(example.shape, example.dtype))
    with mlir.make_ir_context():
        module = lowered.compiler_ir("stablehlo")
        artifact = stablehlo.serialize_portable_artifact(module, stablehlo.get_current_version())
    options = xla_client.CompileOptions()
    options.device_assignment = xla_client.DeviceAssignment.create(np.array([device_ids]))
    xla_options = schema.load().ifrt.XlaCompileOptionsProto()
    xla_options.compile_options.ParseFromString(options.SerializeAsString())
    return artifact, xla_options.SerializeToString()


def python_script(path: str | os.PathLike, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``python path args...`` with text pipes, and without this process's JAX settings (``env`` adds
    variables); a fatal signal (SIGABRT from ``finish``, a crash) makes it print every thread's stack first.

    The tests' clients are scripts of their own under ``tests/clients/`` (checked by ruff as any code is),
    which take what they need as arguments and print what the test checks.
    """
    return _python([os.fspath(path), *args], env)


def python_process(code: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``python -c code args...``, as ``python_script`` runs a file (the benchmarks' clients
    are strings still)."""
    return _python(["-c", textwrap.dedent(code), *args], env)


def _python(arguments: list[str], env: dict[str, str] | None) -> subprocess.Popen:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    environment["PYTHONFAULTHANDLER"] = "1"
    environment.update(env or {})
    return subprocess.Popen(
        [sys.executable, *arguments],
        env=environment,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(process: subprocess.Popen, timeout_s: float = 180.0) -> tuple:
    """``process.communicate()`` within ``timeout_s``; past it, the process is aborted and the error shows
    the end of its stderr (what a hung client was doing is the first thing to know: a ``python_script``
    prints every thread's stack on SIGABRT)."""
    try:
        return process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGABRT)
        try:
            _out, err = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # it handles SIGABRT and lives on
            process.kill()
            _out, err = process.communicate()
        err = err.decode(errors="replace") if isinstance(err, bytes) else (err or "")
        raise TimeoutError(
            f"the process did not finish within {timeout_s:g} s; the end of its stderr:\n{err[-8000:]}"
        ) from None


def finished_ok(process: subprocess.Popen, timeout_s: float = 180.0) -> str:
    """``finish``, then its standard output; an error with its output if it did not exit with status 0."""
    out, err = finish(process, timeout_s)
    if process.returncode != 0:
        raise AssertionError(f"the process {exit_description(process.returncode)}:\n{out}\n{err[-4000:]}")
    return out


class KernelSession:
    """A real Jupyter kernel driven through jupyter_client: run code, collect what it shows.

    ``run()`` returns the cell's outputs: stream text, display data, errors,
    and the state of every widget the cell opened (by model id), and the cell's
    message id (``msg_id``). Stream output that comes for a cell after it ran
    (a thread it started printing, as a notebook shows under that cell) is in
    ``late[msg_id]``; ``wait_for_late`` reads the kernel's output until a
    condition on it holds.
    """

    def __init__(self, kernel_name: str = "pathways", env: dict[str, str] | None = None):
        import jupyter_client

        environment = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
        environment.update(env or {})
        self.manager, self.client = jupyter_client.manager.start_new_kernel(kernel_name=kernel_name, env=environment)
        self.widgets: dict[str, dict] = {}
        self.late: dict[str, dict[str, str]] = {}

    def run(self, code: str, timeout_s: float = 180.0) -> dict:
        message_id = self.client.execute(code)
        result = {"stdout": "", "stderr": "", "data": [], "errors": [], "widgets": [], "msg_id": message_id}
        while True:
            message = self.client.get_iopub_msg(timeout=timeout_s)
            content = message["content"]
            kind = message["msg_type"]
            if kind == "comm_open":
                self.widgets[content["comm_id"]] = content["data"].get("state", {})
            elif kind == "comm_msg" and content["data"].get("method") == "update":
                self.widgets.setdefault(content["comm_id"], {}).update(content["data"].get("state", {}))
            if message["parent_header"].get("msg_id") != message_id:
                self._keep_late(message)
                continue
            if kind == "status" and content["execution_state"] == "idle":
                return result
            if kind == "stream":
                result[content["name"]] += content["text"]
            elif kind in ("display_data", "execute_result"):
                result["data"].append(content["data"])
                model = content["data"].get("application/vnd.jupyter.widget-view+json", {}).get("model_id")
                if model:
                    result["widgets"].append(model)
            elif kind == "error":
                result["errors"].append(f"{content['ename']}: {content['evalue']}")

    def _keep_late(self, message: dict) -> None:
        if message["msg_type"] == "stream":
            late = self.late.setdefault(message["parent_header"].get("msg_id", ""), {"stdout": "", "stderr": ""})
            late[message["content"]["name"]] += message["content"]["text"]

    def wait_for_late(self, message_id: str, condition: Callable[[dict], object], timeout_s: float = 60.0) -> dict:
        """Reads the kernel's output (while no cell runs) until ``condition(late output of message_id)`` holds;
        returns that output (``{"stdout": ..., "stderr": ...}``)."""
        import queue

        def late_output() -> dict:
            with contextlib.suppress(queue.Empty):
                while True:  # what has come by now
                    self._keep_late(self.client.get_iopub_msg(timeout=0))
            return self.late.get(message_id, {"stdout": "", "stderr": ""})

        return wait_until(late_output, timeout_s, f"the late output of cell {message_id}", holds=condition)

    def widget_state(self, model_id: str) -> dict:
        return self.widgets.get(model_id, {})

    def close(self) -> None:
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)

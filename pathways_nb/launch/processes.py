"""Launching pathways-nb servers as child processes and stopping them without leftovers.

Every server command (``pathways-nb proxy``, the resource manager, workers)
accepts ``--port_file``: once it listens it writes its port there (``-``: it
prints ``PORT_ANNOUNCEMENT`` and the port on its output instead). ``ChildServer``
waits for that port (or the child's early death, with its log), and stops the
child with SIGTERM, then SIGKILL, decoding how it ended. A child can be started
again (``relaunch``) on the port it had, so that whoever knew its address finds
it there again; its log keeps every run's output.

A child runs on a ``Node``: this machine by default, or a node of a Slurm
allocation (``launch.slurm.SlurmNode``), where the process started here is
``srun`` and the server is a job step on that node. Such a server announces its
port on its output, which ``srun`` brings back into the log here: no file has to
be shared between the machines.
"""

from __future__ import annotations

import enum
import gc
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence

from pathways_nb.core.exit_status import exit_description
from pathways_nb.core.wait import wait_until
from pathways_nb.errors import PathwaysError

# Set for every child on this machine: the pid of the process that launched it. A child whose
# parent is gone (killed without a chance to stop it) stops itself.
PARENT_ENV = "PATHWAYS_PARENT_PID"
# What a server started with ``--port_file -`` prints, followed by its port, once it listens.
PORT_ANNOUNCEMENT = "pathways-nb listening on port "


def exit_with_parent(stop, interval_s: float = 1.0) -> None:
    """In a child server: calls ``stop()`` once the launching process has died."""
    parent = os.environ.get(PARENT_ENV)
    if not parent:
        return

    def watch() -> None:
        wait_until(lambda: os.getppid() != int(parent), None, "the launcher's end", interval_s=interval_s)
        stop()

    threading.Thread(target=watch, name="pathways-parent-watch", daemon=True).start()


def announce_port(port_file: str, port: int) -> None:
    """In a child server, once it listens: ``port`` into ``port_file``, or on its output if that is ``-``."""
    if port_file == "-":
        print(f"{PORT_ANNOUNCEMENT}{port}", flush=True)
        return
    with open(port_file, "w") as f:
        f.write(str(port))


def _noted_by_the_wakeup_fd(_signum: int, _frame) -> None:
    """SIGINT's and SIGTERM's handler: the interpreter has written the signal's number to the wakeup fd."""


class StopRequest:
    """What ends a server process, SIGINT or SIGTERM or its launcher's death, waited for on its main thread.

    A signal only puts its number on a pipe, through Python's wakeup fd, which the interpreter writes
    from whichever thread the kernel gave the signal to (a handler alone runs on the main thread only
    once it runs Python again, never while it sits in this pipe's ``read``). Stopping the server inside
    a handler could hang the process for good: the handler runs on the main thread wherever that thread
    was, maybe holding a lock the stop needs (logging's), and a second signal runs it again inside the
    first. Once the stop is under way, more signals are ignored (SIGKILL still ends a stop that hangs).
    Made on the main thread.
    """

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self.failure: str | None = None  # why the server itself asked to stop (``fail``), if it did
        self.listen()

    def listen(self) -> None:
        """Takes SIGINT and SIGTERM (again: JAX's distributed runtime puts its own SIGTERM handler in, its
        preemption notifier, which only notes the signal, so a host of an island lived on until SIGKILL)."""
        signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, _noted_by_the_wakeup_fd)

    def request(self) -> None:
        """Asks for the stop (from any thread)."""
        os.write(self._write, b"\0")

    def fail(self, reason: str) -> None:
        """Asks for the stop because the server cannot go on (from any thread); the process then exits with 1."""
        self.failure = reason
        os.write(self._write, b"\xff")

    def wait(self) -> str:
        """Blocks until a stop is asked for; says why. Later signals are ignored: the stop is under way."""
        (signum,) = os.read(self._read, 1)
        for ignored in (signal.SIGINT, signal.SIGTERM):
            signal.signal(ignored, signal.SIG_IGN)  # (else the exiting interpreter restores their default)
        if signum == 0xFF:
            return f"because it cannot go on: {self.failure}"
        return f"on {signal.Signals(signum).name}" if signum else "because its launcher exited"


def serve_until_stopped(server, message: str, started: float, port_file: str | None, stop=None) -> int:
    """In a server's process (``pathways-nb proxy``, ``worker``, ...): announces ``server``, started at
    ``started`` (``time.monotonic()``), and stops it on SIGINT/SIGTERM, when its launcher dies, or when it fails
    (``stop.fail``: then the process exits with 1); returns the exit status."""
    stop = stop or StopRequest()
    stop.listen()  # (the server's start may have joined a JAX distributed runtime, which takes SIGTERM)
    # What start-up made (jax, XLA's modules, the servers) lives as long as the process: a full collection
    # no longer walks it, on whichever thread, the event loop's included, happens to trigger one.
    gc.freeze()
    exit_with_parent(stop.request)
    print(f"{message} (started in {time.monotonic() - started:.1f} s)", flush=True)
    if port_file:
        announce_port(port_file, server.port)
    logging.getLogger("pathways_nb").info("stopping %s", stop.wait())
    server.stop()
    return 1 if stop.failure is not None else 0


# How every pathways-nb command logs (``cli.main``), and what in such a log reports an error: a record
# at ERROR or above, or a traceback that nothing logged (a thread's, or the process's own end).
LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
_ERROR_RECORD = re.compile(r"\d{4}-\d\d-\d\d [\d:,]+ \S+ (ERROR|CRITICAL) ")
_TRACEBACK = "Traceback (most recent call last):"
_TRACEBACK_BETWEEN = (_TRACEBACK, "During handling of the above exception", "The above exception was the direct cause")


class Status(enum.Enum):
    created = "created"
    starting = "starting"
    running = "running"
    closing = "closing"
    closed = "closed"
    failed = "failed"


class ServerStartError(PathwaysError):
    """A child server exited or stayed silent instead of serving."""


class Node:
    """A machine a launcher starts servers on: this one (the base class), or a node of a Slurm allocation.

    A launcher asks its node where a server listens and others reach it (``address``),
    how to run a command there (``command``), for a free port there, and how to say
    how what it started ended.
    """

    name = "this machine"
    address = "127.0.0.1"
    # The process a launcher starts here is the server itself (its pid is the server's), it can
    # write files the launcher reads, and it stops when the launcher dies (PARENT_ENV). On a node
    # of a Slurm allocation, none of this holds: srun runs the server, and Slurm ends the step with it.
    local = True

    def command(self, name: str, command: Sequence[str]) -> list[str]:
        """The command that runs ``command`` (the server ``name``) on this node."""
        return list(command)

    def free_port(self) -> int:
        """A port nothing listens on at ``address`` now."""
        with socket.socket() as probe:
            probe.bind((self.address, 0))
            return probe.getsockname()[1]

    def describe_exit(self, returncode: int | None) -> str:
        """How a process started here ended, from its exit status: ``killed by signal SIGSEGV``."""
        return exit_description(returncode)

    def gone(self) -> str | None:
        """Why nothing can run here any more (a Slurm node: its job ended); None while it can."""
        return None


THIS_MACHINE = Node()


class ChildServer:
    """One ``pathways-nb`` server command running as a child process."""

    def __init__(
        self,
        name: str,
        arguments: Sequence[str],
        env: dict[str, str] | None = None,
        host: str | None = None,
        prefix: Sequence[str] = (),
        cwd: str | None = None,
        log_path: str | None = None,
        node: Node = THIS_MACHINE,
        directory: str | None = None,
    ):
        """``host``: where it listens (its ``address``; default the node's address); ``prefix``: runs it
        through a launcher, e.g. ``["ip", "netns", "exec", NAME]`` (one that execs, so the child's pid is
        the server's); ``cwd``: its working directory; ``log_path``: the file its output goes to, which
        outlives it (default: a file of its own, removed by ``close()``); ``node``: the machine it runs on;
        ``directory``: where its own directory (its port file) is made (default: the temporary directory)."""
        self.name = name
        self.arguments = list(arguments)
        self.env = env
        self.node = node
        self.host = host or node.address
        self.prefix = list(prefix)
        self.cwd = cwd
        self.status = Status.created
        self.port: int | None = None
        self.process: subprocess.Popen | None = None
        self._directory = tempfile.TemporaryDirectory(prefix=f"pathways-{name}-", dir=directory)
        self.log_path = log_path or os.path.join(self._directory.name, "log")

    @property
    def address(self) -> str:
        """``grpc://HOST:PORT``."""
        return f"grpc://{self.hostport}"

    @property
    def hostport(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self, timeout_s: float = 60.0) -> None:
        """Starts the child and waits until it listens; raises ``ServerStartError`` otherwise."""
        self.launch()
        self.wait_started(timeout_s)

    def launch(self, arguments: Sequence[str] | None = None) -> None:
        """Starts the child without waiting (start several, then ``wait_started`` each)."""
        if self.status in (Status.closing, Status.closed):
            raise ServerStartError(f"{self.name} is being stopped; it is not started again")
        self.status = Status.starting
        self._port_file = os.path.join(self._directory.name, "port") if self.node.local else "-"
        if self.node.local and os.path.exists(self._port_file):
            os.unlink(self._port_file)
        self._log_start = os.path.getsize(self.log_path) if os.path.exists(self.log_path) else 0
        server = [sys.executable, "-m", "pathways_nb.cli", *(arguments or self.arguments)]
        command = [*self.prefix, *self.node.command(self.name, [*server, "--port_file", self._port_file])]
        env = dict(self.env if self.env is not None else os.environ)
        env.pop(PARENT_ENV, None)
        if self.node.local:
            env[PARENT_ENV] = str(os.getpid())
        with open(self.log_path, "a") as log:
            # A new process session: Ctrl-C in a terminal reaches only us, and we stop the children.
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=self.cwd
            )

    def wait_started(self, timeout_s: float = 60.0) -> None:
        self.port = wait_until(
            self._port_once_started,
            timeout_s,
            f"{self.name} started",
            holds=lambda port: port is not None,
            interval_s=0.02,
            timeout_error=lambda _port: self._start_timed_out(timeout_s),
        )
        self.status = Status.running

    def _port_once_started(self) -> int | None:
        """The port the child announced, None while it starts; ``ServerStartError`` if it ended instead."""
        port = self._announced_port()
        if port is None and self.process.poll() is not None:
            self.status = Status.failed
            how = self.node.describe_exit(self.process.returncode)
            raise ServerStartError(f"{self.name} {how} while starting:\n{self.log()[-3000:]}")
        return port

    def _start_timed_out(self, timeout_s: float) -> ServerStartError:
        """Stops a child that did not start in time; the error that says so, with its output."""
        self.close()
        self.status = Status.failed
        return ServerStartError(f"{self.name} did not start within {timeout_s:g} s:\n{self.log()[-3000:]}")

    def _announced_port(self) -> int | None:
        """The port this run of the child listens on, once it has said so (in its port file, or its output)."""
        if self._port_file != "-":
            try:
                with open(self._port_file) as f:
                    text = f.read().strip()
            except FileNotFoundError:
                return None
            return int(text) if text else None
        with open(self.log_path, "rb") as log:
            log.seek(self._log_start)
            for line in log.read().decode(errors="replace").splitlines():
                if line.startswith(PORT_ANNOUNCEMENT):
                    return int(line.removeprefix(PORT_ANNOUNCEMENT))
        return None

    def relaunch(self, keep_port: bool) -> None:
        """Starts the child again after it ended (on the same port if ``keep_port``), without waiting."""
        arguments = list(self.arguments)
        if keep_port and self.port is not None and "--server_port" in arguments:
            arguments[arguments.index("--server_port") + 1] = str(self.port)
        self.launch(arguments)

    def log_tail(self, lines: int = 20) -> str:
        """The last ``lines`` lines the child (and its earlier runs) wrote."""
        return "\n".join(self.log().splitlines()[-lines:])

    def log(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def first_error(self, within_bytes: int | None = None) -> str | None:
        """The first error the child logged (in the first ``within_bytes`` of its log), if any: an ERROR or
        CRITICAL record, or the exception that a traceback nothing logged ends with."""
        try:
            with open(self.log_path, "rb") as f:
                text = f.read(-1 if within_bytes is None else within_bytes).decode(errors="replace")
        except OSError:
            return None
        in_traceback = False
        for line in text.splitlines():
            if in_traceback and not line[:1].isspace() and not line.startswith(_TRACEBACK_BETWEEN):
                return line.strip()
            if _ERROR_RECORD.match(line):
                return line.strip()
            in_traceback = in_traceback or line.startswith(_TRACEBACK)
        return None

    def log_size(self) -> int:
        try:
            return os.path.getsize(self.log_path)
        except OSError:
            return 0

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def close(self, timeout_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout_s``; idempotent."""
        if self.status is Status.closed:
            return
        self.status = Status.closing
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.status = Status.closed
        self._directory.cleanup()

    def __repr__(self) -> str:
        return f"<ChildServer {self.name} {self.status.value} port={self.port}>"

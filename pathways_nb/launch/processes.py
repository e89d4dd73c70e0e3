"""Launching pathways-nb servers as child processes and stopping them without leftovers.

Every server command (``pathways-nb proxy``, later the resource manager and
workers) accepts ``--port_file``: once it listens it writes its port there.
``ChildServer`` waits for that file (or the child's early death, with its log),
and stops the child with SIGTERM, then SIGKILL, decoding how it ended. A child
can be started again (``relaunch``) on the port it had, so that whoever knew its
address finds it there again; its log keeps every run's output.
"""

from __future__ import annotations

import enum
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence

from pathways_nb.core.exit_status import exit_description
from pathways_nb.errors import PathwaysError

# Set for every child: the pid of the process that launched it. A child whose
# parent is gone (killed without a chance to stop it) stops itself.
PARENT_ENV = "PATHWAYS_PARENT_PID"


def exit_with_parent(stop, interval_s: float = 1.0) -> None:
    """In a child server: calls ``stop()`` once the launching process has died."""
    parent = os.environ.get(PARENT_ENV)
    if not parent:
        return

    def watch() -> None:
        while True:
            time.sleep(interval_s)
            if os.getppid() != int(parent):
                stop()
                return

    threading.Thread(target=watch, name="pathways-parent-watch", daemon=True).start()


class StopRequest:
    """What ends a server process, SIGINT or SIGTERM or its launcher's death, waited for on its main thread.

    The signal handler only writes a byte to a pipe. Stopping the server inside the handler could
    hang the process for good: the handler runs on the main thread wherever that thread was, maybe
    holding a lock the stop needs (logging's), and a second signal runs it again inside the first.
    Once the stop is under way, more signals are ignored (SIGKILL still ends a stop that hangs).
    """

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        self.failure: str | None = None  # why the server itself asked to stop (``fail``), if it did
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, _frame) -> None:
        os.write(self._write, bytes([signum]))

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


class ChildServer:
    """One ``pathways-nb`` server command running as a child process."""

    def __init__(
        self,
        name: str,
        arguments: Sequence[str],
        env: dict[str, str] | None = None,
        host: str = "127.0.0.1",
        prefix: Sequence[str] = (),
        cwd: str | None = None,
        log_path: str | None = None,
    ):
        """``host``: where it listens (its ``address``); ``prefix``: runs it through a launcher, e.g.
        ``["ip", "netns", "exec", NAME]`` (one that execs, so the child's pid is the server's); ``cwd``: its
        working directory; ``log_path``: the file its output goes to, which outlives it (default: a file of
        its own, removed by ``close()``)."""
        self.name = name
        self.arguments = list(arguments)
        self.env = env
        self.host = host
        self.prefix = list(prefix)
        self.cwd = cwd
        self.status = Status.created
        self.port: int | None = None
        self.process: subprocess.Popen | None = None
        self._directory = tempfile.TemporaryDirectory(prefix=f"pathways-{name}-")
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
        self._port_file = os.path.join(self._directory.name, "port")
        if os.path.exists(self._port_file):
            os.unlink(self._port_file)
        command = [
            *self.prefix,
            sys.executable,
            "-m",
            "pathways_nb.cli",
            *(arguments or self.arguments),
            "--port_file",
            self._port_file,
        ]
        env = dict(self.env if self.env is not None else os.environ)
        env[PARENT_ENV] = str(os.getpid())
        with open(self.log_path, "a") as log:
            # A new process session: Ctrl-C in a terminal reaches only us, and we stop the children.
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=self.cwd
            )

    def wait_started(self, timeout_s: float = 60.0) -> None:
        port_file = self._port_file
        deadline = time.monotonic() + timeout_s
        while True:
            if os.path.exists(port_file):
                text = open(port_file).read().strip()
                if text:
                    self.port = int(text)
                    self.status = Status.running
                    return
            if self.process.poll() is not None:
                self.status = Status.failed
                raise ServerStartError(
                    f"{self.name} {exit_description(self.process.returncode)} while starting:\n{self.log()[-3000:]}"
                )
            if time.monotonic() > deadline:
                self.close()
                self.status = Status.failed
                raise ServerStartError(f"{self.name} did not start within {timeout_s:g} s:\n{self.log()[-3000:]}")
            time.sleep(0.02)

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

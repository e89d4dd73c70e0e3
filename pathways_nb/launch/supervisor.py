"""Keeping a local cluster's processes alive: notice a death at once, say why, start a new one.

One thread per supervised child waits on the process (no polling, so an idle
cluster costs no CPU): when it ends without having been asked to, the
supervisor records how (exit status or signal, and the tail of its output),
tells whoever listens (``on_exit``: the launcher reports a dead worker to the
resource manager, so its island is marked down with the cause at once), and
starts it again after a backoff that doubles while the child keeps dying
young. This is the role distributed's nanny plays, or Kubernetes' restart
policy in a pod.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from pathways_nb.core.retry import Backoff
from pathways_nb.launch.processes import ChildServer, ServerStartError, Status

_LOGGER = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChildExit:
    """One unexpected end of a supervised child."""

    name: str
    pid: int
    returncode: int
    description: str  # "killed by signal SIGSEGV", "exited with status 1" (and where, for a node elsewhere)
    when: float  # time.time()
    log_tail: str
    restart_in_s: float

    def __str__(self) -> str:
        return (
            f"{self.name} (pid {self.pid}) {self.description}; restarting in {self.restart_in_s:g} s. "
            f"Its last output:\n{self.log_tail}"
        )


# Restarts: the first soon, doubling up to 10 s while the child keeps dying within STABLE_S of its start.
RESTARTS = Backoff(first_s=0.1, max_s=10.0)
STABLE_S = 30.0


class Supervisor:
    """Restarts the children it watches when they die, until ``close()``."""

    def __init__(
        self,
        on_exit: Callable[[ChildServer, ChildExit], None] | None = None,
        backoff: Backoff | None = None,
        start_timeout_s: float = 60.0,
    ):
        self._on_exit = on_exit
        self.backoff = backoff or RESTARTS
        self.start_timeout_s = start_timeout_s
        self.exits: list[ChildExit] = []
        self._closed = threading.Event()
        self._threads: list[threading.Thread] = []

    def watch(self, child: ChildServer, keep_port: bool = False) -> None:
        """Supervises a running child; ``keep_port``: restart it on the port it has (others know its address)."""
        thread = threading.Thread(
            target=self._supervise, args=(child, keep_port), name=f"pathways-supervise-{child.name}", daemon=True
        )
        self._threads.append(thread)
        thread.start()

    def _supervise(self, child: ChildServer, keep_port: bool) -> None:
        delay: float | None = None
        while True:
            process = child.process
            started = time.monotonic()
            returncode = process.wait()
            if self._closed.is_set() or child.status in (Status.closing, Status.closed):
                return
            delay = self.backoff.after(None if time.monotonic() - started >= STABLE_S else delay)
            how = child.node.describe_exit(returncode)
            ended = ChildExit(child.name, process.pid, returncode, how, time.time(), child.log_tail(), delay)
            self.exits.append(ended)
            _LOGGER.warning("%s", ended)
            if self._on_exit is not None:
                try:
                    self._on_exit(child, ended)
                except Exception:
                    _LOGGER.exception("reporting the end of %s failed", child.name)
            if self._closed.wait(delay):
                return
            try:
                child.relaunch(keep_port)
                child.wait_started(self.start_timeout_s)
            except ServerStartError as error:
                if self._closed.is_set():
                    return
                _LOGGER.warning("restarting %s failed: %s", child.name, error)
                continue
            _LOGGER.warning("%s is back (pid %d)", child.name, child.process.pid)

    def close(self) -> None:
        """Stops restarting (call before stopping the children)."""
        self._closed.set()

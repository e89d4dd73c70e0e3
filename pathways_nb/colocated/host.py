"""The colocated Python executors of one host, started for its worker's sessions, never inside the worker.

``pathways-nb colocated-host`` runs beside each worker (``LocalCluster(colocated_python=True)``
and ``pathways-nb up --colocated_python`` start one per host; on Kubernetes it is a sidecar
container of the worker's pod, sharing its ``/dev/shm``). The worker holds one
``ColocatedHost.Executor`` call per session that runs colocated Python: the host starts an
executor (``python -m pathways_nb.colocated.executor``) for it, says where it listens, sends what it writes
(bounded: ``colocated.host_output``), reports it if it dies, and stops it when the call ends: the
session ended, or its worker died.

Each executor runs a tenant's code, so it gets as little as the host can give it:

- a user of its own (a fresh uid and gid, no supplementary groups) where this process may switch
  users (it runs as root) and the executor's Python is readable by other users; otherwise the
  host's own user, with a warning that tenants are then not kept apart;
- its own directory (its home, working and temporary directory, and where array shards pass
  through), mode 0700, removed when it ends, with every process left running as its user;
- an environment of its own: no cluster token, nothing of the host's environment but ``PATH``;
  an interpreter of another Python version than the host's (``--executor_python``) gets none of the
  host's packages either, only this installation's ``pathways_nb`` (the executor needs it): its
  own environment must have jax, numpy, cloudpickle, grpcio and protobuf.

The host's socket lives in a directory of the cluster's user and its calls need the cluster token.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import secrets
import shutil
import signal
import site
import stat
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import grpc
import psutil

from pathways_nb.colocated.host_output import ExecutorOutput
from pathways_nb.core import shared_memory, tuning
from pathways_nb.core.aio_server import BackgroundServer
from pathways_nb.core.exit_status import exit_description
from pathways_nb.core.security import ClusterCredentials
from pathways_nb.rpc import cluster_pb2 as pb
from pathways_nb.rpc import cluster_pb2_grpc

_LOGGER = logging.getLogger(__name__)

SERVICE_NAME = "pathways_nb.v1.ColocatedHost"
# Executors' users: uids (and gids) from here on, one per executor while it runs.
DEFAULT_UID_BASE = 1_500_000_000
UID_RANGE = 1 << 24


@dataclass(frozen=True)
class ExecutorPolicy:
    """How this host runs executors: which Python, whether each as a user of its own, and with which packages.

    ``host_packages``: the executors' Python is of this host's version, and gets this host's packages;
    one of another version gets only this installation's ``pathways_nb`` (their compiled parts, numpy's
    say, would not load in it).
    """

    python: str
    separate_users: bool
    uid_base: int = DEFAULT_UID_BASE
    host_packages: bool = True


def choose_policy(python: str | None = None, uid_base: int = DEFAULT_UID_BASE) -> ExecutorPolicy:
    """Separate users where this process may switch users and they can run ``python``; else its own user."""
    python = python or sys.executable
    host_packages = python == sys.executable or _python_version(python) == sys.version_info[:2]
    if os.geteuid() != 0:
        _LOGGER.warning(
            "colocated Python executors run as this host's own user (%d): only root can give each a user of "
            "its own, so tenants' code is not kept apart from each other or from this cluster's files. "
            "Use it for one tenant, or run the host as root",
            os.getuid(),
        )
        return ExecutorPolicy(python, False, uid_base, host_packages)
    problem = _probe_as_other_user(python, uid_base + UID_RANGE - 1, host_packages)
    if problem:
        _LOGGER.warning(
            "colocated Python executors run as root: a user of their own cannot run %s (%s). Install Python "
            "where every user can read it (e.g. /usr/local), or name one with --colocated_python_executable "
            "(of pathways-nb up or colocated-host); until then tenants' code is not kept apart",
            python,
            problem,
        )
        return ExecutorPolicy(python, False, uid_base, host_packages)
    return ExecutorPolicy(python, True, uid_base, host_packages)


def _python_version(python: str) -> tuple[int, int] | None:
    """``python``'s (major, minor), or None if it does not say (its executors' start will say why)."""
    try:
        result = subprocess.run(
            [python, "-c", "import sys; print(*sys.version_info[:2])"],
            env={"PATH": os.environ.get("PATH", os.defpath)},
            capture_output=True,
            text=True,
            timeout=tuning.EXECUTOR_VERSION_TIMEOUT_S.value,
        )
        major, minor = result.stdout.split()
        return int(major), int(minor)
    except (OSError, subprocess.SubprocessError, ValueError) as error:
        _LOGGER.warning("the executors' Python %s did not say its version (%s)", python, error)
        return None


def _probe_as_other_user(python: str, uid: int, host_packages: bool) -> str:
    """Why a user other than this one cannot run an executor with ``python`` ("" if it can)."""
    with tempfile.TemporaryDirectory(prefix="pathways-nb-executor-probe-") as directory:
        os.chmod(directory, 0o755)  # the probe's user reads the path it is given there
        try:
            result = subprocess.run(
                [python, "-m", "pathways_nb.colocated.executor", "--user", str(uid), "--probe"],
                env=_executor_env(Path(directory), host_packages),
                cwd="/",
                capture_output=True,
                text=True,
                timeout=120,
            )
        except (OSError, subprocess.SubprocessError) as error:
            return str(error)
    if result.returncode == 0:
        return ""
    lines = result.stderr.strip().splitlines()
    return lines[-1] if lines else exit_description(result.returncode)


def _executor_env(directory: Path, host_packages: bool) -> dict[str, str]:
    """An executor's whole environment: none of the host's (its cluster token least of all).

    Its Python finds this installation's ``pathways_nb``, and with ``host_packages`` this host's
    packages too (an interpreter of the same version readable by other users, where the host's is
    not). An interpreter of another version finds ``pathways_nb`` alone, through a link in
    ``directory``: the directory that holds ``pathways_nb`` may hold the host's packages too.
    """
    package = Path(__file__).resolve().parent.parent  # pathways_nb
    if host_packages:
        paths = [str(package.parent), *site.getsitepackages()]
    else:
        alone = directory / "pathways-nb-path"
        alone.mkdir(exist_ok=True)
        link = alone / package.name
        if not link.is_symlink():
            link.symlink_to(package, target_is_directory=True)
        paths = [str(alone)]
    return {
        "PATH": os.environ.get("PATH", os.defpath),
        "HOME": str(directory),
        "TMPDIR": str(directory),
        "LANG": "C.UTF-8",
        "PYTHONPATH": os.pathsep.join(paths),
        "PYTHONNOUSERSITE": "1",
        "JAX_PLATFORMS": "cpu",
    }


class UserPool:
    """Users for executors: a uid (and gid of the same number) held by one executor at a time.

    Held across the processes of this machine by a file per uid (created exclusively, holding the
    pid of its host), so that two hosts on one machine never give one user to two tenants; a file
    whose host died is taken over.
    """

    def __init__(self, base: int, directory: Path):
        self.base = base
        self.directory = directory
        directory.mkdir(mode=0o700, exist_ok=True)

    def take(self) -> int:
        for _ in range(1000):
            uid = self.base + secrets.randbelow(UID_RANGE)
            marker = self.directory / str(uid)
            try:
                descriptor = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                if not self._holder_alive(marker):
                    marker.unlink(missing_ok=True)
                continue
            with os.fdopen(descriptor, "w") as file:
                file.write(str(os.getpid()))
            return uid
        raise RuntimeError(f"no free executor user among {UID_RANGE} from {self.base}")

    def give_back(self, uid: int) -> None:
        (self.directory / str(uid)).unlink(missing_ok=True)

    @staticmethod
    def _holder_alive(marker: Path) -> bool:
        try:
            return psutil.pid_exists(int(marker.read_text() or "0"))
        except (OSError, ValueError):
            return True


@dataclass(eq=False)
class _Executor:
    """One running executor, what it writes, and what goes when it ends."""

    process: _Child
    uid: int
    directory: Path
    output: ExecutorOutput


class ColocatedHostService(cluster_pb2_grpc.ColocatedHostServicer):
    """Starts, watches and stops this host's executors (see the module's docstring)."""

    def __init__(self, policy: ExecutorPolicy, root: Path):
        self.policy = policy
        self.root = root
        private = shared_memory.private_root()
        if policy.separate_users and private is None:
            raise RuntimeError("no private directory to hold the executors' users in (see PATHWAYS_SHM_ROOT)")
        # Held in this user's private root (mode 0700): nobody else may take or free a user.
        self._users = UserPool(policy.uid_base, (private or root) / "executor-users")
        self._names = itertools.count()
        self._running: set[_Executor] = set()
        self._unclaimed_stops: set[asyncio.Future] = set()

    async def Executor(self, request: pb.ExecutorRequest, context):
        # Started whole even if the caller goes away meanwhile (a session that ends during its first
        # colocated call): a start cut off half-way would leave a process nobody stops.
        starting = asyncio.ensure_future(self._start(request))
        try:
            executor = await asyncio.shield(starting)
        except asyncio.CancelledError:
            starting.add_done_callback(self._stop_unclaimed)
            raise
        except (OSError, RuntimeError) as error:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(error))
        self._running.add(executor)
        exited = asyncio.ensure_future(executor.process.wait())
        try:
            yield pb.ExecutorEvent(
                started=pb.ExecutorStarted(
                    address=f"unix:{executor.directory / 'executor.sock'}",
                    directory=str(executor.directory),
                    pid=executor.process.pid,
                    uid=executor.uid,
                )
            )
            async for batch in executor.output.batches(exited):
                yield pb.ExecutorEvent(output=batch)
            ended = pb.ExecutorExit(description=exit_description(exited.result()), log_tail=executor.output.tail())
            _LOGGER.warning("the executor of session %s %s:\n%s", request.session, ended.description, ended.log_tail)
            yield pb.ExecutorEvent(exited=ended)
        finally:
            exited.cancel()
            self._running.discard(executor)
            await self._stop(executor)

    def _stop_unclaimed(self, starting: asyncio.Future) -> None:
        """Stops an executor whose caller went away while it started (one that failed cleaned up already)."""
        if starting.cancelled() or starting.exception() is not None:
            return
        stopping = asyncio.ensure_future(self._stop(starting.result()))
        self._unclaimed_stops.add(stopping)
        stopping.add_done_callback(self._unclaimed_stops.discard)

    async def _start(self, request: pb.ExecutorRequest) -> _Executor:
        name = f"executor-{os.getpid()}-{next(self._names)}"
        uid = self._users.take() if self.policy.separate_users else os.getuid()
        directory = self.root / name
        directory.mkdir(mode=0o700)
        ready_read, ready_write = os.pipe()
        # Its stdout, its stderr and its records pipe (``colocated.host_output``): this host's to read and close.
        (stdout_read, stdout_write), (stderr_read, stderr_write), (records_read, records_write) = pipes = [
            os.pipe() for _ in range(3)
        ]
        try:
            if uid != os.getuid():
                os.chown(directory, uid, uid)
            popen = await asyncio.to_thread(
                subprocess.Popen,
                [
                    self.policy.python,
                    "-m",
                    "pathways_nb.colocated.executor",
                    "--socket",
                    str(directory / "executor.sock"),
                    "--directory",
                    str(directory),
                    "--devices",
                    ",".join(str(i) for i in request.device_ids),
                    "--parent",
                    str(os.getpid()),
                    "--ready_fd",
                    str(ready_write),
                    "--output_fd",
                    str(records_write),
                    *(["--user", str(uid)] if uid != os.getuid() else []),
                ],
                # Started as this user: it changes users itself (see pathways_nb.colocated.executor.__main__).
                stdin=subprocess.DEVNULL,
                stdout=stdout_write,
                stderr=stderr_write,
                env=_executor_env(directory, self.policy.host_packages),
                cwd=directory,
                pass_fds=(ready_write, records_write),
                start_new_session=True,
                # Files it writes elsewhere (a checkpoint) are readable by a later session's executor, as
                # files usually are; its own directory stays closed (0700).
                umask=0o022,
            )
            try:
                process = _Child(popen)
            except BaseException:
                popen.kill()
                raise
        except BaseException:
            for descriptor in (ready_read, ready_write, *itertools.chain.from_iterable(pipes)):
                os.close(descriptor)
            self._clean_up(uid, directory)
            raise
        for descriptor in (ready_write, stdout_write, stderr_write, records_write):
            os.close(descriptor)
        output = ExecutorOutput()
        await output.read(stdout_read, stderr_read, records_read)
        executor = _Executor(process, uid, directory, output)
        if not await _ready(ready_read):
            await self._stop(executor)
            raise RuntimeError(
                f"the executor ({self.policy.python}) did not start ({exit_description(process.returncode)}); "
                f"its output:\n{output.tail() or '(none)'}"
            )
        _LOGGER.info("executor for session %s (tenant %s) started as uid %d", request.session, request.tenant, uid)
        return executor

    async def _stop(self, executor: _Executor) -> None:
        """Ends the executor (SIGTERM, then SIGKILL) and everything it left: processes, files, its user."""
        process = executor.process
        if process.returncode is None:
            _signal(process, signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), tuning.EXECUTOR_STOP_GRACE_S.value)
            except asyncio.TimeoutError:
                _signal(process, signal.SIGKILL)
                await process.wait()
        _kill_leftovers(process.pid, executor.uid if self.policy.separate_users else None)
        await executor.output.drained()  # what it wrote last is in the tail now
        self._clean_up(executor.uid, executor.directory)

    def _clean_up(self, uid: int, directory: Path) -> None:
        shutil.rmtree(directory, ignore_errors=True)
        if self.policy.separate_users:
            self._users.give_back(uid)

    async def stop_all(self) -> None:
        await asyncio.gather(*(self._stop(executor) for executor in list(self._running)), *self._unclaimed_stops)
        shutil.rmtree(self.root, ignore_errors=True)


async def _ready(read: int) -> bool:
    """Whether the executor wrote its ready line on the pipe ``read`` (closed here) in time.

    An executor that dies first closes its end: the read then finds nothing.
    """
    loop = asyncio.get_running_loop()
    line = loop.create_future()

    def readable() -> None:
        if not line.done():
            line.set_result(os.read(read, 64))

    loop.add_reader(read, readable)
    try:
        return bool(await asyncio.wait_for(line, tuning.EXECUTOR_START_TIMEOUT_S.value))
    except asyncio.TimeoutError:
        return False
    finally:
        loop.remove_reader(read)
        os.close(read)


class _Child:
    """An executor's process: started off the loop by Python's ``subprocess``, its exit noticed on the loop.

    Not asyncio's subprocesses: under uvloop (``core.loop.new_event_loop``) they start with libuv's
    ``fork``, after which gRPC's fork handlers crash the child of a process with gRPC's threads
    (executors died of SIGSEGV in three of four runs of the colocated tests); ``subprocess`` uses
    ``vfork`` and ``exec``. The exit is read from a pidfd on the loop, so no thread waits for it, and
    the child is reaped only here.
    """

    def __init__(self, popen: subprocess.Popen):
        self.popen = popen
        self.pid = popen.pid
        self.returncode: int | None = None
        self._loop = asyncio.get_running_loop()
        self._exited = self._loop.create_future()
        self._pidfd = os.pidfd_open(popen.pid)
        self._loop.add_reader(self._pidfd, self._reap)

    def _reap(self) -> None:
        returncode = self.popen.poll()
        if returncode is None:
            return
        self._loop.remove_reader(self._pidfd)
        os.close(self._pidfd)
        self.returncode = returncode
        self._exited.set_result(returncode)

    async def wait(self) -> int:
        """The exit status (``subprocess``'s: negative for a signal); cancelling a wait leaves the others."""
        return await asyncio.shield(self._exited)


def _signal(process: _Child, number: int) -> None:
    """Signals a child by pid: it is not reaped before ``_Child`` sees it end, so the pid is still its own.

    Not ``popen.terminate()``: that polls the child first, and would reap it behind ``_Child``'s back.
    """
    try:
        os.kill(process.pid, number)
    except ProcessLookupError:
        pass


def _kill_leftovers(process_group: int, uid: int | None) -> None:
    """SIGKILLs what an executor started and left running: its process group, and every process of its user."""
    try:
        os.killpg(process_group, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if uid is None:
        return
    for process in psutil.process_iter(["uids"]):
        uids = process.info.get("uids")
        if uids is not None and uid in (uids.real, uids.effective):
            try:
                process.kill()
            except psutil.Error:
                pass


class ColocatedHostServer:
    """Serves ``ColocatedHost`` on the unix socket ``socket_path`` until ``stop()``."""

    def __init__(self, socket_path: str, policy: ExecutorPolicy, credentials: ClusterCredentials | None = None):
        self._socket_directory = _private_directory(Path(socket_path).parent)
        parent = Path(os.environ.get("PATHWAYS_SHM_ROOT") or "/dev/shm")
        # Executors' directories: others may pass through (an executor reaches its own) but not list.
        root = Path(tempfile.mkdtemp(prefix=f"pathways-nb-executors-{os.getpid()}-", dir=parent))
        root.chmod(0o711)
        self.service = ColocatedHostService(policy, root)
        self._server = BackgroundServer(
            lambda server: cluster_pb2_grpc.add_ColocatedHostServicer_to_server(self.service, server),
            [SERVICE_NAME],
            host=f"unix:{socket_path}",
            on_stop=self.service.stop_all,
            credentials=credentials,
            process=f"colocated host {socket_path}",
        )
        self.port = 0  # (a unix socket: what ``pathways-nb``'s launchers read from --port_file)

    def stop(self, grace_s: float | None = 1.0) -> None:
        self._server.stop(grace_s)
        if self._socket_directory is not None:  # made here: nothing of this host is left on its machine
            shutil.rmtree(self._socket_directory, ignore_errors=True)


def _private_directory(directory: Path) -> Path | None:
    """Makes the socket's ``directory`` (mode 0700) if it does not exist, and returns it; None if it did.

    On a node of a Slurm allocation nobody else makes it (the launcher is on another machine). One that
    exists must be this user's and closed to others: a directory someone else made in /tmp could hand
    them the socket.
    """
    try:
        directory.mkdir(mode=0o700)
        return directory
    except FileExistsError:
        pass
    found = directory.lstat()
    if not stat.S_ISDIR(found.st_mode) or found.st_uid != os.geteuid() or found.st_mode & 0o077:
        raise ValueError(
            f"the socket's directory {directory} is not a directory of this user closed to others (mode 0700): "
            "remove it, or pass a --socket in a directory of your own"
        )
    return None

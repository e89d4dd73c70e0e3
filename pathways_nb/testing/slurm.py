"""A real Slurm on this machine, for tests: a private munged, slurmctld and one slurmd per emulated node.

``LocalSlurm(nodes=3)`` starts Debian's Slurm (22.05, built with ``MULTIPLE_SLURMD``)
in a temporary directory of its own, with nodes ``n1``, ``n2``, ... each at its own
loopback address (127.0.0.1, 127.0.0.2, ...) and its own slurmd port. Nothing in
``/etc`` is read or written: every command gets ``SLURM_CONF`` (``env()``), and the
daemons run in the foreground as children of this process (a daemonized one lingers as a
zombie of PID 1 for a second or two). ``stop()`` cancels every job, stops the daemons
(munged last: a slurmstepd whose munged is gone loops on "Munge encode failed" and its
slurmd then ignores SIGTERM) and, as a last resort, kills any process still carrying this
Slurm's ``SLURM_CONF`` (slurmstepd double-forks and its tasks start sessions of their own,
so no process group reaches them); it returns those, which should be none. Why each
setting is there is said beside it in ``_CONFIG``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Callable

import psutil

from pathways_nb.testing import wait_until

# Debian's packages that make this Slurm (what `make slurm` installs).
PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
PROGRAMS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "srun", "salloc", "scontrol", "squeue", "scancel")

_CONFIG = """\
ClusterName=pathwaystest
SlurmctldHost=localhost
SlurmctldPort={controller_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={directory}/munge.sock
StateSaveLocation={directory}/state
SlurmdSpoolDir={directory}/spool/%n
SlurmctldPidFile={directory}/slurmctld.pid
SlurmdPidFile={directory}/slurmd.%n.pid
SlurmctldLogFile={directory}/log/slurmctld.log
SlurmdLogFile={directory}/log/slurmd.%n.log
# An empty plugin stack: nothing of /etc/slurm/plugstack.conf.d is loaded.
PlugStackConfig={directory}/plugstack.conf
MailProg=/bin/true
# No cgroups here: processes are tracked by their parents.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
# Otherwise a batch job waits about 3 s before it is scheduled.
SchedulerParameters=batch_sched_delay=0
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
ReturnToService=2
# Trust CPUs= below rather than the machine's cores.
SlurmdParameters=config_overrides
# Between SIGTERM and SIGKILL when a job is cancelled or ends (default 30 s).
KillWait=2
MinJobAge=300
InactiveLimit=0
SlurmdTimeout=30
{nodes}
PartitionName=debug Nodes={node_names} Default=YES MaxTime=INFINITE State=UP
"""


def unavailable() -> str | None:
    """Why a ``LocalSlurm`` cannot run here (one line naming what to install), or None if it can."""
    missing = [program for program in PROGRAMS if shutil.which(program) is None]
    if missing:
        return (
            f"no Slurm ({', '.join(missing)} missing): install it with make slurm "
            f"(as root: apt-get install --no-install-recommends {' '.join(PACKAGES)})"
        )
    if os.geteuid() != 0:
        return "Slurm's slurmd runs jobs only as root here: run the Slurm tests as root"
    return None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class LocalSlurm:
    """Slurm with ``nodes`` emulated nodes ``n1..nN`` at 127.0.0.1..N, started by ``start()``."""

    def __init__(self, nodes: int = 3, cpus_per_node: int = 2):
        self.node_names = [f"n{i}" for i in range(1, nodes + 1)]
        self.node_addresses = {name: f"127.0.0.{i}" for i, name in enumerate(self.node_names, start=1)}
        self.cpus_per_node = cpus_per_node
        self.directory = ""
        self._daemons: list[subprocess.Popen] = []

    @property
    def conf(self) -> str:
        return os.path.join(self.directory, "slurm.conf")

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """``base`` (default: this process's environment) with this Slurm's ``SLURM_CONF``, and no other job's
        ``SLURM_*`` variables, nor this process's JAX or pathways-nb settings (a job starts clean)."""
        leave_out = ("SLURM_", "JAX_", "PATHWAYS_")
        environment = {k: v for k, v in (os.environ if base is None else base).items() if not k.startswith(leave_out)}
        environment["SLURM_CONF"] = self.conf
        return environment

    # -- lifecycle -------------------------------------------------------------------------

    def start(self, timeout_s: float = 60.0) -> LocalSlurm:
        reason = unavailable()
        if reason:
            raise RuntimeError(reason)
        self.directory = tempfile.mkdtemp(prefix="pathways-slurm-")
        os.chmod(self.directory, 0o755)  # munged refuses a socket directory others cannot enter
        for sub in ("state", "log", *(f"spool/{n}" for n in self.node_names)):
            os.makedirs(os.path.join(self.directory, sub))
        open(os.path.join(self.directory, "plugstack.conf"), "w").close()
        nodes = "\n".join(
            f"NodeName={name} NodeHostname=localhost NodeAddr={self.node_addresses[name]} Port={_free_port()} "
            f"CPUs={self.cpus_per_node} RealMemory=1000 State=UNKNOWN"
            for name in self.node_names
        )
        with open(self.conf, "w") as f:
            f.write(
                _CONFIG.format(
                    directory=self.directory,
                    controller_port=_free_port(),
                    nodes=nodes,
                    node_names=",".join(self.node_names),
                )
            )
        try:
            self._start_daemons(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _daemon(self, *command: str) -> None:
        log = open(os.path.join(self.directory, "log", f"{os.path.basename(command[0])}.out"), "ab")
        with log:
            self._daemons.append(
                subprocess.Popen(command, env=self.env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            )

    def _start_daemons(self, timeout_s: float) -> None:
        d = self.directory
        key = os.path.join(d, "munge.key")
        subprocess.run(["mungekey", "-c", "-k", key], check=True, capture_output=True)
        self._daemon(
            "munged", "-F", f"--socket={d}/munge.sock", f"--key-file={key}", f"--pid-file={d}/munged.pid",
            f"--log-file={d}/log/munged.log", f"--seed-file={d}/munged.seed",
        )  # fmt: skip
        self._wait(lambda: os.path.exists(f"{d}/munge.sock"), timeout_s, "munged listening")
        self._daemon("slurmctld", "-D", "-c", "-i")
        for name in self.node_names:
            self._daemon("slurmd", "-D", "-N", name)
        self._wait(self._all_idle, timeout_s, "every node idle")

    def _all_idle(self) -> bool:
        dead = [p.args[0] for p in self._daemons if p.poll() is not None]
        if dead:
            raise RuntimeError(f"{', '.join(dead)} exited while starting; see {self.directory}/log")
        states = self.run("sinfo", "-h", "-N", "-o", "%T", check=False).stdout.split()
        return len(states) == len(self.node_names) and set(states) == {"idle"}

    def _wait(self, condition: Callable[[], object], timeout_s: float, what: str) -> None:
        wait_until(condition, timeout_s, f"Slurm: {what} (its logs: {self.directory}/log)")

    def stop(self, timeout_s: float = 30.0) -> list[str]:
        """Cancels every job, stops the daemons (munged last) and kills whatever still runs under this Slurm.

        Returns what had to be killed that way (``name (pid)``): nothing, when Slurm's own teardown works.
        """
        if not self.directory:
            return []
        if self._daemons:
            self.run("scancel", "--full", "-u", str(os.getuid()), check=False)
            with contextlib.suppress(TimeoutError):
                self._wait(lambda: not self.jobs() and not self._steps_running(), timeout_s, "every job ended")
            for process in reversed(self._daemons):  # slurmds, slurmctld, then munged
                if process.poll() is None:
                    process.terminate()
                try:
                    process.wait(timeout_s / 3)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        leftovers = self.processes()
        killed = []
        for process in leftovers:
            with contextlib.suppress(psutil.Error):
                killed.append(f"{process.name()} ({process.pid})")
                process.kill()
        psutil.wait_procs(leftovers, timeout=5)
        self._daemons.clear()
        shutil.rmtree(self.directory, ignore_errors=True)
        self.directory = ""
        return killed

    def __enter__(self) -> LocalSlurm:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    # -- using it ----------------------------------------------------------------------------

    def run(self, *command: str, check: bool = True, timeout_s: float = 60.0) -> subprocess.CompletedProcess:
        """A Slurm command (``sbatch``, ``scontrol``, ...) against this Slurm; its output as text."""
        result = subprocess.run(command, env=self.env(), capture_output=True, text=True, timeout=timeout_s)
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} exited with status {result.returncode}: {result.stderr.strip()}")
        return result

    def jobs(self) -> list[str]:
        """The ids of the jobs still in the queue (pending, running or completing)."""
        return self.run("squeue", "-h", "-o", "%i", check=False).stdout.split()

    def job_state(self, job_id: str) -> str:
        """The job's state (``PENDING``, ``RUNNING``, ``CANCELLED``, ...), while the controller remembers it."""
        fields = self.run("scontrol", "-o", "show", "job", job_id).stdout.split()
        return next(f.split("=", 1)[1] for f in fields if f.startswith("JobState="))

    def _steps_running(self) -> bool:
        return any(p.name() == "slurmstepd" for p in self.processes())

    def processes(self, job_id: str | None = None) -> list[psutil.Process]:
        """This Slurm's processes other than its daemons (slurmstepd and every task), or only ``job_id``'s.

        Found by their environment: each carries this Slurm's ``SLURM_CONF`` (and a task its
        ``SLURM_JOB_ID``), whatever its parent, session or name.
        """
        if not self.directory:
            return []
        daemons = {p.pid for p in self._daemons}
        wanted = {"SLURM_CONF": self.conf} if job_id is None else {"SLURM_CONF": self.conf, "SLURM_JOB_ID": job_id}
        found = []
        for process in psutil.process_iter():
            if process.pid in daemons or process.pid == os.getpid():
                continue
            with contextlib.suppress(psutil.Error):
                environment = process.environ()
                if all(environment.get(k) == v for k, v in wanted.items()):
                    found.append(process)
        return found

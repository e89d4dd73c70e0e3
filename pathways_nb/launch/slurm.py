"""A cluster laid out over the nodes of a Slurm allocation, and what Slurm says about a job.

Inside an allocation (``sbatch``'s batch script, or a shell of ``salloc``),
``Allocation.from_environment()`` reads the job's nodes and each node's address: Slurm's
``NodeAddr`` (``scontrol show node``), never ``hostname``, which emulated nodes and many
clusters share or do not resolve. ``LocalCluster(nodes=allocation.nodes)`` lays the cluster
over them: the resource manager and the proxy on the first node, one worker per node, each
server a job step of its own that ``srun`` starts from the launcher (``SlurmNode.command``)
and the launcher's supervisor watches, as it watches processes on one machine. A step that
ends (its server crashed, ``scancel`` of the step) is reported to the resource manager as the
end of that worker on that node, and started again. One step per server rather than one step
of a task per node: Slurm cannot start one task of a running step again.

When the job ends (``scancel``, its time limit), Slurm signals every step and the launcher
and tears the steps down; the proxy first tells its clients why (``job_end_reason``).

A running job's cluster is found from the job's id (``find``): its launcher records the
directory of its ``address`` and ``token`` files (``connection_files``) in the job's comment.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from pathways_nb.core.exit_status import exit_description
from pathways_nb.errors import SlurmError
from pathways_nb.launch import connection_files
from pathways_nb.launch.processes import Node

_LOGGER = logging.getLogger(__name__)

JOB_ENV = "SLURM_JOB_ID"
NODELIST_ENV = "SLURM_JOB_NODELIST"
SCHEME = "slurm://"
# The job comment by which a job's cluster is found: this prefix, then the directory of its files.
COMMENT_PREFIX = "pathways-nb:"
# Only the steps that use the node's accelerators (the workers, named worker-I-H by the launcher)
# keep the job's GPUs; the others get none, so that no server but a worker sees them.
_DEVICE_STEPS = ("worker-",)
# Key=Value fields of ``scontrol -o show``: a value runs until the next " Key=".
_FIELD = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z0-9_:/.]*)=(.*?)(?=\s+[A-Za-z][A-Za-z0-9_:/.]*=|\s*$)")


def run(*command: str, timeout_s: float = 30.0) -> str:
    """The output of a Slurm command; ``SlurmError`` in Slurm's own words if it fails."""
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except FileNotFoundError:
        raise SlurmError(
            f"{command[0]} is not installed here", "run this where Slurm's commands are (a login node, or in a job)"
        ) from None
    except subprocess.TimeoutExpired:
        raise SlurmError(" ".join(command), f"no answer within {timeout_s:g} s; is slurmctld up?") from None
    if result.returncode != 0:
        raise SlurmError(" ".join(command), result.stderr.strip() or exit_description(result.returncode))
    return result.stdout


def fields(line: str) -> dict[str, str]:
    """The ``Key=Value`` fields of one line of ``scontrol -o show ...``."""
    return {key: value for key, value in _FIELD.findall(line.strip())}


@dataclass(frozen=True)
class Job:
    """What ``scontrol show job`` says of one job (the controller remembers a job for ``MinJobAge`` after it ends)."""

    job_id: str
    state: str  # PENDING, RUNNING, COMPLETING, CANCELLED, TIMEOUT, FAILED, ...
    reason: str  # why it waits: Resources, Priority, ... ("None" when it does not)
    nodes: str  # NodeList, e.g. n[1-2] ("" until it runs)
    comment: str
    stdout: str  # the file its output goes to

    @classmethod
    def query(cls, job_id: str, timeout_s: float = 30.0) -> Job:
        try:
            lines = run("scontrol", "-o", "show", "job", job_id, timeout_s=timeout_s).splitlines()
        except SlurmError as error:
            raise SlurmError(
                f"Slurm job {job_id} is unknown to Slurm here",
                f"{error.detail}; check its id (squeue --me), and that it ended no longer ago than Slurm remembers",
            ) from None
        found = fields(lines[0]) if lines else {}
        if "JobState" not in found:
            raise SlurmError(f"scontrol show job {job_id}", "said nothing of the job")
        nodes = found.get("NodeList", "")
        return cls(
            job_id=job_id,
            state=found["JobState"],
            reason=found.get("Reason", "None"),
            nodes="" if nodes == "(null)" else nodes,
            comment=found.get("Comment", ""),
            stdout=found.get("StdOut", ""),
        )

    def describe(self) -> str:
        """``PENDING (Resources)``, ``RUNNING on n[1-2]``, ``CANCELLED``."""
        if self.state == "RUNNING":
            return f"RUNNING on {self.nodes}"
        return f"{self.state} ({self.reason})" if self.reason not in ("None", "") else self.state

    @property
    def cluster_directory(self) -> Path | None:
        """The directory of the cluster's address and token files, as its launcher recorded it."""
        if not self.comment.startswith(COMMENT_PREFIX):
            return None
        return Path(self.comment.removeprefix(COMMENT_PREFIX))


class SlurmNode(Node):
    """A node of the allocation: its servers are job steps that ``srun`` starts there."""

    local = False

    def __init__(self, name: str, address: str, job_id: str, secret: str):
        self.name = name
        self.address = address
        self.job_id = job_id
        self._secret = secret  # makes its socket directories' names unguessable

    def _srun(self, step: str) -> list[str]:
        # --overlap: the steps share the node (without it, the second would wait for the first's CPUs).
        return [
            "srun",
            f"--jobid={self.job_id}",
            "--overlap",
            "--nodes=1",
            "--ntasks=1",
            f"--nodelist={self.name}",
            f"--job-name={step}",
            "--mpi=none",
            *([] if step.startswith(_DEVICE_STEPS) else ["--gres=none"]),
        ]

    def command(self, name: str, command: Sequence[str]) -> list[str]:
        return [*self._srun(name), *command]

    def free_port(self) -> int:
        """A port free at the node's address now, found by a short step there."""
        probe = "import socket, sys; s = socket.socket(); s.bind((sys.argv[1], 0)); print(s.getsockname()[1])"
        output = run(*self._srun("pathways-port"), sys.executable, "-c", probe, self.address, timeout_s=120)
        return int(output.split()[-1])

    def describe_exit(self, returncode: int | None) -> str:
        """How a step ended, from its srun's status: srun exits 128+N when its task was killed by signal N."""
        where = f"on Slurm node {self.name}"
        if returncode is not None and returncode > 128:
            try:
                return f"killed by signal {signal.Signals(returncode - 128).name} {where}"
            except ValueError:
                pass
        if returncode is not None and returncode < 0:
            return f"{where}: its srun was {exit_description(returncode)}"
        return f"{exit_description(returncode)} {where}"

    def gone(self) -> str | None:
        """Why the job's steps can no longer run (it ended); None while it runs, or if Slurm does not answer."""
        try:
            job = Job.query(self.job_id)
        except SlurmError as error:
            # (A job that ended long ago is forgotten: "Invalid job id specified".)
            return f"Slurm job {self.job_id} is over ({error.detail})" if "Invalid job id" in str(error) else None
        return None if job.state == "RUNNING" else f"Slurm job {self.job_id} is {job.describe()}"

    def private_socket(self, name: str) -> str:
        """A unix socket path on the node, in a directory the server listening there makes (mode 0700)."""
        return f"/tmp/pathways-nb-{self._secret}-{name}/host.sock"

    def __repr__(self) -> str:
        return f"<SlurmNode {self.name} at {self.address}>"


@dataclass(frozen=True)
class Allocation:
    """The job this process runs in, and its nodes in Slurm's order."""

    job_id: str
    nodes: tuple[SlurmNode, ...]

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> Allocation:
        job_id, node_list = environ.get(JOB_ENV), environ.get(NODELIST_ENV)
        if not job_id or not node_list:
            raise SlurmError(
                "not inside a Slurm allocation",
                f"{JOB_ENV} and {NODELIST_ENV} are not set: run it in a batch script (sbatch) or under salloc",
            )
        names = run("scontrol", "show", "hostnames", node_list).split()
        addresses = node_addresses(names)
        secret = secrets.token_hex(8)
        return cls(job_id, tuple(SlurmNode(name, addresses[name], job_id, secret) for name in names))

    def describe(self) -> str:
        return f"Slurm job {self.job_id}'s nodes {' '.join(node.name for node in self.nodes)}"


def node_addresses(names: Sequence[str]) -> dict[str, str]:
    """Each node's ``NodeAddr``: where Slurm itself reaches it."""
    addresses = {}
    for line in run("scontrol", "-o", "show", "node", ",".join(names)).splitlines():
        node = fields(line)
        if "NodeName" in node:
            addresses[node["NodeName"]] = node.get("NodeAddr") or node["NodeName"]
    missing = [name for name in names if name not in addresses]
    if missing:
        raise SlurmError(f"scontrol show node {','.join(missing)}", "gave no address for these nodes")
    return addresses


def allocation_for(asked: bool | None, environ: Mapping[str, str] = os.environ) -> Allocation | None:
    """The allocation ``pathways-nb up`` lays its cluster over: asked for (``--slurm``: True), or found
    (None: if ``SLURM_JOB_ID`` is set); None for this machine (``--no_slurm``: False)."""
    if asked is False or (asked is None and not environ.get(JOB_ENV)):
        return None
    return Allocation.from_environment(environ)


def record_directory(job_id: str, directory: str | os.PathLike[str]) -> None:
    """Records where the job's cluster writes its address and token, in the job's comment (for ``find``)."""
    try:
        run("scontrol", "update", f"JobId={job_id}", f"Comment={COMMENT_PREFIX}{os.path.abspath(directory)}")
    except SlurmError as error:
        _LOGGER.warning("slurm://%s will not find this cluster: %s", job_id, error)


def job_end_reason(environ: Mapping[str, str] = os.environ) -> str | None:
    """Why the job this process is a step of is ending, for its clients; None if it is not ending (the
    cluster's launcher stopped the cluster, the job runs on) or if this is no job."""
    job_id = environ.get(JOB_ENV)
    if not job_id:
        return None
    try:
        job = Job.query(job_id, timeout_s=2)
    except SlurmError:
        return None
    if job.state == "RUNNING":
        return None
    return f"the Slurm job ended (job {job_id} is {job.state}); its arrays are gone: start a cluster again"


def job_id_of(address: str) -> str | None:
    """``123`` for ``slurm://123``; None for other addresses."""
    if not address.startswith(SCHEME):
        return None
    job_id = address.removeprefix(SCHEME).strip("/")
    if not re.fullmatch(r"\d+(_\d+)?", job_id):
        raise ValueError(f"{address!r} names no Slurm job: use slurm://JOBID, e.g. slurm://12345")
    return job_id


def find(job_id: str) -> tuple[str, str | None]:
    """The address and token of the cluster Slurm job ``job_id`` serves; ``SlurmError`` saying why not."""
    job = Job.query(job_id)
    directory = job.cluster_directory
    if job.state != "RUNNING":
        raise SlurmError(
            f"Slurm job {job_id} is {job.describe()}",
            "a job serves its cluster only while it runs: wait for it (squeue -j JOBID), or submit one",
        )
    if directory is None:
        raise SlurmError(
            f"Slurm job {job_id} runs no pathways-nb cluster",
            "its comment names none; start one with sbatch and pathways-nb deploy slurm's script, or "
            "pathways-nb up --slurm in an allocation",
        )
    address_file = directory / connection_files.ADDRESS_FILE
    if not address_file.exists():
        raise SlurmError(
            f"Slurm job {job_id}'s cluster is not serving yet",
            f"{address_file} appears once it serves (its output: {job.stdout or 'see scontrol show job'})",
        )
    return connection_files.read(address_file)

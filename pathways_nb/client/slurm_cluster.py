"""A pathways-nb cluster as a Slurm job, submitted from Python: ``SlurmCluster``.

Like dask-jobqueue's ``SLURMCluster``: it writes the batch script ``pathways-nb deploy
slurm`` writes (``pathways_nb.deploy.slurm``), submits it with ``sbatch``, and waits
until the job's cluster serves, showing the job's place in the queue while it waits
(``PENDING (Resources)``, then ``RUNNING on n[1-2]`` while the cluster starts).
``connect()`` then connects this process; ``close()`` (or leaving the ``with`` block,
or the interpreter's exit) cancels the job, and Slurm stops every process of it.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

from pathways_nb.core.security import TlsFiles
from pathways_nb.core.wait import wait_until
from pathways_nb.deploy.slurm import OUTPUT_FILE, SCRIPT_FILE, SlurmDeployment, write
from pathways_nb.errors import SlurmError
from pathways_nb.launch import connection_files, live, slurm
from pathways_nb.launch.processes import Status

_LOGGER = logging.getLogger(__name__)

# States in which a job may yet serve: it waits in the queue, or runs.
_ALIVE = {"PENDING", "CONFIGURING", "RUNNING", "REQUEUED", "RESIZING", "SUSPENDED"}
POLL_S = 0.5


class SlurmCluster:
    """A cluster of ``islands`` x ``hosts_per_island`` nodes, one Slurm job, started by ``start()``.

    >>> cluster = SlurmCluster(islands=2, devices_per_host=8, gpus_per_node=8, time="2:00:00")  # doctest: +SKIP
    >>> cluster.connect()             # jax.devices(): the job's 16 GPUs      # doctest: +SKIP
    >>> cluster.close()               # scancel: the job and its processes end  # doctest: +SKIP

    The keyword arguments are ``pathways-nb deploy slurm``'s flags; ``sbatch_options`` adds
    ``#SBATCH`` lines (``["--account=ml", "--qos=high"]``) and ``setup`` shell lines run before
    the cluster starts (``["module load cuda/12.4"]``). ``tls_cert``, ``tls_key`` and ``tls_ca`` (PEM files
    every node reads; the certificate names every node's address) make the servers talk TLS between
    nodes (docs/slurm.md). ``directory`` holds the script, the job's
    output, and its address and token files: every node and this machine must see it (default: a
    new directory in the current one, removed at ``close()``). ``timeout_s``: how long ``start()``
    waits for the job to serve (None: as long as it takes; the queue decides).
    """

    def __init__(
        self,
        islands: int = 1,
        hosts_per_island: int = 1,
        devices_per_host: int = 1,
        *,
        gpus_per_node: int = 0,
        partition: str | None = None,
        time: str | None = None,
        colocated_python: bool = False,
        storage_root: str | None = None,
        job_name: str = "pathways-nb",
        sbatch_options: Sequence[str] = (),
        setup: Sequence[str] = (),
        tls_cert: str | None = None,
        tls_key: str | None = None,
        tls_ca: str | None = None,
        directory: str | os.PathLike[str] | None = None,
        start: bool = True,
        timeout_s: float | None = None,
        progress: bool = True,
    ):
        self.deployment = SlurmDeployment(
            islands=islands,
            hosts_per_island=hosts_per_island,
            devices_per_host=devices_per_host,
            gpus_per_node=gpus_per_node,
            partition=partition,
            time=time,
            colocated_python=colocated_python,
            storage_root=storage_root,
            job_name=job_name,
            sbatch_options=tuple(sbatch_options),
            setup=tuple(setup),
            tls=TlsFiles.of(tls_cert, tls_key, tls_ca),
        )
        self._own_directory = directory is None
        self.directory = Path(directory or tempfile.mkdtemp(prefix="pathways-nb-slurm-", dir=os.getcwd())).absolute()
        self.progress = progress
        self.status = Status.created
        self.job_id: str | None = None
        self.address: str | None = None
        self.token: str | None = None
        if start:
            self.start(timeout_s)

    # -- lifecycle -------------------------------------------------------------------------

    def start(self, timeout_s: float | None = None) -> SlurmCluster:
        """Submits the job and waits until its cluster serves; ``SlurmError`` if the job ends first."""
        if self.status is Status.running:
            return self
        script = write(self.deployment, self.directory)
        connection_files.remove(self.directory)  # an earlier job's files name a cluster that is gone
        self.job_id = slurm.run("sbatch", "--parsable", str(script)).strip().split(";")[0]
        self.status = Status.starting
        live.add(self)
        try:
            self.address, self.token = self._wait_until_serving(timeout_s)
        except BaseException:
            self.status = Status.failed
            self.close()
            raise
        self.status = Status.running
        return self

    def _wait_until_serving(self, timeout_s: float | None) -> tuple[str, str | None]:
        """Polls the job until its cluster has written its address, showing where it is meanwhile."""
        address_file = self.directory / connection_files.ADDRESS_FILE
        bar = None
        if self.progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=None, desc=f"Slurm job {self.job_id}: submitted", bar_format="{desc} ({elapsed})")

        def job_serving() -> slurm.Job:
            job = slurm.Job.query(self.job_id)
            if job.state not in _ALIVE:
                raise SlurmError(
                    f"Slurm job {self.job_id} is {job.describe()} and serves no cluster",
                    f"the end of its output ({self.output_path}):\n{self.logs()[-3000:]}",
                )
            if bar is not None:
                doing = ", the cluster is starting" if job.state == "RUNNING" else ""
                bar.set_description_str(f"Slurm job {self.job_id}: {job.describe()}{doing}")
                bar.refresh()
            return job

        try:
            wait_until(
                job_serving,
                timeout_s,
                f"Slurm job {self.job_id} serving",
                holds=lambda job: job.state == "RUNNING" and address_file.exists(),
                interval_s=POLL_S,
                timeout_error=lambda job: TimeoutError(
                    f"Slurm job {self.job_id} did not serve within {timeout_s:g} s (it is {job.describe()}); "
                    "it is cancelled: try a longer timeout_s, or another partition"
                ),
            )
            return connection_files.read(address_file)
        finally:
            if bar is not None:
                bar.close()

    def connect(self, **options):
        """Connects this process to the cluster (``pathways_nb.connect``'s options); returns the session."""
        from pathways_nb.client.connection import connect

        if self.address is None:
            raise SlurmError("the cluster is not running", "call start() first")
        return connect(self.address, token=self.token, **options)

    def close(self, timeout_s: float = 60.0) -> None:
        """Disconnects this process from it, cancels the job and waits until Slurm has ended it; idempotent."""
        if self.status is Status.closed:
            return
        self.status = Status.closing
        from pathways_nb.client.connection import current, disconnect

        session = current()
        if session is not None and self.address is not None and session.address == self.address:
            disconnect()
        if self.job_id is not None:
            try:
                slurm.run("scancel", self.job_id)
            except SlurmError as error:  # it ended already, and Slurm forgot it
                _LOGGER.info("scancel %s: %s", self.job_id, error)
            self._wait_for_end(timeout_s)
        self.status = Status.closed
        live.discard(self)
        if self._own_directory:
            storage = self.directory / "storage"
            if not any(files for _dir, _subdirs, files in os.walk(storage)):
                shutil.rmtree(self.directory, ignore_errors=True)

    def _wait_for_end(self, timeout_s: float) -> None:
        def job_state() -> slurm.Job | None:
            try:
                return slurm.Job.query(self.job_id)
            except SlurmError:
                return None  # Slurm has forgotten it already

        wait_until(
            job_state,
            timeout_s,
            f"Slurm job {self.job_id} ended",
            holds=lambda job: job is None or (job.state not in _ALIVE and job.state != "COMPLETING"),
            interval_s=0.2,
            timeout_error=lambda job: TimeoutError(
                f"Slurm job {self.job_id} is still {job.describe()} {timeout_s:g} s after scancel"
            ),
        )

    def __enter__(self) -> SlurmCluster:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.close()

    # -- what it is ------------------------------------------------------------------------

    def serves(self, address: str) -> bool:
        return self.status is Status.running and self.address == address

    @property
    def output_path(self) -> Path:
        return self.directory / OUTPUT_FILE.replace("%j", str(self.job_id))

    def logs(self) -> str:
        """The job's output so far (the launcher's, with every step's)."""
        try:
            return self.output_path.read_text(errors="replace")
        except OSError:
            return ""

    def job_script(self) -> str:
        """The batch script it submits."""
        return (self.directory / SCRIPT_FILE).read_text()

    def __repr__(self) -> str:
        d = self.deployment
        where = f" at {self.address}" if self.status is Status.running else ""
        job = f" (Slurm job {self.job_id})" if self.job_id else ""
        devices = "GPU" if d.gpus_per_node else "cpu"
        return (
            f"<SlurmCluster {self.status.value}{where}{job}: {d.islands} island(s) x {d.hosts_per_island} host(s) "
            f"x {d.devices_per_host} {devices} device(s)>"
        )

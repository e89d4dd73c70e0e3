"""A pathways-nb cluster as a Slurm batch job: ``pathways-nb deploy slurm`` writes ``DIR/pathways.sbatch``.

The script asks Slurm for one node per host (``--nodes``, and ``--gres=gpu:G`` for
GPUs), sets up the environment (the site's modules, a virtual environment: the lines
``setup`` gives, or the user adds), and runs ``pathways-nb up --slurm`` in the batch
step. That launcher, the same one ``salloc ... pathways-nb up --slurm`` runs
(``pathways_nb.launch.slurm``), starts every server as a job step of its own on its
node, supervises them, and once the cluster serves writes ``DIR/address`` and
``DIR/token``. The script holds no logic of its own, so what runs is what the tests run.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from pathways_nb.core import security
from pathways_nb.core.security import TlsFiles
from pathways_nb.deploy.accelerators import ACCELERATORS, Accelerator, check_shape, gpus
from pathways_nb.launch import connection_files

SCRIPT_FILE = "pathways.sbatch"
# What a job writes its output to, in the output directory (%j: the job id).
OUTPUT_FILE = "slurm-%j.out"
# A value that goes on an #SBATCH line: Slurm reads those lines word by word, so no spaces, quotes or newlines.
_SBATCH_VALUE = re.compile(r"^[^\s\"'\\#]+$")


@dataclass(frozen=True)
class SlurmDeployment:
    """The shape of a cluster on Slurm and the job that runs it; ``ValueError`` if it cannot be made."""

    islands: int
    hosts_per_island: int
    devices_per_host: int
    gpus_per_node: int = 0
    partition: str | None = None
    time: str | None = None
    colocated_python: bool = False
    storage_root: str | None = None
    job_name: str = "pathways-nb"
    # More #SBATCH options (--account=..., --qos=..., --mem=...), as dask-jobqueue's job_extra_directives.
    sbatch_options: Sequence[str] = ()
    # Shell lines run before the cluster starts, e.g. "module load cuda/12.4" (dask-jobqueue's job_script_prologue).
    setup: Sequence[str] = ()
    # The Python that runs pathways-nb in the job (every node must have it at this path).
    python: str = sys.executable
    # The cluster token's file (default: a fresh token per job), and TLS between the job's servers.
    token_file: str | None = None
    tls: TlsFiles | None = None

    def __post_init__(self) -> None:
        if self.gpus_per_node < 0:
            raise ValueError(f"--gpus_per_node {self.gpus_per_node}: use 0 (CPU workers) or more")
        check_shape(self.islands, self.hosts_per_island, self.devices_per_host, self.accelerator, self.colocated_python)
        for flag, value in (("--partition", self.partition), ("--time", self.time), ("--job_name", self.job_name)):
            if value is not None and not _SBATCH_VALUE.match(value):
                raise ValueError(f"{flag} {value!r} cannot go on an #SBATCH line: no spaces, quotes or '#'")
        for option in self.sbatch_options:
            if not option.startswith("-") or "\n" in option:
                raise ValueError(f"sbatch option {option!r} is not one option, e.g. --account=ml")
        if any("\n" in line for line in self.setup):
            raise ValueError("each setup line is one shell line: pass several lines as several items")

    @property
    def accelerator(self) -> Accelerator:
        return gpus(self.gpus_per_node) if self.gpus_per_node else ACCELERATORS["cpu"]

    @property
    def nodes(self) -> int:
        """One worker per node; the resource manager and the proxy share the first node."""
        return self.islands * self.hosts_per_island

    def command_line(self, output: str) -> str:
        """The ``pathways-nb deploy slurm`` flags that make this deployment (for the script's header)."""
        flags = [
            f"--islands {self.islands}",
            f"--hosts_per_island {self.hosts_per_island}",
            f"--devices_per_host {self.devices_per_host}",
        ]
        if self.gpus_per_node:
            flags.append(f"--gpus_per_node {self.gpus_per_node}")
        for flag, value in (("--partition", self.partition), ("--time", self.time)):
            if value is not None:
                flags.append(f"{flag} {value}")
        if self.colocated_python:
            flags.append("--colocated_python")
        if self.storage_root is not None:
            flags.append(f"--storage_root {shlex.quote(self.storage_root)}")
        if self.token_file is not None:
            flags.append(f"--token_file {shlex.quote(self.token_file)}")
        if self.tls is not None:
            flags.append(shlex.join(self.tls.serving() + self.tls.calling()))
        return "pathways-nb deploy slurm " + " ".join([*flags, f"--output {shlex.quote(output)}"])

    def up_command(self, output: str) -> list[str]:
        """What the batch step runs: the launcher, with this shape, writing its files into ``output``."""
        return [
            self.python,
            "-m",
            "pathways_nb.cli",
            "up",
            "--slurm",
            f"--islands={self.islands}",
            f"--hosts_per_island={self.hosts_per_island}",
            f"--devices_per_host={self.devices_per_host}",
            f"--platform={self.accelerator.platform}",
            "--port=0",
            f"--output={output}",
            *(["--colocated_python"] if self.colocated_python else []),
            *([f"--storage_root={self.storage_root}"] if self.storage_root is not None else []),
            *([f"--token_file={os.path.abspath(self.token_file)}"] if self.token_file is not None else []),
            *(self.tls.serving() + self.tls.calling() if self.tls is not None else []),
        ]


def script_text(deployment: SlurmDeployment, output: str | os.PathLike[str]) -> str:
    """``pathways.sbatch``: how it was made and how to use it, the #SBATCH lines, the environment, the launcher."""
    d = deployment
    directory = os.path.abspath(output)
    if not _SBATCH_VALUE.match(directory):
        raise ValueError(f"--output {directory!r}: the job's output goes on an #SBATCH line, so no spaces or quotes")
    address = os.path.join(directory, connection_files.ADDRESS_FILE)
    token = os.path.join(directory, connection_files.TOKEN_FILE)
    devices = "GPU" if d.gpus_per_node else "CPU"
    sbatch = [
        f"--job-name={d.job_name}",
        f"--nodes={d.nodes}",
        "--ntasks-per-node=1",
        # Whole nodes: a worker owns its node's devices and cores (a job of one CPU per node would confine the
        # workers to that CPU where Slurm enforces allocations with cgroups).
        "--exclusive",
        *([f"--gres=gpu:{d.gpus_per_node}"] if d.gpus_per_node else []),
        *([f"--partition={d.partition}"] if d.partition else []),
        *([f"--time={d.time}"] if d.time else []),
        f"--output={os.path.join(directory, OUTPUT_FILE)}",
        *d.sbatch_options,
    ]
    setup = list(d.setup) or [
        "#   module load cuda/12.4",
        "#   source ~/venvs/pathways/bin/activate",
    ]
    return "\n".join(
        [
            "#!/bin/bash",
            f"# A pathways-nb cluster on Slurm: {d.islands} island(s) of {d.hosts_per_island} host(s) with "
            f"{d.devices_per_host} {devices} device(s) each, one node per host.",
            "# The resource manager and the proxy run on the first node, a worker on every node, each a step of",
            "# this job (squeue -s -j JOBID lists them); a step that ends is started again.",
            f"# Made by: {d.command_line(directory)}",
            f"# Submit it: sbatch {os.path.join(directory, SCRIPT_FILE)}",
            f"# Once it serves, {address} holds grpc://HOST:PORT and {token} the cluster token;",
            "# connect a notebook with: %pathways connect slurm://JOBID",
            f'# or from Python: pathways_nb.connect("{address}")',
            "# scancel JOBID stops every process of it. See docs/slurm.md.",
            *(f"#SBATCH {option}" for option in sbatch),
            "",
            "# The environment every step runs in (srun passes it on to each step): your site's modules, a",
            "# virtual environment. pathways-nb must be importable by this Python on every node:",
            f"#   {d.python}",
            *setup,
            "",
            "exec " + shlex.join(d.up_command(directory)),
            "",
        ]
    )


def write(deployment: SlurmDeployment, output: str | os.PathLike[str]) -> pathlib.Path:
    """Writes ``pathways.sbatch`` into ``output`` (made if missing); returns its path."""
    text = script_text(deployment, output)
    directory = pathlib.Path(output).absolute()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / SCRIPT_FILE
    path.write_text(text)
    path.chmod(0o755)
    return path


def add_parser(targets, common: argparse.ArgumentParser) -> None:
    """``deploy slurm``, among ``targets`` (``deploy``'s commands); ``common``: every command's flags."""
    slurm = targets.add_parser(
        "slurm", parents=[common], help="Slurm: a batch script that runs the cluster as steps of one job"
    )
    slurm.add_argument("--islands", type=int, required=True, help="number of islands")
    slurm.add_argument("--hosts_per_island", type=int, required=True, help="hosts (nodes) per island")
    slurm.add_argument("--devices_per_host", type=int, required=True, help="devices per host (its GPUs, with GPUs)")
    slurm.add_argument(
        "--gpus_per_node", type=int, default=0, help="GPUs per node (--gres=gpu:G, CUDA workers); default 0: CPU"
    )
    slurm.add_argument("--partition", default=None, help="the partition to run in (default: Slurm's)")
    slurm.add_argument("--time", default=None, help="the job's time limit, e.g. 2:00:00 (default: the partition's)")
    slurm.add_argument(
        "--colocated_python",
        action="store_true",
        help="run tenants' jax.experimental.colocated_python beside the devices (CPU workers; "
        "docs/colocated_python.md)",
    )
    slurm.add_argument(
        "--storage_root",
        default=None,
        help="directory every node sees, where the workers and the proxy write profiles and checkpoints "
        "(gs://BUCKET/PATH is BUCKET/PATH there); default: storage/ in --output",
    )
    slurm.add_argument(
        "--output", required=True, help="directory for pathways.sbatch, the job's output, its address and token"
    )
    security.add_arguments(slurm, serve_tls=True, call_tls=True)
    slurm.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Writes the batch script ``deploy slurm`` describes into ``--output``, and says what to do next."""
    deployment = SlurmDeployment(
        islands=args.islands,
        hosts_per_island=args.hosts_per_island,
        devices_per_host=args.devices_per_host,
        gpus_per_node=args.gpus_per_node,
        partition=args.partition,
        time=args.time,
        colocated_python=args.colocated_python,
        storage_root=args.storage_root,
        token_file=args.token_file,
        tls=TlsFiles.of(args.tls_cert, args.tls_key, args.tls_ca),
    )
    path = write(deployment, args.output)
    print(f"wrote {path}\nnext: sbatch {path}, then %pathways connect slurm://JOBID (see docs/slurm.md)")
    return 0

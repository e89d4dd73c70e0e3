"""``pathways-nb up``: a whole cluster, on this machine or over a Slurm allocation's nodes, until it is stopped.

Here it is a ``LocalCluster`` of child processes. Inside a Slurm allocation (``--slurm``, or
found from ``SLURM_JOB_ID``: in the batch script ``pathways-nb deploy slurm`` writes, or under
``salloc``) it is the same launcher with the allocation's nodes (``launch.slurm``): each server a
job step on its node, supervised from here. Once the cluster serves, ``--output DIR`` (by default
``./pathways-nb-JOBID`` in a Slurm job) receives its ``address`` and ``token`` files, and the job's
comment names DIR, so that ``slurm://JOBID`` finds them. Ctrl-C, SIGTERM (Slurm sends it when the
job ends) or, under ``salloc``, the job's end stop the cluster and remove the files.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile

from pathways_nb.core import security, tuning
from pathways_nb.core.command_line import add_suspend_memory_budget
from pathways_nb.launch import connection_files, slurm
from pathways_nb.launch.local_cluster import LocalCluster
from pathways_nb.launch.processes import StopRequest
from pathways_nb.rm import policy

# Islands of a cluster on this machine, unless --islands says otherwise.
DEFAULT_ISLANDS = 2


def add_parser(commands, common: argparse.ArgumentParser) -> None:
    """The ``up`` command, among ``commands``; ``common``: every command's flags."""
    up = commands.add_parser(
        "up", parents=[common], help="start a whole cluster here, or over a Slurm allocation (Ctrl-C stops it)"
    )
    up.add_argument(
        "--islands", type=int, default=None, help="number of islands (default 2; with --slurm: as many as nodes hold)"
    )
    up.add_argument("--hosts_per_island", type=int, default=1, help="hosts per island")
    up.add_argument("--devices_per_host", type=int, default=4, help="devices per host")
    up.add_argument("--server_port", type=int, default=29000, help="the proxy's port; 0 picks a free one")
    up.alias("--port", "--server_port")
    up.add_argument("--platform", default="cpu", help="the workers' platform")
    up.add_argument(
        "--colocated_python",
        action="store_true",
        help="run tenants' jax.experimental.colocated_python beside the devices (docs/colocated_python.md)",
    )
    up.add_argument(
        "--colocated_python_executable",
        default=None,
        help="the Python interpreter colocated Python executors run (default: this one)",
    )
    up.add_argument(
        "--storage_root",
        default=None,
        help="directory the workers and the proxy write profiles and checkpoints under (gs://BUCKET/PATH is "
        "BUCKET/PATH there); default: storage/ in the cluster's directory, kept if anything was written",
    )
    up.add_argument(
        "--worker_timeout",
        type=float,
        default=tuning.ONE_MACHINE_WORKER_TIMEOUT_S.value,
        help="seconds within which a worker that stopped answering is found dead (longer than the resource "
        "manager's 3 s: processes that share a machine's cores can stall for seconds when it is busy)",
    )
    up.add_argument(
        "--keep_logs",
        action="store_true",
        help="keep its processes' logs when it stops (default: only if the run failed: a process ended or "
        "logged an error)",
    )
    policy.add_arguments(up)
    add_suspend_memory_budget(up)
    up.add_argument(
        "--slurm",
        action="store_const",
        const=True,
        default=None,
        help="lay the cluster out over this Slurm allocation's nodes, one job step per server (default when "
        "SLURM_JOB_ID is set: in a batch script or under salloc; docs/slurm.md)",
    )
    up.add_argument("--no_slurm", dest="slurm", action="store_const", const=False, help="keep it on this machine")
    up.add_argument(
        "--output",
        default=None,
        help="write the cluster's address (DIR/address) and token (DIR/token, mode 0600) into this directory "
        "once it serves, removed when it stops (default with --slurm: ./pathways-nb-JOBID)",
    )
    security.add_arguments(up, serve_tls=True, call_tls=True)
    up.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Runs the cluster until it is stopped; the process's exit status."""
    allocation = slurm.allocation_for(args.slurm)
    output = args.output or (f"pathways-nb-{allocation.job_id}" if allocation else None)
    if allocation is not None:
        slurm.record_directory(allocation.job_id, output)  # slurm://JOBID finds it (and says it is starting)
    islands = args.islands if args.islands is not None else _islands_of(allocation, args.hosts_per_island)
    stops: list[StopRequest] = []  # (made once the cluster runs: until then, Ctrl-C interrupts its start)
    cluster = LocalCluster(
        islands=islands,
        hosts_per_island=args.hosts_per_island,
        devices_per_host=args.devices_per_host,
        port=args.server_port,
        platform=args.platform,
        token=security.ClusterCredentials.from_args(args).token,
        colocated_python=args.colocated_python,
        colocated_python_executable=args.colocated_python_executable,
        storage_root=args.storage_root,
        worker_timeout_s=args.worker_timeout,
        suspend_idle_after_s=args.suspend_idle_after,
        suspend_idle_always=args.suspend_idle_always,
        priority_ceilings=args.priority_ceiling,
        suspend_memory_budget=args.suspend_memory_budget,
        log_level=args.log_level,
        keep_logs=args.keep_logs or None,
        nodes=allocation.nodes if allocation else None,
        directory=output,
        on_end=lambda _why: stops and stops[0].request(),  # the Slurm job ended: so does this launcher
        tls=security.TlsFiles.of(args.tls_cert, args.tls_key, args.tls_ca),
    )
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(cluster.close)
        if output is not None:
            connection_files.write(output, cluster.address, cluster.token)
            cleanup.callback(connection_files.remove, output)  # (before the cluster stops: it serves no more)
            token_file = os.path.join(output, connection_files.TOKEN_FILE)
        else:
            token_file = args.token_file or _temporary_token_file(cluster.token, cleanup)
        stop = StopRequest()
        stops.append(stop)
        if cluster.ended:
            stop.request()
        print(_how_to_connect(cluster, allocation, output, token_file), flush=True)
        stop.wait()
    if output is not None and args.output is None:  # ./pathways-nb-JOBID, made for this job: gone if empty
        with contextlib.suppress(OSError):
            os.rmdir(output)
    return 0


def _islands_of(allocation: slurm.Allocation | None, hosts_per_island: int) -> int:
    """As many islands as the allocation's nodes hold (one worker per node), or ``DEFAULT_ISLANDS`` here."""
    if allocation is None:
        return DEFAULT_ISLANDS
    nodes = len(allocation.nodes)
    if hosts_per_island > nodes:
        raise ValueError(
            f"--hosts_per_island {hosts_per_island}: {allocation.describe()} are {nodes}, and each host is a "
            "node; ask Slurm for more nodes, or for fewer hosts per island"
        )
    return nodes // max(hosts_per_island, 1)


def _temporary_token_file(token: str, cleanup: contextlib.ExitStack) -> str:
    """A file holding the token, readable by this user only, removed when the cluster stops: the user is
    told where the token is, never the token itself."""
    directory = cleanup.enter_context(tempfile.TemporaryDirectory(prefix="pathways-nb-token-"))
    path = os.path.join(directory, "token")
    security.write_token_file(path, token)
    return path


def _how_to_connect(
    cluster: LocalCluster, allocation: slurm.Allocation | None, output: str | None, token_file: str
) -> str:
    spec = cluster.spec
    where = f" on {allocation.describe()}" if allocation else ""
    logs = ", ".join(os.path.basename(path) for path in cluster.log_paths.values())
    lines = [
        f"pathways-nb cluster serving {cluster.address}: {spec.islands} island(s) x {spec.hosts_per_island} "
        f"host(s) x {spec.devices_per_host} {spec.platform} device(s){where}, started in {cluster.startup_s:.1f} s"
    ]
    if allocation is not None:
        lines.append(f"  in a notebook: %pathways connect slurm://{allocation.job_id}")
    if output is not None:
        lines.append(f"  connect with: pathways_nb.connect({os.path.join(output, connection_files.ADDRESS_FILE)!r})")
    else:
        lines.append(f"  connect with: pathways_nb.connect({cluster.address!r})")
    lines += [
        f"  or: JAX_PLATFORMS=proxy JAX_BACKEND_TARGET={cluster.address} python ...",
        f"  the cluster views need its token: export {security.TOKEN_ENV}=$(cat {token_file})",
        f"  profiles and checkpoints (gs://BUCKET/PATH) are written under {cluster.storage_root}",
        f"  its processes log ({cluster.log_level or 'WARNING'}) to {cluster.log_directory}/: {logs}",
        "    (pathways-nb logs [--follow] shows them; kept if the run fails)",
        f"  scancel {allocation.job_id} (or Ctrl-C) stops it." if allocation else "  Ctrl-C stops it.",
    ]
    return "\n".join(lines)

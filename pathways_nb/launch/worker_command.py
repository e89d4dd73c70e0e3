"""``pathways-nb worker``: one host's worker in a process of its own, serving its devices to a cluster.

Its parser is built with no server module imported (every ``pathways-nb`` command builds the whole
command line); a worker that joins a group of islands starts its member processes with this same
command (``member_arguments``).
"""

from __future__ import annotations

import argparse
import time

from pathways_nb.core import security
from pathways_nb.core.command_line import DEVICES_HELP, add_port_file, add_storage_root, add_suspend_memory_budget


def add_parser(commands, common: argparse.ArgumentParser) -> None:
    """The ``worker`` command, among ``commands``; ``common``: every command's flags."""
    worker = commands.add_parser("worker", parents=[common], help="serve this host's devices to a cluster")
    worker.add_argument("--resource_manager_address", required=True, help="HOST:PORT of the resource manager")
    worker.add_argument("--server_port", type=int, default=29005, help="port to listen on; 0 picks a free one")
    worker.add_argument("--host", default="127.0.0.1", help="address to listen on")
    worker.add_argument(
        "--advertise_address", default=None, help="host name or IP others reach this worker at (default --host)"
    )
    worker.add_argument("--island", type=int, default=0, help="the island (slice) this host belongs to")
    worker.add_argument("--host_index", type=int, default=0, help="this host's index within its island")
    worker.add_argument(
        "--hosts_per_island", type=int, default=1, help="hosts in this island (several: one SPMD runtime across them)"
    )
    worker.add_argument(
        "--coordinator_address",
        default=None,
        help="HOST:PORT of the island's host 0, which serves its distributed runtime (islands of several hosts)",
    )
    worker.add_argument("--devices", type=int, default=None, help=DEVICES_HELP)
    worker.add_argument("--platform", default="cpu", help="local platform: cpu, cuda, rocm, tpu, or auto")
    worker.add_argument(
        "--colocated_python",
        action="store_true",
        help="give each device a CPU device beside it for jax.experimental.colocated_python "
        "(CPU workers; docs/colocated_python.md)",
    )
    worker.add_argument(
        "--colocated_python_host",
        default=None,
        help="unix:PATH of this host's pathways-nb colocated-host, which starts the executors",
    )
    add_port_file(worker)
    worker.add_argument(
        "--log_directory",
        default=None,
        help="where the member processes this worker starts for groups of islands log (NAME.log) and keep their "
        "files (default: a temporary directory each)",
    )
    # Set by a worker for the member processes it starts (launch.members): not for people.
    worker.add_argument("--group_member", default=None, help=argparse.SUPPRESS)
    add_suspend_memory_budget(worker)
    add_storage_root(worker, "the worker writes profiles and checkpoints that clients ask for")
    security.add_arguments(worker, serve_tls=True, call_tls=True)
    worker.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Serves until stopped, or until the worker cannot stay in its cluster; the process's exit status."""
    from pathways_nb.core.storage import StorageRoot, default_root
    from pathways_nb.launch.members import GroupMembers, decode_membership
    from pathways_nb.launch.processes import StopRequest, serve_until_stopped
    from pathways_nb.worker.island import IslandMembership
    from pathways_nb.worker.runtime import LocalRuntime
    from pathways_nb.worker.server import WorkerServer

    stop = StopRequest()  # before the server starts: a worker that cannot stay in its cluster asks for it
    started = time.monotonic()
    # The collectives between hosts use the address the others reach this host at (not a wildcard).
    reachable = args.advertise_address or (None if args.host in ("0.0.0.0", "::", "[::]") else args.host)
    group = decode_membership(args.group_member) if args.group_member else None
    if group is not None:  # a member of a group of islands, started by this host's worker (launch.members)
        island = IslandMembership(
            group.members, group.member, group.coordinator_address, args.host, collectives_host=reachable
        )
        members = None
    else:
        island = IslandMembership(
            args.hosts_per_island,
            args.host_index,
            args.coordinator_address or "",
            args.host,
            collectives_host=reachable,
        )
        members = GroupMembers(
            lambda membership: member_arguments(args, membership),
            reachable or "127.0.0.1",
            args.host,
            log_directory=args.log_directory,
        )
    island.check()
    runtime = LocalRuntime(args.platform, args.devices, island=island, colocated_python=args.colocated_python)
    server = WorkerServer(
        runtime,
        args.resource_manager_address,
        island=group.island if group is not None else args.island,
        host_index=group.host_index if group is not None else args.host_index,
        port=args.server_port,
        host=args.host,
        advertise_address=args.advertise_address,
        credentials=security.ClusterCredentials.from_args(args),
        colocated_python_host=args.colocated_python_host,
        storage=StorageRoot(args.storage_root or default_root()),
        on_fatal=stop.fail,
        members=members,
        group=group,
        suspend_memory_budget=args.suspend_memory_budget,
    )
    message = (
        f"pathways-nb worker {server.registration.worker_id} at {server.address} with "
        f"{len(runtime.devices)} {runtime.platform} device(s) {list(server.registration.device_ids)}"
    )
    return serve_until_stopped(server, message, started, args.port_file, stop)


def member_arguments(args: argparse.Namespace, membership) -> list[str]:
    """The ``pathways-nb`` arguments of this worker's member of a group (its settings, the group's place)."""
    arguments = [
        "worker",
        "--resource_manager_address",
        args.resource_manager_address,
        "--server_port",
        "0",
        "--host",
        args.host,
        "--platform",
        args.platform,
        "--log_level",
        args.log_level,
    ]
    for flag, value in (
        ("--advertise_address", args.advertise_address),
        ("--devices", args.devices),
        ("--storage_root", args.storage_root),
        ("--suspend_memory_budget", args.suspend_memory_budget),
        ("--token_file", args.token_file),
        ("--tls_cert", args.tls_cert),
        ("--tls_key", args.tls_key),
        ("--tls_ca", args.tls_ca),
    ):
        if value is not None:
            arguments += [flag, str(value)]
    return arguments

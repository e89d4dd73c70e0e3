"""``pathways-nb resource-manager``: a cluster's resource manager in a process of its own.

Its parser is built with no server module imported (every ``pathways-nb`` command builds the whole
command line).
"""

from __future__ import annotations

import argparse
import time

from pathways_nb.core import security
from pathways_nb.core.command_line import add_port_file
from pathways_nb.rm import policy


def add_parser(commands, common: argparse.ArgumentParser) -> None:
    """The ``resource-manager`` command, among ``commands``; ``common``: every command's flags."""
    rm = commands.add_parser(
        "resource-manager", parents=[common], help="run a cluster's resource manager (islands, allocations, health)"
    )
    rm.add_argument("--server_port", type=int, default=29001, help="port to listen on; 0 picks a free one")
    rm.add_argument("--host", default="127.0.0.1", help="address to listen on")
    rm.add_argument("--node_type", default="resource_manager", choices=["resource_manager"], help=argparse.SUPPRESS)
    rm.add_argument("--instance_count", type=int, default=1, help="number of islands (slices)")
    rm.add_argument(
        "--instance_type",
        default=None,
        help="island shape PLATFORM:HOSTSxDEVICES, e.g. cpu:1x4 or gpu:2x8 (PLATFORM as jaxlib names the workers' "
        "devices: cpu, gpu (cuda and rocm mean gpu), tpu); unset: accept any workers",
    )
    rm.add_argument(
        "--worker_timeout",
        type=float,
        default=3.0,
        help="seconds within which a worker that vanished (host gone, network cut, stopped) is found dead",
    )
    policy.add_arguments(rm)
    add_port_file(rm)
    security.add_arguments(rm, serve_tls=True, call_tls=False)
    rm.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Serves until stopped; the process's exit status."""
    from pathways_nb.launch.processes import serve_until_stopped
    from pathways_nb.rm.server import ResourceManagerServer
    from pathways_nb.rm.topology import Topology

    started = time.monotonic()
    topology = Topology.parse(args.instance_count, args.instance_type) if args.instance_type else None
    server = ResourceManagerServer(
        topology,
        port=args.server_port,
        host=args.host,
        worker_timeout_s=args.worker_timeout,
        credentials=security.ClusterCredentials.from_args(args),
        suspend_idle_after_s=args.suspend_idle_after,
        suspend_idle_always=args.suspend_idle_always,
        priority_ceilings=args.priority_ceiling,
    )
    shape = f"{topology.islands} island(s) of {topology.instance_type}" if topology else "any workers"
    message = f"pathways-nb resource manager at {server.address} for {shape}"
    return serve_until_stopped(server, message, started, args.port_file)

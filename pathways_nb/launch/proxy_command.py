"""``pathways-nb proxy``: the IFRT proxy server in a process of its own, on this machine's devices or a cluster's.

Its parser is built with no server module imported: every ``pathways-nb`` command builds the whole
command line, and a server's process loads only its own side.
"""

from __future__ import annotations

import argparse
import time

from pathways_nb.core import security
from pathways_nb.core.command_line import DEVICES_HELP, add_port_file, add_storage_root


def add_parser(commands, common: argparse.ArgumentParser) -> None:
    """The ``proxy`` command, among ``commands`` (an ``add_subparsers()``); ``common``: every command's flags."""
    proxy = commands.add_parser(
        "proxy", parents=[common], help="serve the IFRT proxy protocol on this machine's devices (one process)"
    )
    proxy.add_argument("--server_port", type=int, default=29000, help="port to listen on; 0 picks a free one")
    proxy.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for all interfaces)")
    proxy.add_argument("--devices", type=int, default=None, help=DEVICES_HELP)
    proxy.add_argument("--platform", default="cpu", help="local platform: cpu, cuda, rocm, tpu, or auto")
    proxy.add_argument(
        "--host_buffer_timeout",
        type=float,
        default=60.0,
        help="seconds a request waits for its upload before failing",
    )
    proxy.add_argument(
        "--session_host_buffer_bytes",
        type=int,
        default=None,
        help="most bytes of host buffers (uploads, staged downloads) one session may hold; "
        "default: a quarter of this machine's RAM; 0: no limit",
    )
    proxy.add_argument(
        "--session_device_bytes",
        type=int,
        default=None,
        help="most bytes of arrays one session may keep on its devices; default: half of this machine's "
        "RAM, for CPU devices and for any cluster (--resource_manager_address: the proxy cannot see its workers' "
        "memory, so set it there), no limit for this machine's accelerators, whose runtime enforces its own; "
        "0: no limit",
    )
    add_port_file(proxy)
    add_storage_root(proxy, "the proxy writes its own profiles (and, without a cluster, its devices' ones)")
    proxy.add_argument(
        "--resource_manager_address",
        default=None,
        help="serve a cluster's devices (HOST:PORT of its resource manager) instead of this machine's",
    )
    proxy.add_argument(
        "--allocation_timeout",
        type=float,
        default=60.0,
        help="seconds a new session waits for devices before its connection fails",
    )
    # Its port also serves the IFRT protocol, whose stock client speaks plaintext only: no --tls_cert.
    security.add_arguments(proxy, serve_tls=False, call_tls=True)
    proxy.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Serves until stopped; the process's exit status."""
    from pathways_nb.core.storage import StorageRoot, default_root
    from pathways_nb.launch.processes import serve_until_stopped
    from pathways_nb.launch.slurm import job_end_reason
    from pathways_nb.proxy.context import ProxyLimits
    from pathways_nb.proxy.server import ProxyServer

    started = time.monotonic()
    credentials = security.ClusterCredentials.from_args(args)
    storage = StorageRoot(args.storage_root or default_root())
    if args.resource_manager_address:
        from pathways_nb.proxy.cluster_runtime import ClusterRuntime

        runtime = ClusterRuntime(
            args.resource_manager_address,
            allocation_timeout_s=args.allocation_timeout,
            credentials=credentials,
            storage=storage,
        )
        serving = f"the cluster of {args.resource_manager_address}"
        serving_cpu = True  # the proxy cannot see its workers' memory; their CPU devices are the default
    else:
        from pathways_nb.proxy.local_runtime import LocalProxyRuntime
        from pathways_nb.worker.runtime import LocalRuntime

        devices = LocalRuntime(args.platform, args.devices)
        runtime = LocalProxyRuntime(devices, storage)
        serving = f"{len(devices.devices)} {devices.platform} device(s)"
        serving_cpu = devices.platform == "cpu"
    limits = ProxyLimits(
        host_buffer_timeout_s=args.host_buffer_timeout,
        session_host_buffer_bytes=_memory_share(args.session_host_buffer_bytes, 4),
        session_device_bytes=_memory_share(args.session_device_bytes, 2 if serving_cpu else 0),
    )
    server = ProxyServer(
        runtime,
        port=args.server_port,
        host=args.host,
        limits=limits,
        credentials=credentials,
        stop_reason=job_end_reason,  # inside a Slurm job that ends, its clients are told so
    )
    message = f"pathways-nb proxy serving {server.address} with {serving}"
    return serve_until_stopped(server, message, started, args.port_file)


def _memory_share(flag: int | None, divisor: int) -> int:
    """``flag`` bytes if given, else this machine's RAM / ``divisor`` (0, no limit, when ``divisor`` is 0)."""
    if flag is not None:
        return flag
    if not divisor:
        return 0
    import psutil

    return psutil.virtual_memory().total // divisor

"""The ``pathways-nb`` command.

Flags follow Pathways' containers (``--server_port``, ``--resource_manager_address``)
so an operator who knows those recognizes them: every flag is declared with underscores,
and ``core.command_line.ArgumentParser`` also reads it with hyphens (``--hosts-per-island``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Sequence

from pathways_nb._version import __version__
from pathways_nb.core import security, tuning
from pathways_nb.core.command_line import ArgumentParser
from pathways_nb.errors import PathwaysError
from pathways_nb.launch.processes import LOG_FORMAT


def _serve_proxy(args: argparse.Namespace) -> int:
    from pathways_nb.core.storage import StorageRoot, default_root
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
    from pathways_nb.launch.slurm import job_end_reason

    server = ProxyServer(
        runtime,
        port=args.server_port,
        host=args.host,
        limits=limits,
        credentials=credentials,
        stop_reason=job_end_reason,  # inside a Slurm job that ends, its clients are told so
    )
    return _serve(server, f"pathways-nb proxy serving {server.address} with {serving}", started, args.port_file)


def _memory_share(flag: int | None, divisor: int) -> int:
    """``flag`` bytes if given, else this machine's RAM / ``divisor`` (0, no limit, when ``divisor`` is 0)."""
    if flag is not None:
        return flag
    if not divisor:
        return 0
    import psutil

    return psutil.virtual_memory().total // divisor


def _serve_resource_manager(args: argparse.Namespace) -> int:
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
    return _serve(server, f"pathways-nb resource manager at {server.address} for {shape}", started, args.port_file)


def _serve_worker(args: argparse.Namespace) -> int:
    from pathways_nb.core.storage import StorageRoot, default_root
    from pathways_nb.launch.members import GroupMembers, decode_membership
    from pathways_nb.launch.processes import StopRequest
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
            lambda membership: _member_arguments(args, membership),
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
    return _serve(server, message, started, args.port_file, stop)


def _member_arguments(args: argparse.Namespace, membership) -> list[str]:
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


def _serve_colocated_host(args: argparse.Namespace) -> int:
    from pathways_nb.launch.colocated_host import ColocatedHostServer, choose_policy

    started = time.monotonic()
    policy = choose_policy(args.colocated_python_executable, args.executor_uid_base)
    credentials = security.ClusterCredentials.from_args(args)
    if not credentials.token:
        logging.getLogger("pathways_nb").warning(
            "the colocated host at %s has no cluster token: any process that can open the socket may start "
            "executors (pass --token_file, as its worker does)",
            args.socket,
        )
    server = ColocatedHostServer(args.socket, policy, credentials=credentials)
    users = "a user of its own each" if policy.separate_users else "this host's user"
    message = f"pathways-nb colocated host at unix:{args.socket}: executors run as {users}"
    return _serve(server, message, started, args.port_file)


def _up(args: argparse.Namespace) -> int:
    from pathways_nb.launch.up import up

    return up(args)


def _logs(args: argparse.Namespace) -> int:
    from pathways_nb.launch import cluster_logs

    try:
        cluster_logs.show(cluster_logs.find(args.server_port), args.process, args.tail, args.follow)
    except KeyboardInterrupt:  # the end of --follow
        pass
    return 0


def _operator(args: argparse.Namespace):
    """An Observer of the proxy ``--address`` names (else ``$PATHWAYS_ADDRESS``), with the cluster token."""
    from pathways_nb.client.connection import ADDRESS_ENV, resolve_address
    from pathways_nb.client.observe import Observer

    address = args.address or os.environ.get(ADDRESS_ENV)
    if not address:
        raise ValueError(f"pass the proxy's --address HOST:PORT, or set {ADDRESS_ENV}")
    address, found_token = resolve_address(address)
    token = security.read_token_file(args.token_file) if args.token_file else found_token or security.token_from_env()
    return Observer(address, token)


def _operator_arguments(parser: argparse.ArgumentParser) -> None:
    """--address and --token_file, for a command an operator runs against a proxy."""
    parser.add_argument(
        "--address",
        default=None,
        help="the proxy's HOST:PORT, slurm://JOBID or address file (default: $PATHWAYS_ADDRESS)",
    )
    parser.add_argument(
        "--token_file",
        default=None,
        help="file holding the cluster token (default: the one beside --address's file, else $PATHWAYS_CLUSTER_TOKEN)",
    )


def _drain(args: argparse.Namespace) -> int:
    island, slash, host = args.host.partition("/")
    if not (slash and island.isdigit() and host.isdigit()):
        raise ValueError(f"name the host as ISLAND/HOST (e.g. 0/1), not {args.host!r}")
    place = (int(island), int(host))
    observer = _operator(args)
    try:
        state = observer.drain(*place, undo=args.undo)
        deadline = time.monotonic() + args.wait
        while not args.undo and state.drain_status != "drained" and time.monotonic() < deadline:
            time.sleep(0.5)
            found = [w for w in observer.state().workers if (w.island, w.host_index) == place]
            state = found[0] if found else state
    finally:
        observer.close()
    where = f"island {state.island} host {state.host_index} ({state.address})"
    if args.undo:
        print(f"{where} is back in service")
        return 0
    print(f"{where}: {state.drain_status}")
    return 0 if state.drain_status == "drained" or not args.wait else 1


def _sessions(args: argparse.Namespace) -> int:
    from pathways_nb.client import tables
    from pathways_nb.rpc import cluster_pb2 as pb

    if args.action != "list" and not args.session_ids:
        raise ValueError(
            f"name the sessions to {args.action} by id (pathways-nb sessions list shows them); a notebook "
            f"{args.action}s its own with %pathways {args.action}"
        )
    observer = _operator(args)
    address = observer.address
    try:
        infos = observer.control_sessions(
            pb.SessionControl.Action.Value(args.action.upper()), session_ids=args.session_ids
        )
    finally:
        observer.close()
    print(tables.sessions(infos).to_string(index=False) if infos else f"no sessions at {address}")
    return 0


def _kernel_install(args: argparse.Namespace) -> int:
    from pathways_nb.notebook.kernelspec import install

    prefix = sys.prefix if args.sys_prefix else args.prefix
    where = install(user=args.user, prefix=prefix, name=args.name)
    print(f'installed the "Python 3 (Pathways)" kernel in {where}')
    return 0


def _deploy_k8s(args: argparse.Namespace) -> int:
    from pathways_nb.deploy import Deployment, accelerator, write_kubernetes
    from pathways_nb.rm.policy import SessionPolicy

    deployment = Deployment(
        islands=args.islands,
        hosts_per_island=args.hosts_per_island,
        devices_per_host=args.devices_per_host,
        accelerator=accelerator(args.accelerator),
        image=args.image,
        name=args.name,
        namespace=args.namespace,
        colocated_python=args.colocated_python,
        policy=SessionPolicy(args.suspend_idle_after, args.suspend_idle_always, args.priority_ceiling),
    )
    for path in write_kubernetes(deployment, args.output):
        print(f"wrote {path}")
    print(f"next: build and push {args.image}, kubectl apply -f {args.output}, then see docs/kubernetes.md")
    return 0


def _deploy_slurm(args: argparse.Namespace) -> int:
    from pathways_nb.deploy import slurm

    deployment = slurm.SlurmDeployment(
        islands=args.islands,
        hosts_per_island=args.hosts_per_island,
        devices_per_host=args.devices_per_host,
        gpus_per_node=args.gpus_per_node,
        partition=args.partition,
        time=args.time,
        colocated_python=args.colocated_python,
        storage_root=args.storage_root,
        token_file=args.token_file,
        tls=security.TlsFiles.of(args.tls_cert, args.tls_key, args.tls_ca),
    )
    path = slurm.write(deployment, args.output)
    print(f"wrote {path}\nnext: sbatch {path}, then %pathways connect slurm://JOBID (see docs/slurm.md)")
    return 0


def _serve(server, message: str, started: float, port_file: str | None, stop=None) -> int:
    """Announces a started server, and stops it on SIGINT/SIGTERM, when its launcher dies, or when it fails
    (``stop.fail``: then the process exits with 1)."""
    from pathways_nb.launch.processes import StopRequest, announce_port, exit_with_parent

    stop = stop or StopRequest()
    stop.listen()  # (the server's start may have joined a JAX distributed runtime, which takes SIGTERM)
    exit_with_parent(stop.request)
    print(f"{message} (started in {time.monotonic() - started:.1f} s)", flush=True)
    if port_file:
        announce_port(port_file, server.port)
    logging.getLogger("pathways_nb").info("stopping %s", stop.wait())
    server.stop()
    return 1 if stop.failure is not None else 0


DEVICES_HELP = "number of CPU devices to create (default: JAX's, 1); accelerators always serve all of theirs"


def _byte_count(text: str) -> int:
    """A number of bytes, 0 or more (argparse's error otherwise)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of bytes (an integer, 0 or more)")
    return value


def _add_suspend_memory_budget(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--suspend_memory_budget",
        type=_byte_count,
        default=None,
        metavar="BYTES",
        help="bytes of suspended sessions' arrays a host keeps in its memory; beyond them they go to files under "
        "the storage root until the session resumes (default: no limit)",
    )


def _add_storage_root(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--storage_root",
        default=None,
        help=f"directory {what} under; a client's gs://BUCKET/PATH is BUCKET/PATH there, and nothing is "
        "written outside it (default: $TMPDIR/pathways-nb-$USER/storage)",
    )


def _add_deploy_slurm(targets, common: argparse.ArgumentParser) -> None:
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
    slurm.set_defaults(run=_deploy_slurm)


def build_parser() -> argparse.ArgumentParser:
    from pathways_nb.launch.colocated_host import DEFAULT_UID_BASE
    from pathways_nb.rm import policy

    parser = ArgumentParser(prog="pathways-nb", description="Run JAX on a Pathways-style cluster.")
    parser.add_argument("--version", action="version", version=f"pathways-nb {__version__}")
    # Taken by every command, and by a group of commands too (deploy, kernel): the level given last wins.
    # Its default is the program's, not each parser's, so a command's parser never resets the level given
    # before it (``deploy --log_level DEBUG k8s``).
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--log_level", default=argparse.SUPPRESS, help="Python log level (DEBUG, INFO, WARNING, ...); default WARNING"
    )
    parser.set_defaults(log_level="WARNING")
    commands = parser.add_subparsers(dest="command", required=True)

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
    proxy.add_argument("--port_file", default=None, help="write the bound port to this file once serving")
    _add_storage_root(proxy, "the proxy writes its own profiles (and, without a cluster, its devices' ones)")
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
    proxy.set_defaults(run=_serve_proxy)

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
    rm.add_argument("--port_file", default=None, help="write the bound port to this file once serving")
    security.add_arguments(rm, serve_tls=True, call_tls=False)
    rm.set_defaults(run=_serve_resource_manager)

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
    worker.add_argument("--port_file", default=None, help="write the bound port to this file once serving")
    worker.add_argument(
        "--log_directory",
        default=None,
        help="where the member processes this worker starts for groups of islands log (NAME.log) and keep their "
        "files (default: a temporary directory each)",
    )
    # Set by a worker for the member processes it starts (launch.members): not for people.
    worker.add_argument("--group_member", default=None, help=argparse.SUPPRESS)
    _add_suspend_memory_budget(worker)
    _add_storage_root(worker, "the worker writes profiles and checkpoints that clients ask for")
    security.add_arguments(worker, serve_tls=True, call_tls=True)
    worker.set_defaults(run=_serve_worker)

    colocated = commands.add_parser(
        "colocated-host",
        parents=[common],
        help="start and stop the colocated Python executors of this host's worker (beside it)",
    )
    colocated.add_argument("--socket", required=True, help="the unix socket to serve on")
    colocated.add_argument(
        "--colocated_python_executable",
        default=None,
        help="the Python interpreter executors run (default: this one); other users must be able to read it "
        "for executors to run as users of their own",
    )
    colocated.alias("--executor_python", "--colocated_python_executable")
    colocated.add_argument(
        "--executor_uid_base",
        type=int,
        default=DEFAULT_UID_BASE,
        help="executors run as users from this uid on, one each (when this host runs as root)",
    )
    colocated.add_argument("--port_file", default=None, help="write 0 to this file once serving (for launchers)")
    security.add_arguments(colocated, serve_tls=False, call_tls=False)
    colocated.set_defaults(run=_serve_colocated_host)

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
    _add_suspend_memory_budget(up)
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
    up.set_defaults(run=_up)

    logs = commands.add_parser(
        "logs", parents=[common], help="show the logs of a cluster that pathways-nb up (or LocalCluster) runs here"
    )
    logs.add_argument(
        "process", nargs="*", help="which processes (proxy, resource-manager, worker-0-0, ...; default: all)"
    )
    logs.add_argument(
        "--server_port", type=int, default=None, help="the cluster whose proxy has this port (default: the only one)"
    )
    logs.add_argument("--follow", action="store_true", help="keep showing new lines until the cluster stops")
    logs.add_argument("--tail", type=int, default=None, help="only the last N lines of each (default: all)")
    logs.set_defaults(run=_logs)

    sessions = commands.add_parser(
        "sessions", parents=[common], help="list a cluster's sessions, or suspend or resume some of them"
    )
    sessions.add_argument("action", nargs="?", default="list", choices=["list", "suspend", "resume"])
    sessions.add_argument(
        "session_ids", nargs="*", type=int, metavar="SESSION_ID", help="the sessions to act on (list: default all)"
    )
    _operator_arguments(sessions)
    sessions.set_defaults(run=_sessions)

    drain = commands.add_parser(
        "drain",
        parents=[common],
        help="drain a host: its sessions move to devices like theirs, then it may be stopped without losing work",
    )
    drain.add_argument("host", metavar="ISLAND/HOST", help="the host, as island and host index (e.g. 0/1)")
    drain.add_argument("--undo", action="store_true", help="put the host back in service")
    drain.add_argument(
        "--wait",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="wait up to this long until the host is drained (exit status 1 if it is not by then; default: 0)",
    )
    _operator_arguments(drain)
    drain.set_defaults(run=_drain)

    deploy = commands.add_parser("deploy", parents=[common], help="write what runs a cluster on other machines")
    targets = deploy.add_subparsers(dest="deploy_target", required=True)
    k8s = targets.add_parser(
        "k8s", parents=[common], help="Kubernetes: a JobSet, the proxy's Service, the token Secret, a Dockerfile"
    )
    k8s.add_argument("--islands", type=int, required=True, help="number of islands (one worker Job each)")
    k8s.add_argument("--hosts_per_island", type=int, required=True, help="hosts (worker pods) per island")
    k8s.add_argument("--devices_per_host", type=int, required=True, help="devices (chips) per host")
    k8s.add_argument("--accelerator", default="cpu", help="cpu, tpu-v5e:2x2 or nvidia-h100:8 (default cpu)")
    k8s.add_argument("--image", default=f"pathways-nb:{__version__}", help="the image built from this repository")
    k8s.add_argument("--namespace", default=None, help="Kubernetes namespace (default: kubectl's current one)")
    k8s.add_argument("--name", default="pathways-nb", help="the JobSet's name, which prefixes every object's")
    k8s.add_argument(
        "--colocated_python",
        action="store_true",
        help="run tenants' jax.experimental.colocated_python beside the devices: each worker pod gets a "
        "colocated-host sidecar (CPU workers; docs/colocated_python.md)",
    )
    policy.add_arguments(k8s)
    k8s.add_argument("--output", required=True, help="directory to write the files into")
    k8s.set_defaults(run=_deploy_k8s)
    _add_deploy_slurm(targets, common)

    kernel = commands.add_parser("kernel", parents=[common], help="the Jupyter kernel")
    kernel_commands = kernel.add_subparsers(dest="kernel_command", required=True)
    install = kernel_commands.add_parser("install", parents=[common], help='install the "Python 3 (Pathways)" kernel')
    where = install.add_mutually_exclusive_group()
    where.add_argument("--user", action="store_true", help="for this user only")
    where.add_argument("--sys_prefix", action="store_true", help="in this Python environment")
    where.add_argument("--prefix", default=None, help="under this prefix")
    install.add_argument("--name", default="pathways", help="the kernel's name")
    install.set_defaults(run=_kernel_install)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
    try:
        return args.run(args)
    except (ValueError, OSError, PathwaysError) as e:
        parser.exit(2, f"pathways-nb {args.command}: {e}\n")


if __name__ == "__main__":
    sys.exit(main())

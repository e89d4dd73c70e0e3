"""``python -m pathways_nb.colocated.executor``: started by the host's supervisor, never by hand.

With ``--user``, its first act is to become that user (and group, with no other groups): the
supervisor starts it as itself, because a process with gRPC's threads must not fork and then
change users before ``exec`` (gRPC's fork handlers crash the child), while starting a process
without changing anything lets Python use ``vfork``. It ends with its supervisor (the kernel's
parent-death signal, set after the user changed, which clears it) and on SIGTERM; it says it
serves by writing a line to ``--ready_fd``, and writes its Python output and logging records, tagged
with their calls, to ``--output_fd`` (``pathways_nb.colocated.executor.output``). ``--probe`` only checks that
the user can import what an executor needs (the interpreter and its libraries must be readable by
other users).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys
import threading
from concurrent import futures
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def _become(uid: int) -> None:
    """This user and its group (of the same number), with no supplementary groups, for good."""
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    if os.getuid() != uid or os.geteuid() != uid:
        raise SystemExit(f"could not become user {uid}")


def _end_with_parent(parent: int) -> None:
    """SIGKILL when the supervisor dies (set here: a change of user clears it), and now if it already has."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pathways_nb.colocated.executor")
    parser.add_argument("--user", type=int, default=None, help="the uid (and gid) to run as")
    parser.add_argument("--probe", action="store_true", help="only check that this user can import jax")
    parser.add_argument("--socket", help="unix socket path to serve on")
    parser.add_argument("--directory", help="this executor's own directory")
    parser.add_argument("--devices", help="cluster ids of the host's colocated CPU devices, a,b,...")
    parser.add_argument("--parent", type=int, help="the supervisor's pid")
    parser.add_argument("--ready_fd", type=int, help="write a line here once serving")
    parser.add_argument("--output_fd", type=int, help="write output records here (colocated.executor.output)")
    args = parser.parse_args(argv)
    if args.user is not None:
        _become(args.user)
    if args.probe:
        import cloudpickle  # noqa: F401
        import grpc
        import jax

        return 0
    _end_with_parent(args.parent)
    from pathways_nb.colocated.executor.output import OutputChannel, capture

    channel = OutputChannel(args.output_fd)
    capture(channel)
    device_ids = [int(i) for i in args.devices.split(",") if i]

    import grpc
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", len(device_ids))

    from pathways_nb.colocated.executor.programs import ColocatedDevices
    from pathways_nb.colocated.executor.service import ExecutorService
    from pathways_nb.rpc import cluster_pb2_grpc

    devices = ColocatedDevices(device_ids)
    devices.install()
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="colocated-python"),
        options=[("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)],
    )
    service = ExecutorService(devices, Path(args.directory), channel)
    cluster_pb2_grpc.add_ColocatedExecutorServicer_to_server(service, server)
    if not server.add_insecure_port(f"unix:{args.socket}"):
        print(f"cannot listen on {args.socket}", file=sys.__stderr__)
        return 1
    server.start()
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    with os.fdopen(args.ready_fd, "w") as ready:
        ready.write("ready\n")
    while not stopped.wait(1.0):
        pass
    server.stop(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())

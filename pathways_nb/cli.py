"""The ``pathways-nb`` command.

Flags follow Pathways' containers (``--server_port``, ``--resource_manager_address``)
so an operator who knows those recognizes them.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
from collections.abc import Sequence

from pathways_nb import __version__


def _serve_proxy(args: argparse.Namespace) -> int:
    from pathways_nb.proxy.context import ProxyLimits
    from pathways_nb.proxy.server import ProxyServer
    from pathways_nb.worker.runtime import LocalRuntime

    started = time.monotonic()
    runtime = LocalRuntime(args.platform, args.devices)
    limits = ProxyLimits(host_buffer_timeout_s=args.host_buffer_timeout)
    server = ProxyServer(runtime, port=args.server_port, host=args.host, limits=limits)
    _stop_on_signals(server.stop)
    print(
        f"pathways-nb proxy serving {server.address} with {len(runtime.devices)} {runtime.platform} "
        f"device(s) (started in {time.monotonic() - started:.1f} s)",
        flush=True,
    )
    if args.port_file:
        with open(args.port_file, "w") as f:
            f.write(str(server.port))
    server.wait()
    return 0


def _stop_on_signals(stop) -> None:
    def handler(signum, _frame):
        logging.getLogger("pathways_nb").info("stopping on %s", signal.Signals(signum).name)
        stop()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pathways-nb", description="Run JAX on a Pathways-style cluster.")
    parser.add_argument("--version", action="version", version=f"pathways-nb {__version__}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log_level", default="WARNING", help="Python log level (DEBUG, INFO, WARNING, ...)")
    commands = parser.add_subparsers(dest="command", required=True)

    proxy = commands.add_parser(
        "proxy", parents=[common], help="serve the IFRT proxy protocol on this machine's devices (one process)"
    )
    proxy.add_argument("--server_port", type=int, default=29000, help="port to listen on; 0 picks a free one")
    proxy.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for all interfaces)")
    proxy.add_argument("--devices", type=int, default=None, help="number of CPU devices to create (CPU only)")
    proxy.add_argument("--platform", default="cpu", help="local platform: cpu, cuda, rocm, tpu, or auto")
    proxy.add_argument(
        "--host_buffer_timeout",
        type=float,
        default=60.0,
        help="seconds a request waits for its upload before failing",
    )
    proxy.add_argument("--port_file", default=None, help="write the bound port to this file once serving")
    proxy.set_defaults(run=_serve_proxy)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())

"""``pathways-nb colocated-host``: the colocated Python executors of one host, started by a process of their own
(``colocated.host``), beside its worker.
"""

from __future__ import annotations

import argparse
import logging
import time

from pathways_nb.core import security


def add_parser(commands, common: argparse.ArgumentParser) -> None:
    """The ``colocated-host`` command, among ``commands``; ``common``: every command's flags."""
    from pathways_nb.colocated.host import DEFAULT_UID_BASE

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
    colocated.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Serves until stopped; the process's exit status."""
    from pathways_nb.colocated.host import ColocatedHostServer, choose_policy
    from pathways_nb.launch.processes import serve_until_stopped

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
    return serve_until_stopped(server, message, started, args.port_file)

"""The ``pathways-nb`` command: the commands of each part of pathways-nb, assembled.

Each command is declared and run by the module that implements it (``add_parser``, which sets
``run``): the servers' in ``launch.proxy_command``, ``launch.resource_manager_command``,
``launch.worker_command`` and ``launch.colocated_host_command`` (starting a server's process is the
launch layer's, above the servers); ``up`` and ``logs`` in ``launch``; ``sessions`` and ``drain`` in
``client.operate``; ``deploy`` and ``kernel`` in ``deploy`` and ``notebook.kernelspec``. Building the
parser imports no server and nothing of the client's (jax's backends, pandas): a command's ``run``
imports what it needs.

Flags follow Pathways' containers (``--server_port``, ``--resource_manager_address``)
so an operator who knows those recognizes them: every flag is declared with underscores,
and ``core.command_line.ArgumentParser`` also reads it with hyphens (``--hosts-per-island``).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from pathways_nb import deploy
from pathways_nb._version import __version__
from pathways_nb.client import operate
from pathways_nb.core.command_line import ArgumentParser
from pathways_nb.errors import PathwaysError
from pathways_nb.launch import (
    cluster_logs,
    colocated_host_command,
    proxy_command,
    resource_manager_command,
    up,
    worker_command,
)
from pathways_nb.launch.processes import LOG_FORMAT
from pathways_nb.notebook import kernelspec


def build_parser() -> argparse.ArgumentParser:
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
    for add_parser in (
        proxy_command.add_parser,
        resource_manager_command.add_parser,
        worker_command.add_parser,
        colocated_host_command.add_parser,
        up.add_parser,
        cluster_logs.add_parser,
        operate.add_parsers,  # sessions, drain
        deploy.add_parser,
        kernelspec.add_parser,
    ):
        add_parser(commands, common)
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

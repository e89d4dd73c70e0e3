"""``pathways-nb sessions`` and ``pathways-nb drain``: what an operator does to a running cluster from a terminal,
through its proxy (the cluster token's holder; ``client.observe.Observer``).

The parsers import nothing of the client: every ``pathways-nb`` command, the servers' too, builds the
whole command line.
"""

from __future__ import annotations

import argparse
import os

from pathways_nb.core import security

# How often ``drain --wait`` asks whether the host is drained.
DRAIN_POLL_S = 0.5


def add_parsers(commands, common: argparse.ArgumentParser) -> None:
    """The ``sessions`` and ``drain`` commands, among ``commands``; ``common``: every command's flags."""
    sessions = commands.add_parser(
        "sessions", parents=[common], help="list a cluster's sessions, or suspend or resume some of them"
    )
    sessions.add_argument("action", nargs="?", default="list", choices=["list", "suspend", "resume"])
    sessions.add_argument(
        "session_ids", nargs="*", type=int, metavar="SESSION_ID", help="the sessions to act on (list: default all)"
    )
    _add_proxy_arguments(sessions)
    sessions.set_defaults(run=run_sessions)

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
    _add_proxy_arguments(drain)
    drain.set_defaults(run=run_drain)


def _add_proxy_arguments(parser: argparse.ArgumentParser) -> None:
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


def _observer(args: argparse.Namespace):
    """An Observer of the proxy ``--address`` names (else ``$PATHWAYS_ADDRESS``), with the cluster token."""
    from pathways_nb.client.connection import ADDRESS_ENV, resolve_address
    from pathways_nb.client.observe import Observer

    address = args.address or os.environ.get(ADDRESS_ENV)
    if not address:
        raise ValueError(f"pass the proxy's --address HOST:PORT, or set {ADDRESS_ENV}")
    address, found_token = resolve_address(address)
    token = security.read_token_file(args.token_file) if args.token_file else found_token or security.token_from_env()
    return Observer(address, token)


def run_drain(args: argparse.Namespace) -> int:
    """Drains the host (or, ``--undo``, puts it back), waiting ``--wait`` seconds at most; exit status 1 if it
    waited and the host is not drained."""
    from pathways_nb.core.wait import poll

    island, slash, host = args.host.partition("/")
    if not (slash and island.isdigit() and host.isdigit()):
        raise ValueError(f"name the host as ISLAND/HOST (e.g. 0/1), not {args.host!r}")
    place = (int(island), int(host))
    observer = _observer(args)

    def host_state():
        nonlocal state  # (a host gone from the cluster's state stays as it was last seen)
        found = [w for w in observer.state().workers if (w.island, w.host_index) == place]
        state = found[0] if found else state
        return state

    try:
        state = observer.drain(*place, undo=args.undo)
        if not args.undo and args.wait and state.drain_status != "drained":
            state, _drained = poll(
                host_state, args.wait, holds=lambda s: s.drain_status == "drained", interval_s=DRAIN_POLL_S
            )
    finally:
        observer.close()
    where = f"island {state.island} host {state.host_index} ({state.address})"
    if args.undo:
        print(f"{where} is back in service")
        return 0
    print(f"{where}: {state.drain_status}")
    return 0 if state.drain_status == "drained" or not args.wait else 1


def run_sessions(args: argparse.Namespace) -> int:
    """Lists the cluster's sessions, or suspends or resumes those named; prints the table."""
    from pathways_nb.client import tables
    from pathways_nb.rpc import cluster_pb2 as pb

    if args.action != "list" and not args.session_ids:
        raise ValueError(
            f"name the sessions to {args.action} by id (pathways-nb sessions list shows them); a notebook "
            f"{args.action}s its own with %pathways {args.action}"
        )
    observer = _observer(args)
    address = observer.address
    try:
        infos = observer.control_sessions(
            pb.SessionControl.Action.Value(args.action.upper()), session_ids=args.session_ids
        )
    finally:
        observer.close()
    print(tables.sessions(infos).to_string(index=False) if infos else f"no sessions at {address}")
    return 0

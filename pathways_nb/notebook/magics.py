"""The ``%pathways`` magic: connect, look at the cluster, time the steps, profile the devices, pause.

    %pathways connect ADDRESS [--exclusive] [--devices N] [--only_islands 0,1] [--tenant T] [--weight W] [--one_slice]
                              [--priority N] [--timeout S] [--token T]
        (ADDRESS: grpc://HOST:PORT, slurm://JOBID of a Slurm job's cluster, or a cluster's address file)
    %pathways connect local [--islands I] [--hosts_per_island H] [--devices_per_host D]
    %pathways disconnect | status | devices | islands | allocations | sessions | help
    %pathways suspend | resume      (give your devices back, keeping your arrays; take them again)
    %pathways timeline [--live] [--last N]
    %pathways trace FILE [--last N]
    %pathways logs [--workers]
    %%pathways profile LOGDIR [--hosts N] [--no_servers] [--python]   (a cell magic: profiles the cell)

Each subcommand calls the public Python API (``pathways_nb.connect``,
``Session.islands()``, ``Session.timeline()``, ...); misuse and failures
raise ``UsageError`` with one line that says what to do. Flags are spelled as the
``pathways-nb`` command's (``--hosts_per_island``), and read with hyphens too.
"""

from __future__ import annotations

import itertools
import shlex

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.display import display

from pathways_nb.client import connection, profiles
from pathways_nb.core.command_line import ArgumentParser
from pathways_nb.errors import PathwaysError
from pathways_nb.notebook import cell_output
from pathways_nb.notebook.progress import ActivityMonitor

NOT_CONNECTED = "not connected: run %pathways connect ADDRESS (or %pathways connect local)"


class _Parser(ArgumentParser):
    """argparse that reports misuse as a one-line UsageError instead of exiting."""

    def error(self, message: str):
        if message.endswith("expected one argument"):  # also when the value begins with '-' (a token may)
            message += "; a value that begins with '-' goes as --option=VALUE"
        raise UsageError(f"%pathways: {message} (see %pathways help)")

    def exit(self, status: int = 0, message: str | None = None):
        if message:
            raise UsageError(message.strip())
        raise UsageError("%pathways help")


def _words(line: str) -> list[str]:
    """The line's words (``shlex``); a word that starts with ``#`` begins a comment, as in a shell.

    IPython hands a line magic the rest of its line, comment included
    (``%pathways islands   # who holds which device``).
    """
    return list(itertools.takewhile(lambda word: not word.startswith("#"), shlex.split(line)))


def _parser() -> _Parser:
    parser = _Parser(prog="%pathways", add_help=False, description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", parser_class=_Parser)
    connect = commands.add_parser("connect", add_help=False, help="connect to a cluster, or start one here")
    connect.add_argument("address", help="grpc://host:port, host:port, slurm://JOBID, an address file, or local")
    connect.add_argument("--exclusive", action="store_true", help="nobody else may use your devices")
    connect.add_argument("--devices", type=int, default=0, help="how many devices (default: all)")
    connect.add_argument("--only_islands", default="", help="which islands, e.g. 0,1 (default: any)")
    connect.add_argument("--tenant", default=None, help="your name in the allocation table")
    connect.add_argument(
        "--weight", type=float, default=1.0, help="your share of busy devices against other tenants' (default 1)"
    )
    connect.add_argument(
        "--one_slice", action="store_true", help="all islands one slice (jax.make_mesh spans them; default: one each)"
    )
    connect.add_argument(
        "--priority", type=int, default=0, help="higher goes first; may suspend lower sessions (default 0)"
    )
    connect.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the server and devices")
    connect.add_argument("--token", default=None, help="the cluster token (default: $PATHWAYS_CLUSTER_TOKEN)")
    connect.add_argument("--islands", type=int, default=2, help="local: number of islands")
    connect.add_argument("--hosts_per_island", type=int, default=1, help="local: hosts per island")
    connect.add_argument("--devices_per_host", type=int, default=4, help="local: devices per host")
    for name, text in [
        ("disconnect", "back to this machine's devices"),
        ("status", "the session and the cluster's health"),
        ("devices", "the cluster's devices as a table"),
        ("islands", "the island map"),
        ("allocations", "who holds which devices"),
        ("sessions", "every session: running or suspended, and why"),
        ("suspend", "give your devices back to the cluster, keeping your arrays"),
        ("resume", "take your devices again (the next computation does it too)"),
        ("help", "this help"),
    ]:
        commands.add_parser(name, add_help=False, help=text)
    timeline = commands.add_parser("timeline", add_help=False, help="the step timeline of this session")
    timeline.add_argument("--live", action="store_true", help="keep it current while a loop runs")
    timeline.add_argument("--last", type=int, default=None, help="only the last N steps")
    trace = commands.add_parser("trace", add_help=False, help="write the timeline as a Chrome/Perfetto trace")
    trace.add_argument("file")
    trace.add_argument("--last", type=int, default=None, help="only the last N steps")
    logs = commands.add_parser("logs", add_help=False, help="what your code beside the devices printed lately")
    logs.add_argument(
        "--workers", action="store_true", help="the workers' lines about your programs instead (errors, warnings)"
    )
    profile = commands.add_parser("profile", add_help=False, help="(cell magic) profile the cell on the devices")
    profile.add_argument("logdir", help="the run directory (xprof --logdir / TensorBoard reads it)")
    profile.add_argument("--hosts", type=int, default=0, help="trace at most N hosts (default: all)")
    profile.add_argument("--no_servers", action="store_true", help="leave the proxy and resource manager out")
    profile.add_argument("--python", action="store_true", help="record Python calls too")
    return parser


@magics_class
class PathwaysMagics(Magics):
    def __init__(self, shell):
        super().__init__(shell)
        self.monitor = ActivityMonitor()
        self.views: list = []

    @line_cell_magic
    def pathways(self, line: str, cell: str | None = None):
        """Connect to a Pathways cluster and look at it; ``%pathways help`` lists the subcommands."""
        args = _parser().parse_args(_words(line))
        command = args.command or "help"
        if (cell is None) == (command == "profile"):
            raise UsageError(
                "%%pathways profile LOGDIR is a cell magic (the cell is what it profiles); "
                "the other subcommands are line magics: %pathways " + command
            )
        try:
            if cell is not None:
                return self._profile(args, cell)
            return getattr(self, f"_{command}")(args)
        except PathwaysError as error:
            raise UsageError(str(error)) from None

    # -- subcommands -----------------------------------------------------------------------

    def _help(self, args) -> None:
        print(__doc__.split("\n\n")[1])

    def _connect(self, args) -> None:
        current = connection.current()
        if current is not None:
            raise UsageError(f"already connected to {current.address}: run %pathways disconnect first")
        cluster = None
        address = args.address
        if address == "local":
            from pathways_nb.launch.local_cluster import LocalCluster

            try:
                cluster = LocalCluster(
                    islands=args.islands,
                    hosts_per_island=args.hosts_per_island,
                    devices_per_host=args.devices_per_host,
                )
            except ValueError as error:
                raise UsageError(f"%pathways connect local: {error}") from None
            address = cluster.address
        try:
            session = connection.connect(
                address,
                timeout_s=args.timeout,
                exclusive=args.exclusive,
                num_devices=args.devices,
                islands=[int(i) for i in args.only_islands.split(",") if i.strip()],
                tenant=args.tenant,
                token=args.token,
                weight=args.weight,
                one_slice=args.one_slice,
                priority=args.priority,
            )
        except (PathwaysError, ValueError) as error:
            if cluster is not None:
                cluster.close()
            raise UsageError(str(error)) from None
        session.local_cluster = cluster
        self.monitor.watch(session)
        display(session)

    def _session(self) -> connection.Session:
        session = connection.current()
        if session is None:
            raise UsageError(NOT_CONNECTED)
        return session

    def _disconnect(self, args) -> None:
        session = connection.current()
        if session is None:
            print("not connected")
            return
        for view in self.views:
            view_stop = getattr(view, "stop", None)
            if view_stop is not None:
                view_stop()
        self.views.clear()
        self.monitor.watch(None)
        connection.disconnect()
        print(f"disconnected from {session.address}; JAX uses this machine's devices again")

    def _status(self, args) -> None:
        session = self._session()
        session.device_table()  # fetches the state the summary shows
        display(session)

    def _devices(self, args) -> None:
        display(self._session().device_table())

    def _islands(self, args) -> None:
        from pathways_nb.notebook.widgets import IslandMap

        display(IslandMap(self._session()))

    def _allocations(self, args) -> None:
        from pathways_nb.notebook.widgets import AllocationTable

        display(AllocationTable(self._session()))

    def _sessions(self, args) -> None:
        display(self._session().sessions())

    def _suspend(self, args) -> None:
        display(self._session().suspend())
        print("suspended: your arrays are kept; your next computation resumes the session (or %pathways resume)")

    def _resume(self, args) -> None:
        display(self._session().resume())

    def _timeline(self, args) -> None:
        from pathways_nb.notebook.widgets import TimelineView

        view = TimelineView(self._session(), last=args.last, live=args.live)
        if args.live:
            self.views.append(view)
        display(view)

    def _trace(self, args) -> None:
        timeline = self._session().timeline(last=args.last)
        path = timeline.save_trace(args.file)
        print(
            f"wrote {len(timeline.events)} events on {len(timeline.devices)} device tracks to {path} "
            "(open it in https://ui.perfetto.dev or chrome://tracing)"
        )

    def _logs(self, args) -> None:
        text = self._session().logs(workers=args.workers)
        what = "the workers' lines about this session's programs" if args.workers else "remote output"
        print(text or f"no {what} yet", end="" if text else "\n")

    def _profile(self, args, cell: str):
        """Runs the cell inside ``pathways_nb.profile``; its result (the ``Profile``) shows what the devices did."""
        self._session()
        with profiles.profile(
            args.logdir, hosts=args.hosts, include_servers=not args.no_servers, python_tracer=args.python
        ) as run:
            result = self.shell.run_cell(cell)
        print(f"{len(run.files)} trace files in {run.directory}\nPerfetto: {run.perfetto}\nXProf: {run.xprof_command}")
        if not result.success:
            result.raise_error()
        return run  # shown as the cell's result; ``_.trace`` is what the devices did


def load(ipython) -> None:
    """Registers the magics and the progress bars (``%load_ext pathways_nb``)."""
    magics = PathwaysMagics(ipython)
    ipython.register_magics(magics)
    cell_output.print_under_cells(ipython)
    ipython.events.register("pre_run_cell", magics.monitor.cell_started)
    ipython.events.register("post_run_cell", magics.monitor.cell_finished)

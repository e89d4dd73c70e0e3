"""A local cluster's logs, for processes other than the one that started it (``pathways-nb logs``).

A running ``LocalCluster`` (``pathways-nb up``, ``%pathways connect local``) records itself in this
user's directory of running clusters, ``$TMPDIR/pathways-nb-$USER/clusters/PORT.json`` (PORT: its
proxy's port): the process that owns it, its address and directory, and each of its processes' log
file. ``close()`` removes the record; one whose owner died without removing it (SIGKILL) is ignored,
and removed by the next reader.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TextIO

from pathways_nb.core.storage import user_directory
from pathways_nb.core.wait import wait_until

# How often a followed log is read again for new lines.
FOLLOW_INTERVAL_S = 0.25


def add_parser(commands, common: argparse.ArgumentParser) -> None:
    """The ``logs`` command, among ``commands``; ``common``: every command's flags."""
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
    logs.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Shows the logs (and with ``--follow``, new lines until the cluster stops or Ctrl-C); exit status 0."""
    with contextlib.suppress(KeyboardInterrupt):  # the end of --follow
        show(find(args.server_port), args.process, args.tail, args.follow)
    return 0


@dataclass(frozen=True)
class ClusterRecord:
    """What another process needs to find a running local cluster's logs."""

    address: str
    port: int
    pid: int  # the process that owns the cluster: the record is stale once it is gone
    directory: str
    logs: dict[str, str]  # process name ("proxy", "worker-0-0", ...) -> its log file

    def alive(self) -> bool:
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # a process of another user took the pid: the owner is gone
            return False
        return os.path.isdir(self.directory)


def records_directory() -> Path:
    return user_directory() / "clusters"


def _path(port: int) -> Path:
    return records_directory() / f"{port}.json"


def record(entry: ClusterRecord) -> Path:
    """Records a started cluster (atomically: a reader never sees half a record)."""
    directory = records_directory()
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = _path(entry.port)
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps(asdict(entry)))
    os.replace(partial, path)
    return path


def forget(entry: ClusterRecord) -> None:
    """Removes the record of a cluster that stops (unless another cluster has recorded its port since)."""
    path = _path(entry.port)
    try:
        if json.loads(path.read_text()).get("pid") == entry.pid:
            path.unlink()
    except (OSError, ValueError):
        pass  # already gone, or not ours to remove


def running() -> list[ClusterRecord]:
    """This user's running local clusters, by port; removes the records of clusters whose owner died."""
    found = []
    for path in sorted(records_directory().glob("*.json")):
        try:
            entry = ClusterRecord(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            continue  # removed while we read, or not a record
        if entry.alive():
            found.append(entry)
        else:
            path.unlink(missing_ok=True)
    return sorted(found, key=lambda entry: entry.port)


def find(port: int | None = None) -> ClusterRecord:
    """The running local cluster whose proxy listens on ``port``, or the only one; a ``ValueError`` that says
    what to do otherwise."""
    clusters = running()
    if port is not None:
        chosen = [entry for entry in clusters if entry.port == port]
        if not chosen:
            raise ValueError(f"no local cluster of yours serves port {port}; running: {_listing(clusters)}")
        return chosen[0]
    if not clusters:
        raise ValueError("no local cluster of yours is running: start one with pathways-nb up")
    if len(clusters) > 1:
        raise ValueError(
            f"{len(clusters)} local clusters of yours are running ({_listing(clusters)}): "
            "choose one with --server_port PORT"
        )
    return clusters[0]


def _listing(clusters: list[ClusterRecord]) -> str:
    return ", ".join(f"{entry.address} (pid {entry.pid})" for entry in clusters) or "none"


def show(
    entry: ClusterRecord,
    names: list[str] | None = None,
    tail: int | None = None,
    follow: bool = False,
    out: TextIO | None = None,
) -> None:
    """Writes the logs of ``names`` (default: every process) to ``out`` (default: stdout), each line after its
    process's name; the last ``tail`` lines of each; with ``follow``, then new lines as they come, until the
    cluster stops."""
    out = out or sys.stdout
    unknown = sorted(set(names or ()) - set(entry.logs))
    if unknown:
        raise ValueError(
            f"the cluster at {entry.address} has no process {', '.join(unknown)}; its processes: "
            + ", ".join(entry.logs)
        )
    logs = {name: entry.logs[name] for name in (names or entry.logs)}
    width = max(map(len, logs), default=0)
    positions = dict.fromkeys(logs, 0)
    for name, path in logs.items():
        _write_new(out, name, width, path, positions, tail)
    out.flush()
    if not follow:
        return

    def copied_all_and_stopped() -> bool:
        wrote = any([_write_new(out, name, width, path, positions) for name, path in logs.items()])
        out.flush()
        return not wrote and not entry.alive()

    wait_until(copied_all_and_stopped, None, "the cluster's end", interval_s=FOLLOW_INTERVAL_S)
    out.write(f"(the cluster at {entry.address} stopped)\n")
    out.flush()


def _write_new(
    out: TextIO, name: str, width: int, path: str, positions: dict[str, int], tail: int | None = None
) -> bool:
    """Writes the whole lines added to ``path`` since ``positions[name]`` (the last ``tail`` of them); whether
    there were any."""
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size < positions[name]:
                positions[name] = 0  # written anew
            f.seek(positions[name])
            data = f.read()
    except OSError:
        return False
    complete = data[: data.rfind(b"\n") + 1]  # a line still being written waits for its end
    positions[name] += len(complete)
    lines = complete.splitlines()
    _write(out, name, width, lines[max(0, len(lines) - tail) :] if tail is not None else lines)
    return bool(complete)


def _write(out: TextIO, name: str, width: int, lines) -> None:
    for line in lines:
        out.write(f"{name:<{width}} | {line.decode(errors='replace')}\n")

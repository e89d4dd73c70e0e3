"""Progress bars for long operations while a cell runs: compiles, large transfers, waiting for devices,
suspending and resuming sessions.

The stock client cannot report progress, but the proxy knows what is under way
(``ClusterState.activities``). While a cell runs, the monitor asks twice a
second and shows a tqdm bar for each of this session's activities that has
lasted more than a second, and for the suspension of each session whose devices
this session waits for (a preemption it caused); transfers show bytes.
"""

from __future__ import annotations

import threading
import time

from tqdm.auto import tqdm

from pathways_nb.errors import PathwaysError
from pathways_nb.rpc import cluster_pb2 as pb

# Moves whose bytes the proxy knows but not how far they are: their bars count time, and say the bytes.
MOVES = frozenset({"suspend", "resume"})


def describe(activity: pb.Activity) -> str:
    """What a bar says: ``suspending alice's session (preempted by boss (priority 10, exclusive)), 268MB``."""
    size = f", {tqdm.format_sizeof(activity.bytes_total, 'B')}" if activity.bytes_total else ""
    if activity.kind == "suspend":  # (named "suspending (REASON)")
        return f"suspending {activity.tenant}'s session {activity.name.removeprefix('suspending ')}".rstrip() + size
    if activity.kind == "resume":
        return f"resuming {activity.tenant}'s session{size}"
    return f"{activity.kind}: {activity.name}"


def _bar(activity: pb.Activity) -> tqdm:
    if activity.kind in MOVES:
        return tqdm(total=None, desc=describe(activity), bar_format="{desc} ({elapsed})", leave=False)
    return tqdm(
        total=activity.bytes_total or None,
        desc=describe(activity),
        unit="B" if activity.bytes_total else "it",
        unit_scale=True,
        leave=False,
    )


def shown(state: pb.ClusterState, tenant: str) -> list[pb.Activity]:
    """``tenant``'s activities, and the suspensions of the tenants holding devices it waits for."""
    waits_for = {holder.split(" (")[0] for q in state.queue if q.tenant == tenant for holder in q.waiting.holders}
    return [a for a in state.activities if a.tenant == tenant or (a.kind == "suspend" and a.tenant in waits_for)]


class ActivityMonitor:
    def __init__(self, interval_s: float = 0.5, after_s: float = 1.0):
        self.interval_s = interval_s
        self.after_s = after_s
        self._session = None
        self._running = threading.Event()
        self._thread: threading.Thread | None = None
        self.bars_shown = 0

    def watch(self, session) -> None:
        """The session whose activities to show (None: none)."""
        self._session = session

    def cell_started(self, *_args) -> None:
        if self._session is None or self._running.is_set():
            return
        self._running.set()
        self._thread = threading.Thread(target=self._poll, name="pathways-progress", daemon=True)
        self._thread.start()

    def cell_finished(self, *_args) -> None:
        self._running.clear()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval_s)
            self._thread = None

    def _poll(self) -> None:
        bars: dict[tuple[str, str, float], tqdm] = {}
        try:
            while self._running.is_set() and self._session is not None:
                session = self._session
                try:
                    activities = shown(session.observer.state(), session.tenant)
                except PathwaysError:
                    return
                now = time.time()
                current = set()
                for activity in activities:
                    key = (activity.tenant, activity.name, activity.started)
                    current.add(key)
                    if key not in bars and now - activity.started < self.after_s:
                        continue
                    bar = bars.get(key)
                    if bar is None:
                        bar = bars[key] = _bar(activity)
                        self.bars_shown += 1
                    if activity.bytes_total and activity.kind not in MOVES:
                        bar.update(activity.bytes_done - bar.n)
                    else:
                        bar.refresh()
                for key in set(bars) - current:
                    bars.pop(key).close()
                time.sleep(self.interval_s)
        finally:
            for bar in bars.values():
                bar.close()

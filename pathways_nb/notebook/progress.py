"""Progress bars for long operations while a cell runs: compiles, large transfers, waiting for devices.

The stock client cannot report progress, but the proxy knows what is under way
(``ClusterState.activities``). While a cell runs, the monitor asks twice a
second and shows a tqdm bar for each of this session's activities that has
lasted more than a second; transfers show bytes.
"""

from __future__ import annotations

import threading
import time

from tqdm.auto import tqdm

from pathways_nb.errors import PathwaysError


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
        bars: dict[tuple[str, float], tqdm] = {}
        try:
            while self._running.is_set() and self._session is not None:
                session = self._session
                try:
                    activities = [a for a in session.observer.state().activities if a.tenant == session.tenant]
                except PathwaysError:
                    return
                now = time.time()
                current = set()
                for activity in activities:
                    key = (activity.name, activity.started)
                    current.add(key)
                    if key not in bars and now - activity.started < self.after_s:
                        continue
                    bar = bars.get(key)
                    if bar is None:
                        bar = tqdm(
                            total=activity.bytes_total or None,
                            desc=f"{activity.kind}: {activity.name}",
                            unit="B" if activity.bytes_total else "it",
                            unit_scale=True,
                            leave=False,
                        )
                        bars[key] = bar
                        self.bars_shown += 1
                    if activity.bytes_total:
                        bar.update(activity.bytes_done - bar.n)
                    else:
                        bar.refresh()
                for key in set(bars) - current:
                    bars.pop(key).close()
                time.sleep(self.interval_s)
        finally:
            for bar in bars.values():
                bar.close()

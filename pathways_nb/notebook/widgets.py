"""Notebook views of a session: the island map, the allocation table, the step timeline.

Each is a small object around an ``ipywidgets.HTML`` widget: Python renders
HTML (or SVG) from the session's state and the widget shows it; ``refresh()``
renders again. The live timeline re-renders from a background thread at most
twice a second, so it never slows the loop it watches.
"""

from __future__ import annotations

import abc
import html
import threading
from collections.abc import Sequence

import ipywidgets
import pandas as pd

from pathways_nb.client import tables
from pathways_nb.client.connection import Session
from pathways_nb.client.observe import ObserveUnavailable
from pathways_nb.client.timeline import Timeline

PALETTE = ["#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#eeca3b", "#b279a2", "#ff9da6", "#9d755d"]
FREE = "#e8e8e8"

_STYLE = """
<style>
.pw-island-map { font-family: sans-serif; font-size: 12px; }
.pw-islands { display: flex; flex-wrap: wrap; gap: 10px; }
.pw-island { border: 1px solid #bbb; border-radius: 6px; padding: 6px; }
.pw-island.pw-unhealthy { border-color: #c00; background: #fff0f0; }
.pw-island-title, .pw-host-title { font-weight: bold; margin-bottom: 4px; }
.pw-host { border: 1px dashed #ccc; border-radius: 4px; padding: 4px; margin-top: 4px; }
.pw-devices { display: flex; flex-wrap: wrap; gap: 3px; }
.pw-device { width: 34px; height: 28px; border-radius: 3px; display: flex; align-items: center;
             justify-content: center; color: #fff; font-weight: bold; }
.pw-device.pw-free { color: #555; }
.pw-device.pw-suspended.pw-free { color: #222; text-shadow: 0 0 3px #fff, 0 0 2px #fff; }
.pw-device.pw-mine { outline: 2px solid #000; }
.pw-device.pw-dead { background: repeating-linear-gradient(45deg, #c00, #c00 4px, #f88 4px, #f88 8px) !important; }
.pw-legend { margin-bottom: 6px; }
.pw-legend span { display: inline-block; width: 12px; height: 12px; margin: 0 4px 0 10px; vertical-align: middle; }
.pw-not-running { color: #a60; margin-top: 4px; }
</style>
"""


def _names(cell: str) -> list[str]:
    return [name for name in cell.split(", ") if name]


def tenant_colors(device_table: pd.DataFrame) -> dict[str, str]:
    """A colour per tenant that holds a device or has a suspended session that resumes on one."""
    tenants = sorted({t for column in ("tenants", "suspended") for cell in device_table[column] for t in _names(cell)})
    return {tenant: PALETTE[i % len(PALETTE)] for i, tenant in enumerate(tenants)}


def _hatched(color: str) -> str:
    """Stripes of ``color`` on white: a suspended session's tenant, dimmed (it holds nothing now)."""
    return f"repeating-linear-gradient(135deg, {color} 0 3px, #f6f6f6 3px 7px)"


def _tile(row, colors: dict[str, str], mine: set[int]) -> str:
    """A device: the colour of the tenant holding it, hatched in a suspended tenant's where one resumes on it (a
    band along its foot when another tenant holds it meanwhile)."""
    holders, suspended = _names(row.tenants), _names(row.suspended)
    background = colors[holders[0]] if holders else FREE
    if suspended:
        hatch = _hatched(colors[suspended[0]])
        background = f"{hatch} bottom / 100% 8px no-repeat, {background}" if holders else hatch
    classes = ["pw-device"]
    classes += [] if holders else ["pw-free"]
    classes += ["pw-suspended"] if suspended else []
    classes += ["pw-mine"] if row.id in mine else []
    classes += [] if row.healthy else ["pw-dead"]
    if not row.healthy:
        state = "down"
    elif holders:
        state = f"held by {row.tenants}" + (" (exclusive)" if row.exclusive else "")
    else:
        state = "free"
    if suspended:
        state += f"; {row.suspended} suspended, resumes here"
    title = f"{row.name} · island {row.island} host {row.host_index} · {row.kind} · {state}"
    return (
        f'<div class="{" ".join(classes)}" data-device="{row.id}" style="background:{background}" '
        f'title="{html.escape(title)}">{row.id}</div>'
    )


def render_island_map(
    device_table: pd.DataFrame, mine: set[int], note: str = "", not_running: Sequence[str] = ()
) -> str:
    """Islands -> hosts -> devices, coloured by the tenant holding them, with a legend; the devices that suspended
    sessions resume on hatched in their tenants' colours, and below the map the sessions that do not run, and why."""
    colors = tenant_colors(device_table)
    held = {t for cell in device_table["tenants"] for t in _names(cell)}
    suspended = sorted({t for cell in device_table["suspended"] for t in _names(cell)})
    legend = "".join(
        f'<span style="background:{color}"></span>{html.escape(tenant)}'
        for tenant, color in colors.items()
        if tenant in held
    )
    legend += "".join(
        f'<span class="pw-legend-suspended" style="background:{_hatched(colors[tenant])}"></span>'
        f"{html.escape(tenant)} (suspended)"
        for tenant in suspended
    )
    legend += (
        f'<span style="background:{FREE}"></span>free<span class="pw-legend-dead" style="background:#c00"></span>down'
    )
    islands = []
    for island, island_rows in device_table.groupby("island", sort=True):
        healthy = bool(island_rows["healthy"].all())
        hosts = []
        for host_index, host_rows in island_rows.groupby("host_index", sort=True):
            tiles = "".join(_tile(row, colors, mine) for row in host_rows.itertuples())
            address = html.escape(str(host_rows["host"].iloc[0]))
            hosts.append(
                f'<div class="pw-host" data-host="{host_index}"><div class="pw-host-title">host {host_index} '
                f'<span style="font-weight:normal;color:#666">{address}</span></div>'
                f'<div class="pw-devices">{tiles}</div></div>'
            )
        status = "" if healthy else " pw-unhealthy"
        islands.append(
            f'<div class="pw-island{status}" data-island="{island}"><div class="pw-island-title">island {island}'
            f"{'' if healthy else ' (down)'}</div>{''.join(hosts)}</div>"
        )
    waiting = "".join(f'<div class="pw-not-running">{html.escape(line)}</div>' for line in not_running)
    footer = f'<div style="color:#666;margin-top:4px">{html.escape(note)}</div>' if note else ""
    return (
        f'{_STYLE}<div class="pw-island-map"><div class="pw-legend">{legend}</div>'
        f'<div class="pw-islands">{"".join(islands)}</div>{waiting}{footer}</div>'
    )


class _View(abc.ABC):
    """A view of a session backed by one HTML widget, made with its first rendering.

    The first rendering travels in the widget's creation message, not in an update after it: a
    notebook saved right after the cell (nbclient, a kernel under load) keeps what the cell showed.
    """

    def __init__(self, session: Session):
        self.session = session

    def _show(self) -> None:
        """Makes the widget, with what ``render`` draws now (subclasses call it once they are ready)."""
        self.widget = ipywidgets.HTML(value=self.render())

    @abc.abstractmethod
    def render(self) -> str:
        """The view's HTML now."""

    def refresh(self) -> _View:
        """Draws the view again from the session's current state."""
        self.widget.value = self.render()
        return self

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)


class IslandMap(_View):
    """Islands, hosts and devices, coloured by tenant and state; this session's devices outlined, those that
    suspended sessions resume on hatched."""

    def __init__(self, session: Session):
        super().__init__(session)
        self._show()

    def render(self) -> str:
        table = self.session.device_table()  # (fetches the state, or notes why there is none)
        not_running = tables.not_running(self.session._state)
        return render_island_map(table, {d.id for d in self.session.devices}, self.session._note, not_running)

    def to_pandas(self) -> pd.DataFrame:
        return self.session.device_table()


class AllocationTable(_View):
    """Who holds which devices, who waits, and which sessions are suspended, with their state and why;
    ``to_pandas()`` for the rows."""

    def __init__(self, session: Session):
        super().__init__(session)
        self._show()

    def render(self) -> str:
        try:
            frame = self.session.allocations()
        except ObserveUnavailable as error:
            return f"<i>{html.escape(str(error))}</i>"
        if not len(frame):
            return "<i>no allocations</i>"
        # (A suspended session's row leaves ``exclusive`` empty: it holds nothing, and its request is not known.)
        return frame.fillna("").to_html(index=False, classes="pw-allocations", border=0)

    def to_pandas(self) -> pd.DataFrame:
        return self.session.allocations()


class TimelineView(_View):
    """The session's step timeline; ``live=True`` keeps it current (at most ``max_fps`` renders a second).

    It keeps the newest ``keep`` events it has seen and draws the last
    ``last`` steps of them.
    """

    def __init__(
        self, session: Session, last: int | None = None, live: bool = False, max_fps: float = 2.0, keep: int = 20_000
    ):
        super().__init__(session)
        self.last = last
        self.max_fps = max_fps
        self.keep = keep
        self.renders = 0
        self._labels = session.device_labels()
        self._events = session.observer.events(session.tenant)[-keep:]
        self._spans_drawn = len(session.device_spans)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._show()
        if live:
            self.start()

    @property
    def timeline(self) -> Timeline:
        """The proxy's events and, beside them, the device spans of the session's profiled runs."""
        timeline = Timeline([*self._events, *self.session.device_spans], self._labels)
        return timeline.last(self.last) if self.last else timeline

    def render(self) -> str:
        self.renders += 1
        return self.timeline.svg()

    def start(self) -> None:
        """Follows new events in the background until ``stop()`` (or the session ends)."""
        if self.live:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._follow, name="pathways-live-timeline", daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        while not self._stop.wait(1.0 / self.max_fps):
            after = self._events[-1].sequence if self._events else 0
            try:
                new = self.session.observer.events(self.session.tenant, after=after)
            except Exception:  # noqa: BLE001 - the session ended: stop quietly
                return
            spans = len(self.session.device_spans)
            if new or spans != self._spans_drawn:
                self._events = (self._events + new)[-self.keep :]
                self._spans_drawn = spans
                self.refresh()

    def stop(self) -> None:
        self._stop.set()

    @property
    def live(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def to_pandas(self) -> pd.DataFrame:
        return self.timeline.to_pandas()

    def save_trace(self, path: str) -> str:
        return self.timeline.save_trace(path)


__all__ = ["AllocationTable", "IslandMap", "TimelineView", "render_island_map"]

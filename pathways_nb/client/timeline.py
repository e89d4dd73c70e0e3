"""A session's step timeline: compile, execute, transfer and wait bars per device.

Built from the proxy's events. A *step* is one execution of the step program:
the program executed most often, unless one is named. ``svg()`` draws it
(what the notebook widget shows), ``chrome_trace()`` exports it for Perfetto
or chrome://tracing, ``to_pandas()`` gives the rows.
"""

from __future__ import annotations

import collections
import html
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import pandas as pd

from pathways_nb.rpc import cluster_pb2 as pb

COLORS = {
    "execute": "#4c78a8",
    "compile": "#f58518",
    "transfer": "#54a24b",
    "upload": "#b279a2",
    "download": "#9d755d",
    "wait": "#bab0ac",
    # Device spans from a profile (``client.device_trace``): a program's run, and the XLA ops inside it.
    "program": "#72b7b2",
    "op": "#e45756",
}
COLUMNS = ["kind", "name", "device", "island", "start", "end", "duration_ms", "bytes", "failed", "tenant"]


@dataclass(frozen=True)
class DeviceLabel:
    id: int
    name: str  # "cpu:4"
    island: int


class Timeline:
    """Events of a session, one row per (event, device)."""

    def __init__(self, events: Iterable[pb.Event], devices: Sequence[DeviceLabel], step_program: str | None = None):
        self.events = sorted(events, key=lambda e: (e.start, e.sequence))
        self.devices = list(devices)
        self._island = {d.id: d.island for d in self.devices}
        counts = collections.Counter(e.name for e in self.events if e.kind == "execute")
        self.step_program = step_program or (counts.most_common(1)[0][0] if counts else None)

    # -- data ------------------------------------------------------------------------------

    def to_pandas(self) -> pd.DataFrame:
        rows = [
            {
                "kind": e.kind,
                "name": e.name,
                "device": device,
                "island": self._island.get(device, -1),
                "start": pd.Timestamp(e.start, unit="s"),
                "end": pd.Timestamp(e.end, unit="s"),
                "duration_ms": (e.end - e.start) * 1e3,
                "bytes": e.bytes,
                "failed": e.failed,
                "tenant": e.tenant,
            }
            for e in self.events
            for device in (e.device_ids or [-1])
        ]
        return pd.DataFrame(rows, columns=COLUMNS)

    def steps(self) -> list[float]:
        """Start times (seconds since the epoch) of the step program's executions."""
        first_device: int | None = None
        starts = []
        # The proxy's executions; a profile's device spans alone (``client.device_trace``) have program runs.
        kind = "execute" if any(e.kind == "execute" for e in self.events) else "program"
        for e in self.events:
            if e.kind == kind and e.name == self.step_program:
                first_device = first_device if first_device is not None else (e.device_ids or [-1])[0]
                if (e.device_ids or [-1])[0] == first_device:
                    starts.append(e.start)
        return starts

    def last(self, steps: int) -> Timeline:
        """Only what happened during the last ``steps`` steps."""
        starts = self.steps()
        if steps <= 0 or len(starts) <= steps:
            return self
        since = starts[-steps]
        return Timeline([e for e in self.events if e.end >= since], self.devices, self.step_program)

    # -- exports ---------------------------------------------------------------------------

    def chrome_trace(self) -> dict:
        """Chrome-trace JSON (Perfetto, chrome://tracing): a process per island, a track per device."""
        trace = []
        for island in sorted({d.island for d in self.devices}):
            trace.append({"ph": "M", "name": "process_name", "pid": island, "args": {"name": f"island {island}"}})
        for device in self.devices:
            trace.append(
                {
                    "ph": "M",
                    "name": "thread_name",
                    "pid": device.island,
                    "tid": device.id,
                    "args": {"name": device.name},
                }
            )
        for e in self.events:
            for device in e.device_ids:
                trace.append(
                    {
                        "ph": "X",
                        "name": e.name,
                        "cat": e.kind,
                        "pid": self._island.get(device, -1),
                        "tid": device,
                        "ts": e.start * 1e6,
                        "dur": max(0.0, e.end - e.start) * 1e6,
                        "args": {"kind": e.kind, "bytes": e.bytes, "failed": e.failed, "tenant": e.tenant},
                    }
                )
        return {"traceEvents": trace, "displayTimeUnit": "ms"}

    def save_trace(self, path: str) -> str:
        with open(path, "w") as f:
            json.dump(self.chrome_trace(), f)
        return path

    def svg(self, width: int = 900, row_height: int = 22) -> str:
        """The timeline as SVG: one row per device, a bar per event, dashed lines at step starts."""
        label_width, top = 150, 24
        plot_width = max(100, width - label_width - 10)
        rows = {d.id: i for i, d in enumerate(self.devices)}
        height = top + row_height * max(1, len(self.devices)) + 24
        spans = [(e.start, e.end) for e in self.events if e.device_ids]
        begin = min((s for s, _ in spans), default=0.0)
        finish = max((e for _, e in spans), default=begin + 1e-3)
        scale = plot_width / max(finish - begin, 1e-6)

        def x(t: float) -> float:
            return label_width + (t - begin) * scale

        parts = [
            f'<svg class="pw-timeline" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            'font-family="sans-serif" font-size="11">'
        ]
        for device in self.devices:
            y = top + rows[device.id] * row_height
            parts.append(
                f'<text x="4" y="{y + row_height * 0.7:.1f}">{html.escape(device.name)} (island {device.island})</text>'
                f'<line x1="{label_width}" y1="{y + row_height:.1f}" x2="{width - 10}" y2="{y + row_height:.1f}" '
                'stroke="#eee"/>'
            )
        for start in self.steps():
            parts.append(
                f'<line class="pw-step" x1="{x(start):.1f}" y1="{top - 4}" x2="{x(start):.1f}" y2="{height - 20}" '
                'stroke="#888" stroke-dasharray="3,3"/>'
            )
        for e in self.events:
            for device in e.device_ids:
                if device not in rows:
                    continue
                y = top + rows[device] * row_height + 3
                bar_height = row_height - 6
                if e.kind == "op":  # an op in the lower half of its program's bar, so both show
                    bar_height //= 2
                    y += row_height - 6 - bar_height
                w = max(1.0, (e.end - e.start) * scale)
                title = f"{e.kind}: {e.name} ({(e.end - e.start) * 1e3:.2f} ms)" + (" FAILED" if e.failed else "")
                outline = ' stroke="red"' if e.failed else ""
                parts.append(
                    f'<rect class="pw-bar pw-{e.kind}" data-device="{device}" x="{x(e.start):.1f}" y="{y}" '
                    f'width="{w:.1f}" height="{bar_height}" fill="{COLORS.get(e.kind, "#999")}"{outline}>'
                    f"<title>{html.escape(title)}</title></rect>"
                )
        legend_x = label_width
        for kind, color in COLORS.items():
            parts.append(
                f'<rect x="{legend_x}" y="6" width="10" height="10" fill="{color}"/>'
                f'<text x="{legend_x + 14}" y="15">{kind}</text>'
            )
            legend_x += 80
        parts.append(
            f'<text x="{label_width}" y="{height - 6}">{(finish - begin) * 1e3:.1f} ms, '
            f"{len(self.steps())} step(s) of {html.escape(self.step_program or '-')}</text></svg>"
        )
        return "".join(parts)

    def _repr_html_(self) -> str:
        return self.svg()

    def plot(self):
        """The timeline as a matplotlib figure (for papers and reports)."""
        import matplotlib.pyplot as plt

        figure, axes = plt.subplots(figsize=(10, 0.4 * max(2, len(self.devices)) + 1))
        rows = {d.id: i for i, d in enumerate(self.devices)}
        begin = min((e.start for e in self.events), default=0.0)
        for e in self.events:
            for device in e.device_ids:
                if device in rows:
                    axes.barh(
                        rows[device],
                        (e.end - e.start) * 1e3,
                        left=(e.start - begin) * 1e3,
                        color=COLORS.get(e.kind, "#999"),
                        height=0.7,
                    )
        for start in self.steps():
            axes.axvline((start - begin) * 1e3, color="#888", linestyle="--", linewidth=0.8)
        axes.set_yticks(range(len(self.devices)), [d.name for d in self.devices])
        axes.set_xlabel("ms")
        axes.invert_yaxis()
        figure.tight_layout()
        return figure

    def __repr__(self) -> str:
        return (
            f"<Timeline {len(self.events)} events on {len(self.devices)} devices, "
            f"{len(self.steps())} steps of {self.step_program}>"
        )

"""A session's step timeline: compile, execute, transfer and wait bars per device.

Built from the proxy's events. A *step* is one execution of the step program:
the program executed most often, unless one is named. ``svg()`` draws it
(what the notebook widget shows), ``chrome_trace()`` exports it for Perfetto
or chrome://tracing, ``to_pandas()`` gives the rows.

The drawing's time axis is set by what the devices did (executions, transfers,
profiled programs and ops), so that the steps fill it: right after a first run,
seconds of compiling would otherwise squeeze milliseconds of steps into the last
pixels. Compiles, waits, and the step program's first run on a device after each
compile of it there (a warm-up, which can take long too) do not set the scale: a
stretch with only those, or nothing, many times longer than what the devices did
otherwise is drawn as a narrow break labelled with its length; the one before the
steps that holds their program's first compile is marked "first step + compile".

A suspended session (``Session.suspend``, or the cluster's preemption) is off its
devices from its suspend's start to the end of the resume after it: ``suspensions()``
pairs the two events, ``svg()`` hatches that stretch on the session's devices and marks
the break that holds it "suspended", ``plot()`` hatches it, and ``chrome_trace()`` adds
it as a span around the two. Neither sets the scale, and neither is a step.
"""

from __future__ import annotations

import bisect
import collections
import html
import itertools
import json
import statistics
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
    # A session's arrays moving off its devices (it gives them back) and onto them again.
    "suspend": "#393b79",
    "resume": "#9c9ede",
}
SUSPENDED = "#c6c7e8"  # the stripes of a stretch off the devices
COLUMNS = ["kind", "name", "device", "island", "start", "end", "duration_ms", "bytes", "failed", "tenant"]
# Kinds drawn without setting the axis's scale: where only they happen, for long enough, the axis breaks.
UNSCALED_KINDS = frozenset({"compile", "wait", "suspend", "resume"})
# A stretch without scaled work breaks the axis if it is this many times the typical burst of work or the
# typical time from one step to the next (and at least BREAK_MIN_S): compiles (100 ms to seconds) break,
# the gaps between a loop's steps do not.
BREAK_FACTOR = 5.0
BREAK_MIN_S = 1e-3
BREAK_WIDTH_PX = 28
FIRST_STEP_WIDTH_PX = 48  # also a break that holds a suspension: both are labelled


@dataclass(frozen=True)
class DeviceLabel:
    id: int
    name: str  # "cpu:4"
    island: int


@dataclass(frozen=True)
class Suspension:
    """A stretch a session spent off its devices: from its suspend's start to the end of the resume after it, or
    to the timeline's end while it is still suspended (``resumed`` empty)."""

    start: float
    end: float
    device_ids: tuple[int, ...]
    reason: str  # why it was suspended: "preempted by boss (priority 10, exclusive)"
    resumed: str  # why it resumed: "a request arrived"; "" while still suspended

    def describe(self) -> str:
        resumed = f"; resumed: {self.resumed}" if self.resumed else "; still suspended"
        return f"suspended for {_duration(self.end - self.start)}: {self.reason}{resumed}"


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
        kind = self._step_kind()
        for e in self.events:
            if e.kind == kind and e.name == self.step_program:
                first_device = first_device if first_device is not None else (e.device_ids or [-1])[0]
                if (e.device_ids or [-1])[0] == first_device:
                    starts.append(e.start)
        return starts

    def _step_kind(self) -> str:
        """The proxy's executions; a profile's device spans alone (``client.device_trace``) have program runs."""
        return "execute" if any(e.kind == "execute" for e in self.events) else "program"

    def _warmups(self) -> set[int]:
        """The step program's first execution on a device after each compile of it there (as ``id()``s of the
        events): like the compile, it is not what a step costs."""
        program, kind = self.step_program, self._step_kind()
        compiled: set[int] = set()  # devices whose latest compile of the program has not run yet
        warm = set()
        for e in self.events:
            if e.name != program:
                continue
            if e.kind == "compile":
                compiled.update(e.device_ids)
            elif e.kind == kind and compiled.intersection(e.device_ids):
                warm.add(id(e))
                compiled.difference_update(e.device_ids)
        return warm

    def suspensions(self) -> list[Suspension]:
        """Each suspend event with the resume after it on the same devices (the proxy's ``suspended: REASON`` and
        ``resumed: REASON``)."""
        end = max((e.end for e in self.events), default=0.0)
        resumes = [e for e in self.events if e.kind == "resume"]
        stretches = []
        for e in self.events:
            if e.kind != "suspend":
                continue
            resume = next((r for r in resumes if r.start >= e.start and set(r.device_ids) & set(e.device_ids)), None)
            if resume is not None:
                resumes.remove(resume)
            stretches.append(
                Suspension(
                    e.start,
                    resume.end if resume is not None else end,
                    tuple(e.device_ids),
                    e.name.removeprefix("suspended: "),
                    resume.name.removeprefix("resumed: ") if resume is not None else "",
                )
            )
        return stretches

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
        # Each suspension as a span around its suspend and resume (Perfetto draws them nested on the track).
        for stretch in self.suspensions():
            for device in stretch.device_ids:
                trace.append(
                    {
                        "ph": "X",
                        "name": f"suspension: {stretch.reason}",
                        "cat": "suspension",
                        "pid": self._island.get(device, -1),
                        "tid": device,
                        "ts": stretch.start * 1e6,
                        "dur": max(0.0, stretch.end - stretch.start) * 1e6,
                        "args": {"resumed": stretch.resumed or "not yet"},
                    }
                )
        return {"traceEvents": trace, "displayTimeUnit": "ms"}

    def save_trace(self, path: str) -> str:
        with open(path, "w") as f:
            json.dump(self.chrome_trace(), f)
        return path

    def svg(self, width: int = 900, row_height: int = 22, breaks: bool = True) -> str:
        """The timeline as SVG: one row per device, a bar per event, dashed lines at step starts.

        With ``breaks`` (the default), long stretches of only compiles, waits or idle time are drawn as
        narrow breaks (see the module's docstring); ``breaks=False`` draws time to one scale.
        """
        label_width, top = 150, 24
        plot_width = max(100, width - label_width - 10)
        rows = {d.id: i for i, d in enumerate(self.devices)}
        rows_bottom = top + row_height * max(1, len(self.devices))
        height = rows_bottom + 38
        drawn = [e for e in self.events if e.device_ids]
        steps = self.steps()
        warm = self._warmups()
        suspensions = self.suspensions()
        off = [(stretch.start, stretch.end) for stretch in suspensions]
        scaled = [e for e in drawn if e.kind not in UNSCALED_KINDS and id(e) not in warm]
        axis = _Axis.of(drawn, scaled, label_width, plot_width, steps, breaks, off)
        x = axis.x
        # The break before everything that sets the scale, if it holds the step program's first compile.
        lead = axis.breaks[0] if axis.breaks and axis.breaks[0][0] == axis.begin else None
        first_step = lead is not None and any(
            e.kind == "compile" and e.name == self.step_program and e.start < lead[1] for e in drawn
        )

        parts = [
            f'<svg class="pw-timeline" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            'font-family="sans-serif" font-size="11"><defs><pattern id="pw-suspended" width="6" height="6" '
            f'patternUnits="userSpaceOnUse" patternTransform="rotate(45)"><rect width="3" height="6" '
            f'fill="{SUSPENDED}"/></pattern></defs>'
        ]
        parts += _breaks_drawn(axis, drawn, top, rows_bottom, width, first_step, off)
        for device in self.devices:
            y = top + rows[device.id] * row_height
            parts.append(
                f'<text x="4" y="{y + row_height * 0.7:.1f}">{html.escape(device.name)} (island {device.island})</text>'
                f'<line x1="{label_width}" y1="{y + row_height:.1f}" x2="{width - 10}" y2="{y + row_height:.1f}" '
                'stroke="#eee"/>'
            )
        for stretch in suspensions:
            left, stretch_width = x(stretch.start), max(1.0, x(stretch.end) - x(stretch.start))
            for device in stretch.device_ids:
                if device in rows:
                    parts.append(
                        f'<rect class="pw-suspension" data-device="{device}" x="{left:.1f}" '
                        f'y="{top + rows[device] * row_height + 1}" width="{stretch_width:.1f}" '
                        f'height="{row_height - 2}" fill="url(#pw-suspended)" stroke="{SUSPENDED}">'
                        f"<title>{html.escape(stretch.describe())}</title></rect>"
                    )
        for start in steps:
            parts.append(
                f'<line class="pw-step" x1="{x(start):.1f}" y1="{top - 4}" x2="{x(start):.1f}" y2="{rows_bottom + 4}" '
                'stroke="#888" stroke-dasharray="3,3"/>'
            )
        parts += _bars(drawn, rows, top, row_height, x)
        parts += _legend(label_width)
        broken = sum(end - start for start, end in axis.breaks)
        narrow = f" ({_duration(broken)} of it drawn narrow, in grey)" if axis.breaks else ""
        parts.append(
            f'<text x="{label_width}" y="{height - 6}">{_duration(axis.span)}{narrow}, '
            f"{len(steps)} step(s) of {html.escape(self.step_program or '-')}</text></svg>"
        )
        return "".join(parts)

    def _repr_html_(self) -> str:
        return self.svg()

    def plot(self):
        """The timeline as a matplotlib figure (for papers and reports)."""
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch

        figure, axes = plt.subplots(figsize=(10, 0.4 * max(2, len(self.devices)) + 1))
        rows = {d.id: i for i, d in enumerate(self.devices)}
        begin = min((e.start for e in self.events), default=0.0)

        def bars(span, **style) -> None:
            for device in span.device_ids:
                if device in rows:
                    axes.barh(rows[device], (span.end - span.start) * 1e3, left=(span.start - begin) * 1e3, **style)

        for stretch in self.suspensions():
            bars(stretch, color="none", edgecolor=SUSPENDED, hatch="//", height=0.9)
        for e in self.events:
            bars(e, color=COLORS.get(e.kind, "#999"), height=0.7)
        for start in self.steps():
            axes.axvline((start - begin) * 1e3, color="#888", linestyle="--", linewidth=0.8)
        kinds = {e.kind for e in self.events if e.device_ids}
        handles = [Patch(color=color, label=kind) for kind, color in COLORS.items() if kind in kinds]
        if "suspend" in kinds:
            handles.append(Patch(facecolor="none", edgecolor=SUSPENDED, hatch="//", label="suspended"))
        if handles:
            axes.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
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


def _breaks_drawn(
    axis: _Axis,
    drawn: Sequence[pb.Event],
    top: float,
    bottom: float,
    width: float,
    first_step: bool,
    off: Sequence[tuple[float, float]] = (),
) -> list[str]:
    """The axis's breaks: grey bands with a cut mark, each labelled with its length where there is room; the
    first, with ``first_step``, marked as the first step's (and its compile's); one that holds stretches ``off``
    the devices (suspensions), marked with how long of it the session was suspended."""
    parts = []
    labels_end = 0.0  # where the last label drawn ends: the next one must not overlap it
    for index, (start, end) in enumerate(axis.breaks):
        left, right = axis.x(start), axis.x(end)
        first_step = first_step and index == 0
        suspended = sum(max(0.0, min(end, b) - max(start, a)) for a, b in off)
        during = sorted({e.kind for e in drawn if e.start < end and e.end > start}) or ["idle"]
        what = "until the step program's first step was done, with its compile" if first_step else "drawn narrow"
        title = f"{_duration(end - start)} {what}: {', '.join(during)}"
        mark = " pw-first-step" if first_step else " pw-suspended" if suspended else ""
        parts.append(
            f'<rect class="pw-break{mark}" x="{left:.1f}" y="{top - 4}" '
            f'width="{right - left:.1f}" height="{bottom - top + 8}" fill="#f2f2f2">'
            f"<title>{html.escape(title)}</title></rect>"
            f'<path d="M{left:.1f},{bottom + 4} l4,-8 M{right - 4:.1f},{bottom + 4} l4,-8" stroke="#999"/>'
        )
        if first_step:
            label = f"first step + compile: {_duration(end - start)}"
        else:
            label = f"suspended: {_duration(suspended)}" if suspended else _duration(end - start)
        label_width = 5 * len(label)  # about, at 9 px
        # A marked break's label starts at its left edge (or ends at the drawing's); another's is centred under it.
        if first_step:
            at = left
        elif suspended:
            at = max(min(left, width - label_width), labels_end + 6)
        else:
            at = max((left + right - label_width) / 2, labels_end + 6)
        if not first_step and at + label_width > (width if suspended else min(right + 30, width)):
            continue  # no room for it (crowded, narrow breaks): its band's title says
        labels_end = at + label_width
        parts.append(
            f'<text class="pw-break-length" x="{at:.1f}" y="{bottom + 16}" font-size="9" fill="#666">{label}</text>'
        )
    return parts


def _duration(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds >= 1 else f"{seconds * 1e3:.1f} ms"


@dataclass(frozen=True)
class _Axis:
    """Time to x: one scale, but for the breaks, each drawn a few pixels wide."""

    pieces: tuple[tuple[float, float, float, float], ...]  # (start, end, x at start, x at end), in order
    breaks: tuple[tuple[float, float], ...]
    begin: float
    span: float  # seconds from the first event's start to the last one's end

    @classmethod
    def of(
        cls,
        events: Sequence[pb.Event],
        scaled: Sequence[pb.Event],
        left: float,
        width: float,
        steps: Sequence[float] = (),
        breaks: bool = True,
        wide: Sequence[tuple[float, float]] = (),
    ) -> _Axis:
        """The axis for ``events`` drawn ``width`` pixels wide from ``left``: with ``breaks``, the long stretches
        that none of ``scaled`` covers are breaks (the first, before the steps, and those that overlap a stretch
        of ``wide``, a little wider: they are labelled)."""
        begin = min((e.start for e in events), default=0.0)
        finish = max((e.end for e in events), default=begin + 1e-3)
        bursts = _bursts(scaled) if breaks else []
        broken: list[tuple[float, float]] = []
        if bursts:
            # Typical: a burst of work, or the time between two steps (after the first, which holds the compile).
            periods = [b - a for a, b in itertools.pairwise(steps[1:])]
            typical = max(statistics.median(end - start for start, end in bursts), statistics.median(periods or [0]))
            threshold = max(BREAK_FACTOR * typical, BREAK_MIN_S)
            edges = [begin, *(t for burst in bursts for t in burst), finish]
            gaps = zip(edges[::2], edges[1::2], strict=True)
            broken = [(start, end) for start, end in gaps if end - start > threshold]
        widths = [
            FIRST_STEP_WIDTH_PX if start == begin or any(a < end and b > start for a, b in wide) else BREAK_WIDTH_PX
            for start, end in broken
        ]
        shrink = min(1.0, 0.4 * width / sum(widths)) if widths else 1.0  # breaks take at most 40% of the width
        scale = (width - shrink * sum(widths)) / max(finish - begin - sum(b - a for a, b in broken), 1e-6)
        pieces, t, x = [], begin, left
        for (start, end), break_px in [*zip(broken, widths, strict=True), ((finish, finish), 0.0)]:
            pieces.append((t, start, x, x + (start - t) * scale))
            x += (start - t) * scale
            if end > start:
                pieces.append((start, end, x, x + break_px * shrink))
                x += break_px * shrink
            t = end
        return cls(tuple(pieces), tuple(broken), begin, finish - begin)

    def x(self, t: float) -> float:
        index = max(0, bisect.bisect_right(self.pieces, t, key=lambda piece: piece[0]) - 1)
        start, end, x0, x1 = self.pieces[index]
        return x0 + (x1 - x0) * min(max((t - start) / (end - start), 0.0), 1.0) if end > start else x0


def _bursts(scaled: Sequence[pb.Event]) -> list[list[float]]:
    """What the devices did as [start, end] stretches, overlapping events merged, in order."""
    bursts: list[list[float]] = []
    for e in sorted(scaled, key=lambda e: e.start):
        if bursts and e.start <= bursts[-1][1]:
            bursts[-1][1] = max(bursts[-1][1], e.end)
        else:
            bursts.append([e.start, e.end])
    return bursts


def _bars(drawn: list, rows: dict[int, int], top: int, row_height: int, x) -> list[str]:
    """A bar per event and device; an op sits in the lower half of its program's bar, so both show."""
    parts = []
    for e in drawn:
        for device in e.device_ids:
            if device not in rows:
                continue
            y = top + rows[device] * row_height + 3
            bar_height = row_height - 6
            if e.kind == "op":
                bar_height //= 2
                y += row_height - 6 - bar_height
            w = max(1.0, x(e.end) - x(e.start))
            title = f"{e.kind}: {e.name} ({_duration(e.end - e.start)})" + (" FAILED" if e.failed else "")
            outline = ' stroke="red"' if e.failed else ""
            parts.append(
                f'<rect class="pw-bar pw-{e.kind}" data-device="{device}" x="{x(e.start):.1f}" y="{y}" '
                f'width="{w:.1f}" height="{bar_height}" fill="{COLORS.get(e.kind, "#999")}"{outline}>'
                f"<title>{html.escape(title)}</title></rect>"
            )
    return parts


def _legend(label_width: int) -> list[str]:
    """The colour of each kind of event, in a row above the devices."""
    parts = []
    legend_x = label_width
    for kind, fill in [*COLORS.items(), ("suspended", "url(#pw-suspended)")]:
        parts.append(
            f'<rect x="{legend_x}" y="6" width="10" height="10" fill="{fill}"/>'
            f'<text x="{legend_x + 14}" y="15">{kind}</text>'
        )
        legend_x += 24 + 6 * len(kind)  # (about 6 px a letter)
    return parts

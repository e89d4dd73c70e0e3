"""``pathways_nb.profile(logdir)``: this process's trace and every worker's, in one run directory, no cloud needed.

Inside the ``with`` block the cluster's hosts trace themselves (a ``profileRequest`` plugin program,
as pathwaysutils sends to Pathways on Cloud) and so does this process (jaxlib's profiler). On exit
the hosts write their traces under the cluster's storage root, this process fetches them through
the proxy's observe API into ``<logdir>/plugins/profile/<session>/`` next to its own, and reads them
(``client.device_trace``): ``Profile.trace`` then shows what each device did, writes a Perfetto
trace, and gives the ``xprof --logdir`` command that opens the run.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from pathways_nb.client.device_trace import XPLANE_SUFFIX, DeviceTrace, read_session
from pathways_nb.client.timeline import DeviceLabel
from pathways_nb.errors import PathwaysError

# Where in the cluster's storage root the traces of ``profile()`` go (gs://BUCKET/PATH form).
STORAGE_PREFIX = "gs://pathways-nb/profiles"


@dataclass
class Profile:
    """One profiled run: where its files are and, once the block has ended, what the devices did."""

    logdir: Path
    session: str
    location: str  # where the cluster wrote the hosts' traces (under its storage root)
    trace: DeviceTrace | None = None
    perfetto: Path | None = None
    files: list[Path] = field(default_factory=list)

    @property
    def directory(self) -> Path:
        return self.logdir / "plugins" / "profile" / self.session

    @property
    def xprof_command(self) -> str:
        return f"xprof --logdir {self.logdir} --port 8791"

    def _repr_html_(self) -> str:
        if self.trace is None:
            return f"<i>profiling into {self.directory}</i>"
        return self.trace._repr_html_()

    def __repr__(self) -> str:
        return f"<Profile {self.session}: {len(self.files)} files in {self.directory}>"


def _session():
    from pathways_nb.client.connection import current

    session = current()
    if session is None:
        raise PathwaysError("pathways_nb.profile() needs a connection: pathways_nb.connect(...) or %pathways connect")
    return session


@contextlib.contextmanager
def profile(
    logdir: str | os.PathLike[str],
    *,
    hosts: int = 0,
    include_servers: bool = True,
    python_tracer: bool = False,
    host_tracer_level: int = 2,
    progress: bool = True,
) -> Iterator[Profile]:
    """Profiles the block: this process and the cluster's hosts (``hosts``: at most that many; 0: all).

    ``include_servers`` traces the proxy and the resource manager too. On exit the hosts' traces are
    written and fetched into ``logdir`` (with a progress bar while that takes a while), read, and
    drawn: ``Profile.trace`` is the ``DeviceTrace``, also added to the session's timeline.
    """
    import jax
    from jax._src.lib import _profiler

    session = _session()
    name = time.strftime("%Y_%m_%d_%H_%M_%S")
    run = Profile(Path(logdir).absolute(), name, f"{STORAGE_PREFIX}/{uuid.uuid4().hex}")
    run.directory.mkdir(parents=True, exist_ok=True)
    request = {
        "traceLocation": run.location,
        "maxNumHosts": hosts,
        "includeResourceManagers": include_servers,
        "xprofTraceOptions": {
            "traceDirectory": run.location,
            "traceSessionName": name,
            "hostTraceLevel": host_tracer_level,
            "pwTraceOptions": {"enablePythonTracer": python_tracer},
        },
    }
    executable = _compile(jax, json.dumps({"profileRequest": request}))
    _run(executable)  # start the hosts' traces
    options = _profiler.ProfileOptions()
    options.host_tracer_level = host_tracer_level
    options.python_tracer_level = int(python_tracer)
    mine = _profiler.ProfilerSession(options)
    try:
        yield run
    finally:
        own = mine.stop()
        with _progress(progress, "the cluster writes its traces"):
            _run(executable)  # stop them: each host writes its file
        (run.directory / f"client-{socket.gethostname()}{XPLANE_SUFFIX}").write_bytes(own)
    run.files = _fetch(session, run, progress)
    placement, labels = _placement(session)
    run.trace = read_session(run.logdir, name, placement, labels)
    run.perfetto = run.trace.save_perfetto()
    session.add_device_spans(run.trace.events)


def _compile(jax, text: str):
    from jax.extend import ifrt_programs

    programs = ifrt_programs.ifrt_programs
    client = jax.devices()[0].client
    return client.compile_ifrt_program(programs.make_plugin_program(text), programs.make_plugin_compile_options())


def _run(executable) -> None:
    """One execution, waited for (its status says whether every host did its part)."""
    results = executable.execute_sharded([], with_tokens=True)
    results.consume_token().block_until_ready()


@contextlib.contextmanager
def _progress(show: bool, what: str) -> Iterator[None]:
    """A bar that counts the seconds while ``what`` takes more than one."""
    if not show:
        yield
        return
    done = threading.Event()

    def tick() -> None:
        if done.wait(1.0):
            return
        with tqdm(desc=what, unit="s", bar_format="{desc}: {elapsed}", leave=False) as bar:
            while not done.wait(0.5):
                bar.refresh()

    thread = threading.Thread(target=tick, name="pathways-profile-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _fetch(session, run: Profile, progress: bool) -> list[Path]:
    """The cluster's trace files of the run, into its directory (bytes counted on a bar)."""
    written: list[Path] = []
    bar = tqdm(desc="fetching traces", unit="B", unit_scale=True, leave=False, disable=not progress)
    try:
        current = None
        for chunk in session.observer.read_profile(run.location, run.session):
            if chunk.name:
                if current is not None:
                    current.close()
                path = run.directory / Path(chunk.name).name
                current = open(path, "wb")
                written.append(path)
                bar.total = (bar.total or 0) + chunk.size
            current.write(chunk.data)
            bar.update(len(chunk.data))
        if current is not None:
            current.close()
    finally:
        bar.close()
    return [*written, *(p for p in run.directory.glob(f"client-*{XPLANE_SUFFIX}"))]


def _placement(session) -> tuple:
    """(island, host, local ordinal) -> the device's label (which names its host), and the labels."""
    devices = {d.id: d for d in session.state().devices}
    labels = {
        label.id: DeviceLabel(label.id, f"{label.name} host {devices[label.id].host_index}", label.island)
        for label in session.device_labels()
        if label.id in devices
    }
    places = {(d.island, d.host_index, d.local_id): d.id for d in devices.values()}

    def place(island: int, host: int, ordinal: int) -> DeviceLabel | None:
        device_id = places.get((island, host, ordinal))
        return labels.get(device_id) if device_id is not None else None

    return place, list(labels.values())

"""Many sessions on one proxy: wire-level sessions, each looping a small upload and a small program.

A session here is an ``AsyncWireSession`` (the IFRT proxy protocol spoken
request by request, over a connection of its own), not a JAX process: the
stock client opens one session per process, and 200 JAX processes would
measure the machine, not the proxy. The sessions are coroutines of one event
loop in each of a few client processes (one, unless told), apart from the
proxy, whose CPU time and memory are read from its process. Coroutines take
turns in the order their replies come, so a session served less than another
was served less by the servers; threads would take turns as the OS and the GIL
chose (a CI run gave two sessions of one process 18 and 144 rounds).
Each session compiles ``x * 2 + 1`` on one device of its allocation (sessions
spread over both islands' devices), runs one round to warm up, and then, while
the run lasts, loops: upload 4 KiB and make it an array, execute, read the
result back (checked), forget both arrays. Before the loop every session is
idle for a while (it has compiled and run once), and the proxy's CPU time over
that window is compared with the same window before any session was open.

``benchmarks/sessions.py`` runs it with 200 sessions for 60 s; the test suite
with 50 for 10 s.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import queue
import statistics
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import psutil

from pathways_nb.testing import lowered_program
from pathways_nb.testing.async_wire import AsyncWireSession

# The payload of one upload: 1024 float32 (4 KiB).
ELEMENTS = 1024


def _program(x):
    return x * 2 + 1


@dataclass
class SessionsRun:
    """What ``run`` measured; CPU in seconds of CPU time per second, memory in bytes."""

    sessions: int
    seconds: float
    iterations: list[int]  # per session, in the measured loop
    round_trips_s: list[float]  # every iteration's time
    errors: list[str]
    proxy_cpu_quiet: float  # no session open
    proxy_cpu_idle: float  # every session open and idle
    proxy_cpu_busy: float  # every session looping
    proxy_rss_before: int
    proxy_rss_idle: int
    proxy_rss_busy: int
    clients_cpu_busy: float  # the client processes together

    @property
    def served(self) -> int:
        return sum(count > 0 for count in self.iterations)

    @property
    def fairness(self) -> float:
        """The slowest session's iterations over the median session's."""
        return self.share(0.0)

    def share(self, quantile: float) -> float:
        """The iterations of the session at ``quantile`` (0: the slowest) over the median session's."""
        median = statistics.median(self.iterations) if self.iterations else 0
        ordered = sorted(self.iterations)
        return ordered[int(quantile * (len(ordered) - 1))] / median if median else 0.0

    def round_trip_ms(self, quantile: float) -> float:
        ordered = sorted(self.round_trips_s)
        return ordered[min(len(ordered) - 1, int(quantile * len(ordered)))] * 1e3 if ordered else float("nan")

    @property
    def cpu_per_iteration_us(self) -> float:
        total = sum(self.iterations)
        return self.proxy_cpu_busy * self.seconds / total * 1e6 if total else float("nan")


def run(
    address: str,
    proxy_pid: int,
    sessions: int,
    seconds: float,
    clients: int = 1,
    idle_window_s: float = 5.0,
    timeout_s: float = 600.0,
) -> SessionsRun:
    """Opens ``sessions`` sessions on the proxy at ``address`` (process ``proxy_pid``) from ``clients``
    processes, measures them idle for ``idle_window_s``, then looping for ``seconds``."""
    proxy = psutil.Process(proxy_pid)
    clients = max(1, min(clients, sessions))
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    go = context.Event()
    finish = context.Event()
    shares = [list(range(sessions))[i::clients] for i in range(clients)]
    processes = [
        context.Process(target=_client, args=(address, share, seconds, go, finish, results), daemon=True)
        for share in shares
    ]
    deadline = time.monotonic() + timeout_s
    rss_before = proxy.memory_info().rss
    quiet = _cpu_over(proxy, idle_window_s)
    try:
        for process in processes:
            process.start()
        _expect(results, "ready", processes, deadline)
        rss_idle = proxy.memory_info().rss
        idle = _cpu_over(proxy, idle_window_s)
        client_processes = [psutil.Process(p.pid) for p in processes]
        clients_before = sum(_cpu_s(p) for p in client_processes)
        before, started = _cpu_s(proxy), time.monotonic()
        go.set()
        finished = _expect(results, "done", processes, deadline)
        elapsed = time.monotonic() - started
        busy = (_cpu_s(proxy) - before) / elapsed
        clients_busy = (sum(_cpu_s(p) for p in client_processes) - clients_before) / elapsed
        rss_busy = proxy.memory_info().rss
    finally:
        finish.set()
        for process in processes:
            process.join(60)
            if process.is_alive():
                process.kill()
    iterations, round_trips, errors = [], [], []
    for per_session, failures in finished:
        for count, times in per_session:
            iterations.append(count)
            round_trips.extend(times)
        errors.extend(failures)
    return SessionsRun(
        sessions,
        seconds,
        iterations,
        round_trips,
        errors,
        quiet,
        idle,
        busy,
        rss_before,
        rss_idle,
        rss_busy,
        clients_busy,
    )


def _cpu_s(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def _cpu_over(process: psutil.Process, window_s: float) -> float:
    """``process``'s CPU time per second over the next ``window_s``."""
    before, started = _cpu_s(process), time.monotonic()
    time.sleep(window_s)
    return (_cpu_s(process) - before) / (time.monotonic() - started)


def _expect(results, kind: str, processes: list, deadline: float) -> list:
    """A message of ``kind`` from each client; a client's failure (or death) is raised with what it said."""
    values = []
    while len(values) < len(processes):
        try:
            got, value = results.get(timeout=1.0)
        except queue.Empty:
            dead = [p.exitcode for p in processes if p.exitcode is not None]
            if dead:
                raise RuntimeError(f"a client process ended (exit status {dead[0]}) before it said {kind!r}") from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"the clients did not all say {kind!r} in time") from None
            continue
        if got == "failed":
            raise RuntimeError(f"a client process failed:\n{value}")
        if got != kind:
            raise RuntimeError(f"expected {kind!r} from the clients, got {got!r}")
        values.append(value)
    return values


# -- in each client process ----------------------------------------------------------------


class _Looping:
    """One session: its device, its program, and the handles it uses next."""

    def __init__(self, wire: AsyncWireSession, index: int):
        self.wire = wire
        devices = list(wire.init_response.primary_device_ids)
        self.device = devices[index % len(devices)]
        self.value = np.full(ELEMENTS, index % 1000, np.float32)
        self.expected = _program(self.value).tobytes()
        self.executable = 0
        self._handles = iter(range(1_000_000, 1 << 62, 3))

    @classmethod
    async def start(cls, address: str, index: int, programs: dict[int, tuple[bytes, bytes]]) -> _Looping:
        """A session that has compiled its program and run one round."""
        session = cls(await AsyncWireSession.open(address), index)
        program = programs.get(session.device)
        if program is None:  # lowering is JAX's, on this thread: once per device, before any round
            program = programs[session.device] = lowered_program(_program, session.value, [session.device])
        compiled = await session.wire.compile(program)
        if compiled.response_metadata.status.code:
            raise RuntimeError(f"compiling failed: {compiled.response_metadata.status.message}")
        session.executable = compiled.compile_response.loaded_executable_handle
        await session.once()
        return session

    async def once(self) -> None:
        """Uploads, executes, reads back (checked), forgets."""
        argument = next(self._handles)
        result, host = argument + 1, argument + 2
        await self.wire.make_array(argument, self.value, self.device)
        status = (await self.wire.execute(self.executable, [argument], [result])).response_metadata.status
        if status.code:
            raise RuntimeError(f"execute failed: {status.message}")
        if await self.wire.read_array(result, host) != self.expected:
            raise RuntimeError(f"a wrong result on device {self.device}")
        await self.wire.destruct([argument, result])

    async def loop(self, ends: float, failures: list[str]) -> tuple[int, list[float]]:
        """Rounds until ``ends`` (monotonic): how many, and each one's time."""
        times = []
        try:
            while time.monotonic() < ends:
                started = time.perf_counter()
                await self.once()
                times.append(time.perf_counter() - started)
        except Exception as error:  # noqa: BLE001 - counted as a session not served
            failures.append(f"session on device {self.device}: {error}")
        return len(times), times


def _client(address: str, indices: Sequence[int], seconds: float, go, finish, results) -> None:
    asyncio.run(_sessions(address, indices, seconds, go, finish, results))


async def _sessions(address: str, indices: Sequence[int], seconds: float, go, finish, results) -> None:
    programs: dict[int, tuple[bytes, bytes]] = {}  # by device: lowered once per process
    sessions: list[_Looping] = []
    try:
        for index in indices:
            sessions.append(await _Looping.start(address, index, programs))
    except Exception:  # noqa: BLE001 - reported to the parent, which raises it
        results.put(("failed", traceback.format_exc()))
        return
    results.put(("ready", len(sessions)))
    await asyncio.to_thread(go.wait)
    failures: list[str] = []
    ends = time.monotonic() + seconds
    outcomes = await asyncio.gather(*(session.loop(ends, failures) for session in sessions))
    results.put(("done", (list(outcomes), failures)))
    await asyncio.to_thread(finish.wait)
    for session in sessions:
        await session.wire.close()

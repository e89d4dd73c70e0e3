"""What colocated Python prints, in the notebook: under the cell whose call printed it, bounded, for its tenant alone.

A real Pathways kernel (jupyter_client) connected to the shared cluster with colocated Python runs
cells whose colocated functions print and log; a stock client runs in a child process (two tenants'
clients: tests/test_colocated_python.py). The host's bounds are also checked alone, through real
pipes, where a flood's counts are exact whatever the machine's speed.
"""

from __future__ import annotations

import asyncio
import os
import re
import site
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from pathways_nb.client.observe import Observer
from pathways_nb.colocated.executor.output import LineStream, OutputChannel
from pathways_nb.colocated.host_output import ExecutorOutput
from pathways_nb.core import colocated_output, tuning
from pathways_nb.errors import PathwaysError
from pathways_nb.testing import KernelSession

PLACED = re.compile(r"^\[island (\d) host (\d)\] (.*)$", re.M)
DROPPED = re.compile(r"^([\d,]+) lines dropped on island (\d) host (\d) \((.*)\)$", re.M)


def placed(text: str) -> list[tuple[int, int, str]]:
    """The remote lines of a cell's output: (island, host, line)."""
    return [(int(island), int(host), line) for island, host, line in PLACED.findall(text)]


def dropped(text: str) -> int:
    return sum(int(count.replace(",", "")) for count, *_ in DROPPED.findall(text))


# -- the host's bounds, alone ------------------------------------------------------------------------


def test_a_flood_through_the_pipes_keeps_the_budget_and_counts_every_line_it_drops():
    lines = 1_000_000

    async def run() -> list:
        (out_r, out_w), (err_r, err_w), (records_r, records_w) = os.pipe(), os.pipe(), os.pipe()
        output = ExecutorOutput()
        await output.read(out_r, err_r, records_r)
        channel = OutputChannel(records_w)
        stream = LineStream(channel, colocated_output.STDOUT, sys.__stdout__)

        def executor() -> None:  # as the executor's Python and its C libraries write
            with channel.call(1, "flood", "cell-1"):
                stream.write("".join(f"line {i}\n" for i in range(lines)))
                stream.write("a partial line at the call's end")
            with channel.call(2, "raw", "cell-2"):
                os.write(err_w, b"raw line\n" * 1000)
            for fd in (out_w, err_w, records_w):
                os.close(fd)

        ended = asyncio.ensure_future(asyncio.to_thread(executor))
        return [batch async for batch in output.batches(ended)]

    batches = asyncio.run(run())
    sent = [line for batch in batches for line in batch.lines]
    flood = [line for line in sent if line.call == "flood"]
    kept = [line for line in flood if not line.dropped]
    assert len(kept) <= tuning.OUTPUT_BURST_LINES.value + 1 and kept[0].text == "line 0"
    assert kept[-1].text == "a partial line at the call's end" and kept[-1].context == "cell-1"
    assert len(kept) + sum(line.dropped for line in flood) == lines + 1  # every line went, or was counted
    assert all("over the budget of 100 lines a second" in line.text for line in flood if line.dropped)
    raw = [line for line in sent if line.call == "raw"]  # the executor's stderr: its latest call's
    assert {line.stream for line in raw if not line.dropped} <= {"stderr"}
    assert sum(1 for line in raw if not line.dropped) + sum(line.dropped for line in raw) == 1000
    assert [n for batch in batches for n in batch.calls_done] == [1, 2]


# -- a notebook ---------------------------------------------------------------------------------------

SETUP = """
import logging, os, sys, time
import jax, numpy as np
from jax.experimental import colocated_python as cp
cpus = cp.colocated_cpu_devices(jax.devices())
x0 = jax.device_put(np.zeros(1, np.float32), cpus[0])   # island 0's host
x1 = jax.device_put(np.zeros(1, np.float32), cpus[2])   # island 1's host
"""


@pytest.fixture(scope="module")
def notebook(kernel_installed, colocated_cluster):
    session = KernelSession("pathways")
    cluster = colocated_cluster
    out = session.run(f"%pathways connect {cluster.address} --tenant notebook-a --token {cluster.token}")
    assert not out["errors"], out
    out = session.run(SETUP)
    assert not out["errors"], out
    yield session
    session.close()


def test_each_cells_output_holds_exactly_its_own_lines_tagged_with_where_they_ran(notebook):
    cells = [
        ("x0", 'print("marker-1 first"); print("marker-1 second")'),
        ("x1", 'print("marker-2 on island 1")'),
        ("x0", 'print("marker-3"); logging.warning("marker-3 warns"); print("marker-3 to stderr", file=sys.stderr)'),
    ]
    outputs = []
    for index, (where, body) in enumerate(cells, 1):
        code = f"@cp.colocated_python\ndef cell{index}(x):\n    {body}\n    return x + {index}\n"
        code += f"print(float(np.asarray(cell{index}({where}))[0]))"
        out = notebook.run(code)
        assert not out["errors"], out
        outputs.append(out)
    first, second, third = outputs
    assert "1.0\n" in first["stdout"] and "2.0\n" in second["stdout"] and "3.0\n" in third["stdout"]
    assert placed(first["stdout"]) == [(0, 0, "marker-1 first"), (0, 0, "marker-1 second")]
    assert placed(second["stdout"]) == [(1, 0, "marker-2 on island 1")]
    assert placed(third["stdout"]) == [(0, 0, "marker-3")]
    assert placed(third["stderr"]) == [(0, 0, "WARNING root: marker-3 warns"), (0, 0, "marker-3 to stderr")]
    assert not placed(first["stderr"]) and not placed(second["stderr"])
    logs = notebook.run("%pathways logs")["stdout"]
    assert [line for *_, line in placed(logs) if "marker" in line] == [
        "marker-1 first",
        "marker-1 second",
        "marker-2 on island 1",
        "marker-3",
        "WARNING root: marker-3 warns",
        "marker-3 to stderr",
    ]


def test_an_iterator_printing_while_the_next_cell_runs_prints_under_the_cell_that_started_it(notebook):
    # The iterator prints its first batch at once, then each next one while a call of the next cell waits for it
    # (in turn, through semaphores in the executor's builtins), so every batch but the first is printed while the
    # next cell runs, and another call is the executor's latest.
    started = notebook.run(
        """
@cp.colocated_python_class
class Prefetcher:
    def __init__(self):
        import builtins, queue, threading
        self.batches = queue.Queue()
        builtins.next_batch, builtins.batch_printed = threading.Semaphore(0), threading.Semaphore(0)

        def fill():
            print("prefetched batch 0")
            self.batches.put(0)
            for i in range(1, 8):  # each while a call of the next cell waits for it
                if not builtins.next_batch.acquire(timeout=60):
                    return
                print(f"prefetched batch {i}")
                self.batches.put(i)
                builtins.batch_printed.release()

        threading.Thread(target=fill, daemon=True).start()

    def next(self, x):
        return x + self.batches.get()

prefetcher = Prefetcher()
print("first batch", float(np.asarray(prefetcher.next(x1))[0]))
"""
    )
    assert not started["errors"], started
    following = notebook.run(
        """
@cp.colocated_python
def meanwhile(x):
    import builtins
    print("the next cell's own line")
    builtins.next_batch.release()
    if not builtins.batch_printed.acquire(timeout=60):
        raise TimeoutError("the prefetcher printed no batch within 60 s")
    return x

for _ in range(7):
    np.asarray(meanwhile(x1))
"""
    )
    assert not following["errors"], following
    assert [line for *_, line in placed(following["stdout"])] == ["the next cell's own line"] * 7
    late = notebook.wait_for_late(started["msg_id"], lambda late: "prefetched batch 7" in late["stdout"])
    batches = [line for *_, line in placed(started["stdout"] + late["stdout"])]
    assert batches == [f"prefetched batch {i}" for i in range(8)]
    assert all(island == 1 for island, _, _ in placed(started["stdout"] + late["stdout"]))


def test_a_million_lines_keep_the_budget_and_are_counted_the_call_returns_and_the_next_works(
    notebook, colocated_cluster
):
    host = psutil.Process(colocated_cluster.colocated_hosts[(1, 0)].process.pid)
    before = host.memory_info().rss
    files_before = {f.path: os.path.getsize(f.path) for f in host.open_files() if os.path.exists(f.path)}
    out = notebook.run(
        """
@cp.colocated_python
def flood(x):
    print("\\n".join(f"flood line {i}" for i in range(10**6)))
    return x + 7

started = time.monotonic()
print("returned", float(np.asarray(flood(x1))[0]), "after", time.monotonic() - started)
"""
    )
    assert not out["errors"], out
    returned, elapsed = re.search(r"returned (\S+) after (\S+)", out["stdout"]).groups()
    assert float(returned) == 7.0
    shown = [line for *_, line in placed(out["stdout"]) if line.startswith("flood line")]
    budget = tuning.OUTPUT_BURST_LINES.value + tuning.OUTPUT_RATE_LINES_S.value * float(elapsed)
    assert 0 < len(shown) <= budget and shown[0] == "flood line 0"
    assert len(shown) + dropped(out["stderr"]) == 10**6
    assert "lines dropped on island 1 host 0 (over the budget of 100 lines a second" in out["stderr"]
    after = notebook.run(
        "@cp.colocated_python\ndef after(x):\n    print('after the flood')\n    return x\nnp.asarray(after(x1))"
    )
    assert [line for *_, line in placed(after["stdout"])] == ["after the flood"]
    assert host.memory_info().rss - before < 64 << 20
    for path, size in files_before.items():  # (its log): nothing of the flood on disk
        assert not os.path.exists(path) or os.path.getsize(path) - size < 64 << 10, path


# -- other clients --------------------------------------------------------------------------------------

STOCK_CLIENT = Path(__file__).with_name("clients") / "colocated_stock_client.py"


def test_only_the_connection_that_made_the_calls_reads_their_lines(notebook, colocated_cluster):
    """Its tenant and its secret, both (two tenants' clients each print only their own lines:
    tests/test_colocated_python.py)."""
    observer = Observer(colocated_cluster.address, colocated_cluster.token)
    secret = notebook.run("import pathways_nb\nprint(pathways_nb.current().secret)")["stdout"].split()[-1]
    try:
        with pytest.raises(PathwaysError, match="no connection of tenant 'notebook-a' with that secret"):
            observer.output("notebook-a", "a guess")
        with pytest.raises(PathwaysError, match="no connection of tenant 'another-tenant' with that secret"):
            observer.output("another-tenant", secret)
        assert any(line.text == "marker-1 first" for line in observer.output("notebook-a", secret).lines)
    finally:
        observer.close()


def test_a_client_without_pathways_nb_runs_colocated_python_as_before(colocated_cluster, tmp_path):
    environment = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    environment.update(PYTHONPATH=site.getsitepackages()[0], IFRT_PROXY_USE_INSECURE_GRPC_CREDENTIALS="true")
    result = subprocess.run(
        [sys.executable, "-S", STOCK_CLIENT, colocated_cluster.address],
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "RESULT [3.0, 3.0] False" in result.stdout  # (and no pathways_nb in it)
    assert not placed(result.stdout + result.stderr)  # it never asked for its output: nothing changed for it


def test_the_workers_lines_about_the_sessions_programs(notebook):
    out = notebook.run(
        """
@cp.colocated_python
def fails(x):
    raise ValueError("the input pipeline ran dry")

try:
    np.asarray(fails(x0))
except Exception as error:
    print("raised", type(error).__name__)
"""
    )
    assert "raised JaxRuntimeError" in out["stdout"], out
    workers = notebook.run("%pathways logs --workers")["stdout"]
    assert "[island 0 host 0] ERROR pathways_nb.worker.session: jax_colocated_python_v0.0.1 failed" in workers
    assert "ValueError: the input pipeline ran dry" in workers
    assert "ValueError" not in notebook.run("%pathways logs")["stdout"]

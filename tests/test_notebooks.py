"""The teaching notebooks in notebooks/ run top to bottom in the Pathways kernel (nbclient), and show what they say.

Each executed notebook starts its own local cluster (``%pathways connect
local`` or ``LocalCluster``), as a reader's would. cloud.ipynb needs a real
remote cluster and is only checked for the steps it promises.
"""

from __future__ import annotations

import pathlib
import re

import nbformat
import numpy as np
from nbclient import NotebookClient

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
DOCS_PAGE = NOTEBOOKS.parent / "docs" / "notebooks.md"
EXECUTED = [
    "pipeline",
    "sharing",
    "multihost",
    "multislice",
    "failures",
    "profiling",
    "colocated_input",
    "checkpoints",
]
NOT_EXECUTED = {"cloud": "needs a remote cluster", "quickstart": "tests/test_quickstart.py runs it"}


def _outputs(cell) -> str:
    """What a code cell showed, as text: streams, plain-text reprs and errors."""
    parts = []
    for output in cell.get("outputs", []):
        if output["output_type"] == "stream":
            parts.append(output["text"])
        elif output["output_type"] == "error":
            parts.append(f"{output['ename']}: {output['evalue']}")
        elif "data" in output:
            parts.append(output["data"].get("text/plain", ""))
    return "".join(parts)


def _html(cell) -> list[str]:
    """The HTML a code cell showed (reprs that have one: DataFrames, timelines, profiles)."""
    return [o["data"]["text/html"] for o in cell.get("outputs", []) if "text/html" in o.get("data", {})]


def _widget_html(notebook, cell) -> list[str]:
    """The HTML of the views (HTML widgets) a cell displayed, from the widget state nbclient saved.

    Other widgets are left out: a compile that lasts over a second under load shows a progress bar
    (an HBox) in the same cell, before the view.
    """
    states = notebook.metadata.get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {})
    models = states.get("state", {})
    shown = [
        models[data["application/vnd.jupyter.widget-view+json"]["model_id"]]
        for output in cell.get("outputs", [])
        for data in [output.get("data", {})]
        if "application/vnd.jupyter.widget-view+json" in data
    ]
    return [model["state"]["value"] for model in shown if model["model_name"] == "HTMLModel"]


def _execute(name: str):
    notebook = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    NotebookClient(notebook, timeout=300, kernel_name="pathways").execute()
    cells = [c for c in notebook.cells if c.cell_type == "code"]
    errors = [o for c in cells for o in c.get("outputs", []) if o["output_type"] == "error"]
    assert not errors, f"{name}: {errors}"
    return notebook, cells


def _cell(cells, startswith: str):
    return next(c for c in cells if c.source.startswith(startswith))


def test_every_notebook_is_run_or_says_why_not_and_is_listed_in_the_docs():
    names = sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb"))
    assert names == sorted([*EXECUTED, *NOT_EXECUTED])
    page = DOCS_PAGE.read_text()
    for name in names:
        assert f"notebooks/{name}.ipynb" in page, f"docs/notebooks.md does not list {name}.ipynb"
        notebook = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
        nbformat.validate(notebook)
        assert notebook.metadata.kernelspec.name == "pathways"
        assert not any(c.get("outputs") for c in notebook.cells if c.cell_type == "code"), f"{name} has outputs"


def test_pipeline_trains_four_stages_with_1f1b_and_shows_the_schedule(kernel_installed):
    _notebook, cells = _execute("pipeline")
    plans = _outputs(_cell(cells, "from pathways_nb.pipeline import live_activations")).splitlines()
    assert plans[0] == "stage 0 (island 0): F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7   holds 4", plans
    assert [line.rsplit(" ", 1)[1] for line in plans] == ["4", "3", "2", "1"]
    losses = re.findall(r"pipelined loss ([\d.]+), unpipelined ([\d.]+)", _outputs(_cell(cells, "sgd = ")))
    assert len(losses) == 8, losses
    np.testing.assert_allclose(*np.array(losses, float).T, rtol=1e-5)  # float32, added in another order
    assert float(losses[-1][0]) < float(losses[0][0])
    (svg,) = _html(_cell(cells, "import pathways_nb"))
    devices = set(re.findall(r'class="pw-bar pw-execute" data-device="(\d+)"', svg))
    assert devices == {"0", "1", "2", "3"}, devices  # one device of each island
    analysis = _outputs(_cell(cells, "from pathways_nb.pipeline import bubble"))
    measured, theory = map(float, re.search(r"bubble: measured (-?[\d.]+), in theory ([\d.]+)", analysis).groups())
    assert theory == 0.27 and 0 < measured < 1, analysis
    assert any(
        "image/png" in o.get("data", {}) for o in _cell(cells, "from pathways_nb.pipeline import bubble").outputs
    )


def test_no_notebook_or_page_says_a_program_runs_on_one_island():
    """Programs run across islands since multislice: no notebook, page or the README may say otherwise."""
    claim = re.compile(r"(program|jit|computation)s? (only )?runs? on (one|a single) island", re.IGNORECASE)
    texts = [*NOTEBOOKS.glob("*.ipynb"), *(NOTEBOOKS.parent / "docs").glob("*.md"), NOTEBOOKS.parent / "README.md"]
    claims = [f"{path.name}: {m.group(0)}" for path in texts for m in claim.finditer(path.read_text())]
    assert not claims, claims


def test_sharing_shows_tenants_the_queue_weights_and_a_preempted_session(kernel_installed):
    notebook, cells = _execute("sharing")
    assert "bob: connected" in _outputs(_cell(cells, "bob = tenant("))
    (shared_map,) = _widget_html(notebook, _cell(cells, "bob = tenant("))
    assert "alice" in shared_map and "bob" in shared_map
    (queue,) = _widget_html(notebook, _cell(cells, "carol = tenant("))
    assert "carol" in queue and "waiting (1)" in queue
    handover = _cell(cells, "leave(bob)")
    assert "carol: connected" in _outputs(handover)
    table, island_map = _widget_html(notebook, handover)
    assert "carol" in table and "bob" not in table and "waiting" not in table
    assert "held by carol (exclusive)" in island_map
    weights = _outputs(_cell(cells, "dave = tenant("))
    assert "dave: connected" in weights
    # erin (priority 10) takes island 0: alice's session is suspended, seen in each view, and resumes by itself.
    preempted = _cell(cells, "import jax")
    assert "erin: connected\nalice: suspended\n" in _outputs(preempted), _outputs(preempted)
    why = "preempted by tenant erin (priority 10, exclusive)"
    (sessions,) = _html(preempted)
    assert re.search(rf"<td>alice</td>\s*<td>suspended</td>\s*<td>{re.escape(why)}</td>", sessions), sessions
    table, island_map = _widget_html(notebook, _cell(cells, "display(AllocationTable"))
    assert re.search(rf"<td>alice</td>\s*<td>suspended</td>\s*<td>suspended</td>\s*<td>{re.escape(why)}</td>", table)
    suspended_tiles = re.findall(
        r'class="pw-device pw-suspended[^"]*" data-device="(\d+)"[^>]*title="([^"]*)"', island_map
    )
    assert [device for device, _ in suspended_tiles] == ["0", "1"], suspended_tiles
    assert all("held by erin (exclusive); alice suspended, resumes here" in title for _, title in suspended_tiles)
    assert "alice (suspended)" in island_map and f"suspended ({why})" in island_map
    resumed = _cell(cells, "leave(erin)")
    assert "x[-1] = 999999.0 alice: running" in _outputs(resumed)
    (timeline,) = _html(resumed)
    assert set(re.findall(r'class="pw-suspension" data-device="(\d+)"', timeline)) == {"0", "1"}
    assert f"{why}; resumed: a request arrived" in timeline
    assert re.search(r'class="pw-break-length"[^>]*>suspended: [\d.]+ m?s<', timeline)  # (erin's start is long)


def test_multihost_runs_one_program_across_both_hosts(kernel_installed):
    notebook, cells = _execute("multihost")
    assert "[(0, 0, 0), (1, 0, 0), (2, 0, 1), (3, 0, 1)]" in _outputs(_cell(cells, "session = pathways_nb.connect"))
    (island_map,) = _widget_html(notebook, _cell(cells, "from pathways_nb.notebook.widgets import IslandMap"))
    assert 'data-host="0"' in island_map and 'data-host="1"' in island_map
    text = "".join(_outputs(c) for c in cells)
    assert "shards on hosts: [0, 1]" in text and "loss:" in text


def test_multislice_trains_across_two_islands_and_through_losing_one(kernel_installed):
    _notebook, cells = _execute("multislice")
    assert "[(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]" in _outputs(cells[0])
    assert "equal to local JAX's (float32 rounding): True" in _outputs(_cell(cells, "def train"))
    assert "group of islands 0+1: serving=True, 4 members" in _outputs(_cell(cells, "for group in"))
    elastic = _outputs(_cell(cells, "from pathwaysutils.elastic"))
    assert "trained on island 0 alone while island 1 was down: True" in elastic, elastic
    assert "[[0, 1], [0, 1], [0, 1]]" in elastic


def test_failures_kill_a_worker_see_the_error_and_bring_it_back(kernel_installed):
    notebook, cells = _execute("failures")
    down_island = 'class="pw-island pw-unhealthy" data-island='
    before = _widget_html(notebook, _cell(cells, "import time"))[0]
    assert 'data-island="1"' in before and down_island not in before
    error = _outputs(_cell(cells, "def island_healthy"))
    assert "island 1 host 0" in error and ("unreachable" in error or "lost" in error), error
    assert re.search(r"island 0: \d", _outputs(_cell(cells, 'print("island 0:"')))
    (down,) = _widget_html(notebook, _cell(cells, "while_down"))
    assert f'{down_island}"1"' in down and f'{down_island}"0"' not in down
    back = _cell(cells, "started = time.monotonic()")
    assert re.search(r"came back by itself|restarted island 1's worker by hand", _outputs(back))
    assert down_island not in _widget_html(notebook, back)[0]
    assert re.search(r"island 1: \d", _outputs(_cell(cells, "x1 = jax.device_put")))
    assert "disconnected from" in _outputs(cells[-1])


def test_checkpoints_are_written_by_the_workers_and_restore_into_another_mesh(kernel_installed):
    _, cells = _execute("checkpoints")
    assert "proxy/pathways CloudPathwaysArrayHandler" in _outputs(_cell(cells, "import jax"))
    assert "steps: [100]" in _outputs(_cell(cells, "path = "))
    files = _outputs(_cell(cells, "step_directory"))
    assert "_METADATA" in files and "embed/ .zarray 0.0 0.1 1.0 1.1" in files and "bias/ .zarray 0" in files
    assert "restored equal: True" in _outputs(_cell(cells, "target = {name"))
    moved = _outputs(_cell(cells, "island1 = "))
    assert moved.count("on devices [2, 3], equal: True") == 4 and "a step on island 1: (8, 256) True" in moved
    assert "plain JAX equal: True" in _outputs(_cell(cells, "import subprocess"))


def test_cloud_notebook_has_the_steps():
    notebook = nbformat.read(NOTEBOOKS / "cloud.ipynb", as_version=4)
    text = "\n".join(c.source for c in notebook.cells)
    for step in [
        "kubectl port-forward",
        "JAX_PLATFORMS=proxy JAX_BACKEND_TARGET=grpc://localhost:29000",
        'pathways_nb.connect("grpc://localhost:29000"',
        "pathwaysutils.initialize()",
        "%pathways islands",
    ]:
        assert step in text, step


def test_profiling_finds_the_slowest_op_on_both_islands(kernel_installed):
    notebook, cells = _execute("profiling")
    profiled = _cell(cells, "%%pathways profile")
    assert "trace files in" in _outputs(profiled) and "xprof --logdir" in _outputs(profiled)
    html = _html(profiled)[0]
    assert {"0", "2"} <= set(re.findall(r'class="pw-bar pw-op" data-device="(\d+)"', html)), "ops of both islands"
    assert re.search(r"slowest op: \S+ in jit_train_step: [\d.]+ ms in all", _outputs(_cell(cells, "top = ")))
    (svg,) = _widget_html(notebook, _cell(cells, "%pathways timeline"))
    assert "pw-op" in svg and "pw-execute" in svg
    files = _outputs(_cell(cells, "print(run.trace.xprof_command)"))
    assert "island0-host0.xplane.pb" in files and "island1-host0.xplane.pb" in files


def test_colocated_input_trains_from_pipelines_on_the_hosts(kernel_installed):
    _, cells = _execute("colocated_input")
    devices = _outputs(_cell(cells, "import jax"))
    assert "cpu:0 (cpu accelerator) has cpu:4 beside it, on island 0" in devices
    training = _outputs(_cell(cells, "@jax.jit"))
    learned = re.search(r"learned \[([^\]]+)\]", training).group(1)
    assert np.allclose([float(v) for v in learned.split()], [2.0, -3.0, 0.5, 1.0], atol=0.05), learned
    printed = [line for line in training.splitlines() if line.startswith("[island")]  # by the pipelines
    assert sorted(printed) == [
        f"[island {i} host 0] {what}"
        for i in (0, 1)
        for what in (f"pipeline of seed {i} ready: 32 examples a batch", "served 20 batches", "served 40 batches")
    ]
    assert "[island 1 host 0] served 40 batches" in _outputs(_cell(cells, "%pathways logs"))
    served = _outputs(_cell(cells, "import psutil"))
    assert "{0: 40, 1: 40} batches served per island" in served
    assert served.count("executor pid") == 2  # one per island's host
    assert "ValueError: refusing a batch of shape (32, 4) on purpose" in _outputs(_cell(cells, "@cp.colocated_python"))

"""``pathways_nb.pipeline``: MPMD pipeline training steps equal the unpipelined step's, locally and through a
cluster of 4 islands; its schedules' order and memory, driven directly; bad input refused before dispatch.

The equality checks run in a stock client (tests/clients/pipeline_equals_unpipelined.py), once on this
machine's CPU devices and once against a cluster of 4 islands of one device, one stage per island.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pathways_nb.launch.local_cluster import LocalCluster
from pathways_nb.pipeline import Op, Pipeline, bubble, issue_order, live_activations, schedule_ops
from pathways_nb.testing import finished_ok, python_script

CLIENT = Path(__file__).with_name("clients") / "pipeline_equals_unpipelined.py"


def _check_equal_to_unpipelined(report: dict) -> None:
    assert sorted(report) == ["1f1b-2", "1f1b-4", "gpipe-2", "gpipe-4"]
    for name, run in report.items():
        # float32 rounding: the pipeline adds the microbatches' gradients in another order than one matmul does
        assert run["loss_error"] < 1e-6 and run["grad_error"] < 1e-6, (name, run)
        assert run["devices"] == run["expected_devices"], (name, run)
        stages = len(run["devices"])
        assert run["peak_live"] == ([8] * (stages - 1) if name.startswith("gpipe") else list(range(stages, 1, -1))) + [
            1
        ]


def test_steps_equal_the_unpipelined_step_on_local_jax():
    _check_equal_to_unpipelined(json.loads(finished_ok(python_script(CLIENT, "local"), 240)))


def test_steps_equal_the_unpipelined_step_through_a_cluster_of_4_islands():
    with LocalCluster(islands=4, devices_per_host=1) as cluster:
        report = json.loads(finished_ok(python_script(CLIENT, cluster.address), 300).splitlines()[-1])
    _check_equal_to_unpipelined(report)


@pytest.mark.parametrize("stages,microbatches", [(2, 8), (4, 16), (8, 32), (4, 2), (1, 4)])
def test_1f1b_holds_at_most_s_activations_per_stage_and_gpipe_holds_m(stages, microbatches):
    one_f_one_b = schedule_ops("1f1b", stages, microbatches)
    gpipe = schedule_ops("gpipe", stages, microbatches)
    for s in range(stages - 1):
        assert live_activations(one_f_one_b[s]) == min(stages - s, microbatches)
        assert live_activations(gpipe[s]) == microbatches
    for plan in (one_f_one_b, gpipe):  # every stage runs every microbatch's forward and backward once
        for s, ops in enumerate(plan):
            kinds = ["FB"] if s == stages - 1 else ["F", "B"]
            assert sorted((op.kind, op.microbatch) for op in ops) == sorted(
                (k, m) for k in kinds for m in range(microbatches)
            )


def test_1f1b_alternates_after_its_warm_up():
    assert schedule_ops("1f1b", 3, 4)[0] == [
        Op("F", 0), Op("F", 1), Op("F", 2), Op("B", 0), Op("F", 3), Op("B", 1), Op("B", 2), Op("B", 3)
    ]  # fmt: skip


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_issue_order_puts_each_program_after_the_ones_it_takes_from(kind):
    plans = schedule_ops(kind, 4, 8)
    order = issue_order(plans)
    position = {(s, op.kind, op.microbatch): i for i, (s, op) in enumerate(order)}
    for s, plan in enumerate(plans):
        assert [op for stage, op in order if stage == s] == plan  # each stage's own order is kept
        for op in plan:
            if op.kind in ("F", "FB") and s > 0:
                assert position[(s - 1, "F", op.microbatch)] < position[(s, op.kind, op.microbatch)]
            if op.kind == "B":
                taken = (s + 1, "FB" if s + 1 == len(plans) - 1 else "B", op.microbatch)
                assert position[taken] < position[(s, "B", op.microbatch)]


def test_bubble_is_the_textbook_fraction():
    assert bubble(4, 16) == pytest.approx(3 / 19)
    assert bubble(1, 4) == 0


def _layer(p, x):
    return jnp.tanh(x @ p)


def _loss(p, x):
    return jnp.mean(x @ p)


def _params(*shapes):
    return [np.ones(shape, np.float32) / 8 for shape in shapes]


def test_a_step_reads_nothing_back_to_the_host():
    """Everything a step returns is a future; a read of a device's result inside it would raise here."""
    devices = jax.devices()[:2]
    pipe = Pipeline([_layer, _loss], devices, microbatches=4)
    params, batch = _params((8, 8), (8, 2)), np.ones((16, 8), np.float32)
    pipe.step(params, batch)  # compiles
    with jax.transfer_guard_device_to_host("disallow"):
        result = pipe.step(params, batch)
    assert float(result.loss) == pytest.approx(float(_loss(params[1], _layer(params[0], batch))))


def _refused(pipe: Pipeline, params, batch, targets=None) -> str:
    with pytest.raises(ValueError) as raised:
        pipe.step(params, batch, targets)
    assert not any(getattr(p, "forward", None) and p.forward._cache_size() for p in pipe._programs), "dispatched"
    return str(raised.value)


def test_bad_input_is_refused_before_anything_runs_naming_the_stage():
    devices = jax.devices()[:3]
    with pytest.raises(ValueError, match="3 stages but 2 placements"):
        Pipeline([_layer, _layer, _loss], devices[:2], microbatches=4)
    with pytest.raises(ValueError, match="stage 1's placement must be"):
        Pipeline([_layer, _loss], [devices[0], "island 1"], microbatches=4)
    with pytest.raises(ValueError, match="unknown schedule 'zero-bubble'"):
        Pipeline([_layer, _loss], devices[:2], microbatches=4, schedule="zero-bubble")
    pipe = Pipeline([_layer, _layer, _loss], devices, microbatches=4)
    batch = np.ones((16, 8), np.float32)
    assert "the batch's 18 examples do not split into 4 microbatches" in _refused(
        pipe, _params((8, 8), (8, 8), (8, 2)), np.ones((18, 8), np.float32)
    )
    message = _refused(pipe, _params((8, 8), (6, 8), (8, 2)), batch)
    assert message.startswith("stage 1 (_layer) cannot take stage 0's output float32[4, 8]: dot_general"), message
    assert "stage 0 (_layer) cannot take the microbatch" in _refused(pipe, _params((5, 8), (8, 8), (8, 2)), batch)
    message = _refused(Pipeline([_layer, _layer], devices[:2], microbatches=4), _params((8, 8), (8, 8)), batch)
    assert message.startswith("stage 1 (_layer) must return a scalar loss, not float32[4, 8]"), message
    assert "2 parameter trees for 3 stages" in _refused(pipe, _params((8, 8), (8, 8)), batch)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_recomputing_the_forward_gives_the_same_step_holding_only_inputs(schedule):
    devices, params, batch = jax.devices()[:3], _params((8, 8), (8, 8), (8, 2)), np.ones((16, 8), np.float32)
    kept, recomputed = (
        Pipeline([_layer, _layer, _loss], devices, microbatches=4, schedule=schedule, recompute=recompute)
        for recompute in (False, True)
    )
    want, got = kept.step(params, batch), recomputed.step(params, batch)
    assert float(got.loss) == pytest.approx(float(want.loss), rel=1e-6)
    for g, w in zip(got.grads, want.grads, strict=True):  # (the recomputed forward may fuse otherwise)
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7)
    assert got.peak_live == want.peak_live

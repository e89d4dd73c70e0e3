"""MPMD pipeline training in plain JAX: stages on their own devices (any islands), microbatches between them.

>>> from pathways_nb.pipeline import Pipeline
>>> pipe = Pipeline([stage0, stage1, loss], [island0, island1, island2], microbatches=8)  # doctest: +SKIP
>>> result = pipe.step(params, batch, targets)                                            # doctest: +SKIP
>>> result.loss, result.grads                                                             # doctest: +SKIP

Each stage is a function ``stage(params, x) -> y``; the last one is ``loss(params, x, targets) -> scalar``
(or ``loss(params, x)`` when no targets are given). Each runs on its own placement: a device, a list of
devices, a ``Mesh`` or a ``Sharding``, on one island or several. One ``step`` splits the batch into
microbatches, runs every stage's forward and backward in the order of the chosen schedule, moves
activations forward and their gradients back with ``jax.device_put`` (worker to worker on a cluster), and
returns the mean loss and each stage's gradients, on that stage's devices. Nothing in a step waits for a
result: every call returns a future, so the whole step is enqueued ahead and each stage runs as soon as its
input has landed. The same code runs on local JAX (say, 4 CPU devices), which is how to debug it.

The schedule is the order in which each stage's programs are issued (each device runs its programs in
the order they were issued):

- ``"gpipe"``: every forward, then every backward; a stage holds the residuals of all M microbatches.
- ``"1f1b"``: stage s runs S-1-s forwards ahead, then alternates one forward and one backward; it holds at
  most S-s microbatches' residuals. Both leave the same bubble, (S-1)/(M+S-1) of the step.

Placements may repeat a mesh (stages 0 and 2 on one island, 1 and 3 on another: interleaved virtual
stages); such stages then share their devices in the order the step issues them, without a schedule of
their own.

The backward keeps the forward's residuals (``jax.vjp`` in the forward's program, its pullback applied
in the backward's) rather than recomputing the forward: a stage then does the model's work once, as an
SPMD step does, and pays for it in memory, which 1F1B bounds. ``recompute=True`` keeps only each
microbatch's input instead and runs the forward again inside the backward (a third more compute).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding

Schedule = Literal["gpipe", "1f1b"]
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b")


@dataclass(frozen=True)
class Op:
    """One program of a schedule: the forward (``"F"``) or backward (``"B"``) of a microbatch on a stage.

    The last stage's forward and backward are one program (``"FB"``): its backward can start at once.
    """

    kind: Literal["F", "B", "FB"]
    microbatch: int


def schedule_ops(kind: Schedule, stages: int, microbatches: int) -> list[list[Op]]:
    """Each stage's programs, in the order that stage issues them, for ``stages`` stages and
    ``microbatches`` microbatches."""
    if kind not in SCHEDULES:
        raise ValueError(f"unknown schedule {kind!r}: one of {', '.join(SCHEDULES)}")
    last = [Op("FB", m) for m in range(microbatches)]
    plans = []
    for stage in range(stages - 1):
        if kind == "gpipe":
            plans.append([Op("F", m) for m in range(microbatches)] + [Op("B", m) for m in range(microbatches)])
        else:
            plans.append(_one_forward_one_backward(stages - 1 - stage, microbatches))
    return [*plans, last]


def _one_forward_one_backward(warmup: int, microbatches: int) -> list[Op]:
    """``warmup`` forwards ahead, then a forward and a backward in turn, then the remaining backwards."""
    warmup = min(warmup, microbatches)
    plan = [Op("F", m) for m in range(warmup)]
    for m in range(warmup, microbatches):
        plan += [Op("F", m), Op("B", m - warmup)]
    plan += [Op("B", m) for m in range(microbatches - warmup, microbatches)]
    return plan


def live_activations(plan: Sequence[Op]) -> int:
    """The most microbatches whose residuals one stage holds at once under ``plan``."""
    live = peak = 0
    for op in plan:
        live += op.kind == "F"
        peak = max(peak, live)
        live -= op.kind == "B"
    return max(peak, 1 if any(op.kind == "FB" for op in plan) else 0)


def issue_order(plans: Sequence[Sequence[Op]]) -> list[tuple[int, Op]]:
    """One order for the controller to issue every stage's programs in: each stage's own order kept, and
    each program after the programs whose outputs it takes (its forward input from the stage before, its
    backward input from the stage after). Stages take turns, so no stage's queue waits on the controller."""
    done: set[tuple[int, str, int]] = set()
    cursors = [0] * len(plans)
    order: list[tuple[int, Op]] = []
    while len(order) < sum(map(len, plans)):
        progressed = False
        for stage, plan in enumerate(plans):
            while cursors[stage] < len(plan) and _ready(stage, plan[cursors[stage]], done):
                op = plan[cursors[stage]]
                order.append((stage, op))
                done.update((stage, kind, op.microbatch) for kind in (("F", "B") if op.kind == "FB" else (op.kind,)))
                cursors[stage] += 1
                progressed = True
        if not progressed:
            raise ValueError("the schedule deadlocks: a stage waits for a program issued after its own")
    return order


def _ready(stage: int, op: Op, done: set) -> bool:
    needs = []
    if op.kind in ("F", "FB") and stage > 0:
        needs.append((stage - 1, "F", op.microbatch))
    if op.kind == "B":
        needs.append((stage + 1, "B", op.microbatch))
    return all(need in done for need in needs)


@dataclass
class StepResult:
    """What one ``Pipeline.step`` returns: futures on the stages' devices.

    ``loss`` is the mean of the microbatches' losses, on the last stage's devices; ``grads[s]`` has the
    structure of stage s's parameters, on stage s's devices (the mean over microbatches, so the gradient
    of ``loss``); ``peak_live[s]`` is the most microbatches' residuals stage s held at once.
    """

    loss: jax.Array
    grads: list[Any]
    peak_live: list[int] = field(default_factory=list)


class Pipeline:
    """A pipeline of stage functions, each on its own placement, that runs training steps.

    Args:
        stages: ``stage(params, x) -> y`` for every stage but the last; the last returns the loss, a
            scalar: ``loss(params, x, targets)``, or ``loss(params, x)`` when ``step`` gets no targets.
        placements: where each stage runs, one per stage: a ``jax.Device``, a list of devices, a ``Mesh``
            (the stage's parameters and activations replicated over it) or a ``Sharding`` (activations
            placed with it; parameters replicated over its devices unless already there).
        microbatches: how many microbatches a step splits its batch into (the batch's leading dimension
            must be a multiple).
        schedule: ``"gpipe"`` or ``"1f1b"`` (see the module's docstring).
        recompute: run the forward again in the backward instead of keeping its residuals.

    Each stage's forward and backward are compiled once per placement (``jax.jit``), named
    ``stage<s>_forward``/``stage<s>_backward`` so that a timeline shows them apart.
    """

    def __init__(
        self,
        stages: Sequence[Callable],
        placements: Sequence[Any],
        *,
        microbatches: int,
        schedule: Schedule = "1f1b",
        recompute: bool = False,
    ):
        if len(stages) != len(placements):
            raise ValueError(f"{len(stages)} stages but {len(placements)} placements: give one placement per stage")
        if len(stages) < 1:
            raise ValueError("a pipeline needs at least one stage")
        if microbatches < 1:
            raise ValueError(f"microbatches must be at least 1, not {microbatches}")
        self.stages = list(stages)
        self.shardings = [_sharding(p, s) for s, p in enumerate(placements)]
        self.microbatches = microbatches
        self.schedule = schedule
        self.plans = schedule_ops(schedule, len(stages), microbatches)
        self._order = issue_order(self.plans)
        last = len(stages) - 1
        self._programs = [_StagePrograms(fn, s, s == last, recompute, 1 / microbatches) for s, fn in enumerate(stages)]
        self._split = _jit(functools.partial(_split_microbatches, microbatches=microbatches), "split_microbatches")
        self._checked: set = set()

    @property
    def step_program(self) -> str:
        """The name of the first program of every step (it cuts the batch into microbatches): a timeline's
        ``step_program``, as in ``Session.timeline(last=1, step_program=pipe.step_program)``."""
        return "jit_split_microbatches"

    def step(self, params: Sequence[Any], batch: Any, targets: Any = None) -> StepResult:
        """One training step: the mean loss over the batch and each stage's gradients, as futures.

        ``params[s]`` is stage s's parameters (a pytree; moved to its devices if elsewhere); ``batch`` and
        ``targets`` are pytrees of arrays whose leading dimension is the batch. Bad input raises a
        ``ValueError`` naming the stage before anything is dispatched.
        """
        if len(params) != len(self.stages):
            raise ValueError(f"{len(params)} parameter trees for {len(self.stages)} stages")
        self._check(params, batch, targets)
        params = [_place(p, sharding) for p, sharding in zip(params, self.shardings, strict=True)]
        inputs = self._pieces(batch, self.shardings[0])
        labels = None if targets is None else self._pieces(targets, self.shardings[-1])
        return _Step(self, params, inputs, labels).run()

    def held_bytes(self, params: Sequence[Any], batch: Any) -> list[int]:
        """The most bytes of residuals each stage holds at once under this schedule (shapes only: its peak
        number of live microbatches times what one microbatch's forward keeps for the backward; the last
        stage's forward and backward are one program, which keeps nothing between programs)."""
        x = _microbatch_shape(batch, self.microbatches, "batch")
        held = []
        for s, (programs, p) in enumerate(zip(self._programs[:-1], params, strict=False)):
            y, kept = jax.eval_shape(programs.forward, p, x)
            one = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves((kept, x)))
            held.append(live_activations(self.plans[s]) * one)
            x = y
        return [*held, 0]

    def _pieces(self, tree: Any, sharding: Sharding) -> list[Any]:
        """A batch as microbatches on ``sharding``: one transfer and one program, not one per microbatch."""
        pieces = self._split(jax.device_put(tree, _replicated(sharding)))
        return [jax.device_put(piece, sharding) for piece in pieces]

    def _check(self, params: Sequence[Any], batch: Any, targets: Any) -> None:
        """Shapes only (``jax.eval_shape``): each stage takes the previous stage's output, the last returns a
        scalar. Checked once per structure, shapes and dtypes of the arguments."""
        key = tuple(_signature(tree) for tree in (list(params), batch, targets))
        if key in self._checked:
            return
        x = _microbatch_shape(batch, self.microbatches, "batch")
        labels = None if targets is None else _microbatch_shape(targets, self.microbatches, "targets")
        for s, (stage, p) in enumerate(zip(self.stages, params, strict=True)):
            last = s == len(self.stages) - 1
            arguments = (p, x, labels) if last and labels is not None else (p, x)
            taking = "the microbatch" if s == 0 else f"stage {s - 1}'s output {_describe(x)}"
            try:
                x = jax.eval_shape(stage, *arguments)
            except Exception as error:  # any tracing error: the stage cannot take this input
                raise ValueError(f"stage {s} ({_name(stage)}) cannot take {taking}: {error}") from error
        if not (isinstance(x, jax.ShapeDtypeStruct) and x.shape == ()):
            raise ValueError(
                f"stage {len(self.stages) - 1} ({_name(self.stages[-1])}) must return a scalar loss, not {_describe(x)}"
            )
        self._checked.add(key)


class _StagePrograms:
    """One stage's jitted programs: the forward (its output, and what the backward needs of it), the backward
    (the input's gradient, the parameters' gradients added to the running sum), and for the last stage both
    in one program.

    The forward's residuals leave out the stage's inputs, parameters and microbatch (``jax.vjp`` keeps them,
    and a program's outputs are new buffers: M microbatches would hold M copies of the parameters); the
    backward takes them again. Where each of ``jax.vjp``'s residuals goes is read while the forward is
    traced, and used when the backward is.
    """

    def __init__(self, fn: Callable, index: int, last: bool, recompute: bool, scale: float):
        self.fn = fn
        if last:
            self.forward_backward = _jit(_last_stage(fn, scale), f"stage{index}_forward_backward", donate=(3,))
            return
        self._layouts: dict[tuple, tuple] = {}  # residuals' shapes -> (the pullback's treedef, the inputs' places)
        forward = (lambda p, x: (fn(p, x), [])) if recompute else self._keeping_forward
        backward = self._recomputing_backward if recompute else self._kept_backward
        self.forward = _jit(forward, f"stage{index}_forward")
        self.backward = _jit(backward, f"stage{index}_backward", donate=(3,))

    def _keeping_forward(self, p, x):
        """The output and the residuals that are not the stage's inputs (the backward gets those again)."""
        y, pullback = jax.vjp(self.fn, p, x)
        leaves, treedef = jax.tree.flatten(pullback)
        inputs = {id(leaf): i for i, leaf in enumerate(jax.tree.leaves((p, x)))}
        kept = [leaf for leaf in leaves if id(leaf) not in inputs]
        self._layouts[_signature(kept)] = (treedef, tuple(inputs.get(id(leaf)) for leaf in leaves))
        return y, kept

    def _kept_backward(self, p, residuals, grad_y, accumulated):
        kept, x = residuals
        treedef, places = self._layouts[_signature(kept)]
        inputs, rest = jax.tree.leaves((p, x)), iter(kept)
        pullback = treedef.unflatten([next(rest) if i is None else inputs[i] for i in places])
        return _backward(pullback, grad_y, accumulated)

    def _recomputing_backward(self, p, residuals, grad_y, accumulated):
        _, x = residuals
        _, pullback = jax.vjp(self.fn, p, x)
        return _backward(pullback, grad_y, accumulated)


def _last_stage(fn: Callable, scale: float) -> Callable:
    """The loss's forward and backward in one program, scaled by 1/M so that the sums over microbatches are
    the batch's mean loss and its gradient."""

    def forward_backward(p, x, labels, accumulated):
        def scaled_loss(p, x):
            return (fn(p, x) if labels is None else fn(p, x, labels)) * scale

        loss, (grad_p, grad_x) = jax.value_and_grad(scaled_loss, argnums=(0, 1))(p, x)
        return grad_x, _added(accumulated, (loss, grad_p))

    return forward_backward


def _backward(pullback, grad_y, accumulated):
    grad_p, grad_x = pullback(grad_y)
    return grad_x, _added(accumulated, grad_p)


def _added(accumulated, tree):
    """``tree`` added to the running sum (the first microbatch's backward starts it: ``accumulated`` None)."""
    return tree if accumulated is None else jax.tree.map(jnp.add, accumulated, tree)


def _jit(fn: Callable, name: str, donate: tuple[int, ...] = ()) -> Callable:
    """``jax.jit``, its program named ``jit_<name>`` (what timelines and profiles show)."""

    def program(*args):
        return fn(*args)

    program.__name__ = program.__qualname__ = name
    return jax.jit(program, donate_argnums=donate)


class _Step:
    """One step's dataflow: issues every program of the schedule in ``issue_order``, moving each output to
    the stage that takes it; holds the futures (nothing here waits for one)."""

    def __init__(self, pipe: Pipeline, params: list, inputs: list, labels: list | None):
        self.pipe, self.params, self.labels = pipe, params, labels
        stages = len(pipe.stages)
        self.inbox: list[dict[int, Any]] = [dict(enumerate(inputs))] + [{} for _ in range(stages - 1)]
        self.grad_inbox: list[dict[int, Any]] = [{} for _ in range(stages)]
        self.residuals: list[dict[int, Any]] = [{} for _ in range(stages)]
        self.accumulated: list[Any] = [None] * stages
        self.peak_live = [0] * stages

    def run(self) -> StepResult:
        for stage, op in self.pipe._order:
            {"F": self._forward, "B": self._backward, "FB": self._forward_backward}[op.kind](stage, op.microbatch)
        loss, grad_last = self.accumulated[-1]
        return StepResult(loss, [*self.accumulated[:-1], grad_last], self.peak_live)

    def _forward(self, stage: int, m: int) -> None:
        x = self.inbox[stage].pop(m)
        y, kept = self.pipe._programs[stage].forward(self.params[stage], x)
        self.residuals[stage][m] = (kept, x)  # the input, kept for the backward rather than copied
        self.peak_live[stage] = max(self.peak_live[stage], len(self.residuals[stage]))
        self.inbox[stage + 1][m] = jax.device_put(y, self.pipe.shardings[stage + 1])

    def _backward(self, stage: int, m: int) -> None:
        programs = self.pipe._programs[stage]
        residuals, grad_y = self.residuals[stage].pop(m), self.grad_inbox[stage].pop(m)
        grad_x, self.accumulated[stage] = programs.backward(
            self.params[stage], residuals, grad_y, self.accumulated[stage]
        )
        if stage > 0:
            self.grad_inbox[stage - 1][m] = jax.device_put(grad_x, self.pipe.shardings[stage - 1])

    def _forward_backward(self, stage: int, m: int) -> None:
        labels = None if self.labels is None else self.labels[m]
        program = self.pipe._programs[stage].forward_backward
        x = self.inbox[stage].pop(m)
        grad_x, self.accumulated[stage] = program(self.params[stage], x, labels, self.accumulated[stage])
        self.peak_live[stage] = max(self.peak_live[stage], 1)
        if stage > 0:
            self.grad_inbox[stage - 1][m] = jax.device_put(grad_x, self.pipe.shardings[stage - 1])


def _sharding(placement: Any, stage: int) -> Sharding:
    """A stage's placement as the sharding its activations take."""
    if isinstance(placement, Sharding):
        return placement
    if isinstance(placement, Mesh):
        return NamedSharding(placement, PartitionSpec())
    devices = [placement] if isinstance(placement, jax.Device) else list(placement)
    if not devices or not all(isinstance(d, jax.Device) for d in devices):
        raise ValueError(
            f"stage {stage}'s placement must be a device, a list of devices, a Mesh or a Sharding, not {placement!r}"
        )
    return NamedSharding(Mesh(np.array(devices), ("stage",)), PartitionSpec())


def _place(tree: Any, sharding: Sharding) -> Any:
    """A stage's parameters on its devices: kept where they are if already there, else replicated."""
    replicated = _replicated(sharding)

    def place(leaf):
        if isinstance(leaf, jax.Array) and leaf.sharding.device_set == sharding.device_set:
            return leaf
        return jax.device_put(leaf, replicated)

    return jax.tree.map(place, tree)


def _replicated(sharding: Sharding) -> Sharding:
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec())
    devices = sorted(sharding.device_set, key=lambda d: d.id)
    return NamedSharding(Mesh(np.array(devices), ("stage",)), PartitionSpec())


def _split_microbatches(tree: Any, microbatches: int) -> list[Any]:
    size = jax.tree.leaves(tree)[0].shape[0] // microbatches
    return [jax.tree.map(lambda a, i=i: a[i * size : (i + 1) * size], tree) for i in range(microbatches)]


def _microbatch_shape(tree: Any, microbatches: int, what: str) -> Any:
    """A microbatch's shapes (``jax.ShapeDtypeStruct``s); a ``ValueError`` if the batch does not split evenly."""
    leaves = jax.tree.leaves(tree)
    if not leaves:
        raise ValueError(f"the {what} has no arrays")
    sizes = {np.shape(leaf)[0] if np.ndim(leaf) else None for leaf in leaves}
    if len(sizes) != 1 or None in sizes:
        raise ValueError(
            f"every array of the {what} needs the same leading (batch) dimension, not {sorted(sizes, key=str)}"
        )
    (size,) = sizes
    if size % microbatches:
        raise ValueError(f"the {what}'s {size} examples do not split into {microbatches} microbatches")
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct((size // microbatches, *np.shape(a)[1:]), _dtype(a)), tree)


def _dtype(leaf: Any) -> np.dtype:
    return leaf.dtype if hasattr(leaf, "dtype") else np.asarray(leaf).dtype


def _signature(tree: Any) -> tuple:
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((np.shape(leaf), str(_dtype(leaf))) for leaf in leaves)


def _describe(tree: Any) -> str:
    return str(jax.tree.map(lambda s: f"{s.dtype}{list(s.shape)}", tree))


def _name(fn: Callable) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def bubble(stages: int, microbatches: int) -> float:
    """The idle fraction of a GPipe or 1F1B step in theory, (S-1)/(M+S-1), with forwards and backwards of
    equal length on every stage and free transfers."""
    return (stages - 1) / (microbatches + stages - 1)

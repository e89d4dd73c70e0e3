"""Workloads the benchmarks time on local devices and through pathways-nb, with the same code."""

from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp
import numpy as np

MIB = 1 << 20


def tiny_programs_per_second(device, seconds: float) -> float:
    """Chained ``x + 1`` calls dispatched back to back, then one wait."""
    step = jax.jit(lambda x: x + 1)
    x = step(jax.device_put(np.float32(0), device)).block_until_ready()
    count, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        for _ in range(500):
            x = step(x)
        count += 500
    x.block_until_ready()
    elapsed = time.perf_counter() - started
    assert float(x) == count + 1
    return count / elapsed


def host_to_device_gbps(device, size_mib: int, repeats: int) -> float:
    host = np.random.default_rng(0).random(size_mib * MIB // 4, dtype=np.float32)
    jax.device_put(host, device).block_until_ready()
    started = time.perf_counter()
    for _ in range(repeats):
        jax.device_put(host, device).block_until_ready()
    return size_mib * MIB * repeats / (time.perf_counter() - started) / 1e9


def device_to_host_gbps(device, size_mib: int, repeats: int) -> float:
    host = np.random.default_rng(1).random(size_mib * MIB // 4, dtype=np.float32)
    elapsed = 0.0
    for repeat in range(repeats + 1):
        on_device = jax.device_put(host, device).block_until_ready()  # fresh: no cached host copy
        started = time.perf_counter()
        back = np.asarray(on_device)
        if repeat:  # the first read warms up
            elapsed += time.perf_counter() - started
    assert back.shape == host.shape
    return size_mib * MIB * repeats / elapsed / 1e9


def device_to_device_gbps(source, target, size_mib: int, repeats: int) -> float:
    """Copies between two devices (between islands, on a cluster)."""
    on_source = jax.device_put(np.ones(size_mib * MIB // 4, np.float32), source).block_until_ready()
    jax.device_put(on_source, target).block_until_ready()
    started = time.perf_counter()
    for _ in range(repeats):
        jax.device_put(on_source, target).block_until_ready()
    return size_mib * MIB * repeats / (time.perf_counter() - started) / 1e9


def compute_step_ms(device, size: int, steps: int) -> float:
    """Mean time of a chained matmul step."""
    w = jax.device_put(np.random.default_rng(2).random((size, size), dtype=np.float32) / size, device)
    step = jax.jit(lambda x, w: jnp.tanh(x @ w))
    x = step(w, w).block_until_ready()
    started = time.perf_counter()
    for _ in range(steps):
        x = step(x, w)
    x.block_until_ready()
    return (time.perf_counter() - started) / steps * 1e3


def calibrate(measure_ms, start: int, target_ms: float, limit: int = 8192) -> int:
    """The size whose step takes closest to ``target_ms``: grown by 25% until a step takes that long, then one
    more size between the last two, interpolated on the power law their two times give (a 25% step in
    size alone leaves the time up to 40% off, as a matrix product's time grows with the size cubed)."""
    measured = {start: measure_ms(start)}
    size = start
    while size < limit and measured[size] < target_ms:
        size = int(size * 1.25)
        measured[size] = measure_ms(size)
    below = [s for s, ms in measured.items() if ms < target_ms]
    if below and size != start:
        low = max(below)
        exponent = math.log(measured[size] / measured[low]) / math.log(size / low)
        if exponent > 0:
            between = round(low * (target_ms / measured[low]) ** (1 / exponent))
            if low < between < size:
                measured[between] = measure_ms(between)
    return min(measured, key=lambda s: abs(math.log(measured[s] / target_ms)))


def mlp_params(width: int, depth: int = 3, seed: int = 3) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        (rng.standard_normal((width, width), np.float32) / np.sqrt(width), np.zeros(width, np.float32))
        for _ in range(depth)
    ]


def _mlp_loss(params, x, y):
    for w, b in params:
        x = jnp.tanh(x @ w + b)
    return jnp.mean((x - y) ** 2)


_train_step = jax.jit(
    lambda params, x, y: jax.tree.map(lambda p, g: p - 0.01 * g, params, jax.grad(_mlp_loss)(params, x, y))
)


def mlp_steps_per_second(device, width: int, batch: int, steps: int) -> float:
    """Training steps (forward, backward, update) of a small MLP, chained."""
    params = jax.device_put(mlp_params(width), device)
    rng = np.random.default_rng(4)
    x = jax.device_put(rng.standard_normal((batch, width), np.float32), device)
    y = jax.device_put(rng.standard_normal((batch, width), np.float32), device)
    params = jax.block_until_ready(_train_step(params, x, y))
    started = time.perf_counter()
    for _ in range(steps):
        params = _train_step(params, x, y)
    jax.block_until_ready(params)
    return steps / (time.perf_counter() - started)


def flax_training_steps_per_second(device, seconds: float, width: int = 512, batch: int = 256) -> float:
    """Training steps of a small Flax MLP (three hidden layers) with Optax's Adam, chained, for ``seconds``."""
    import flax.linen as nn
    import optax

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(3):
                x = nn.tanh(nn.Dense(width)(x))
            return nn.Dense(1)(x)

    model, optimizer = MLP(), optax.adam(1e-3)
    rng = np.random.default_rng(5)
    with jax.default_device(jax.devices("cpu")[0]):  # made here, then placed where the steps run
        params = model.init(jax.random.key(0), np.zeros((1, width), np.float32))
        state = jax.device_put((params, optimizer.init(params)), device)
    x = jax.device_put(rng.standard_normal((batch, width), np.float32), device)
    y = jax.device_put(rng.standard_normal((batch, 1), np.float32), device)

    def loss_of(params, x, y):
        return jnp.mean((model.apply(params, x) - y) ** 2)

    @jax.jit
    def step(state, x, y):
        params, opt_state = state
        loss, grads = jax.value_and_grad(loss_of)(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    state, loss = jax.block_until_ready(step(state, x, y))
    steps, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        for _ in range(16):
            state, loss = step(state, x, y)
        loss.block_until_ready()
        steps += 16
    return steps / (time.perf_counter() - started)


_stage = jax.jit(lambda w, h: jnp.tanh(h @ w))


def pipeline_microbatches_per_second(first, second, width: int, batch: int, microbatches: int) -> float:
    """A 2-stage model run on microbatches: stage 1 on ``first``, stage 2 on ``second``."""
    rng = np.random.default_rng(5)
    w1 = jax.device_put(rng.standard_normal((width, width), np.float32) / np.sqrt(width), first)
    w2 = jax.device_put(rng.standard_normal((width, width), np.float32) / np.sqrt(width), second)
    inputs = [jax.device_put(rng.standard_normal((batch, width), np.float32), first) for _ in range(microbatches)]
    jax.block_until_ready(_stage(w2, jax.device_put(_stage(w1, inputs[0]), second)))
    started = time.perf_counter()
    outputs = [_stage(w2, jax.device_put(_stage(w1, x), second)) for x in inputs]
    jax.block_until_ready(outputs)
    return microbatches / (time.perf_counter() - started)


def print_table(rows: list[tuple[str, str, float, float, float]], left: str, right: str) -> None:
    print(f"{'workload':<40} {'unit':<13} {left:>12} {right:>12} {'ratio':>8}")
    for name, unit, left_value, right_value, ratio in rows:
        print(f"{name:<40} {unit:<13} {left_value:>12.4g} {right_value:>12.4g} {ratio:>8.3f}")

"""Pipelines across islands vs SPMD on the same devices: a decoder-only Transformer (Flax), S stages, M = 4S.

    python benchmarks/pipeline.py [--stages 2,4,8] [--cluster_stages 2,4] [--seconds 6]

For each S: the model (S x --blocks_per_stage blocks) split into S stages, one device per stage, trained with
``pathways_nb.pipeline`` under GPipe and 1F1B over M = 4S microbatches, beside the same model and global
batch trained SPMD (data parallel: one program over the same S devices, the batch split over them). Each
runs on local JAX (S CPU devices in one process) and through a cluster of S islands of one device (the
SPMD program then runs across the islands, on their group). Reported side by side, from one run:

- tokens/s over SPMD's on the same backend;
- the bubble: 1 - (the stages' own compute per step) / (S x the step's time), against (S-1)/(M+S-1); a
  stage's own compute is its forward and backward on one microbatch timed alone, times M;
- the most residual bytes a stage holds at once (``Pipeline.held_bytes``: 1F1B holds at most S
  microbatches' where GPipe holds M).

Each time is the fastest of its runs, the runs of all of them (SPMD, both schedules, each stage alone)
taking turns for --seconds, so that a burst of load elsewhere costs them alike.

On one machine every device shares the same CPU cores, so S stages cannot all compute at once: the
ratios say what the machine allows, not what islands of their own would do.
"""

from __future__ import annotations

import argparse
import json
import os

import tables

from pathways_nb.launch.local_cluster import LocalCluster
from pathways_nb.testing import python_process

CLIENT = """
    import json, sys, time
    import flax.linen as nn, jax, jax.numpy as jnp, numpy as np
    if sys.argv[1] == "local":
        devices = jax.devices()
    else:
        import pathways_nb
        pathways_nb.connect(sys.argv[1], token=sys.argv[2], progress=False)
        devices = jax.devices()
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from pathways_nb.pipeline import Pipeline, bubble
    stages, blocks, seconds = int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
    width, heads, length, vocab, per_microbatch = 128, 4, 64, 256, 4
    microbatches = 4 * stages
    devices = devices[:stages]

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
            x = x + nn.SelfAttention(heads, deterministic=True)(nn.LayerNorm()(x), mask=mask)
            return x + nn.Dense(width)(nn.gelu(nn.Dense(4 * width)(nn.LayerNorm()(x))))

    class Stage(nn.Module):
        first: bool
        last: bool

        @nn.compact
        def __call__(self, x, targets=None):
            if self.first:
                x = nn.Embed(vocab, width)(x) + self.param("position", nn.initializers.normal(0.02), (length, width))
            for _ in range(blocks):
                x = Block()(x)
            if not self.last:
                return x
            logits = nn.Dense(vocab)(nn.LayerNorm()(x))
            return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1))

    modules = [Stage(first=s == 0, last=s == stages - 1) for s in range(stages)]
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, (microbatches * per_microbatch, length + 1)).astype(np.int32)
    batch, targets = tokens[:, :-1], tokens[:, 1:]
    params, x = [], batch[:per_microbatch]
    for s, module in enumerate(modules):
        extra = (targets[:per_microbatch],) if module.last else ()
        params.append(module.init(jax.random.key(s), x, *extra))
        x = module.apply(params[-1], x) if not module.last else x
    functions = [module.apply for module in modules]

    def full_loss(params, batch, targets):
        x = batch
        for function, p in zip(functions[:-1], params[:-1]):
            x = function(p, x)
        return functions[-1](params[-1], x, targets)

    def wait(result):
        jax.block_until_ready((result.loss, result.grads))

    def fastest(steps):
        # Each step's shortest time, the steps taking turns (so that a burst of load elsewhere costs them
        # alike) for `seconds` and at least 3 rounds, after two runs each to compile and warm up.
        times = {name: [] for name in steps}
        for step in [*steps.values()] * 2:
            step()
        rounds, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds or rounds < 3:
            for name, step in steps.items():
                began = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - began)
            rounds += 1
        return {name: min(spans) for name, spans in times.items()}

    row = {"stages": stages, "microbatches": microbatches, "tokens": len(batch) * length}
    mesh = Mesh(np.array(devices), ("data",))
    spmd_params = jax.device_put(params, NamedSharding(mesh, P()))
    spread = NamedSharding(mesh, P("data"))
    spmd_batch, spmd_targets = jax.device_put(batch, spread), jax.device_put(targets, spread)
    spmd = jax.jit(jax.value_and_grad(full_loss))
    steps = {"spmd": lambda: jax.block_until_ready(spmd(spmd_params, spmd_batch, spmd_targets))}
    placed = [jax.device_put(p, d) for p, d in zip(params, devices)]
    for schedule in ("gpipe", "1f1b"):
        pipe = Pipeline(functions, devices, microbatches=microbatches, schedule=schedule)
        steps[schedule] = lambda pipe=pipe: wait(pipe.step(placed, batch, targets))
        row[f"{schedule}_held"] = pipe.held_bytes(params, batch)
    x = jax.device_put(batch[:per_microbatch], devices[0])
    for s, (function, p) in enumerate(zip(functions, placed)):  # each stage's forward and backward, alone
        if s == stages - 1:
            labels = jax.device_put(targets[:per_microbatch], devices[s])
            alone = jax.jit(lambda p, x, f=function, t=labels: jax.grad(lambda p, x: f(p, x, t), (0, 1))(p, x))
        else:
            alone = jax.jit(lambda p, x, f=function: jax.vjp(f, p, x)[1](f(p, x)))
        steps[f"stage{s}"] = lambda alone=alone, p=p, x=x: jax.block_until_ready(alone(p, x))
        if s < stages - 1:
            x = jax.device_put(function(p, x), devices[s + 1])
    fast = fastest(steps)
    row.update({f"{name}_s": fast[name] for name in ("spmd", "gpipe", "1f1b")})
    stage_s = sum(fast[f"stage{s}"] for s in range(stages))
    row["busy_s"] = stage_s * microbatches
    row["theory"] = bubble(stages, microbatches)
    print(json.dumps(row), flush=True)
"""


def _measure(stages: int, blocks: int, seconds: float, cluster: LocalCluster | None) -> dict:
    """One row, from a client on local JAX (``cluster`` None: S CPU devices) or on the cluster."""
    if cluster is None:
        env = {"XLA_FLAGS": f"--xla_force_host_platform_device_count={stages}", "JAX_PLATFORMS": "cpu"}
        process = python_process(CLIENT, "local", "", str(stages), str(blocks), str(seconds), env=env)
    else:
        process = python_process(CLIENT, cluster.address, cluster.token, str(stages), str(blocks), str(seconds))
    out, err = process.communicate(timeout=1800)
    if process.returncode != 0:
        raise RuntimeError(err[-3000:])
    row = json.loads(out.strip().splitlines()[-1])
    row["backend"] = "local JAX" if cluster is None else f"cluster, {stages} islands"
    return row


def _ratios(row: dict) -> dict:
    for schedule in ("gpipe", "1f1b"):
        row[f"{schedule}_ratio"] = row["spmd_s"] / row[f"{schedule}_s"]
        row[f"{schedule}_bubble"] = 1 - row["busy_s"] / (row["stages"] * row[f"{schedule}_s"])
        row[f"{schedule}_held_mib"] = max(row[f"{schedule}_held"]) / 2**20
    row["spmd_tokens_per_s"] = row["tokens"] / row["spmd_s"]
    return row


COLUMNS = [
    ("backend", "backend", "{}"),
    ("stages", "S", "{}"),
    ("microbatches", "M", "{}"),
    ("spmd_tokens_per_s", "SPMD tokens/s", "{:.0f}"),
    ("gpipe_ratio", "GPipe / SPMD", "{:.2f}"),
    ("1f1b_ratio", "1F1B / SPMD", "{:.2f}"),
    ("gpipe_bubble", "bubble GPipe", "{:.2f}"),
    ("1f1b_bubble", "bubble 1F1B", "{:.2f}"),
    ("theory", "(S-1)/(M+S-1)", "{:.2f}"),
    ("gpipe_held_mib", "held GPipe, MiB", "{:.1f}"),
    ("1f1b_held_mib", "held 1F1B, MiB", "{:.1f}"),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", default="2,4,8", help="stage counts to run on local JAX")
    parser.add_argument("--cluster_stages", default="2,4", help="stage counts to run through a cluster")
    parser.add_argument("--blocks_per_stage", type=int, default=1, help="Transformer blocks in each stage")
    parser.add_argument("--seconds", type=float, default=6.0, help="how long each measurement runs")
    args = parser.parse_args()
    rows = []
    for stages in (int(s) for s in args.stages.split(",") if s):
        rows.append(_ratios(_measure(stages, args.blocks_per_stage, args.seconds, None)))
        print(json.dumps(rows[-1]), flush=True)
    for stages in (int(s) for s in args.cluster_stages.split(",") if s):
        with LocalCluster(islands=stages, devices_per_host=1) as cluster:
            rows.append(_ratios(_measure(stages, args.blocks_per_stage, args.seconds, cluster)))
        print(json.dumps(rows[-1]), flush=True)
    print(f"\n{os.cpu_count()} CPU cores; {args.blocks_per_stage} block(s) per stage\n")
    print(tables.markdown(rows, COLUMNS))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Orbax checkpoints through pathwaysutils persistence: the workers write and read, the client never holds the arrays.

Each client is a stock JAX process as a Pathways on Cloud training script runs it:
``JAX_PLATFORMS=proxy``, ``ENABLE_PATHWAYS_PERSISTENCE=1``, ``pathwaysutils.initialize()``, Orbax's
``StandardCheckpointer``; the cluster has 2 islands x 2 CPU devices, and arrays are sharded over
all four. Checkpoints are ordinary Orbax checkpoints: a plain ``JAX_PLATFORMS=cpu`` process restores
them with stock Orbax, and the cluster restores what such a process saved.
"""

from __future__ import annotations

import glob
import json
import os
import re
import select
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from pathways_nb import testing
from pathways_nb.client.observe import Observer
from pathways_nb.launch.local_cluster import LocalCluster

# The tree every test saves: bfloat16, float32 and int32 arrays in three shardings over the 4
# devices (2 islands x 2), and a PRNG key. Made on the devices, so that the client holds none of it.
TREE = """
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

    def make(mesh, shape, spec, values):
        # Each device computes its own shard of values(flat index), as no program spans islands.
        sharding = NamedSharding(mesh, spec)
        def shard(index, device):
            ranges = [range(*s.indices(n)[:2]) for s, n in zip(index, shape)]
            def compute():
                grids = jnp.meshgrid(*[jnp.arange(r.start, r.stop) for r in ranges], indexing="ij")
                return values(sum(g * int(np.prod(shape[k + 1:])) for k, g in enumerate(grids)))
            return jax.jit(compute, out_shardings=SingleDeviceSharding(device))()
        indices = sharding.devices_indices_map(shape)
        return jax.make_array_from_single_device_arrays(shape, sharding, [shard(indices[d], d) for d in indices])

    def tree(devices):
        mesh = Mesh(np.array(devices).reshape(2, 2), ("islands", "devices"))
        return {
            "w": make(mesh, (1024, 512), P("islands", "devices"), lambda i: jnp.sin(i * 0.01).astype(jnp.bfloat16)),
            "b": make(mesh, (512, 256), P(None, "devices"), lambda i: jnp.cos(i * 0.5).astype(jnp.float32)),
            "steps": make(mesh, (64, 64), P(), lambda i: (i * 7).astype(jnp.int32)),
            "key": jax.device_put(jax.random.key(7), NamedSharding(mesh, P())),
        }

    def host_values(tree):
        return {k: np.asarray(jax.random.key_data(v) if k == "key" else v) for k, v in tree.items()}

    def same(restored, expected):
        return {k: bool(np.array_equal(host_values(restored)[k], expected[k]))
                and str(restored[k].dtype) == str(expected_dtypes[k]) for k in expected}
"""

CLIENT_PRELUDE = """
    import json, os, resource, sys
    import pathwaysutils
    pathwaysutils.initialize()
    import orbax.checkpoint as ocp
"""


def _errors(stderr: str) -> str:
    """A failed process's Python traceback, without the stock client's C++ stack dumps."""
    return "\n".join(line for line in stderr.splitlines() if line.strip() and not line.startswith("\t"))[-5000:]


def _client_command(server, code: str, *args: str) -> tuple[list[str], dict[str, str]]:
    """A stock JAX client of ``server`` running ``code``, as a Pathways on Cloud training script runs."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("JAX_")}
    env.update(
        JAX_PLATFORMS="proxy",
        JAX_BACKEND_TARGET=server.address,
        IFRT_PROXY_USE_INSECURE_GRPC_CREDENTIALS="true",
        ENABLE_PATHWAYS_PERSISTENCE="1",
    )
    source = textwrap.dedent(CLIENT_PRELUDE) + textwrap.dedent(TREE) + textwrap.dedent(code)
    return [sys.executable, "-c", source, *args], env


def _client(server, code: str, *args: str) -> list[dict]:
    """Runs ``code`` in a stock JAX client of ``server`` (a cluster or a proxy); the JSON lines it printed."""
    command, env = _client_command(server, code, *args)
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, _errors(result.stderr)
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def _client_process(cluster: LocalCluster, code: str, *args: str) -> subprocess.Popen:
    command, env = _client_command(cluster, code, *args)
    return subprocess.Popen(
        command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _next_json(client: subprocess.Popen, timeout_s: float = 240) -> dict:
    """The next JSON line the client prints; fails with its errors if it ends or takes longer."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if select.select([client.stdout], [], [], 1.0)[0]:
            line = client.stdout.readline()
            if line.startswith("{"):
                return json.loads(line)
            if not line:
                break
    client.kill()
    raise AssertionError(f"the client printed no result within {timeout_s} s:\n{_errors(client.communicate()[1])}")


def _wait_for(condition, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if result := condition():
            return result
        time.sleep(0.005)
    raise AssertionError(f"{condition} did not hold within {timeout_s} s")


def _local(code: str, *args: str) -> list[dict]:
    """Runs ``code`` in plain local JAX (4 CPU devices, stock Orbax, no pathways-nb); its JSON lines."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("JAX_")}
    env.update(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="4")
    source = "import json, sys\nimport orbax.checkpoint as ocp\n" + textwrap.dedent(TREE) + textwrap.dedent(code)
    result = subprocess.run([sys.executable, "-c", source, *args], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, _errors(result.stderr)
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("storage")
    with LocalCluster(islands=2, devices_per_host=2, storage_root=root) as cluster:
        yield cluster


def _moved_bytes(cluster: LocalCluster, start: float, end: float) -> int:
    """Bytes the proxy carried between a client and the devices (uploads, downloads) in [start, end]."""
    observer = Observer(cluster.address, cluster.token)
    try:
        return sum(e.bytes for e in observer.events() if e.kind in ("upload", "download") and start <= e.start <= end)
    finally:
        observer.close()


SAVE_AND_RESTORE = """
    import time
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    path = sys.argv[1]
    handler = type(ocp.type_handlers.get_type_handler(jax.Array)).__name__
    state = tree(jax.devices()[:4])
    expected = host_values(state)
    expected_dtypes = {k: v.dtype for k, v in state.items()}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.time()
    checkpointer = ocp.StandardCheckpointer(use_ocdbt=False)
    checkpointer.save(path, state)
    checkpointer.wait_until_finished()
    print(json.dumps({"runtime_type": jax.devices()[0].client.runtime_type, "handler": handler,
                      "save": [started, time.time()],
                      "peak_growth_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak}), flush=True)

    def targets(mesh, specs):
        # A PRNG key's target is its key data's (Orbax 0.12.8's Pathways handler gets a key-typed target's
        # shape wrong; docs/checkpoints.md); it comes back as a key.
        physical = {**state, "key": jax.random.key_data(state["key"])}
        return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, specs[k]))
                for k, v in physical.items()}

    same_mesh = state["w"].sharding.mesh
    specs = {k: v.sharding.spec for k, v in state.items()}
    restored = checkpointer.restore(path, targets(same_mesh, specs))
    print(json.dumps({"same mesh": same(restored, expected)}), flush=True)
    # Island 1's two devices only, every array split or replicated differently from the save.
    other = Mesh(np.array(jax.devices()[2:4]), ("x",))
    other_specs = {"w": P(None, "x"), "b": P("x"), "steps": P("x"), "key": P()}
    restored = checkpointer.restore(path, targets(other, other_specs))
    print(json.dumps({"other mesh": same(restored, expected),
                      "on": sorted({d.id for v in restored.values() for d in v.devices()})}), flush=True)
    # Only shardings: Orbax reads shapes and dtypes from the checkpoint (the client opens each .zarray).
    restore_args = {k: ocp.ArrayRestoreArgs(sharding=NamedSharding(same_mesh, specs[k])) for k in state}
    restored = ocp.PyTreeCheckpointer().restore(path, args=ocp.args.PyTreeRestore(restore_args=restore_args))
    print(json.dumps({"from metadata": same(restored, expected)}), flush=True)
    np.savez(sys.argv[2], **expected)
"""


def test_orbax_saves_and_restores_through_the_workers(cluster, tmp_path):
    path = os.path.join(cluster.storage_root, "run", "step_1")
    saved, same_mesh, other_mesh, from_metadata = _client(cluster, SAVE_AND_RESTORE, path, str(tmp_path / "x.npz"))
    assert saved["runtime_type"] == "proxy/pathways" and saved["handler"] == "CloudPathwaysArrayHandler"
    everything = {"w": True, "b": True, "steps": True, "key": True}
    assert same_mesh["same mesh"] == everything
    assert other_mesh["other mesh"] == everything and other_mesh["on"] == [2, 3]
    assert from_metadata["from metadata"] == everything
    # The arrays (1.3 MiB) never passed through the proxy, nor grew the client's memory.
    assert _moved_bytes(cluster, *saved["save"]) < 16 << 10
    assert saved["peak_growth_kib"] < 1024
    files = sorted(os.listdir(path))
    assert {"_METADATA", "_CHECKPOINT_METADATA", "w", "b", "steps", "key", "array_metadatas"} <= set(files), files
    assert sorted(os.listdir(os.path.join(path, "w"))) == [".zarray", "0.0", "0.1", "1.0", "1.1"]
    assert sorted(os.listdir(os.path.join(path, "steps"))) == [".zarray", "0.0"]  # replicated: written once


SAVE = """
    checkpointer = ocp.StandardCheckpointer(**json.loads(sys.argv[2]))
    checkpointer.save(sys.argv[1], tree(jax.devices()[:4]))
    checkpointer.wait_until_finished()
"""

RESTORE = """
    state = tree(jax.devices()[:4])
    expected, expected_dtypes = host_values(state), {k: v.dtype for k, v in state.items()}
    physical = {**state, "key": jax.random.key_data(state["key"])}
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in physical.items()}
    print(json.dumps({"same": same(ocp.StandardCheckpointer().restore(sys.argv[1], target), expected)}))
"""


def test_checkpoints_are_ordinary_orbax_checkpoints_both_ways(cluster):
    everything = {"w": True, "b": True, "steps": True, "key": True}
    # Saved through the cluster, restored by stock Orbax in plain local JAX.
    through_cluster = os.path.join(cluster.storage_root, "proof", "cluster")
    _client(cluster, SAVE, through_cluster, json.dumps({"use_ocdbt": False}))
    assert _local(RESTORE, through_cluster) == [{"same": everything}]
    # Saved by stock Orbax in plain local JAX (its default format: OCDBT), restored through the cluster.
    saved_locally = os.path.join(cluster.storage_root, "proof", "local")
    _local(SAVE, saved_locally, "{}")
    assert os.path.exists(os.path.join(saved_locally, "manifest.ocdbt"))
    assert _client(cluster, RESTORE, saved_locally) == [{"same": everything}]


DONATE_AND_DROP = """
    import gc
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    sharding = NamedSharding(Mesh(np.array(jax.devices()[:2]), ("x",)), P("x"))
    make = jax.jit(lambda: jnp.arange(1 << 22, dtype=jnp.float32).reshape(1024, 4096), out_shardings=sharding)
    checkpointer = ocp.StandardCheckpointer(use_ocdbt=False)
    # The next training step donates the state the save is still writing: it runs once the write is done.
    state = make()
    checkpointer.save(sys.argv[1] + "/donated", {"w": state})
    stepped = jax.jit(lambda w: w + 1, donate_argnums=0)(state)
    checkpointer.wait_until_finished()
    # An array nobody holds any more but the save: the client deletes it, after the write.
    checkpointer.save(sys.argv[1] + "/dropped", {"w": make()})
    gc.collect()
    checkpointer.wait_until_finished()
    target = {"w": jax.ShapeDtypeStruct((1024, 4096), jnp.float32, sharding=sharding)}
    expected = np.arange(1 << 22, dtype=np.float32).reshape(1024, 4096)
    def restored(name):
        return bool(np.array_equal(np.asarray(checkpointer.restore(sys.argv[1] + name, target)["w"]), expected))
    print(json.dumps({"stepped": bool(np.array_equal(np.asarray(stepped), expected + 1)),
                      "donated": restored("/donated"), "dropped": restored("/dropped")}))
"""


def test_a_saved_array_stays_until_written_when_the_next_step_donates_it_or_the_client_drops_it(cluster):
    (result,) = _client(cluster, DONATE_AND_DROP, os.path.join(cluster.storage_root, "held"))
    assert result == {"stepped": True, "donated": True, "dropped": True}


REFUSED = """
    import datetime
    from orbax.checkpoint._src.metadata import array_metadata_store
    from orbax.checkpoint._src.serialization import cloud_pathways_array_handler
    state = tree(jax.devices()[:4])

    def save(path):
        checkpointer = ocp.StandardCheckpointer(use_ocdbt=False)
        try:
            checkpointer.save(path, state)
            checkpointer.wait_until_finished()
            return "saved"
        except Exception as error:
            return str(error)

    outcomes = {name: save(path) for name, path in zip(["outside", "dotdot", "symlink"], sys.argv[1:4])}
    # A timeout too short for any write.
    ocp.type_handlers.register_type_handler(jax.Array, cloud_pathways_array_handler.CloudPathwaysArrayHandler(
        timeout=datetime.timedelta(microseconds=1), array_metadata_store=array_metadata_store.Store()), override=True)
    outcomes["timeout"] = save(sys.argv[4])
    print(json.dumps(outcomes))
"""


def test_places_outside_the_storage_root_and_timeouts_are_refused_clearly(cluster, tmp_path):
    root = cluster.storage_root
    outside, elsewhere = tmp_path / "outside", tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, os.path.join(root, "escape"))
    dotdot = os.path.join(root, "run", "..", "..", "x")
    paths = [str(outside / "ckpt"), dotdot, os.path.join(root, "escape", "ckpt"), os.path.join(root, "slow")]
    (outcomes,) = _client(cluster, REFUSED, *paths)
    assert "PERMISSION_DENIED" in outcomes["outside"] and "outside this server's storage root" in outcomes["outside"]
    assert "INVALID_ARGUMENT" in outcomes["dotdot"] and "'..'" in outcomes["dotdot"]
    assert "PERMISSION_DENIED" in outcomes["symlink"] and "symbolic link" in outcomes["symlink"]
    assert "DEADLINE_EXCEEDED" in outcomes["timeout"], outcomes["timeout"]
    assert re.search(r"writing array '\w+' in .*slow.* on island \d host 0: did not finish", outcomes["timeout"])
    # Nothing of an array reached a place outside the root (the client's own metadata files may have).
    written = [p for place in (outside, elsewhere) for p in place.rglob("*") if p.name in (".zarray", "0", "0.0")]
    assert not written, written


KILLED = """
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    def filled(devices, shape, value):  # each device makes its own shard
        sharding = NamedSharding(Mesh(np.array(devices), ("x",)), P("x"))
        rows = shape[0] // len(devices)
        make = lambda: jnp.full((rows, shape[1]), value, jnp.float32)
        parts = [jax.jit(make, out_shardings=SingleDeviceSharding(d))() for d in devices]
        return jax.make_array_from_single_device_arrays(shape, sharding, parts)

    every = jax.devices()[:4]
    manager = ocp.CheckpointManager(sys.argv[1], item_handlers=ocp.StandardCheckpointHandler(use_ocdbt=False))
    manager.save(1, args=ocp.args.StandardSave({"small": filled(every, (4096, 64), 1)}))
    manager.wait_until_finished()
    # Step 2 also has 256 MiB on island 1 alone: its worker writes for a while (and is killed meanwhile).
    state = {"small": filled(every, (4096, 64), 2), "big": filled(jax.devices()[2:4], (32768, 2048), 2)}
    print(json.dumps({"saving": 2}), flush=True)
    try:
        manager.save(2, args=ocp.args.StandardSave(state))
        manager.wait_until_finished()
        failure = None
    except Exception as error:
        failure = str(error)
    del state
    manager.reload()
    print(json.dumps({"failure": failure, "steps": manager.all_steps()}), flush=True)
    sys.stdin.readline()  # the test brings the worker back
    manager.save(3, args=ocp.args.StandardSave({"small": filled(every, (4096, 64), 3)}))
    manager.wait_until_finished()
    sharding = NamedSharding(Mesh(np.array(every), ("x",)), P("x"))
    target = {"small": jax.ShapeDtypeStruct((4096, 64), jnp.float32, sharding=sharding)}
    restored = np.asarray(manager.restore(3, args=ocp.args.StandardRestore(target))["small"])
    steps = ocp.CheckpointManager(sys.argv[1]).all_steps()
    print(json.dumps({"steps": steps, "restored": bool((restored == 3).all())}), flush=True)
"""


def test_a_worker_killed_mid_save_fails_it_with_data_loss_and_the_next_save_works(cluster):
    directory = os.path.join(cluster.storage_root, "killed")
    client = _client_process(cluster, KILLED, directory)
    try:
        assert _next_json(client) == {"saving": 2}
        worker = cluster.workers[(1, 0)].process
        # Killed as soon as its first file of the 256 MiB appears, long before it can have written them all.
        _wait_for(lambda: glob.glob(f"{directory}/2.orbax-checkpoint-tmp*/**/big/*", recursive=True), 120)
        os.kill(worker.pid, signal.SIGKILL)
        outcome = _next_json(client)
        assert "DATA_LOSS" in outcome["failure"] and "island 1 host 0" in outcome["failure"], outcome
        assert outcome["steps"] == [1]  # the half-written step 2 is no checkpoint
        assert glob.glob(f"{directory}/2.orbax-checkpoint-tmp*")
        cluster.wait_for_worker(1, 0, timeout_s=120, not_pid=worker.pid)
        client.stdin.write("\n")
        client.stdin.flush()
        assert _next_json(client) == {"steps": [1, 3], "restored": True}
    finally:
        client.kill()
        client.communicate()


QUOTA = """
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    sharding = NamedSharding(Mesh(np.array(jax.devices()[:4]), ("x",)), P("x"))
    w = jax.jit(lambda: jnp.ones((1024, 1024), jnp.float32), out_shardings=sharding)()  # 4 MiB of the 6 allowed
    checkpointer = ocp.StandardCheckpointer(use_ocdbt=False)
    checkpointer.save(sys.argv[1], {"w": w})
    checkpointer.wait_until_finished()
    target = {"w": jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=sharding)}
    try:
        checkpointer.restore(sys.argv[1], target)
        over = "restored"
    except Exception as error:
        over = str(error)
    w.delete()
    restored = checkpointer.restore(sys.argv[1], target)["w"]
    print(json.dumps({"over": over, "after": bool((np.asarray(restored) == 1).all())}))
"""


def test_a_restore_counts_against_the_session_device_quota_before_reading(tmp_path):
    """On the single-process proxy, which runs the hosts' part itself."""
    quota = ("--session_device_bytes", str(6 << 20), "--storage_root", str(tmp_path))
    with testing.proxy_process(4, *quota) as server:
        (result,) = _client(server, QUOTA, str(tmp_path / "ckpt"))
    assert "RESOURCE_EXHAUSTED" in result["over"] and "--session_device_bytes" in result["over"], result
    assert result["after"]

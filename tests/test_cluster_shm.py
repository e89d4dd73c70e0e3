"""Array bytes inside a cluster on one host: through shared memory, or over gRPC where it is turned off.

Both paths run the same checks (uploads, downloads, copies between islands,
arrays sharded over two devices; several dtypes, odd sizes, empty arrays),
bitwise against numpy, each on a cluster of its own: one as it starts by
default, one whose processes all have ``PATHWAYS_SHARED_MEMORY=0``. What
each path really carried is observed where it happens: the bytes a proxy's
stream to a worker moved each way, and the worker's own transfer events.
The same stream's messages show that dropped arrays ride along with commands.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from pathways_nb.client.observe import Observer
from pathways_nb.core import shared_memory, tuning
from pathways_nb.core.convert import array_meta
from pathways_nb.core.events import EventLog
from pathways_nb.launch.local_cluster import LocalCluster
from pathways_nb.protocol import dtypes
from pathways_nb.protocol.errors import RequestError
from pathways_nb.protocol.shardings import IfrtSharding
from pathways_nb.proxy.cluster_runtime import ClusterRuntime
from pathways_nb.proxy.loop_handoff import on_loop
from pathways_nb.proxy.placement import local_sharding
from pathways_nb.proxy.worker_link import WorkerLost
from pathways_nb.rpc import cluster_pb2 as pb
from pathways_nb.rpc import cluster_pb2_grpc
from pathways_nb.testing import finished_ok, python_script, wait_until

SHARED, GRPC = "shared memory", "gRPC"


@pytest.fixture(scope="module", params=[SHARED, GRPC])
def cluster(request):
    """Two islands of two devices; with ``GRPC``, every process of it has shared memory turned off."""
    saved = os.environ.get(shared_memory.ENABLE_ENV)
    if request.param == GRPC:
        os.environ[shared_memory.ENABLE_ENV] = "0"  # the children's environment is read at construction
    try:
        started = LocalCluster(islands=2, devices_per_host=2, start=False)
    finally:
        if saved is None:
            os.environ.pop(shared_memory.ENABLE_ENV, None)
        else:
            os.environ[shared_memory.ENABLE_ENV] = saved
    with started.start() as running:
        running.path = request.param
        yield running


@pytest.fixture(scope="module")
def proxy(cluster):
    """A proxy's cluster runtime in this process (shared memory on), and one session on every device."""
    runtime = ClusterRuntime(cluster.resource_manager.hostport, credentials=cluster.credentials)
    opening = runtime.open_session(1, {}, EventLog().sink("test"))
    session = asyncio.run_coroutine_threadsafe(opening, runtime.loop).result(timeout=60)
    yield session
    _on_loop(session, session.release)
    runtime.close()


def _link(session, device_id: int):
    return _on_loop(session, lambda: session.streams.link(session.devices.device(device_id)))


def _on_loop(session, step, *args):
    """``step(*args)`` on the proxy's loop, which owns the session's state (this thread waits, as a pool's does)."""
    return on_loop(session.cluster.loop, step, *args)


def _local(session, sharding: IfrtSharding):
    return local_sharding(sharding, _on_loop(session, session.placement.placed, sharding.device_ids))


CLIENTS = Path(__file__).with_name("clients")
ROUND_TRIPS = CLIENTS / "cluster_round_trips.py"


def test_client_round_trips_are_bitwise_equal(cluster):
    result = json.loads(finished_ok(python_script(ROUND_TRIPS, cluster.address)))
    assert result["mismatches"] == []
    # Every copy between islands went the cluster's way, as its source worker reports it.
    observer = Observer(cluster.address, cluster.token)
    names = wait_until(
        lambda: [e.name for e in observer.events(result["tenant"]) if e.kind == "transfer"],
        10,
        f"{result['transfers']} transfer events",
        holds=lambda names: len(names) >= result["transfers"],
        interval_s=0.1,
    )
    assert len(names) == result["transfers"]
    way = "through shared memory" if cluster.path == SHARED else "over gRPC"
    assert all(name.endswith(way) for name in names), names


@pytest.mark.parametrize("dtype", [np.float32, np.uint8, np.float64])
def test_proxy_moves_bytes_the_clusters_way(proxy, cluster, dtype):
    session = proxy
    device = session.device_ids[0]
    link = _link(session, device)
    before = link.moved.copy()
    big = np.random.default_rng(1).random(tuning.SHARED_MEMORY_MIN_BYTES.value + 17).astype(dtype)
    small = np.arange(5, dtype=dtype)
    for host in (big, small, big[:0]):
        back = session.to_host(session.put_blocking(host, IfrtSharding((device,))))
        assert back.dtype == host.dtype and back.tobytes() == host.tobytes()
    moved = link.moved - before
    small_bytes = 2 * small.nbytes  # up and down; small arrays always ride in the messages
    if cluster.path == SHARED:
        assert moved == {SHARED: 2 * big.nbytes, GRPC: small_bytes}
    else:
        assert moved == {GRPC: 2 * big.nbytes + small_bytes}


def test_sharded_array_on_two_devices_of_one_worker(proxy, cluster):
    session = proxy
    devices = session.device_ids[:2]
    host = np.arange(4 * 40000, dtype=np.int32).reshape(4, 40000)
    sharding = IfrtSharding(devices, op_sharding=_split_rows(2))
    array = session.put_blocking(host, sharding)
    assert session.to_host(array).tobytes() == host.tobytes()
    shards = _on_loop(session, session.disassemble, array, sharding)
    assert np.concatenate([session.to_host(s) for s in shards]).tobytes() == host.tobytes()


def _split_rows(parts: int):
    from pathways_nb.protocol import schema

    op = schema.load().xla.OpSharding()
    op.type = op.OTHER
    op.tile_assignment_dimensions.extend([parts, 1])
    op.tile_assignment_devices.extend(range(parts))
    return op.SerializeToString()


def test_a_file_outside_the_private_root_is_refused(proxy, cluster, tmp_path):
    """A peer that names any other file gets a clear error (or a plea for the bytes), and the file stays."""
    session = proxy
    device = session.device_ids[0]
    link = _link(session, device)
    stranger = tmp_path / "not-shared"
    stranger.write_bytes(bytes(4096))
    meta = array_meta(
        dtypes.from_numpy(np.dtype(np.uint8)),
        (4096,),
        _local(session, IfrtSharding((device,))),
    )
    array_id = _on_loop(session, link.new_id)
    put = pb.Command(put=pb.Put(id=array_id, meta=meta, shared=pb.SharedFile(path=str(stranger), size=4096)))
    _on_loop(session, link.send, put)
    with pytest.raises(RequestError, match="PATHWAYS_SHARED_MEMORY=0"):
        link.fetch(array_id)
    stub = cluster_pb2_grpc.WorkerStub(cluster.credentials.channel(link.address))
    header = pb.ArrayChunk(
        session=link.session_key,
        id=_on_loop(session, link.new_id),
        meta=meta,
        shared=pb.SharedFile(path=str(stranger), size=4096),
    )
    assert stub.PushArray(iter([header]), timeout=10).not_shared
    assert stranger.read_bytes() == bytes(4096)


def test_no_file_is_left_behind(proxy, cluster):
    """Every file a proxy or worker wrote was taken (and so removed) by its reader."""
    session = proxy
    host = np.ones(1 << 20, np.float32)
    island0, island1 = IfrtSharding(session.device_ids[:1]), IfrtSharding(session.device_ids[2:3])
    copied = _on_loop(session, session.copy, session.put_blocking(host, island0), island1)
    assert session.to_host(copied).tobytes() == host.tobytes()
    pids = {os.getpid()} | {w.process.pid for w in cluster.workers.values()} | {cluster.proxy.process.pid}
    mine = [d for d in shared_memory.private_root().iterdir() if _owner(d) in pids]
    if cluster.path == SHARED:
        assert {d.name.split("-")[0] for d in mine} >= {"proxy", "worker"}  # they did use shared memory
    else:
        assert [d for d in mine if d.name.startswith("worker")] == []  # its workers never did
    # What stays: the "owner" proof of a jax client's upload directory (this process's, if an earlier
    # test connected here), for as long as that client lives.
    assert [f for d in mine for f in d.iterdir() if f.name != "owner"] == []


def test_a_download_the_proxy_cannot_take_comes_over_grpc(proxy, cluster, tmp_path, monkeypatch):
    """A worker's file the proxy cannot take (here: the proxy's private root moved meanwhile): fetched again."""
    if cluster.path == GRPC:
        pytest.skip("workers without shared memory write no files")
    session = proxy
    sharding = IfrtSharding(session.device_ids[:1])
    link = _link(session, sharding.device_ids[0])
    host = np.arange(1 << 18, dtype=np.int32)
    array = session.put_blocking(host, sharding)
    monkeypatch.setenv(shared_memory.ROOT_ENV, str(tmp_path))
    before = link.moved.copy()
    assert session.to_host(array).tobytes() == host.tobytes()
    assert link.moved - before == {GRPC: host.nbytes}


def _owner(directory) -> int:
    parts = directory.name.rsplit("-", 2)
    return int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else -1


def test_directories_of_dead_processes_are_reaped():
    root = shared_memory.private_root()
    finished = psutil.Popen(["true"])
    finished.wait()
    dead = root / f"worker-{finished.pid}-reaptest"
    dead.mkdir()
    (dead / "left-over").write_bytes(b"x")
    alive = root / f"worker-{os.getpid()}-reaptest"
    alive.mkdir()
    try:
        shared_memory.reap_stale()  # (another process starting now may reap it first: the same outcome)
        assert not dead.exists() and alive.exists()
    finally:
        alive.rmdir()


def test_a_kept_upload_is_handed_on_as_the_same_file_and_otherwise_goes_with_its_mapping():
    """A client's upload the proxy keeps (``take(keep=)``) reaches a worker with no copy in the proxy."""
    import gc

    client, outbox = shared_memory.SharedDirectory("client"), shared_memory.Outbox("keeper")
    values = np.arange(1 << 16, dtype=np.float32)
    try:
        path = client.write("lt_1", values)
        inode = os.stat(path).st_ino
        kept = shared_memory.take(path, values.nbytes, keep=outbox)
        assert not path.exists()
        host = memoryview(np.ascontiguousarray(np.frombuffer(kept, np.float32)).reshape(-1).view(np.uint8))
        assert outbox.hand_over("link-", host[4:]) is None  # only the whole buffer goes on as its file
        handed = outbox.hand_over("link-", host)
        assert handed is not None and handed.name.startswith("link-") and os.stat(handed).st_ino == inode
        assert outbox.hand_over("link-", host) is None  # handed on once
        assert np.array_equal(np.frombuffer(shared_memory.take(handed, values.nbytes), np.float32), values)
        assert not handed.exists()

        again = shared_memory.take(client.write("lt_2", values), values.nbytes, keep=outbox)
        assert [p.name.startswith("kept-") for p in outbox._directory.path.iterdir()] == [True]
        del again
        gc.collect()
        assert list(outbox._directory.path.iterdir()) == []  # not handed on: removed with its mapping
    finally:
        client.close()


def test_a_killed_workers_files_go_when_it_is_replaced(proxy, cluster):
    """SIGKILL runs no atexit: the worker the supervisor starts in its place removes what it left."""
    if cluster.path == GRPC:
        pytest.skip("workers without shared memory write no files")
    session = proxy
    island1 = IfrtSharding(session.device_ids[2:3])
    host = np.ones(1 << 20, np.float32)
    assert session.to_host(session.put_blocking(host, island1)).tobytes() == host.tobytes()  # its reply was a file
    old_pid = cluster.workers[(1, 0)].process.pid
    (directory,) = [d for d in shared_memory.private_root().iterdir() if _owner(d) == old_pid]
    (directory / "in-flight").write_bytes(bytes(10))  # as if it died while a reader was on its way
    os.kill(old_pid, signal.SIGKILL)
    cluster.wait_for_worker(1, 0, timeout_s=60, not_pid=old_pid)
    assert not directory.exists()


def test_an_array_pushed_before_its_session_opens_waits_for_the_session():
    """A peer's push and the proxy's stream race to a worker; a push that wins waits for the session."""
    result = json.loads(finished_ok(python_script(CLIENTS / "worker_early_push.py")))
    assert result == {"waiting": True, "fetched": [0, 1, 2, 3, 4]}


def test_a_broken_stream_to_a_healthy_worker_is_opened_again(proxy, cluster):
    """A stream can break while its worker lives on (here: cancelled under the link); the session is not cut off."""
    with tuning.RELINK_AFTER_S.overridden(60.0):  # (no new stream while the test looks)
        broken = _check_broken_stream_refused(proxy)
    # Once RELINK_AFTER_S has passed with the worker still healthy, the next use opens a new stream.
    with tuning.RELINK_AFTER_S.overridden(0.0):
        fresh = _link(proxy, 0)
    assert fresh is not broken and fresh.request_and_wait(pb.Command(wait=pb.Wait()), "wait").done
    assert proxy.to_host(proxy.put_blocking(np.arange(3, dtype=np.float32), IfrtSharding((0,)))).tolist() == [0, 1, 2]


def _check_broken_stream_refused(proxy):
    """Breaks the session's stream to island 0's worker; new work on it fails with the break's error."""
    broken = _link(proxy, 0)
    kept = proxy.put_blocking(np.arange(3, dtype=np.float32), IfrtSharding((0,)))
    proxy.cluster.loop.call_soon_threadsafe(lambda: broken._call.cancel())  # (after the stream opened)
    wait_until(lambda: not broken.alive, 10, "the link's stream broken", interval_s=0.01)
    with pytest.raises(WorkerLost):  # at first, new work fails with the break's error
        _link(proxy, 0)
    with pytest.raises(RequestError):  # what the broken stream held is lost with it
        proxy.to_host(kept)
    return broken


def test_a_relocated_array_arrives_by_shards_and_bad_shards_fail_it_clearly(proxy, cluster):
    """A push of an array's shards one after the other (as a session moving here sends them) lands on the devices;
    one whose bytes do not fit its shards fails that array with what was wrong, instead of leaving it pending."""
    session = proxy
    devices = session.device_ids[:2]
    link = _link(session, devices[0])
    host = np.arange(4 * 6, dtype=np.float32).reshape(4, 6)
    sharding = IfrtSharding(devices, op_sharding=_split_rows(2))
    meta = array_meta(dtypes.from_numpy(host.dtype), host.shape, _local(session, sharding))
    locals_ = [session.devices.device(d).local_id for d in devices]
    stub = cluster_pb2_grpc.WorkerStub(cluster.credentials.channel(link.address))
    good, bad = _on_loop(session, link.new_id), _on_loop(session, link.new_id)
    chunk = pb.ArrayChunk(session=link.session_key, id=good, meta=meta, data=host.tobytes(), shard_devices=locals_)
    stub.PushArray(iter([chunk]), timeout=10)
    assert np.frombuffer(link.fetch(good), np.float32).tobytes() == host.tobytes()
    short = pb.ArrayChunk(session=link.session_key, id=bad, meta=meta, data=host.tobytes()[:-4], shard_devices=locals_)
    stub.PushArray(iter([short]), timeout=10)
    with pytest.raises(RequestError, match="bytes arrived for 2 shards"):
        link.fetch(bad)


def test_dropped_arrays_ride_along_with_the_commands_that_keep_coming(proxy):
    """A chain that sends a command and drops an array every millisecond sends the forgotten ids with its
    commands, none alone: the one timer that would send them alone after ``tuning.FORGET_DELAY_S`` finds them
    gone."""
    session = proxy
    device = session.device_ids[0]
    link = _link(session, device)
    host = np.arange(4, dtype=np.float32)
    kept = session.put_blocking(host, IfrtSharding((device,)))
    before = link.messages.copy()
    ended = time.monotonic() + 0.6
    puts = 0
    while time.monotonic() < ended:
        new = session.put_blocking(host, IfrtSharding((device,)))
        time.sleep(0.0005)
        kept = new  # the array before is dropped, after its command went: forgotten, it waits for the next
        puts += 1
        time.sleep(0.0005)
    sent = link.messages - before
    assert sent["commands"] >= 0.5 * puts / 4, (sent, puts)  # bursts may share a message
    # None, unless this thread stalled longer than the delay with an id waiting (a timer per id: a third or more).
    assert sent["forgotten ids alone"] <= puts // 50, (sent, puts)
    assert session.to_host(kept).tobytes() == host.tobytes()


def test_an_array_deleted_right_after_its_session_resumes_waits_for_the_resume(proxy, cluster):
    """A delete that reaches a worker just behind a resume (the client let an array go as its session came back)
    lets the resume read the array's copy first: the resume succeeds, and what was kept comes back intact."""
    host = np.arange(1 << 18, dtype=np.float32)
    kept, dropped = proxy.put_blocking(host, IfrtSharding((0,))), proxy.put_blocking(host + 1, IfrtSharding((0,)))
    for _link, pending in _on_loop(proxy, proxy.suspend_on_workers):
        pending.wait(60)

    def resume_then_delete():
        resumed = proxy.resume_on_workers()
        dropped.delete()  # sent on the same stream, right behind the resume
        return resumed

    resumed = _on_loop(proxy, resume_then_delete)
    for _link, pending in resumed:
        pending.wait(60)
    assert proxy.to_host(kept).tobytes() == host.tobytes()
    assert dropped.is_deleted()

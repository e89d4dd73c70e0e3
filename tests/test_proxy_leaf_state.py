"""The proxy's small state holders, driven directly (no servers): host buffers, quotas, activities, compile cache.

Each is owned by the proxy's event loop (the compile cache by the compile pool's threads): these tests
run them on a loop as the server does, and finish work on other threads as its pools do, to check that
what another thread delivers changes nothing until the loop takes it, and the races the locks used to
guard: an upload stored while a take waits, a staged download deleted while it is read.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from pathways_nb.core.dataflow import Pending, wait_on_loop
from pathways_nb.protocol.errors import (
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidRequest,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from pathways_nb.proxy.activities import Activities
from pathways_nb.proxy.context import CompileCache, Quota
from pathways_nb.proxy.host_buffers import HostBuffers

FLAG = "--session_host_buffer_bytes"


def on_loop(test):
    """Runs ``test(buffers, quota)`` on a fresh event loop, as a session's loop would."""

    async def run(timeout_s: float = 5.0):
        quota = Quota("host buffers", 100, FLAG)
        buffers = HostBuffers(asyncio.get_running_loop(), timeout_s, quota)
        await test(buffers, quota)

    return run


def on_another_thread(work) -> None:
    """Runs ``work`` on a thread of its own, as a pool thread would, and waits until it has run."""
    thread = threading.Thread(target=work)
    thread.start()
    thread.join()


# -- quotas ----------------------------------------------------------------------------------


def test_a_quota_refuses_what_goes_over_its_limit_and_counts_nothing_then():
    quota = Quota("host buffers", 100, FLAG)
    assert quota.take(60, "the upload of host buffer 1") == 60
    with pytest.raises(ResourceExhausted) as refused:
        quota.take(50, "the upload of host buffer 2")
    message = refused.value.message
    assert "the upload of host buffer 2 needs 50 bytes" in message and "already holds 60 bytes" in message
    assert FLAG in message and quota.in_use == 60
    assert quota.take(50, "a program's results", credit=10) == 50  # the 10 bytes it frees make room
    quota.give(110)
    assert quota.in_use == 0


def test_a_quota_of_zero_has_no_limit():
    quota = Quota("device memory", 0, "--session_device_bytes")
    quota.take(1 << 50, "a large array")
    assert quota.in_use == 1 << 50


# -- uploads ---------------------------------------------------------------------------------


def test_an_upload_stored_while_a_take_waits_goes_to_it_and_gives_its_quota_back():
    @on_loop
    async def test(buffers, quota):
        taken = buffers.take(1)
        assert not taken.done
        with pytest.raises(InvalidRequest, match="already used by another request"):
            buffers.take(1).wait(0)
        buffers.store(1, memoryview(b"\x07" * 30), buffers.reserve(30, "the upload of host buffer 1"))
        assert bytes(taken.wait(0)) == b"\x07" * 30
        assert quota.in_use == 0  # handed over: the array made from it counts it now
        with pytest.raises(NotFound):
            buffers.read(1)

    asyncio.run(test())


def test_an_upload_stored_first_waits_for_its_take_and_counts_until_then():
    @on_loop
    async def test(buffers, quota):
        buffers.store(2, memoryview(b"\x01" * 40), buffers.reserve(40, "the upload of host buffer 2"))
        assert quota.in_use == 40
        with pytest.raises(InvalidRequest, match="already stored"):
            buffers.store(2, memoryview(b"\x02" * 10), buffers.reserve(10, "the upload of host buffer 2"))
        assert quota.in_use == 40  # the refused one's bytes were given back
        assert bytes(buffers.take(2).wait(0)) == b"\x01" * 40
        assert quota.in_use == 0

    asyncio.run(test())


def test_an_upload_over_the_quota_fails_the_array_made_from_it_not_the_upload():
    @on_loop
    async def test(buffers, quota):
        waiting = buffers.take(3)
        with pytest.raises(ResourceExhausted) as refused:
            buffers.reserve(200, "the upload of host buffer 3")
        buffers.fail(3, refused.value)
        assert waiting.error is refused.value
        buffers.fail(4, refused.value)  # no request waits yet: the next take gets the error
        assert buffers.take(4).error is refused.value
        assert quota.in_use == 0

    asyncio.run(test())


def test_a_take_that_waits_past_the_upload_time_out_fails_naming_its_buffer():
    async def test():
        buffers = HostBuffers(asyncio.get_running_loop(), 0.05, Quota("host buffers", 100, FLAG))
        waiting = buffers.take(5)
        await wait_on_loop(waiting)
        assert isinstance(waiting.error, DeadlineExceeded) and "host buffer 5" in waiting.error.message
        buffers.store(5, memoryview(b"\x05"), 0)  # late: kept for the next take, not for the expired one
        assert bytes(buffers.take(5).wait(0)) == b"\x05"

    asyncio.run(test())


# -- downloads -------------------------------------------------------------------------------


def test_a_staged_download_counts_from_the_start_and_lands_on_the_loop_not_on_the_reading_thread():
    @on_loop
    async def test(buffers, quota):
        reading = buffers.stage(1, buffers.reserve(40, "reading array 1"))
        landed = buffers.ready(1)
        assert quota.in_use == 40 and landed is not None and not landed.done
        on_another_thread(lambda: reading.resolve(memoryview(b"\x01" * 40)))
        # The reader is done, but the store is the loop's: nothing changed until the loop turns.
        assert not landed.done
        with pytest.raises(FailedPrecondition, match="still being read"):
            buffers.read(1)
        await wait_on_loop(landed)
        assert buffers.ready(1) is None and bytes(buffers.read(1)) == b"\x01" * 40
        buffers.delete(1)
        assert quota.in_use == 0

    asyncio.run(test())


def test_a_lookup_that_comes_after_the_read_ended_but_before_the_loop_took_it_waits_for_the_loop():
    @on_loop
    async def test(buffers, quota):
        reading = buffers.stage(6, buffers.reserve(4, "reading array 6"))
        on_another_thread(lambda: reading.resolve(memoryview(b"\x06" * 4)))
        landed = buffers.ready(6)
        assert landed is not None and not landed.done
        await wait_on_loop(landed)
        assert bytes(buffers.read(6)) == b"\x06" * 4

    asyncio.run(test())


def test_a_download_read_on_the_loop_itself_is_there_at_once():
    @on_loop
    async def test(buffers, quota):
        buffers.stage(2, buffers.reserve(8, "reading array 2")).resolve(memoryview(b"\x02" * 8))
        assert buffers.ready(2) is None and bytes(buffers.read(2)) == b"\x02" * 8

    asyncio.run(test())


def test_a_failed_read_gives_its_bytes_back_at_once_and_keeps_its_error():
    @on_loop
    async def test(buffers, quota):
        reading = buffers.stage(3, buffers.reserve(40, "reading array 3"))
        landed = buffers.ready(3)
        on_another_thread(lambda: reading.fail(RuntimeError("the worker is gone")))
        await wait_on_loop(landed)
        assert quota.in_use == 0
        with pytest.raises(DataLoss, match="the worker is gone"):
            buffers.read(3)
        buffers.delete(3)
        with pytest.raises(NotFound):
            buffers.read(3)

    asyncio.run(test())


def test_a_staged_download_deleted_while_it_is_read_drops_its_bytes_when_they_arrive():
    @on_loop
    async def test(buffers, quota):
        reading = buffers.stage(4, buffers.reserve(40, "reading array 4"))
        later = buffers.stage(5, buffers.reserve(10, "reading array 5"))
        lookup = buffers.ready(4)
        buffers.delete(4)
        assert quota.in_use == 10 and lookup.done  # a lookup waiting for it finds it gone, now

        def reads_end() -> None:
            reading.resolve(memoryview(b"\x04" * 40))
            later.resolve(memoryview(b"\x05" * 10))

        landed = buffers.ready(5)
        on_another_thread(reads_end)
        await wait_on_loop(landed)  # the loop took the late bytes of 4 first, in the order they came
        with pytest.raises(NotFound):
            buffers.read(4)
        assert quota.in_use == 10 and bytes(buffers.read(5)) == b"\x05" * 10
        with pytest.raises(NotFound):
            buffers.delete(4)

    asyncio.run(test())


def test_a_handle_is_staged_once_and_a_refused_stage_gives_its_bytes_back():
    @on_loop
    async def test(buffers, quota):
        buffers.stage(5, buffers.reserve(40, "reading array 5"))
        with pytest.raises(InvalidRequest, match="already in use"):
            buffers.stage(5, buffers.reserve(40, "reading array 5 again"))
        with pytest.raises(InvalidRequest, match="already stored"):
            buffers.store(5, memoryview(b""), buffers.reserve(10, "the upload of host buffer 5"))
        assert quota.in_use == 40
        with pytest.raises(ResourceExhausted, match="reading array 6 needs 80 bytes"):
            buffers.reserve(80, "reading array 6")

    asyncio.run(test())


# -- the end of a session --------------------------------------------------------------------


def test_a_closed_session_fails_what_waits_gives_everything_back_and_takes_no_more():
    @on_loop
    async def test(buffers, quota):
        buffers.store(1, memoryview(b"\x01" * 20), buffers.reserve(20, "the upload of host buffer 1"))
        waiting = buffers.take(2)
        reading = buffers.stage(3, buffers.reserve(40, "reading array 3"))
        lookup = buffers.ready(3)
        buffers.close("the client disconnected")
        assert quota.in_use == 0
        assert isinstance(waiting.error, Unavailable) and isinstance(lookup.error, Unavailable)
        on_another_thread(lambda: reading.resolve(memoryview(b"\x03" * 40)))  # a read that ends late
        await asyncio.sleep(0)
        for handle in (1, 3):
            with pytest.raises(Unavailable, match="disconnected"):
                buffers.read(handle)
        with pytest.raises(Unavailable):
            buffers.reserve(1, "the upload of host buffer 4")
        with pytest.raises(Unavailable):
            buffers.store(4, memoryview(b"\x04"), 0)
        assert isinstance(buffers.take(1).error, Unavailable) and quota.in_use == 0

    asyncio.run(test())


def test_many_reads_ending_on_pool_threads_each_land_once():
    """Pool threads end reads while the loop stages, takes and deletes others: the counts always add up."""

    @on_loop
    async def test(buffers, quota):
        quota.limit = 0
        readings: dict[int, Pending] = {}
        for handle in range(200):
            readings[handle] = buffers.stage(handle, buffers.reserve(10, f"reading array {handle}"))
        with ThreadPoolExecutor(4) as pool:
            ended = [pool.submit(readings[h].resolve, memoryview(bytes([h % 256]) * 10)) for h in range(200)]
            for handle in range(0, 200, 2):
                buffers.delete(handle)  # half of them while their reads end
            for future in ended:
                await asyncio.wrap_future(future)
        for handle in range(1, 200, 2):
            landed = buffers.ready(handle)
            if landed is not None:
                await wait_on_loop(landed)
            assert bytes(buffers.read(handle)) == bytes([handle % 256]) * 10
        assert quota.in_use == 100 * 10

    asyncio.run(test())


# -- activities ------------------------------------------------------------------------------


def test_activities_on_the_loop_are_listed_while_their_block_runs():
    async def test():
        activities = Activities()
        with activities.track("upload", "4 MiB to the server", "alice", 4 << 20) as upload:
            upload.bytes_done = 1 << 20
            (listed,) = activities.snapshot()
            assert (listed.kind, listed.tenant, listed.bytes_done, listed.bytes_total) == (
                "upload",
                "alice",
                1 << 20,
                4 << 20,
            )
            listed.bytes_done = 0  # a copy: the activity itself is its owner's
            assert activities.snapshot()[0].bytes_done == 1 << 20
        assert activities.snapshot() == []

    asyncio.run(test())


def test_an_activity_of_a_pool_thread_is_registered_and_removed_by_the_loop():
    async def test():
        loop = asyncio.get_running_loop()
        activities = Activities()
        entered, leave = threading.Event(), threading.Event()

        def compile_on_a_pool_thread() -> None:
            with activities.track_from_pool(loop, "compile", "compiling", "bob"):
                entered.set()
                leave.wait(5)

        compiling = loop.run_in_executor(None, compile_on_a_pool_thread)
        await asyncio.to_thread(entered.wait, 5)  # its answer comes after the registering, on the loop
        assert [(a.kind, a.tenant) for a in activities.snapshot()] == [("compile", "bob")]
        leave.set()
        await compiling
        assert activities.snapshot() == []

    asyncio.run(test())


# -- the compile cache (the compile pool's threads alone) ------------------------------------


def test_the_compile_cache_evicts_the_least_recently_used_program():
    cache = CompileCache(2)
    keys = [CompileCache.key(f"program {i}".encode(), b"options", (0,)) for i in range(3)]
    programs = [object() for _ in range(3)]  # the cache keeps what it is given
    cache.put(keys[0], programs[0])
    cache.put(keys[1], programs[1])
    assert cache.get(keys[0]) is programs[0]  # now the most recently used
    cache.put(keys[2], programs[2])
    assert cache.get(keys[1]) is None and cache.get(keys[0]) is programs[0] and cache.get(keys[2]) is programs[2]
    assert (cache.hits, cache.misses) == (3, 1)
    assert CompileCache.key(b"program 0", b"options", (1,)) != keys[0]  # other devices, another program


def test_the_compile_cache_shared_by_compile_threads_stays_within_its_size():
    cache = CompileCache(8)

    def compile_many(thread: int) -> None:
        for i in range(500):
            key = CompileCache.key(f"program {i % 16}".encode(), b"", (thread,))
            if cache.get(key) is None:
                cache.put(key, object())

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(compile_many, range(2)))
    assert cache.hits + cache.misses == 1000 and len(cache) == 8

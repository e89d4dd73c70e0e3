"""A worker's reply stream: replies go at once, timeline events ride along or wait for one timer."""

import asyncio
import threading
import time

from pathways_nb.core import tuning
from pathways_nb.core.loop import call_on
from pathways_nb.rpc import cluster_pb2 as pb
from pathways_nb.worker.service import Replies


async def _batches_while_recording(
    seconds: float, event_every_s: float, reply_every_s: float
) -> tuple[int, int, float]:
    """Batches the stream sent while another thread recorded events and, more rarely, replies (each handed to the
    loop, which owns the stream's replies, as a session's threads hand them); the replies; and how long the
    recording lasted."""
    replies = Replies()
    loop = asyncio.get_running_loop()
    stop = threading.Event()
    sent_replies = 0
    recorded_s = 0.0

    def record() -> None:
        nonlocal sent_replies, recorded_s
        started = next_reply = time.monotonic()
        while not stop.is_set():
            call_on(loop, replies.put_event, pb.Event(kind="execute"))
            if time.monotonic() >= next_reply:
                call_on(loop, replies.put, pb.Reply(request=sent_replies))
                sent_replies += 1
                next_reply += reply_every_s
            time.sleep(event_every_s)
        recorded_s = time.monotonic() - started
        call_on(loop, replies.close)

    recorder = threading.Thread(target=record)
    batches = 0

    async def drain() -> None:
        nonlocal batches
        async for _batch in replies.batches():
            batches += 1

    draining = asyncio.create_task(drain())
    recorder.start()
    await asyncio.sleep(seconds)
    stop.set()
    await asyncio.to_thread(recorder.join)
    await draining
    return batches, sent_replies, recorded_s


def test_events_between_replies_wait_for_one_timer_and_do_not_go_one_by_one():
    """A program per millisecond records an event each; a reply every 20 ms goes at once, carrying the events
    so far; the events after it wait for at most one timer, however long the stream runs (one timer per
    drained batch used to pile up until nearly every event went in a message of its own)."""
    seconds = 1.5
    batches, sent_replies, recorded_s = asyncio.run(_batches_while_recording(seconds, 0.001, 0.02))
    timers = recorded_s / tuning.EVENTS_DELAY_S.value + 1
    assert sent_replies > 0.5 * seconds / 0.02, sent_replies
    assert batches <= sent_replies + timers + 2, (batches, sent_replies, timers)

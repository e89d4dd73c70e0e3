"""Connects to the proxy at argv[1] and prints, per thread of this process that wakes often at rest or
runs under SCHED_IDLE, its wake-ups per second, its policy and its timer slack; then that a program
still runs.

One line per such thread: ``thread <wakeups/s> <idle|normal> <slack ns>``; then ``result <value>``.
"""

import os
import sys
import time

import jax
import numpy as np

import pathways_nb


def timer_slack_ns(tid: int) -> int | None:
    try:
        with open(f"/proc/{tid}/timerslack_ns") as slack:
            return int(slack.read())
    except (OSError, ValueError):
        return None


def wakeups() -> dict[int, int]:
    counts = {}
    for name in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{name}/status") as status:
                for line in status:
                    if line.startswith("voluntary_ctxt_switches:"):
                        counts[int(name)] = int(line.split()[1])
        except OSError:
            pass
    return counts


pathways_nb.connect(sys.argv[1])
x = jax.numpy.ones(4) + 1  # arrays made and dropped: the batched deletions have work
del x
before, started = wakeups(), time.monotonic()
time.sleep(0.5)
after, elapsed = wakeups(), time.monotonic() - started
for tid, count in after.items():
    rate = (count - before.get(tid, count)) / elapsed
    try:
        idle = os.sched_getscheduler(tid) == os.SCHED_IDLE
    except OSError:  # the thread ended
        continue
    if rate > 500 or idle:
        print("thread", round(rate), "idle" if idle else "normal", timer_slack_ns(tid))
print("result", float(jax.jit(lambda v: v.sum())(np.ones(8, np.float32))))

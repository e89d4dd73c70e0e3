"""A colocated call whose executor the test kills while it runs, then another call.

Says the executor's pid (the function returns it); the next call writes ``running`` in the executor's
directory and sleeps (the test kills the executor then); says what that call raised, then the pid
of the executor that ran the call after it.
"""

import jax
import numpy as np
from colocated_client import connect, say
from jax.experimental import colocated_python as cp

cpus = connect()


@cp.colocated_python
def pid_or_wait(x):
    import os
    import pathlib
    import time

    if float(np.asarray(x)[0]) > 0:
        pathlib.Path("running").write_text("")
        time.sleep(300)
    return jax.device_put(np.float32(os.getpid()), x.sharding)


zero = jax.device_put(np.zeros(1, np.float32), cpus[3])
say(pid=int(np.asarray(pid_or_wait(zero))))
try:
    np.asarray(pid_or_wait(zero + 1))
    say(raised=None)
except Exception as error:  # noqa: BLE001 - what arrives is what the test checks
    say(raised=type(error).__name__, message=str(error))
say(after=int(np.asarray(pid_or_wait(zero))))

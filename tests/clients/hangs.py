"""Never ends: a thread named ``stuck`` waits forever, and the main thread sleeps.

What a client that hangs looks like: the test aborts it and reads every thread's stack.
"""

import threading
import time


def wait_forever():
    threading.Event().wait()


threading.Thread(target=wait_forever, name="stuck").start()
time.sleep(600)

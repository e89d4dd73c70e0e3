"""Connects to argv[1] as tenant ``bob``, exclusively, waiting 3 s at most.

Prints ``connected``, or the seconds it waited and why it could not connect.
"""

import sys
import time

import pathways_nb

started = time.monotonic()
try:
    pathways_nb.connect(sys.argv[1], tenant="bob", exclusive=True, timeout_s=3, progress=False)
    print("connected")
except pathways_nb.ConnectionFailed as error:
    print(round(time.monotonic() - started), error)

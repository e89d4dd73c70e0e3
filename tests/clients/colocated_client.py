"""What the colocated-Python client scripts share (imported by them, not run): connecting as the test
says, and reporting JSON lines.

Functions sent to the executors must not use what this module defines: they are pickled by value
only where they are defined in the script itself.
"""

import json
import sys

import jax
from jax.experimental import colocated_python as cp

import pathways_nb


def connect() -> list:
    """Connects to argv[1] with the cluster token argv[2] as tenant argv[3]; the devices' colocated CPU
    devices (in the order of ``jax.devices()``)."""
    pathways_nb.connect(sys.argv[1], token=sys.argv[2], tenant=sys.argv[3])
    return cp.colocated_cpu_devices(jax.devices())


def say(**values) -> None:
    """One JSON line for the test."""
    print(json.dumps(values), flush=True)

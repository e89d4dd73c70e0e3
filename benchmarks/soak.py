"""Soak a 2-island LocalCluster: 8 client processes for 60 s, one killed mid-run, then a memory check.

    python benchmarks/soak.py [--clients 8] [--seconds 60]

Prints the number of checked operations, wrong results (must be 0) and
errors, and each server process's RSS after the soak relative to after a
warm-up (target: within 10%). See ``pathways_nb.testing.soak``.
"""

from __future__ import annotations

import sys

from pathways_nb.testing import soak

if __name__ == "__main__":
    sys.exit(soak.main())

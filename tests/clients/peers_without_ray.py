"""benchmarks/peers.py's main with the arguments argv[1:], in a Python that sees no Ray.

``sys.modules["ray"] = None`` is how Python marks a module as not importable: this run sees no Ray,
whether or not the bench extra is installed here. Run with benchmarks/ on PYTHONPATH.
"""

import sys

sys.modules["ray"] = None
import peers  # noqa: E402 - after Ray is made unimportable

raise SystemExit(peers.main(sys.argv[1:]))

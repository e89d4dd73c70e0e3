"""Where the jaxlib internals the servers use differ across the supported range (0.10.2 to 0.12).

One module per concern, each detecting the feature it needs (never comparing
version numbers), so the rest of the code calls one function whatever jaxlib
is installed. ``SUPPORTED_JAXLIB`` in ``pathways_nb.errors`` states the range;
tests/test_compat.py runs clients of both ends against servers of both ends.
"""

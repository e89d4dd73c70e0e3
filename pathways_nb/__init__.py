"""pathways-nb: a cluster of accelerators that feels like one machine from a notebook."""

__version__ = "0.1.0"

"""The package's version, in a module of its own so that servers read it without importing the client."""

__version__ = "0.1.0"

"""Exceptions users of pathways-nb can catch; each says what happened and what to do."""

from __future__ import annotations

# The jaxlib versions the servers run on (tests/test_compat.py runs both ends; docs/compatibility.md).
SUPPORTED_JAXLIB = "0.10.2 to 0.12.0.1"
SUPPORTED_RANGE = ">=0.10.2,<0.13"  # as pyproject.toml requires jax and jaxlib


class PathwaysError(Exception):
    """Base class of every error pathways-nb raises on purpose."""


class SchemaUnavailableError(PathwaysError):
    """The IFRT proxy wire schema could not be read from the installed jaxlib."""

    def __init__(self, jaxlib_version: str, detail: str):
        self.jaxlib_version = jaxlib_version
        self.detail = detail
        super().__init__(
            f"cannot read the IFRT proxy wire schema from jaxlib {jaxlib_version}: {detail}. "
            f"The pathways-nb server runs on jaxlib {SUPPORTED_JAXLIB} "
            f"(pip install 'jax{SUPPORTED_RANGE}' 'jaxlib{SUPPORTED_RANGE}')."
        )


class ConnectionFailed(PathwaysError, ConnectionError):
    """Nothing usable answered at the address given to ``connect``."""

    def __init__(self, address: str, timeout_s: float, detail: str):
        self.address = address
        self.timeout_s = timeout_s
        self.detail = detail
        super().__init__(
            f"could not connect to a Pathways proxy at {address} within {timeout_s:g} s: {detail}. "
            "Check the address and that the server runs (pathways-nb up, or pathways-nb proxy); "
            "JAX still uses this machine's devices"
        )


class SlurmError(PathwaysError):
    """A Slurm command failed, or Slurm says a job cannot serve a cluster (it ended, it is not ours)."""

    def __init__(self, what: str, detail: str):
        self.what = what
        self.detail = detail
        super().__init__(f"{what}: {detail}")

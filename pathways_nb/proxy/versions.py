"""Which IFRT proxy protocol version a session speaks.

The stock client sends the range it understands and aborts its process (a
CHECK, not an exception) if the reply falls outside it, so the server answers
only with a version inside both ranges, and otherwise refuses the call with a
gRPC error that says which jaxlib versions fit.
"""

from __future__ import annotations

from dataclasses import dataclass

# What stock clients send in GetVersion (measured): jaxlib 0.7.2 protocol 15-16 and
# serialization 0-0, 0.9.0 16-22, 0.10.2 16-25 and 0-3, 0.12.0.1 16-25 and 2-6.
# Protocol versions this server implements: 16 (executable device lists) to
# 25 (the newest that jaxlib 0.10.2's and 0.12.0.1's clients speak).
PROTOCOL_MIN = 16
PROTOCOL_MAX = 25
# IFRT serialization versions (the version_number fields of the ifrt protos) this
# server reads and writes; a 0.12 client (2-6) gets 3, as 0.10.2's client does.
SERDES_MIN = 0
SERDES_MAX = 3

# Named protocol versions whose behaviour the server switches on.
EXECUTE_RESULT = 21  # fetch_execute_result replaces check_future for execute status
DEVICE_PLATFORM_NAME = 22  # devices carry platform_name

# Clients known to work (see docs/compatibility.md); shown in refusals.
SUPPORTED_CLIENTS = "jax/jaxlib 0.7.2 to 0.12.0.1"


class VersionMismatch(Exception):
    """The client's protocol range and the server's do not overlap."""


@dataclass(frozen=True)
class Negotiated:
    protocol_version: int
    serdes_version: int


def choose(client_min: int, client_max: int, serdes_min: int, serdes_max: int) -> Negotiated:
    """The newest version both sides speak, or ``VersionMismatch`` saying what to install."""
    protocol = min(client_max, PROTOCOL_MAX)
    if protocol < max(client_min, PROTOCOL_MIN):
        raise VersionMismatch(
            f"the client speaks IFRT proxy protocol {client_min}-{client_max}, this server "
            f"{PROTOCOL_MIN}-{PROTOCOL_MAX}; use a client from {SUPPORTED_CLIENTS} "
            "(or upgrade pathways-nb on the server)"
        )
    serdes = min(serdes_max, SERDES_MAX)
    if serdes < max(serdes_min, SERDES_MIN):
        raise VersionMismatch(
            f"the client speaks IFRT serialization {serdes_min}-{serdes_max}, this server "
            f"{SERDES_MIN}-{SERDES_MAX}; use a client from {SUPPORTED_CLIENTS}"
        )
    return Negotiated(protocol, serdes)

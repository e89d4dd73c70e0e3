"""HTTP/2 keepalive as the cluster's liveness: gRPC's core pings a connection and closes it when
a ping goes unanswered, so a peer that vanished (its host gone, its network cut, its process
stopped) ends every call on that connection without a message from Python on either side.

The resource manager pings the connections of its open calls (a worker's ``Attach`` stream, a
proxy's ``Allocate``); a worker pings the resource manager's, less often, to notice one that
vanished. A ping costs each side a few microseconds in gRPC's core, never the Python loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pathways_nb.core import tuning


@dataclass(frozen=True)
class Liveness:
    """How a peer that vanished is noticed within ``bound_s``: a ping every ``ping_interval_s`` of
    quiet, ``ping_timeout_s`` for its answer, then ``settle_s`` for a launcher to say why it ended.

    A peer that stops for less than ``ping_timeout_s + settle_s`` (a stall) and comes back is
    never found dead.
    """

    ping_interval_s: float
    ping_timeout_s: float
    settle_s: float

    @classmethod
    def within(cls, bound_s: float) -> Liveness:
        """A sixth of the bound until the next ping, two thirds for its answer (gRPC's core answers
        at once; the margin is for a loaded machine, and is how long a stall may last), a sixth to
        settle (as long as a proxy waits for the cause of a broken stream)."""
        if not 0 < bound_s < math.inf:
            raise ValueError(f"the worker time-out must be a number of seconds > 0, not {bound_s!r}")
        return cls(bound_s / 6, bound_s * 2 / 3, bound_s / 6)

    @property
    def bound_s(self) -> float:
        return self.ping_interval_s + self.ping_timeout_s + self.settle_s

    def server_options(self) -> list[tuple[str, int]]:
        """Options of a server that pings its callers' connections, and lets callers ping it."""
        return [
            ("grpc.keepalive_time_ms", _ms(self.ping_interval_s)),
            # The time-out gRPC's core applies to a keepalive ping (``keepalive_timeout_ms`` alone left
            # it at the one-minute default in grpcio 1.85).
            ("grpc.http2.ping_timeout_ms", _ms(self.ping_timeout_s)),
            ("grpc.keepalive_timeout_ms", _ms(self.ping_timeout_s)),
            # Keep pinging a quiet connection (the default stops after two pings without data).
            ("grpc.http2.max_pings_without_data", 0),
            # Callers ping every tuning.CLIENT_PING_INTERVAL_S: never refuse it (a refusal closes the stream, and
            # on a loaded machine two pings may arrive closer together than they were sent).
            ("grpc.http2.max_ping_strikes", 0),
        ]


def client_options(ping_interval_s: float | None = None) -> list[tuple[str, int]]:
    """Options of a channel that pings its server while a call is open, and fails the calls of one
    that stops answering within ``ping_interval_s`` (default: ``tuning.CLIENT_PING_INTERVAL_S``: a
    resource manager that vanished is noticed within two of them)."""
    if ping_interval_s is None:
        ping_interval_s = tuning.CLIENT_PING_INTERVAL_S.value
    return [
        ("grpc.keepalive_time_ms", _ms(ping_interval_s)),
        ("grpc.http2.ping_timeout_ms", _ms(ping_interval_s)),
        ("grpc.keepalive_timeout_ms", _ms(ping_interval_s)),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))

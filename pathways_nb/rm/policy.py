"""The resource manager's policy on sessions: the priorities tenants may ask for, and when idle sessions
are asked to suspend.

Its flags are declared here once, for every command that runs a resource manager (``pathways-nb
resource-manager``, ``up``, ``deploy k8s``); a launcher hands a policy on to the resource manager
it starts as ``flags()``.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Mapping
from dataclasses import dataclass

# The key of ``priority_ceilings`` for every tenant not named.
EVERY_OTHER_TENANT = "*"


@dataclass(frozen=True)
class SessionPolicy:
    """``suspend_idle_after_s``: a session with no request for this long is asked to suspend when a
    request waits for its devices (0: never for being idle); ``suspend_idle_always``: also when nobody
    waits. ``priority_ceilings``: tenant -> the highest priority it may ask for (``"*"``: every tenant not
    named; a tenant without one, or None: no ceiling). ``ValueError`` if inconsistent."""

    suspend_idle_after_s: float = 0.0
    suspend_idle_always: bool = False
    priority_ceilings: Mapping[str, int] | None = None

    def __post_init__(self) -> None:
        if self.suspend_idle_after_s < 0:
            raise ValueError(
                f"--suspend_idle_after {self.suspend_idle_after_s:g}: give seconds >= 0 (0: never suspend a "
                "session for being idle)"
            )
        if self.suspend_idle_always and not self.suspend_idle_after_s:
            raise ValueError(
                "--suspend_idle_always needs --suspend_idle_after SECONDS: how long a session must be idle to be "
                "suspended"
            )

    def ceiling(self, tenant: str) -> int | None:
        """The highest priority ``tenant`` may ask for; None: any."""
        ceilings = self.priority_ceilings or {}
        return ceilings.get(tenant, ceilings.get(EVERY_OTHER_TENANT))

    def flags(self) -> list[str]:
        """This policy as flags of ``pathways-nb resource-manager`` (none for the default one)."""
        flags = [f"--suspend_idle_after={self.suspend_idle_after_s:g}"] if self.suspend_idle_after_s else []
        if self.suspend_idle_always:
            flags.append("--suspend_idle_always")
        return flags + [f"--priority_ceiling={tenant}={n}" for tenant, n in (self.priority_ceilings or {}).items()]


def _ceiling(value: str) -> tuple[str, int]:
    """One ``--priority_ceiling TENANT=N`` (a tenant's name may hold ``=``: N follows the last one)."""
    match = re.fullmatch(r"(.+)=([-+]?\d+)", value.strip())
    if match is None:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not TENANT=N: give a tenant and a whole number, e.g. alice=10, or *=0 for every other tenant"
        )
    return match[1], int(match[2])


class _Ceilings(argparse.Action):
    """Collects each ``--priority_ceiling`` into one dict (a tenant given twice: the last one counts)."""

    def __call__(self, parser, namespace, value, option_string=None):
        tenant, ceiling = value
        setattr(namespace, self.dest, {**(getattr(namespace, self.dest) or {}), tenant: ceiling})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--suspend_idle_after``, ``--suspend_idle_always`` and ``--priority_ceiling`` (a dict or None)."""
    parser.add_argument(
        "--suspend_idle_after",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="suspend a session with no request for this long when another request waits for its devices "
        "(default 0: never)",
    )
    parser.add_argument(
        "--suspend_idle_always",
        action="store_true",
        help="suspend sessions idle for --suspend_idle_after even when nobody waits for their devices (clusters "
        "that scale down)",
    )
    parser.add_argument(
        "--priority_ceiling",
        type=_ceiling,
        action=_Ceilings,
        default=None,
        metavar="TENANT=N",
        help="the highest priority TENANT's sessions may ask for; repeat it for several tenants, *=N for every "
        "other tenant (default: no ceiling)",
    )

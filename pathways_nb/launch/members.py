"""The group members a worker runs beside itself: its host's part in groups of islands (multislice).

The resource manager forms a group of islands by ordering every host's worker to start a member
process (``rm.groups``): a ``pathways-nb worker`` of its own that serves the host's devices again as
part of the group's JAX runtime. ``pathways-nb worker`` hands its ``WorkerServer`` a ``GroupMembers``
that carries the orders out: it starts a member (for member 0 it picks the port of the group's
coordination service and reports it at once, so that the other members can start joining while
member 0 waits for them), stops one when its group is down, and reports a member that ended
unasked, with how and its last output. A member ends with its worker (it watches its parent), and
a worker's stop stops its members.
"""

from __future__ import annotations

import base64
import logging
import os
import socket
import threading
from collections.abc import Callable, Sequence

from pathways_nb.core import tuning
from pathways_nb.core.exit_status import exit_description
from pathways_nb.launch.processes import ChildServer, ServerStartError
from pathways_nb.rpc import cluster_pb2 as pb

_LOGGER = logging.getLogger(__name__)

# The flag that makes ``pathways-nb worker`` a group member: a base64 ``GroupMembership``.
MEMBER_FLAG = "--group_member"


def encode_membership(membership: pb.GroupMembership) -> str:
    return base64.urlsafe_b64encode(membership.SerializeToString()).decode()


def decode_membership(text: str) -> pb.GroupMembership:
    """The membership a ``--group_member`` value names (``ValueError`` if it is not one)."""
    try:
        return pb.GroupMembership.FromString(base64.urlsafe_b64decode(text.encode()))
    except Exception as error:  # noqa: BLE001 - base64 and protobuf errors alike
        raise ValueError(f"{MEMBER_FLAG} is not a group membership: {error}") from None


class _Member:
    def __init__(self, membership: pb.GroupMembership, child: ChildServer):
        self.membership = membership
        self.child = child
        self.stopping = False


class GroupMembers:
    """This worker's member processes, one per group its host is part of."""

    def __init__(
        self,
        arguments: Callable[[pb.GroupMembership], Sequence[str]],
        coordinator_host: str,
        bind_host: str,
        log_directory: str | None = None,
    ):
        """``arguments(membership)``: the ``pathways-nb`` arguments that start a member; ``coordinator_host``: how
        other hosts reach this one; ``bind_host``: where to listen. ``report`` (set by the worker) tells the
        resource manager what became of a member. ``log_directory``: where the members log (``NAME.log``)
        and keep their port files, for a launcher that removes it (a worker killed with SIGKILL cannot
        remove its members' files); default: a temporary directory of each member's own."""
        self._arguments = arguments
        self.report: Callable[[pb.GroupMemberEvent], None] = lambda _event: None
        self._coordinator_host = coordinator_host
        self._bind_host = bind_host
        if log_directory is not None and not os.path.isdir(log_directory):
            raise ValueError(
                f"--log_directory {log_directory!r} is not a directory: create it, or leave the flag out for a "
                "temporary directory per member"
            )
        self._log_directory = log_directory
        self._lock = threading.Lock()
        self._members: dict[str, _Member] = {}
        self._closed = False

    def apply(self, order: pb.GroupOrder) -> None:
        """Carries out one of the resource manager's orders (on the thread that reads them: it never waits)."""
        if order.HasField("start"):
            self._start(order.start)
        elif order.stop:
            self._stop(order.stop, order.stop_epoch, order.reason)

    def _start(self, membership: pb.GroupMembership) -> None:
        self._stop(membership.group, membership.epoch - 1, "a new epoch of its group starts")
        if membership.member == 0 and not membership.coordinator_address:
            membership.coordinator_address = f"{self._coordinator_host}:{_free_port(self._bind_host)}"
        name = f"group{membership.group}-member{membership.member}"
        log_path = os.path.join(self._log_directory, f"{name}.log") if self._log_directory else None
        child = ChildServer(
            name,
            [*self._arguments(membership), MEMBER_FLAG, encode_membership(membership)],
            log_path=log_path,
            directory=self._log_directory,
        )
        member = _Member(membership, child)
        with self._lock:
            if self._closed:
                return
            self._members[membership.group] = member
            child.launch()
        _LOGGER.info("started %s (epoch %d, pid %d)", name, membership.epoch, child.process.pid)
        if membership.member == 0:  # the others join it: they may start while it waits for them
            self.report(self._event(membership, coordinator_address=membership.coordinator_address))
        threading.Thread(target=self._watch, args=(member,), name=f"pathways-{name}", daemon=True).start()

    def _watch(self, member: _Member) -> None:
        """Waits for the member to serve, then to end; an end nobody asked for is reported."""
        child = member.child
        try:
            child.wait_started(tuning.GROUP_FORM_TIMEOUT_S.value)
            child.process.wait()
            how = exit_description(child.process.returncode)
        except ServerStartError as error:
            how = str(error)
        if member.stopping:
            return
        tail = child.log_tail(tuning.EXECUTOR_LOG_TAIL_LINES.value)
        _LOGGER.warning("%s ended: %s", child.name, how)
        self.report(self._event(member.membership, exited=f"{how}; its last output:\n{tail}"))

    def _stop(self, group: str, epoch: int, reason: str) -> None:
        """Stops the member of ``group`` if it is of ``epoch`` or older."""
        with self._lock:
            member = self._members.get(group)
            if member is None or member.membership.epoch > epoch:
                return
            del self._members[group]
            member.stopping = True
        _LOGGER.info("stopping %s: %s", member.child.name, reason)
        # Off the reading thread: a member stuck in a collective whose peer died takes a SIGKILL to end.
        threading.Thread(target=member.child.close, args=(5.0,), daemon=True).start()

    def close(self) -> None:
        """Stops every member (this worker stops)."""
        with self._lock:
            self._closed = True
            members, self._members = list(self._members.values()), {}
        for member in members:
            member.stopping = True
            member.child.close(5.0)

    @staticmethod
    def _event(membership: pb.GroupMembership, **fields) -> pb.GroupMemberEvent:
        return pb.GroupMemberEvent(group=membership.group, epoch=membership.epoch, member=membership.member, **fields)


def _free_port(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host if host not in ("", "0.0.0.0") else "", 0))
        return probe.getsockname()[1]

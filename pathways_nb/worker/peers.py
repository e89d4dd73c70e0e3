"""The other workers this one talks to: arrays pushed to them, and an island's order told to its other hosts.

The stubs, one per peer address, belong to the worker's event loop (``Peers.stub``): a command names
its peer, and the loop hands the stub to the pool thread that pushes (``push``, which blocks) or to
whoever announces an island step (``announce_step``, which does not). No lock: no other thread looks
a peer up.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import grpc
import numpy as np

from pathways_nb.core import shared_memory, tuning
from pathways_nb.core.aio_server import SERVER_OPTIONS
from pathways_nb.core.dataflow import Pending
from pathways_nb.core.security import ClusterCredentials
from pathways_nb.protocol.errors import Unavailable
from pathways_nb.rpc import cluster_pb2 as pb
from pathways_nb.rpc import cluster_pb2_grpc

_LOGGER = logging.getLogger(__name__)

Peer = cluster_pb2_grpc.WorkerStub


class Peers:
    """A stub per peer worker, made at first use (loop-owned)."""

    def __init__(self, credentials: ClusterCredentials) -> None:
        self._credentials = credentials
        self._stubs: dict[str, Peer] = {}

    def stub(self, address: str) -> Peer:
        stub = self._stubs.get(address)
        if stub is None:
            stub = cluster_pb2_grpc.WorkerStub(self._credentials.channel(address, options=SERVER_OPTIONS))
            self._stubs[address] = stub
        return stub


def push(peer: Peer, address: str, header: pb.ArrayChunk, host: np.ndarray | None) -> bool:
    """Sends an array (or, in ``header.shared``, the file that holds it) to a peer worker. Blocks: on a pool thread.

    False if the peer could not take the shared file (the caller sends the bytes instead);
    UNAVAILABLE if the push failed (the peer's copy of the array never comes).
    """
    data = memoryview(host.reshape(-1).view(np.uint8)) if host is not None else memoryview(b"")

    def chunks():
        yield header
        chunk = tuning.MESSAGE_CHUNK_BYTES.value
        for start in range(0, data.nbytes, chunk):
            yield pb.ArrayChunk(data=data[start : start + chunk].tobytes())

    try:
        return not peer.PushArray(chunks()).not_shared
    except grpc.RpcError as error:
        raise Unavailable(
            f"sending array {header.id} to {address} failed ({error.code().name}: {error.details()})"
        ) from None
    finally:
        if header.HasField("shared"):
            shared_memory.discard(header.shared.path)  # taken by now, or never will be


def announce_step(peers: Sequence[tuple[str, Peer]], gang: str, step: int) -> list[Pending]:
    """Host 0: tells the island's other hosts the step of a multi-host program, without waiting (any thread).

    Returns, per host, what is done once that host's part of the step has run (or once
    telling it failed, or took longer than ``tuning.PART_REPORT_TIMEOUT_S``: then it no longer counts).
    """
    orders = pb.GangOrders(steps=[pb.GangStep(gang=gang, step=step)])
    reported = []
    for address, peer in peers:
        ran = Pending()
        call = peer.OrderGang.future(orders, timeout=tuning.PART_REPORT_TIMEOUT_S.value)
        call.add_done_callback(lambda call, ran=ran, address=address: _part_reported(call, ran, address))
        reported.append(ran)
    return reported


def _part_reported(call: grpc.Future, ran: Pending, address: str) -> None:
    try:
        error = call.exception()
    except grpc.FutureCancelledError:
        error = None
    if error is not None and error.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
        _LOGGER.warning("telling %s the island's order failed: %s", address, error.details())
    ran.resolve(None)

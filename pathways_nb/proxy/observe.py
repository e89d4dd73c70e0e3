"""The proxy's observe service: the cluster as notebooks show it (devices, health, allocations, queue)."""

from __future__ import annotations

import asyncio

import grpc

from pathways_nb.protocol.errors import RequestError
from pathways_nb.proxy.context import ProxyContext
from pathways_nb.rpc import cluster_pb2_grpc

SERVICE_NAME = "pathways_nb.v1.Observe"


class ObserveService(cluster_pb2_grpc.ObserveServicer):
    def __init__(self, context: ProxyContext):
        self.context = context

    async def GetClusterState(self, request, context):
        try:
            return await asyncio.to_thread(self.context.runtime.cluster_state)
        except RequestError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, e.message)

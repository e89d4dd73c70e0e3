"""A peer's push that reaches a worker before its session's stream from the proxy waits for the session.

The worker's service runs here (this process's CPU device, on a gRPC server of its own), as a worker
process runs it. An array is pushed for a session whose stream is not open yet; once the service
holds the push (waiting for the session), the stream opens and fetches the array.

Prints JSON: whether the push was still waiting, not refused, when the service held it, and the
array the session fetched.
"""

import itertools
import json
import os
import threading

import numpy as np

from pathways_nb.core.aio_server import BackgroundServer
from pathways_nb.core.convert import array_meta
from pathways_nb.core.security import ClusterCredentials, generate_token
from pathways_nb.protocol import dtypes
from pathways_nb.protocol.shardings import IfrtSharding
from pathways_nb.rpc import cluster_pb2 as pb
from pathways_nb.rpc import cluster_pb2_grpc
from pathways_nb.testing import wait_until
from pathways_nb.worker.runtime import LocalRuntime
from pathways_nb.worker.service import SERVICE_NAME, WorkerService

credentials = ClusterCredentials(token=generate_token())
service = WorkerService(LocalRuntime("cpu", 1), credentials=credentials)
server = BackgroundServer(
    lambda grpc_server: cluster_pb2_grpc.add_WorkerServicer_to_server(service, grpc_server),
    [SERVICE_NAME],
    credentials=credentials,
)
stub = cluster_pb2_grpc.WorkerStub(credentials.channel(server.address))
key, host = f"test-early-push-{os.getpid()}", np.arange(5, dtype=np.int32)
meta = array_meta(dtypes.from_numpy(host.dtype), host.shape, IfrtSharding((0,), ""))
pushed = stub.PushArray.future(iter([pb.ArrayChunk(session=key, id=7, meta=meta, data=host.tobytes())]))
wait_until(lambda: key in service._early_pushes, 30, "the push held by the service, waiting for its session")
waiting = not pushed.done()  # waiting for the session, not refused
batches = iter([pb.CommandBatch(session=key), pb.CommandBatch(commands=[pb.Command(fetch=pb.Fetch(id=7, request=1))])])
stream = stub.Session(itertools.chain(batches, iter(threading.Event().wait, True)))
pushed.result(timeout=10)
reply = next(r for batch in stream for r in batch.replies if r.request == 1)
print(json.dumps({"waiting": waiting, "fetched": np.frombuffer(reply.data, host.dtype).tolist()}))
stream.cancel()
server.stop()

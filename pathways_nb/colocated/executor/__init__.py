"""The colocated Python executor: one tenant session's Python on one host.

Started as ``python -m pathways_nb.colocated.executor``.

It runs what ``jax.experimental.colocated_python`` ships (a cloudpickled function and its
specialization) on CPU devices of its own that stand for the host's colocated CPU devices. The
host's supervisor (``pathways_nb.colocated.host``) starts it, as an unprivileged user where
the host allows, never the worker; the worker calls it (``ColocatedExecutor.Run``). It imports only
what it needs (jax, cloudpickle, the wire format): no server of the cluster runs in it.
"""

"""Colocated Python (``jax.experimental.colocated_python``): every part of it, each module in the process it runs in.

A tenant's function runs in an executor of its own beside the devices' worker (docs/design.md,
"Colocated Python"; user-facing: docs/colocated_python.md). A call goes proxy -> worker -> executor,
and the executor is started by its host's colocated host:

- ``proxy``: the program's proxy half, which checks a call and plans it (the proxy's compile pool);
- ``worker``: its host half, which hands a call to the session's executor (a worker's pool), and
  the worker's ``ColocatedPython``; ``executors``: the worker's link to its host's colocated host,
  one ``Executor`` call per session, and each session's executor calls;
- ``host``: ``pathways-nb colocated-host``, which starts and stops the executors of one host's
  worker; ``host_output``: how it reads and bounds what they write;
- ``executor/``: the executor process (``python -m pathways_nb.colocated.executor``);
- ``arrays``: argument and result shards as the worker and an executor exchange them (both).

What an executor writes travels on to the client through the output path every worker line takes
(``core.colocated_output``, ``proxy/connection_output.py``, ``client/remote_output.py``). This
package imports only the layers below the servers (``core``, ``protocol``, ``rpc``, errors), so any
server, the launchers and the command line may import it.
"""

# The custom-call program type jax's colocated Python compiles.
PROGRAM_TYPE = "jax_colocated_python_v0.0.1"

OFF = (
    "colocated Python is off on this cluster: start it with --colocated_python "
    "(pathways_nb.LocalCluster(colocated_python=True), pathways-nb up --colocated_python); "
    "docs/colocated_python.md says what a tenant can do with it"
)

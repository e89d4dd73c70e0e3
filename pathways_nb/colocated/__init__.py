"""Colocated Python (``jax.experimental.colocated_python``): every part of it, in the process it runs in.

A tenant's function runs in an executor of its own beside the devices' worker (docs/design.md,
"Colocated Python"; user-facing: docs/colocated_python.md). The modules here are named for the
process their code runs in, as the package's folders are:

- ``proxy``: the program's proxy half, which checks a call and plans it (the proxy's compile pool);
- ``worker``: its host half, which hands a call to the session's executor (a worker's pool);

This package imports only the layers below the servers (``core``, ``protocol``, ``rpc``, errors), so
any server may import it.
"""

# The custom-call program type jax's colocated Python compiles.
PROGRAM_TYPE = "jax_colocated_python_v0.0.1"

OFF = (
    "colocated Python is off on this cluster: start it with --colocated_python "
    "(pathways_nb.LocalCluster(colocated_python=True), pathways-nb up --colocated_python); "
    "docs/colocated_python.md says what a tenant can do with it"
)

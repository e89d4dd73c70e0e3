"""Kernel state that jaxlib sets up only in the process that lowers a program.

A program that calls LAPACK (``jnp.linalg.solve``, ``cholesky``, ``inv``,
triangular solves, ...) is lowered to a custom call whose kernel reads function
pointers that ``jaxlib.lapack`` fills in *while lowering* (``_lapack.initialize()``).
Lowering happens in the client's process, never in a server's, so a server that
runs such a program with the pointers unset jumps to address 0 and dies with
SIGSEGV. GPU builds have the same kind of state for their hybrid (CPU-side)
eigen-solver kernels. A process that executes programs it did not lower calls
``prepare()`` once, before its first program runs (JAX's own ``jax.export``
deserializer does the same).
"""

from __future__ import annotations

import logging

_LOGGER = logging.getLogger(__name__)


def prepare() -> None:
    """Registers jaxlib's custom-call targets and initializes the kernels that lowering would have."""
    # Importing the module registers the LAPACK and GPU solver FFI targets with XLA.
    from jax._src.lax import linalg

    linalg.initialize_lapack()
    try:
        from jax._src.lib import gpu_solver
    except ImportError:  # a jaxlib without GPU plugins
        return
    if gpu_solver is not None:
        try:
            gpu_solver.initialize_hybrid_kernels()
        except Exception:  # a GPU build without its plugin installed
            _LOGGER.debug("no hybrid GPU solver kernels to initialize", exc_info=True)

"""Linear algebra (LAPACK custom calls) through the proxy and the cluster equals local JAX.

These programs call kernels whose state jaxlib sets up while lowering, which
happens in the client's process; a server that did not set it up itself died
with SIGSEGV on the first of them (see ``pathways_nb.worker.jaxlib_kernels``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
import numpy as np
import pytest

RNG = np.random.default_rng(7)
A = RNG.standard_normal((5, 5)).astype(np.float32)
SPD = (A @ A.T + 5 * np.eye(5)).astype(np.float32)
B = RNG.standard_normal((5, 3)).astype(np.float32)
C = (A + 1j * RNG.standard_normal((5, 5))).astype(np.complex64)

PROGRAMS = {
    "solve": lambda a, spd, b, c: jnp.linalg.solve(a, b),
    "solve_eye": lambda a, spd, b, c: jnp.linalg.solve(jnp.eye(3), jnp.ones(3)),
    "inv": lambda a, spd, b, c: jnp.linalg.inv(a),
    "det_slogdet": lambda a, spd, b, c: (jnp.linalg.det(a), *jnp.linalg.slogdet(a)),
    "cholesky": lambda a, spd, b, c: jnp.linalg.cholesky(spd),
    "cho_solve": lambda a, spd, b, c: jsl.cho_solve(jsl.cho_factor(spd), b),
    "qr": lambda a, spd, b, c: jnp.linalg.qr(a),
    "svd": lambda a, spd, b, c: jnp.linalg.svd(a),
    "eigh": lambda a, spd, b, c: jnp.linalg.eigh(spd),
    "eig": lambda a, spd, b, c: jnp.linalg.eig(a),
    "lstsq_pinv": lambda a, spd, b, c: (jnp.linalg.lstsq(a, b)[0], jnp.linalg.pinv(a)),
    "lu_and_lu_solve": lambda a, spd, b, c: (jsl.lu(a), jsl.lu_solve(jsl.lu_factor(a), b)),
    "solve_triangular": lambda a, spd, b, c: jsl.solve_triangular(jnp.triu(a) + 5 * jnp.eye(5), b),
    "schur_and_expm": lambda a, spd, b, c: (jsl.schur(a), jsl.expm(a / 4)),
    "tridiagonal_solve": lambda a, spd, b, c: jax.lax.linalg.tridiagonal_solve(
        jnp.concatenate([jnp.zeros(1), a[0, 1:]]), 4 + jnp.abs(a[1]), jnp.concatenate([a[2, :-1], jnp.zeros(1)]), b
    ),
    "complex_solve": lambda a, spd, b, c: jnp.linalg.solve(c, c @ jnp.ones(5, jnp.complex64)),
    "associative_scan": lambda a, spd, b, c: jax.lax.associative_scan(jnp.matmul, jnp.stack([a, spd, a.T]) / 10),
}


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_linalg_equals_local(both, name):
    program = jax.jit(PROGRAMS[name])
    both(lambda devices: program(*(jax.device_put(v, devices[0]) for v in (A, SPD, B, C))))

"""Semantics JAX's own tests rely on, through the proxy and a cluster (each once a failure of JAX's test slice)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax._src import core


def test_programs_make_take_and_return_tokens(both):
    def program(devices):
        x = jax.device_put(np.arange(8, dtype=np.int32), devices[0])
        made = jax.jit(jax.lax.create_token)(1.0)
        y, passed = jax.jit(lambda a, t: (a * 2, t))(x, made)
        captured = jax.jit(lambda a: (a + 2, made))(x)[1]
        for token in (made, passed, captured):
            assert isinstance(token, core.Token)
            token.block_until_ready()
            with pytest.raises(RuntimeError, match="Cannot convert a token-shape buffer to a numpy array"):
                np.asarray(token._buf)
        assert passed is not made
        return y

    both(program)

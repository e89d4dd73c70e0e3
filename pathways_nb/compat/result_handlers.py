"""Result handlers: how a worker turns an executable's raw outputs into ``jax.Array`` values."""

from __future__ import annotations

import functools


@functools.cache
def _takes_skip_checks() -> bool:
    """jaxlib <= 0.10 has a ``_skip_checks`` flag (its sharding checks repeat ours); 0.11 dropped it."""
    from jax._src.lib import xla_client as xc

    return "_skip_checks" in (xc.array_result_handler.__doc__ or "")


def array(aval, sharding):
    """A handler making committed arrays of ``aval`` laid out by ``sharding`` (a jax sharding)."""
    from jax._src.lib import xla_client as xc

    if _takes_skip_checks():
        return xc.array_result_handler(aval, sharding, committed=True, _skip_checks=True)
    return xc.array_result_handler(aval, sharding, committed=True)

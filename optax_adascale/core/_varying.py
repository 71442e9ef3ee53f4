"""Varying types across the two branches of a ``lax.cond`` under shard_map (micro-batch and accumulation loops)."""

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from optax_adascale.core._axes import varying_axes

Array = jax.Array


def match_varying(x: Any, like: Any) -> Any:
    """``lax.pcast`` each leaf of ``x`` to vary over the axes its twin in ``like`` varies over.

    Needed where the two branches of a ``lax.cond`` under shard_map return a
    per-replica value from one branch and a fresh (unvarying) one from the
    other. A no-op under pmap, vmap and ``check_vma=False``.
    """

    def cast(a, b):
        missing = varying_axes(b) - varying_axes(a)
        if not missing:
            return a
        return lax.pcast(a, tuple(sorted(missing)), to="varying")

    return jax.tree.map(cast, x, like)


def fresh_zeros(x: Any, dtype: Any = None) -> Array:
    """Zeros with ``x``'s shape and sharding (and dtype unless given), replica-invariant."""
    return jnp.zeros(x.shape, x.dtype if dtype is None else dtype, out_sharding=jax.typeof(x).sharding)

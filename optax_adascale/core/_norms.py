"""Squared norms in float32: the one numeric convention every statistic follows.

A leaf is scaled and accumulated in float32 (complex64) or wider, squared *after* the upcast so that
float16/bfloat16 values cannot overflow; 16-bit floats are divided by ``n`` before a sum over samples.
No named axes here (those are :mod:`._collect`'s).
"""

from typing import Any

import jax
import jax.numpy as jnp

Array = jax.Array
STAT_DTYPE = jnp.float32


def compute_dtype(dtype: Any) -> Any:
    """Dtype a leaf is scaled and accumulated in: float32/complex64 or wider."""
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return jnp.promote_types(dtype, jnp.complex64)
    return dtype if jnp.finfo(dtype).bits > 32 else jnp.dtype(STAT_DTYPE)


def leaf_sq_norm(x: Array) -> Array:
    """``‖x‖² = Σ|x|²`` in float32, squared after the upcast so f16/bf16 cannot overflow."""
    x = x.astype(compute_dtype(x.dtype))
    if jnp.iscomplexobj(x):
        sq = jnp.real(x) * jnp.real(x) + jnp.imag(x) * jnp.imag(x)
    else:
        sq = x * x
    return jnp.sum(sq).astype(STAT_DTYPE)


def low_precision(x: Array) -> bool:
    """16-bit floats: divided by ``n`` before a sum so that values near their maximum cannot overflow."""
    return jnp.issubdtype(x.dtype, jnp.floating) and jnp.finfo(x.dtype).bits <= 16

"""Squared norms in float32: the one numeric convention every statistic follows.

A leaf is scaled and accumulated in float32 (complex64) or wider, squared *after* the upcast so that
float16/bfloat16 values cannot overflow; 16-bit floats are divided by ``n`` before a sum over samples.
No named axes here (those are :mod:`._collect`'s).
"""

from collections.abc import Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from optax_adascale import _compat

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


# A leaf of at most this many elements shares one reduction with the other small leaves of its key.
SMALL_LEAF = 1 << 16


def fused_sq_norms(leaves: Sequence[Array], keys: Sequence[Hashable]) -> list[Array]:
    """Per-leaf float32 values whose sum over the leaves of one key is their ``Σ‖x‖²``, in few reductions.

    A model with many small leaves (biases, normalisation scales, small kernels) would run one reduction per
    leaf. Here the small leaves (at most :data:`SMALL_LEAF` elements) of one key and compute dtype are
    concatenated and reduced once, their total carried by the first of them and 0 by the others; a larger
    leaf is reduced alone (its own pass, no copy). Exact up to float32 summation order, for every consumer
    that only sums the values of a key (the groups' and model axes' sums: the key is both).
    """
    out: list[Array | None] = [None] * len(leaves)
    buckets: dict[Any, list[int]] = {}
    for i, (x, key) in enumerate(zip(leaves, keys, strict=True)):
        if jnp.size(x) > SMALL_LEAF:
            out[i] = leaf_sq_norm(x)
        else:  # shard_map's varying type too: concatenated values must share it
            buckets.setdefault((key, compute_dtype(jnp.result_type(x)), _compat.varying_axes(x)), []).append(i)
    for members in buckets.values():
        if len(members) == 1:
            out[members[0]] = leaf_sq_norm(leaves[members[0]])
            continue
        flat = jnp.concatenate([jnp.ravel(leaves[i].astype(compute_dtype(leaves[i].dtype))) for i in members])
        out[members[0]] = leaf_sq_norm(flat)
        for i in members[1:]:
            out[i] = jnp.zeros([], STAT_DTYPE)
    return out  # type: ignore[return-value]


def leaf_sq_norms(leaves: Sequence[Array]) -> list[Array]:
    """Each leaf's ``‖x‖²`` (float32, as :func:`leaf_sq_norm`), the small leaves in few reductions.

    Leaves of at most :data:`SMALL_LEAF` elements of one compute dtype and one size class (up to the next
    power of two) are padded to that width with zeros, stacked, and reduced along it together: one
    reduction per class instead of one per leaf (a micro-batch loop takes every leaf's norm per
    micro-batch). Larger leaves are reduced alone. Exact up to float32 summation order.
    """
    out: list[Array | None] = [None] * len(leaves)
    buckets: dict[Any, list[int]] = {}
    for i, x in enumerate(leaves):
        size = int(jnp.size(x))
        if size > SMALL_LEAF or size <= 1:
            out[i] = leaf_sq_norm(x)
            continue
        width = 1 << (size - 1).bit_length()
        # shard_map's varying type too: stacked values must share it
        buckets.setdefault((compute_dtype(jnp.result_type(x)), width, _compat.varying_axes(x)), []).append(i)
    for (dtype, width, _), members in buckets.items():
        if len(members) == 1:
            out[members[0]] = leaf_sq_norm(leaves[members[0]])
            continue
        rows = jnp.stack(
            [jnp.pad(jnp.ravel(leaves[i].astype(dtype)), (0, width - int(jnp.size(leaves[i])))) for i in members]
        )
        if jnp.iscomplexobj(rows):
            sq = jnp.real(rows) * jnp.real(rows) + jnp.imag(rows) * jnp.imag(rows)
        else:
            sq = rows * rows
        sums = jnp.sum(sq, axis=1).astype(STAT_DTYPE)
        for j, i in enumerate(members):
            out[i] = sums[j]
    return out  # type: ignore[return-value]


def leaf_dots(pairs: Sequence[tuple[Array, Array]]) -> list[Array]:
    """``Re Σ x·conj(y)`` of each pair (float32, computed in the pair's compute dtype), each in its own fused
    multiply-reduce. Not stacked as :func:`leaf_sq_norms` stacks small leaves: the τ clock's guard, its one caller,
    reads state buffers whose stacked copies would cost memory (13 % of the drop-in's step on
    ``tests/gspmd/test_cost.py``'s MLP)."""
    out = []
    for x, y in pairs:
        dtype = compute_dtype(jnp.promote_types(jnp.result_type(x), jnp.result_type(y)))
        x, y = x.astype(dtype), y.astype(dtype)
        products = jnp.real(x) * jnp.real(y) + jnp.imag(x) * jnp.imag(y) if jnp.iscomplexobj(x) else x * y
        out.append(jnp.sum(products).astype(STAT_DTYPE))
    return out


def gram_dots(arrays: Sequence[Array], pairs: Sequence[tuple[int, int]], axis: int | None = None) -> list[Array]:
    """``Σ x_i·x_j`` (float32) for each pair ``(i, j)`` of ``arrays`` (one shape, real), over ``axis`` (``None``: every
    element), in one variadic reduction: each array read once, however many pairs it is in (six separate
    multiply-reduces over three arrays read each three times)."""
    dtype = compute_dtype(jnp.result_type(*arrays))
    xs = [x.astype(dtype) if axis is not None else x.astype(dtype).reshape(-1) for x in arrays]
    products = [xs[i] * xs[j] for i, j in pairs]
    zero = jnp.zeros([], dtype)
    dims = (0,) if axis is None else (axis,)
    sums = jax.lax.reduce(products, [zero] * len(products), lambda a, b: [u + v for u, v in zip(a, b)], dims)
    return [x.astype(STAT_DTYPE) for x in sums]


def low_precision(x: Array) -> bool:
    """16-bit floats: divided by ``n`` before a sum so that values near their maximum cannot overflow."""
    return jnp.issubdtype(x.dtype, jnp.floating) and jnp.finfo(x.dtype).bits <= 16

"""A value's sharding type, read: its spec per dimension, the mesh axes it is split over, the axes it is ``reduced``
(a parameter's copy: the same numbers on each device, its cotangent a per-device partial) or ``unreduced`` (that
partial) over. Explicit types only; a value without a sharded type (a Python constant, a token) has none."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from optax_adascale import _compat


def spec_axes(entry: Any) -> tuple[str, ...]:
    """The mesh axes one ``PartitionSpec`` entry names."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def partitions(x: Any) -> tuple[Any, ...]:
    """``x``'s sharding spec as one entry per dimension (Explicit types; ``None`` where unsharded)."""
    aval = jax.typeof(x)
    spec = aval.sharding.spec
    parts = tuple(spec.partitions)
    return parts + (None,) * (aval.ndim - len(parts))


def _spec_of(x: Any) -> P | None:
    """``x``'s ``PartitionSpec``; ``None`` for a value without a sharded type (not an array or an array's
    description, a token)."""
    if not (is_array(x) or isinstance(x, jax.ShapeDtypeStruct)):
        return None
    return getattr(getattr(jax.typeof(x), "sharding", None), "spec", None)


def reduced_axes(x: Any) -> frozenset[str]:
    """The mesh axes ``x``'s type is ``reduced`` over (none for a value without a sharded type)."""
    return frozenset(getattr(_spec_of(x), "reduced", frozenset()))


def unreduced_axes(x: Any) -> frozenset[str]:
    """The mesh axes ``x``'s type is ``unreduced`` over: a partial sum on each device."""
    return frozenset(getattr(_spec_of(x), "unreduced", frozenset()))


def partial_spec(x: Any) -> P:
    """``x``'s spec with one entry per dimension and its ``unreduced`` axes: how a ``shard_map`` reads a partial."""
    return P(*partitions(x), unreduced=unreduced_axes(x))


def axes_of(x: Any) -> frozenset[str]:
    """The mesh axes an array's dimensions are split over (none for a scalar or a non-array)."""
    if not hasattr(x, "shape") or not jnp.ndim(x):
        return frozenset()
    return frozenset(a for e in partitions(x) for a in spec_axes(e))


def strip(entry: Any, axes: frozenset[str]) -> Any:
    """A spec entry without ``axes``."""
    kept = tuple(a for a in spec_axes(entry) if a not in axes)
    return None if not kept else kept[0] if len(kept) == 1 else kept


def plain(x: Any) -> Any:
    """A ``reduced`` value as a plain one (forward only: the same numbers on every device); others as they are."""
    return jax.reshard(x, P(*partitions(x))) if reduced_axes(x) else x


def is_array(x: Any) -> bool:
    """A value with a shape and a sharded type (a traced array), not a Python constant or an opaque leaf."""
    return isinstance(x, jax.Array) or _compat.is_tracer(x)

"""A parameter's per-copy values as arrays: each data shard's ``unreduced`` partial stacked on a leading axis of
size ``shards`` and back (``stack``, ``unstack``, ``Stacked`` for the per-shard ``vmap``), a ``reduced`` value as
one copy per device (``copies``, for a ``shard_map`` manual over the data axes), and an output made ``reduced``
over the row axes (``as_reduced``); a data shard's partial moved between the data axes and the other row axes
(``data_partial``, ``spread_partial``, ``fill_partial``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from optax_adascale.gspmd import _types
from optax_adascale.gspmd._layout import Layout


@dataclasses.dataclass
class Stacked:
    """A value as the per-shard ``vmap`` sees it: stacked on a leading axis of size ``shards``, or whole."""

    value: Any
    stacked: bool
    dim: int = -1
    like: Any = None

    @classmethod
    def of(cls, layout: Layout, x: Any) -> Stacked:
        data = frozenset(layout.data)
        if not hasattr(x, "shape"):
            return cls(x, False)
        if _types.unreduced_axes(x) & data:  # each shard's partial
            return cls(stack_partials(layout, x), True, like=x)
        if not jnp.ndim(x):
            return cls(x, False)
        parts = _types.partitions(x)
        for d, entry in enumerate(parts):
            axes = _types.spec_axes(entry)
            if axes[: len(layout.data)] == layout.data:
                rest = axes[len(layout.data) :]
                shape = x.shape[:d] + (layout.shards, x.shape[d] // layout.shards) + x.shape[d + 1 :]
                spec = (*parts[:d], layout.data_spec, (rest[0] if len(rest) == 1 else rest) or None, *parts[d + 1 :])
                y = x.reshape(shape, out_sharding=P(*spec))
                return cls(jnp.moveaxis(y, d, 0), True, d, x)
            if data & set(axes):
                raise ValueError(
                    f"value_and_grad(data_axes={layout.data_spec!r}): an operand sharded {P(*parts)} splits the data "
                    "axes in an order the drop-in cannot take apart per shard; shard the batch dimension over the "
                    "data axes first (in mesh order)."
                )
        return cls(x, False)

    def unstack(self, g: Any) -> Any:
        """Per-shard cotangents ``(shards, ...)`` back into the rows of the original operand."""
        y = jnp.moveaxis(g, 0, self.dim)
        shape = self.like.shape
        return y.reshape(shape, out_sharding=P(*_types.partitions(self.like)))


def copies(layout: Layout, x: Any, axes: frozenset[str]) -> tuple[Any, Any]:
    """A ``reduced`` value as its copies stacked on a new leading axis split over ``axes`` (one block per device
    along them), and that axis's spec entry. The cotangent of the stack, each device's own, comes back as the
    value's ``unreduced`` partial."""
    order = tuple(a for a in layout.axis_names if a in axes)
    entry = order[0] if len(order) == 1 else order
    n = int(np.prod([layout.size(a) for a in order]))
    parts = _types.partitions(x)
    reduced = _types.reduced_axes(x)

    @jax.custom_vjp
    def stack(v):
        plain = _types.plain(v)
        return jax.reshard(jnp.broadcast_to(plain[None], (n, *plain.shape)), P(entry, *parts))

    def fwd(v):
        return stack(v), None

    def bwd(_, ct):
        u = jax.shard_map(
            lambda b: b[0],
            mesh=layout.mesh,
            in_specs=P(entry, *parts),
            out_specs=P(*parts, unreduced=frozenset(order)),
            check_vma=False,
        )(ct)
        return (fill_partial(layout, u, reduced - frozenset(order)),)

    stack.defvjp(fwd, bwd)
    return stack(x), entry


def stack_partials(layout: Layout, u: Any) -> Any:
    """An ``unreduced`` array as ``(shards, *shape)``, row ``i`` data shard ``i``'s partial."""
    spec_out = P(layout.data_spec, *(_types.strip(e, frozenset(layout.data)) for e in _types.partitions(u)))
    return jax.shard_map(
        lambda b: b[None], mesh=layout.mesh, in_specs=_types.partial_spec(u), out_specs=spec_out, check_vma=False
    )(u)


def unstack_partials(layout: Layout, st: Any, like: Any) -> Any:
    """``(shards, *shape)`` rows back into one ``unreduced`` array typed like ``like`` (over the other axes)."""
    parts = _types.partitions(like)
    data = frozenset(layout.data)
    spec_in = P(layout.data_spec, *(_types.strip(e, data) for e in parts))
    return jax.shard_map(
        lambda b: b[0], mesh=layout.mesh, in_specs=spec_in, out_specs=P(*parts, unreduced=data), check_vma=False
    )(st)


def as_reduced(x: Any, rows: frozenset[str]) -> Any:
    """A floating output replicated over the row axes as ``reduced`` over them (its cotangent stays each copy's)."""
    if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.inexact) and not rows & _types.axes_of(x):
        return jax.reshard(x, P(*_types.partitions(x), reduced=rows))
    return x


def data_partial(layout: Layout, u: Any) -> Any:
    """A partial ``unreduced`` over the data axes and :attr:`Layout.extra`: summed over the extra axes, so that each
    data shard's partial (its sample) is what each device holds."""
    over = _types.unreduced_axes(u)
    if not over & frozenset(layout.extra):
        return u
    return jax.reshard(u, P(*_types.partitions(u), unreduced=over & frozenset(layout.data)))


def spread_partial(layout: Layout, u: Any, like_reduced: frozenset[str]) -> Any:
    """A data-shard partial (``unreduced`` over the data axes) as the cotangent of a value ``reduced`` over
    ``like_reduced`` (some of :attr:`Layout.extra` too): the same sum, held by index 0 of the extra axes."""
    return fill_partial(layout, u, like_reduced & frozenset(layout.extra))


def fill_partial(layout: Layout, u: Any, axes: frozenset[str]) -> Any:
    """``u`` ``unreduced`` over ``axes`` too, with the same sum: held by index 0 along them, zeros elsewhere."""
    axes = axes - _types.unreduced_axes(u)
    if not axes:
        return u
    parts = _types.partitions(u)
    first = tuple(axes)

    def body(b):
        keep = jnp.all(jnp.stack([jax.lax.axis_index(a) == 0 for a in first]))
        return jnp.where(keep, b, jnp.zeros_like(b))

    return jax.shard_map(
        body,
        mesh=layout.mesh,
        in_specs=P(*parts, unreduced=_types.unreduced_axes(u)),
        out_specs=P(*parts, unreduced=_types.unreduced_axes(u) | axes),
        check_vma=False,
    )(u)

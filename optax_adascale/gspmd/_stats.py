"""Each device's statistics: mesh-shaped float32 arrays, element ``[i, j, ...]`` device ``(i, j, ...)``'s local
``Σ|x|²`` of its block of a gradient.

:func:`local_sq` makes one (a ``shard_map`` over every mesh axis that reads each device's block, no collective),
masked by a constant so that the sum over the devices counts every distinct piece once: every data axis for a
per-copy partial (each data shard holds its own), the axes the leaf is split over for the rest, index 0 along any
axis it is replicated over. :func:`totals` sums the stacked arrays of every leaf in one all-reduce of a few floats.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from optax_adascale.core._norms import STAT_DTYPE
from optax_adascale.gspmd._layout import Layout
from optax_adascale.gspmd._types import spec_axes


def local_sqs(layout: Layout, items: list[tuple[Any, P, bool]]) -> jax.Array:
    """Every device's local ``Σ|x|²`` of several arrays in one ``shard_map``, masked as :func:`local_sq` does:
    a ``(len(items), *mesh)`` float32 array (the masks are constants: one multiply for all of them)."""
    rank = len(layout.axis_names)
    if not items:
        return jnp.zeros((0,) + layout.axis_sizes, STAT_DTYPE)

    def body(*blocks):
        out = []
        for block in blocks:
            v = block.astype(jnp.promote_types(block.dtype, STAT_DTYPE))
            sq = jnp.real(v * jnp.conj(v)) if jnp.iscomplexobj(v) else v * v
            out.append(jnp.sum(sq).astype(STAT_DTYPE))
        return jnp.stack(out).reshape((len(out),) + (1,) * rank)

    stacked = jax.shard_map(
        body,
        mesh=layout.mesh,
        in_specs=tuple(spec for _, spec, _ in items),
        out_specs=P(None, *layout.axis_names),
        check_vma=False,
    )(*(x for x, _, _ in items))
    masks = np.stack([_np_mask(layout, _counted(layout, spec, per_copy)) for _, spec, per_copy in items])
    return stacked * masks


def _counted(layout: Layout, spec: P, per_copy: bool) -> frozenset[str]:
    split = frozenset(a for entry in spec.partitions for a in spec_axes(entry))
    return split | (frozenset(layout.data) if per_copy else frozenset())


def _np_mask(layout: Layout, counted: frozenset[str]) -> np.ndarray:
    """1 where every axis outside ``counted`` is at index 0, else 0: one copy of each piece (a constant)."""
    mask = np.ones(layout.axis_sizes, np.float32)
    for d, axis in enumerate(layout.axis_names):
        if axis not in counted:
            index = [slice(None)] * len(layout.axis_sizes)
            index[d] = slice(1, None)
            mask[tuple(index)] = 0.0
    return mask


def local_sq(layout: Layout, x: Any, spec: P, per_copy: bool) -> jax.Array:
    """The mesh-shaped array of each device's local ``Σ|x|²`` (float32) of ``x`` typed ``spec``, masked so that
    its sum over the devices counts every distinct piece once.

    A device's block is a piece of a leaf split over the axes ``spec`` names; along any other axis the
    devices hold copies, of which only index 0 counts, except that a per-copy partial (``per_copy``,
    ``spec`` unreduced over the data axes) differs on every data shard: all of them count.
    """

    def body(block):
        v = block.astype(jnp.promote_types(block.dtype, STAT_DTYPE))
        sq = jnp.real(v * jnp.conj(v)) if jnp.iscomplexobj(v) else v * v
        return jnp.sum(sq).astype(STAT_DTYPE).reshape((1,) * len(layout.axis_names))

    sq = jax.shard_map(body, mesh=layout.mesh, in_specs=spec, out_specs=layout.mesh_spec(), check_vma=False)(x)
    return sq * _np_mask(layout, _counted(layout, spec, per_copy))


def totals(layout: Layout, stacked: jax.Array) -> jax.Array:
    """``Σ_devices`` of a ``(m, *mesh)`` array of per-device values: one all-reduce of ``m`` floats over every
    device (a ``psum`` over all mesh axes at once, where a sum over the array's dimensions is one per axis)."""
    axes = layout.axis_names

    def body(local):
        return jax.lax.psum(local.reshape(local.shape[0]), axes)

    return jax.shard_map(body, mesh=layout.mesh, in_specs=P(None, *axes), out_specs=P(), check_vma=False)(stacked)

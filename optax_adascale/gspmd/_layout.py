"""Where the drop-in's numbers live on the mesh: axis kinds, values' sharding types, per-device statistics.

Statistics are kept as *mesh-shaped* float32 arrays: element ``[i, j, ...]`` is device
``(i, j, ...)``'s local ``Σ x²`` of its block of a gradient. :func:`local_sq` makes one (a
``shard_map`` over every mesh axis that reads each device's block, no collective), and
:func:`total` sums a leaf's array over the devices that hold *different* pieces: every data
axis for a per-copy partial (each data shard holds its own), the axes the leaf is split over
for the rest, index 0 along any axis it is replicated over. Summing the stacked arrays of
every leaf is one all-reduce of a few floats.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from optax_adascale import _compat
from optax_adascale.core._norms import STAT_DTYPE


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


@dataclasses.dataclass(frozen=True)
class Layout:
    """The static facts of one call: the mesh, the data axes, the samples.

    Attributes:
      axis_names, axis_sizes: the mesh's axes, in mesh order.
      data: the data axes (``data_axes``), in mesh order.
      shards: data shards, ``∏`` of the data axes' sizes.
      k: micro-batches per shard.
      mesh: the concrete mesh when passed as ``mesh=`` (else ``None``: the context's).
      extra: mesh axes the batch is split over besides the data axes (a sequence axis; HSDP's ``fsdp`` when
        ``data_axes`` names ``data`` alone). A parameter's copy is ``reduced`` over every axis its rows are split
        over (:attr:`rows`), so its partials are ``unreduced`` over them; the samples are the data shards, whose
        partials sum those over the extra axes (:func:`data_partial`).
      convert: the mesh axes made Explicit for a loss traced with them Auto (``_drop_in._converted``).
    """

    axis_names: tuple[str, ...]
    axis_sizes: tuple[int, ...]
    data: tuple[str, ...]
    k: int
    mesh: Any = None
    extra: tuple[str, ...] = ()
    convert: frozenset[str] = frozenset()

    @classmethod
    def of(cls, mesh: Any, names: tuple[str, ...], k: int, given: Any = None) -> Layout:
        """``given``: the ``mesh=`` argument; a concrete mesh passed that way is named in every ``shard_map``
        (no mesh set around the jit: it tells JAX the devices)."""
        order = tuple(mesh.axis_names)
        data = tuple(a for a in order if a in names)
        concrete = given if isinstance(given, jax.sharding.Mesh) else None
        return cls(order, tuple(mesh.shape[a] for a in order), data, k, concrete)

    @property
    def shards(self) -> int:
        return math.prod(self.size(a) for a in self.data)

    @property
    def n(self) -> int:
        return self.shards * self.k

    def size(self, axis: str) -> int:
        return self.axis_sizes[self.axis_names.index(axis)]

    @property
    def data_spec(self) -> Any:
        """The batch dimension's spec entry: the data axes."""
        return self.data[0] if len(self.data) == 1 else self.data

    def mesh_spec(self) -> P:
        """The spec of a mesh-shaped array of per-device values: one dimension per mesh axis."""
        return P(*self.axis_names)

    @property
    def rows(self) -> frozenset[str]:
        """Every mesh axis the batch's rows are split over: the data axes and :attr:`extra`."""
        return frozenset(self.data) | frozenset(self.extra)

    def with_batch(self, args: Any) -> Layout:
        """This layout with :attr:`extra` read off the batch: the axes its leaves (those sharded over the data
        axes on their first dimension) are split over besides the data axes."""
        data = set(self.data)
        extra: set[str] = set()
        for x in jax.tree.leaves(args):
            if hasattr(x, "shape") and jnp.ndim(x) and data <= set(spec_axes(partitions(x)[0])):
                extra |= {a for e in partitions(x) for a in spec_axes(e)}
        ordered = tuple(a for a in self.axis_names if a in extra - data and self.size(a) > 1)
        return dataclasses.replace(self, extra=ordered)


def data_partial(layout: Layout, u: Any) -> Any:
    """A partial ``unreduced`` over the data axes and :attr:`Layout.extra`: summed over the extra axes, so that each
    data shard's partial (its sample) is what each device holds."""
    over = unreduced_axes(u)
    if not over & frozenset(layout.extra):
        return u
    return jax.reshard(u, P(*partitions(u), unreduced=over & frozenset(layout.data)))


def spread_partial(layout: Layout, u: Any, like_reduced: frozenset[str]) -> Any:
    """A data-shard partial (``unreduced`` over the data axes) as the cotangent of a value ``reduced`` over
    ``like_reduced`` (some of :attr:`Layout.extra` too): the same sum, held by index 0 of the extra axes."""
    return fill_partial(layout, u, like_reduced & frozenset(layout.extra))


def fill_partial(layout: Layout, u: Any, axes: frozenset[str]) -> Any:
    """``u`` ``unreduced`` over ``axes`` too, with the same sum: held by index 0 along them, zeros elsewhere."""
    axes = axes - unreduced_axes(u)
    if not axes:
        return u
    parts = partitions(u)
    first = tuple(axes)

    def body(b):
        keep = jnp.all(jnp.stack([jax.lax.axis_index(a) == 0 for a in first]))
        return jnp.where(keep, b, jnp.zeros_like(b))

    return jax.shard_map(
        body,
        mesh=layout.mesh,
        in_specs=P(*parts, unreduced=unreduced_axes(u)),
        out_specs=P(*parts, unreduced=unreduced_axes(u) | axes),
        check_vma=False,
    )(u)


def specs_like(given: Any, tree: Any, layout: Layout, name: str = "param_specs") -> list[P]:
    """``given`` (``PartitionSpec``\\ s or ``NamedSharding``\\ s, a pytree prefix of ``tree``) as one spec per leaf
    of ``tree``, checked against the mesh and the leaves' ranks."""
    is_spec = lambda x: x is None or isinstance(x, (P, jax.sharding.NamedSharding))  # noqa: E731
    leaves, treedef = jax.tree.flatten(tree)
    try:
        flat = broadcast_prefix(given, tree, is_spec)
    except (ValueError, TypeError) as err:
        spec_tree = jax.tree.structure(given, is_leaf=is_spec)
        what = "params" if name == "param_specs" else "the arguments after params"
        raise ValueError(
            f"{name} must be a pytree like {what} with one PartitionSpec per leaf (or per subtree): got {spec_tree} "
            f"for {treedef}."
        ) from err
    out = []
    for x, spec in zip(leaves, flat, strict=True):
        if isinstance(spec, jax.sharding.NamedSharding):
            spec = spec.spec
        if spec is None:
            spec = P()
        if not isinstance(spec, P):
            raise TypeError(f"{name} leaves must be PartitionSpecs or NamedShardings, got {spec!r}")
        parts = tuple(spec) + (None,) * (jnp.ndim(x) - len(spec))
        unknown = [a for e in parts for a in spec_axes(e) if a not in layout.axis_names]
        if len(parts) > jnp.ndim(x) or unknown:
            raise ValueError(
                f"{name}: {spec} does not fit an array of shape {tuple(jnp.shape(x))} on the mesh with axes "
                f"{layout.axis_names}."
            )
        out.append(P(*parts))
    return out


class _Group(tuple):
    """One prefix leaf's copies, one per leaf of the subtree it covers (a tuple JAX does not flatten into)."""


def broadcast_prefix(prefix: Any, tree: Any, is_leaf) -> list[Any]:
    """One entry of ``prefix`` (a pytree prefix of ``tree``; ``is_leaf`` says what its leaves are) per leaf of
    ``tree``, in ``tree``'s flattening order."""
    groups = jax.tree.map(lambda s, sub: _Group([s] * len(jax.tree.leaves(sub))), prefix, tree, is_leaf=is_leaf)
    return [s for group in jax.tree.leaves(groups, is_leaf=lambda x: isinstance(x, _Group)) for s in group]


def param_specs_like(param_specs: Any, params: Any, layout: Layout) -> list[P] | None:
    """``param_specs`` as one spec per leaf of ``params``; ``None`` if not given."""
    return None if param_specs is None else specs_like(param_specs, params, layout)


def check_specs_agree(specs: list[P], params: Any) -> None:
    """On Explicit axes the parameters' types carry their layout: ``param_specs`` must say the same."""
    for i, (spec, x) in enumerate(zip(specs, jax.tree.leaves(params), strict=True)):
        if tuple(spec) != partitions(x):
            raise ValueError(
                f"param_specs: leaf {i} is typed {P(*partitions(x))} on this mesh of Explicit axes, but param_specs "
                f"says {spec}. On Explicit axes the parameters' types are their layout; give the specs they are "
                "placed with, or leave param_specs out."
            )


def auto_axes(mesh: Any) -> tuple[str, ...]:
    return tuple(a for a, t in zip(mesh.axis_names, mesh.axis_types, strict=True) if t != AxisType.Explicit)


def auto_sharding(v: Any) -> bool:
    """A sharding parameter naming a mesh with Auto axes (a loss traced on such a mesh): dropped when re-bound."""
    mesh = getattr(v, "mesh", None)
    return isinstance(v, jax.sharding.NamedSharding) and mesh is not None and bool(auto_axes(mesh))


def bind(layout: Layout, eqn: Any, invals: list[Any], params: dict[str, Any] | None = None) -> Any:
    """``eqn`` bound to ``invals`` as traced (``_compat.bind``); traced on the Auto mesh (:attr:`Layout.convert`),
    under the Explicit context instead of its own and without the shardings that name the Auto mesh."""
    if layout.convert:
        return _compat.bind(eqn, invals, params, context=False, drop=auto_sharding)
    return _compat.bind(eqn, invals, params)


def is_array(x: Any) -> bool:
    """A value with a shape and a sharded type (a traced array), not a Python constant or an opaque leaf."""
    return isinstance(x, jax.Array) or hasattr(x, "aval")


# --------------------------------------------------------------------------- per-device statistics


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

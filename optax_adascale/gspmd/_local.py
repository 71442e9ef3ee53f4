"""Per copy, where JAX's own types do not keep a parameter's copies (``reduced``) apart: two class rules.

:func:`by_rows` (an elementwise equation of a copy and the rows, ``x * scale``, ``h + b``, which JAX's types refuse):
the rows' dimension split into (data shards, rows per shard) and each shard's copy put along the first, so that the
equation runs as JAX's own on plain operands, its transpose summing each shard's rows into that shard's copy.

:func:`local` (every other equation on a copy that JAX's types do not carry: a product of copies, a convolution,
a copy with constants): forward on the plain values (the same numbers on every device), backward the equation's own
VJP applied to each device's partial cotangent, on its own rows (a ``shard_map`` manual over the data axes), or
``vmap``\\ ped over the stacked shards where an operand is split over a model axis too. With the rows, that needs the
equation local to them (``_rows.mixes`` for its class); otherwise a ``ValueError`` says how to write that step.

:func:`by_groups` (a grouped contraction of the rows and a copy, ``lax.ragged_dot(tokens, experts, group_sizes)``):
its groups index the whole batch's rows, so each device's rows are run with its own copy and its own groups' sizes
(the overlap of each group with its block of rows) in a ``shard_map`` manual over every axis; its transpose gives
each device's partial.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from optax_adascale import _compat
from optax_adascale.gspmd import _copies, _rebind, _rows, _types
from optax_adascale.gspmd._layout import Layout
from optax_adascale.gspmd._table import Kind


def local(layout: Layout, kind: Kind, eqn, invals, forward=None):
    """``eqn`` on plain values; its VJP applied to each device's partial cotangent (see the module docstring).

    With only ``reduced`` (replicated) inputs the outputs stay ``reduced``; with an input sharded over the data
    axes the equation must be local to the rows (its outputs sharded over them too). ``forward``: how ``eqn`` runs
    on the plain values (default: bound as traced; a lookup on a converted Auto mesh: GSPMD's, ``_auto``); the
    backward pass is the equation's own VJP per data shard either way.
    """
    forward = forward or (lambda xs: _rebind.rebind(layout, eqn, xs))
    data = frozenset(layout.data)
    red = [bool(_types.reduced_axes(x)) for x in invals]
    mixing = any(not r and data & _types.axes_of(x) for x, r in zip(invals, red, strict=True))
    if mixing:  # each shard's rows alone must give the equation's own result: nothing may mix rows
        rows = [_row_dims(x, data) if hasattr(x, "shape") and not r else frozenset() for x, r in zip(invals, red)]
        mixed = _rows.mixes(kind, eqn, rows)
        if mixed:
            raise ValueError(_not_local(eqn, mixed))
    if not any(r and jnp.issubdtype(x.dtype, jnp.inexact) for x, r in zip(invals, red, strict=True)):
        plain_out = forward([_types.plain(x) if r else x for x, r in zip(invals, red, strict=True)])
        outs = list(plain_out) if _compat.multiple_results(eqn) else [plain_out]
    else:  # JAX never differentiates the forward itself (its JVP rule may need shardings it cannot infer)
        outs = _LocalVJP(layout, kind, eqn, red, keep_reduced=not mixing, forward=forward)(*invals)
    if mixing and any(isinstance(o, jax.Array) and jnp.ndim(o) and not data <= _types.axes_of(o) for o in outs):
        raise ValueError(_not_local(eqn, "its output is not sharded over the data axes"))
    return outs if _compat.multiple_results(eqn) else outs[0]


def by_rows(layout: Layout, eqn, invals) -> Any:
    """An elementwise equation of a copy and the rows, each shard's copy along the rows (the module docstring);
    ``None`` where the layout does not split that way: rows over more than the data axes, along more than one
    dimension or not over the data axes alone, or a copy with more than one row along the rows' dimension (those
    take :func:`local`)."""
    if _compat.multiple_results(eqn) or layout.extra:
        return None
    out_shape = tuple(_compat.traced_type(_compat.outputs(eqn)[0]).shape)
    data = frozenset(layout.data)
    arrays = [x for x in invals if hasattr(x, "shape") and jnp.ndim(x)]
    dims = {
        d
        for x in arrays
        if not _types.reduced_axes(x)
        for d, e in enumerate(_types.partitions(x))
        if data & set(_types.spec_axes(e))
    }
    if not out_shape or len(dims) != 1 or any(jnp.ndim(x) != len(out_shape) for x in arrays):
        return None
    (d,) = dims
    for x in arrays:
        if _types.reduced_axes(x) and x.shape[d] != 1:
            return None
        if not _types.reduced_axes(x) and x.shape[d] != 1 and _types.spec_axes(_types.partitions(x)[d]) != layout.data:
            return None
    n, entry = layout.shards, layout.data_spec

    def split(x):
        if not hasattr(x, "shape") or not (jnp.ndim(x) or _types.reduced_axes(x)):
            return x
        if not jnp.ndim(x):  # a scalar copy: one element along every dimension
            x = x.reshape((1,) * len(out_shape))
        parts = _types.partitions(x)
        if _types.reduced_axes(x):
            stack, _ = _copies.copies(layout, x, data)  # (n, *x.shape), a copy per data shard
            stack = jnp.moveaxis(stack, 0, d)  # (.., n, 1, ..): dim d + 1 is x's own size-1 dimension
            shape, spec = x.shape[:d] + (n, 1) + x.shape[d + 1 :], (*parts[:d], entry, None, *parts[d + 1 :])
            return stack.reshape(shape, out_sharding=P(*spec))
        if x.shape[d] == 1:
            shape, spec = x.shape[:d] + (1, 1) + x.shape[d + 1 :], (*parts[:d], None, None, *parts[d + 1 :])
        else:
            shape, spec = (
                x.shape[:d] + (n, x.shape[d] // n) + x.shape[d + 1 :],
                (*parts[:d], entry, None, *parts[d + 1 :]),
            )
        return x.reshape(shape, out_sharding=P(*spec))

    out = _rebind.rebind(layout, eqn, [split(x) for x in invals])
    parts = _types.partitions(out)
    return out.reshape(out_shape, out_sharding=P(*parts[:d], entry, *parts[d + 2 :]))


def by_groups(layout: Layout, eqn, invals) -> Any:
    """A grouped contraction (``ragged_dot_general``) of the rows (its lhs, split over the data axes along its
    ragged dimension) and a copy (its rhs): each device's rows with its own copy and its groups' sizes (the module
    docstring). Any other layout is refused with our ``ValueError`` naming the one it takes."""
    lhs, rhs, sizes = invals
    data = frozenset(layout.data)
    dims = _compat.ragged_dims(eqn)
    lhs_parts, rhs_parts = _types.partitions(lhs), _types.partitions(rhs)
    free = [d for d in range(jnp.ndim(lhs)) if d not in dims.contracting and d not in dims.batch]
    takes = (
        not dims.offset
        and not dims.batch
        and not layout.extra
        and dims.ragged in free
        and bool(_types.reduced_axes(rhs))
        and not _types.reduced_axes(lhs)
        and _types.spec_axes(lhs_parts[dims.ragged]) == layout.data
        and all(e is None for d, e in enumerate(lhs_parts) if d != dims.ragged)
        and all(e is None for d, e in enumerate(rhs_parts) if d not in dims.rhs_free)
        and not (_types.axes_of(rhs) & data)
    )
    if not takes:
        raise ValueError(_not_grouped(eqn, lhs_parts, rhs_parts, layout))
    stacked, entry = _copies.copies(layout, rhs, data)
    sizes = jax.reshard(sizes, P()) if _types.axes_of(sizes) else sizes
    rows_per_device = lhs.shape[dims.ragged] // layout.shards
    out_spec = P(
        *(layout.data_spec if d == dims.ragged else None for d in free), *(rhs_parts[d] for d in dims.rhs_free)
    )
    sharding = lambda v: isinstance(v, (NamedSharding, P))  # noqa: E731

    def body(x, w, counts):
        start = lax.axis_index(layout.data) * rows_per_device
        ends = jnp.cumsum(counts)
        begins = ends - counts
        stop = start + rows_per_device
        own = jnp.clip(jnp.minimum(ends, stop) - jnp.maximum(begins, start), 0, None).astype(counts.dtype)
        return _compat.bind(eqn, [x, w[0], own], context=False, drop=sharding)

    return jax.shard_map(
        body,
        mesh=layout.mesh,
        in_specs=(P(*lhs_parts), P(entry, *rhs_parts), P()),
        out_specs=out_spec,
        axis_names=frozenset(layout.axis_names),
        check_vma=False,
    )(lhs, stacked, sizes)


def _not_grouped(eqn, lhs_parts, rhs_parts, layout: Layout) -> str:
    return (
        f"value_and_grad(data_axes={layout.data_spec!r}): loss_fn applies the grouped contraction "
        f"'{_compat.primitive_name(eqn)}' (lax.ragged_dot) to a parameter (sharded {P(*rhs_parts)}) and the batch's "
        f"rows (sharded {P(*lhs_parts)}). Its groups index the whole batch's rows, so the drop-in runs it on each "
        "device's rows with that device's own copy and its groups' sizes; that needs the lhs's ragged dimension "
        f"split over the data axes alone (P({layout.data_spec!r}, None)), its other dimensions whole, no batch "
        "dimension, no group_offset and the parameter not split over the data axes (gather an FSDP weight first: "
        "jax.reshard(w, P(...)) without the data axes). Lay the tokens out that way (jax.reshard(x, "
        f"P({layout.data_spec!r}, None))), or run the grouped matmul inside a jax.shard_map manual over the data "
        "axes, as MaxText's sparse MoE does."
    )


def copy_on_auto_axes(layout: Layout) -> str:
    return (
        f"value_and_grad(data_axes={layout.data_spec!r}): loss_fn casts a parameter to Auto axes "
        f"(jax.sharding.auto_axes) on this Explicit mesh. From JAX 0.12.1 ({jax.__version__} here) the cast's "
        "transpose returns the parameter's gradient whole on one device and zeros on the others: the gradient is "
        "right, but the per-copy statistics (each data shard's own gradient) would be wrong. Write that step the "
        f"Explicit way, without auto_axes: the operation with out_sharding=P({layout.data_spec!r}, None) where JAX "
        "asks for it (x.at[idx].get(out_sharding=...), jnp.einsum(..., out_sharding=...), lax.ragged_dot(..., "
        "out_sharding=...)); or build the mesh with Auto axes (jax.sharding.Mesh) and pass param_specs=, where the "
        "drop-in makes GSPMD's decisions itself."
    )


def grouped_on_auto_axes(layout: Layout) -> str:
    return (
        f"value_and_grad(data_axes={layout.data_spec!r}): loss_fn casts a parameter to Auto axes "
        "(jax.sharding.auto_axes) and applies a grouped matmul (lax.ragged_dot) to it there. JAX 0.10-0.12.0 "
        "transposes that matmul on Auto axes into wrong per-device partials for a parameter's copy "
        "(jax.value_and_grad of the same loss with the parameter typed reduced disagrees with it), so the gradient "
        "and the statistics would be wrong. Call lax.ragged_dot(tokens, experts, group_sizes, "
        f"out_sharding=P({layout.data_spec!r}, None)) on the Explicit mesh instead, without auto_axes: the drop-in "
        "runs it on each device's rows, exactly (on an Explicit mesh JAX itself cannot differentiate it)."
    )


def _row_dims(x: Any, data: frozenset[str]) -> frozenset[int]:
    """The dimensions of ``x`` split over the data axes: they index rows of the batch."""
    return frozenset(d for d, e in enumerate(_types.partitions(x)) if data & set(_types.spec_axes(e)))


def _not_local(eqn, why: str) -> str:
    return (
        f"value_and_grad(data_axes=...) cannot take per-copy statistics through the operation "
        f"'{_compat.primitive_name(eqn)}' of loss_fn: JAX has no rule for it on parameters typed reduced over the data "
        f"axes, and it is not local to the rows ({why}), so running it on each data shard's rows would change it. "
        "Write this step of the loss so that a parameter meets the batch in a row-local operation (a matmul, an "
        "elementwise op, an embedding lookup), or keep the parameter out of the step that mixes the rows."
    )


class _LocalVJP:
    """``eqn`` as a ``custom_vjp``: forward on the plain values, backward the equation's own VJP per data shard.

    The backward pass stacks every per-shard value on a leading axis of size ``shards`` (a data-sharded operand
    or cotangent: its rows split; an ``unreduced`` cotangent: each shard's partial) and runs the equation's VJP on
    each device's block (:func:`_per_device_vjp`) or, where a value is split over a model axis too, ``vmap``\\ s it
    over that axis (:func:`_per_shard_vmap`). A ``reduced`` input's cotangents become its ``unreduced`` partial; a
    data-sharded input's go back in place; a replicated one's are summed.
    """

    def __init__(self, layout: Layout, kind: Kind, eqn, red, keep_reduced, forward):
        self.layout, self.kind, self.eqn, self.red, self.keep_reduced = layout, kind, eqn, red, keep_reduced
        self.forward = forward

    def _forward(self, *xs):
        plain = [_types.plain(x) if r else x for x, r in zip(xs, self.red, strict=True)]
        outs = self.forward(plain)
        outs = list(outs) if _compat.multiple_results(self.eqn) else [outs]
        if self.keep_reduced:
            outs = [_copies.as_reduced(o, self.layout.rows) for o in outs]
        return tuple(outs), tuple(plain)

    def _vjp_fn(self):
        eqn = self.eqn
        sharding = lambda v: isinstance(v, (NamedSharding, P))  # noqa: E731

        def g(*xs):  # one shard's block: no trace-time context, no sharding parameters
            out = _compat.bind(eqn, xs, context=False, drop=sharding)
            return list(out) if _compat.multiple_results(eqn) else [out]

        def vjp(plain, cts):
            _, f = jax.vjp(g, *plain)
            return list(f(list(cts)))

        return vjp

    def __call__(self, *invals):
        layout = self.layout
        vjp = self._vjp_fn()
        reduced_over = [_types.reduced_axes(x) for x in invals]

        @jax.custom_vjp
        def f(*xs):
            return self._forward(*xs)[0]

        def fwd(*xs):
            return self._forward(*xs)

        def bwd(plain, cts):
            cts = [_copies.data_partial(layout, c) if hasattr(c, "shape") else c for c in cts]
            values = [x for x in [*plain, *cts] if hasattr(x, "shape")]
            per_device = _on_devices(layout, values)
            try:
                if per_device:
                    grads = _per_device_vjp(layout, vjp, list(plain), cts, self.red)
                else:
                    auto = self.kind is not Kind.CUSTOM  # a custom rule checks its cotangents' Explicit types
                    grads = _per_shard_vmap(layout, vjp, list(plain), cts, self.red, auto)
            except (ValueError, TypeError) as err:  # our refusal in place of JAX's error, no other path
                if self.kind is not Kind.CUSTOM:
                    raise
                raise ValueError(custom_refusal()) from err
            return tuple(
                _copies.spread_partial(layout, g, over) if r else g
                for g, r, over in zip(grads, self.red, reduced_over, strict=True)
            )

        f.defvjp(fwd, bwd)
        return list(f(*invals))


def _on_devices(layout: Layout, values: list[Any]) -> bool:
    """Whether each device's block holds whole per-shard values: nothing split over a model axis (a ``shard_map``
    would gather it), no dimension split over the data axes and another axis, or over them out of mesh order."""
    data = frozenset(layout.data)
    for x in values:
        if _types.axes_of(x) - data:
            return False
        if any(data & set(_types.spec_axes(e)) and _types.spec_axes(e) != layout.data for e in _types.partitions(x)):
            return False
    return True


def _per_device_vjp(layout: Layout, vjp, plain: list[Any], cts: list[Any], red: list[bool]) -> list[Any]:
    """The VJP on each device's own rows, in a ``shard_map`` manual over every axis (no collective: each data shard's
    rows, partial cotangent and parameter copy are on its devices, whole along the other axes, :func:`_on_devices`).
    Manual over the data axes alone, a primitive whose sharding JAX cannot infer on the remaining Explicit axes
    (``ragged_dot_general`` without ``out_sharding``) would fail there."""
    data, entry = frozenset(layout.data), layout.data_spec

    def row_spec(x: Any) -> P | None:
        if not hasattr(x, "shape") or not jnp.ndim(x) or not _types.axes_of(x) & data:
            return None
        return P(*(entry if data & set(_types.spec_axes(e)) else None for e in _types.partitions(x)))

    args, specs, kinds = [], [], []
    for x in [*plain, *cts]:
        if hasattr(x, "shape") and _types.unreduced_axes(x) & data:
            args.append(_copies.stack_partials(layout, x))
            specs.append(P(entry))
            kinds.append("partial")
        elif (spec := row_spec(x)) is not None:
            args.append(x)
            specs.append(spec)
            kinds.append("rows")
        else:
            args.append(x)
            specs.append(P())
            kinds.append("whole")
    out_specs = [row_spec(x) if k == "rows" and not r else P(entry) for x, k, r in zip(plain, kinds, red)]
    n = len(plain)

    def body(*blocks):
        local = [b[0] if k == "partial" else b for b, k in zip(blocks, kinds, strict=True)]
        grads = vjp(local[:n], local[n:])
        return [g if spec != P(entry) else g[None] for g, spec in zip(grads, out_specs, strict=True)]

    grads = jax.shard_map(
        body,
        mesh=layout.mesh,
        in_specs=tuple(specs),
        out_specs=out_specs,
        axis_names=frozenset(layout.axis_names),
        check_vma=False,
    )(*args)
    out = []
    for g, x, r, spec in zip(grads, plain, red, out_specs, strict=True):
        if r:
            out.append(_copies.unstack_partials(layout, g, x))  # a reduced input: each device's partial
        elif spec == P(entry):
            out.append(_summed(g, x))  # a replicated input: the reduction JAX's own transpose would do
        else:
            out.append(g)  # a data-sharded input: its rows, in place
    return out


def _per_shard_vmap(layout: Layout, vjp, plain: list[Any], cts: list[Any], red: list[bool], auto: bool) -> list[Any]:
    """The VJP ``vmap``\\ ped over the shards stacked on a leading axis; ``auto``: with the mesh's axes Auto inside
    (one shard's block of an Explicit-mode program need not be Explicit-valid on its own: a reshape of a block split
    over a model axis)."""
    res = [_copies.Stacked.of(layout, x) for x in plain]
    cot = [_copies.Stacked.of(layout, c) for c in cts]
    axes = [0 if r.stacked else None for r in res]

    def per_shard(res_vals, ct_vals):
        one = lambda rv, cv: vjp(rv, cv)  # noqa: E731
        return jax.vmap(one, in_axes=(axes, [0 if c.stacked else None for c in cot]))(res_vals, ct_vals)

    args = ([r.value for r in res], [c.value for c in cot])
    if auto:
        data = frozenset(layout.data)
        out_specs = [P(layout.data_spec, *(_types.strip(e, data) for e in _types.partitions(x))) for x in plain]
        grads = jax.sharding.auto_axes(per_shard, out_sharding=out_specs)(*args)
    else:
        grads = per_shard(*args)
    out = []
    for g, x, r, rs in zip(grads, plain, red, res, strict=True):
        if r:
            out.append(_copies.unstack_partials(layout, g, x))  # a reduced input: each shard's partial
        elif rs.stacked:
            out.append(rs.unstack(g))  # a data-sharded input: its rows back in place
        else:
            out.append(_summed(g, x))  # a replicated input: the reduction JAX's own transpose would do
    return out


def _summed(g: Any, x: Any) -> Any:
    """The per-shard cotangents ``(shards, ...)`` of a replicated input summed; an integer input's (``float0``, an
    index a decomposition's rule closes over) is its zero cotangent, which has no sum."""
    if not jnp.issubdtype(jnp.result_type(x), jnp.inexact):
        return np.zeros(jnp.shape(x), jax.dtypes.float0)
    return jnp.sum(g, axis=0)


def custom_refusal() -> str:
    return (
        "value_and_grad(data_axes=...): loss_fn applies a jax.custom_vjp / jax.custom_jvp function to a parameter "
        "sharded over the data axes (FSDP) before the parameter is gathered; the per-copy statistics need the rule "
        "applied to the gathered copy, and JAX checks the rule's types against the sharded one. Gather the parameter "
        "first (jax.reshard(w, P(...)) without the data axes) and apply the function to the result, or keep that "
        "parameter replicated over the data axes."
    )

"""The rule JAX's types imply where JAX has none: an equation applied to ``reduced`` values, per data shard.

An equation with no ``reduced`` rule in JAX (it raises), or a ``custom_jvp``/``custom_vjp`` call on
``reduced`` values, runs forward on the plain values (the same numbers on every device). Its backward
pass applies the equation's own VJP to each device's partial cotangent: every per-shard value is stacked
on a leading axis of size ``shards`` and the VJP is ``vmap``\\ ped over it, the data axes manual. That
needs the equation to be local to the rows (its output sharded over the data axes where an input is);
otherwise :func:`local` raises a ``ValueError`` saying how to write that step of the loss.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from optax_adascale.gspmd import _copies, _layout, _rows
from optax_adascale.gspmd._layout import Layout

CUSTOM = ("custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr")


def local(interp: Any, eqn, invals):
    """``eqn`` on plain values (bound by ``interp``, the interpreter); its VJP applied to each device's partial
    cotangent (data axes manual).

    With only ``reduced`` (replicated) inputs the outputs stay ``reduced``; with an input sharded over the
    data axes the equation must be local to the rows (its outputs sharded over them too).
    """
    data = interp.data
    red = [bool(_layout.reduced_axes(x)) for x in invals]
    mixing = any(not r and data & _layout.axes_of(x) for x, r in zip(invals, red, strict=True))
    if mixing:  # each shard's rows alone must give the equation's own result: nothing may mix rows
        rows = [_row_dims(x, data) if hasattr(x, "shape") and not r else frozenset() for x, r in zip(invals, red)]
        if _rows.has_subjaxprs(eqn):
            raise ValueError(_opaque_call(eqn))
        mixed = _rows.equation_coupling(eqn, rows)
        if mixed:
            raise ValueError(_not_local(eqn, mixed))
    plain_out = interp.bind(eqn, [_layout.plain(x) if r else x for x, r in zip(invals, red, strict=True)])
    outs = list(plain_out) if eqn.primitive.multiple_results else [plain_out]
    if mixing and any(isinstance(o, jax.Array) and jnp.ndim(o) and not data <= _layout.axes_of(o) for o in outs):
        raise ValueError(_not_local(eqn, "its output is not sharded over the data axes"))
    if not any(r and jnp.issubdtype(x.dtype, jnp.inexact) for x, r in zip(invals, red, strict=True)):
        return plain_out
    result = _LocalVJP(interp, eqn, red, keep_reduced=not mixing)(*invals)
    return result if eqn.primitive.multiple_results else result[0]


def elementwise_by_row_shard(interp: Any, eqn, invals) -> Any:
    """An elementwise equation of a parameter's copy and the rows (``x * scale``, ``h + b``), which JAX refuses on a
    ``reduced`` operand: the rows' dimension split into (data shards, rows per shard) and each shard's copy of the
    parameter put along the first (``copies``), so that the equation runs as JAX's own on plain operands, its
    transpose summing each shard's rows into that shard's copy. ``None`` where this is not that case."""
    layout = interp.layout
    if eqn.primitive.multiple_results or layout.extra or not eqn.outvars:
        return None
    out_shape = tuple(eqn.outvars[0].aval.shape)
    data = frozenset(layout.data)
    arrays = [x for x in invals if hasattr(x, "shape")]
    if not out_shape or any(jnp.ndim(x) not in (0, len(out_shape)) for x in arrays):
        return None
    if any(not _rows._broadcasts(tuple(jnp.shape(x)), out_shape) for x in arrays):
        return None
    dims = set()
    for x in arrays:
        if not _layout.reduced_axes(x) and jnp.ndim(x):
            dims |= {d for d, e in enumerate(_layout.partitions(x)) if data & set(_layout.spec_axes(e))}
    if len(dims) != 1:
        return None
    (d,) = dims
    n, size = layout.shards, out_shape[d]
    entry = layout.data_spec
    split_shape = out_shape[:d] + (n, size // n) + out_shape[d + 1 :]

    def split(x):
        if _layout.reduced_axes(x) and hasattr(x, "shape"):
            x = x.reshape((1,) * len(out_shape)) if not jnp.ndim(x) else x
            if x.shape[d] != 1:
                return None
            stack, _ = _copies.copies(layout, x, data)  # (n, *x.shape), a copy per data shard
            parts = _layout.partitions(x)
            stack = jnp.moveaxis(stack, 0, d)  # (.., n, 1, ..): dim d + 1 is x's own size-1 dimension
            return stack.reshape(
                x.shape[:d] + (n, 1) + x.shape[d + 1 :], out_sharding=P(*parts[:d], entry, None, *parts[d + 1 :])
            )
        if not hasattr(x, "shape") or not jnp.ndim(x):
            return x
        parts = _layout.partitions(x)
        if x.shape[d] == 1:
            return x.reshape(
                x.shape[:d] + (1, 1) + x.shape[d + 1 :], out_sharding=P(*parts[:d], None, None, *parts[d + 1 :])
            )
        if tuple(_layout.spec_axes(parts[d])) != layout.data:
            return None
        return x.reshape(
            split_shape[: d + 2] + x.shape[d + 1 :], out_sharding=P(*parts[:d], entry, None, *parts[d + 1 :])
        )

    operands = [split(x) for x in invals]
    if any(o is None and hasattr(x, "shape") for o, x in zip(operands, invals, strict=True)):
        return None
    try:
        out = interp.bind(eqn, operands)
    except Exception:  # noqa: BLE001 - not an elementwise equation JAX takes this way: the per-copy VJP
        return None
    parts = _layout.partitions(out)
    merged = parts[:d] + (entry,) + parts[d + 2 :]
    return out.reshape(out_shape, out_sharding=P(*merged))


def keeps_copies(interp: Any, eqn, invals, out) -> bool:
    """Whether JAX's own rules keep each data shard's copy of the parameters apart through ``eqn``, an equation
    with a ``reduced`` input. Through an equation that meets the batch (an operand sharded over the data axes)
    they do: its transpose contracts the rows into an ``unreduced`` partial. Through one of the parameters alone
    (and constants: ``W + A @ B``, ``W Wᵀ``) the output must stay ``reduced`` and JAX's VJP must take the
    ``unreduced`` cotangent it then gets; JAX types a matmul of two reduced values plain, and has no transpose of a
    linear map of an unreduced value whose other operand is not sharded over the data axes. Found here on abstract
    values, before the backward pass is built."""
    data = interp.data
    if any(data & _layout.axes_of(x) for x in invals if hasattr(x, "shape") and not _layout.reduced_axes(x)):
        return True
    outs = list(out) if eqn.primitive.multiple_results else [out]
    inexact = lambda x: hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)  # noqa: E731
    if any(inexact(o) and not _layout.reduced_axes(o) & data for o in outs):
        return False
    return backward_ok(interp, lambda *a: interp.bind(eqn, list(a)), invals, out, eqn.primitive.multiple_results)


def backward_ok(interp: Any, fn, invals, out, multiple: bool) -> bool:
    """Whether JAX builds the VJP of ``fn`` at ``invals`` for the cotangents its outputs ``out`` get (``unreduced``
    where an output is ``reduced``): traced on abstract values, nothing computed."""
    outs = list(out) if multiple else [out]
    cts = [_partial_aval(o, interp.rows) for o in outs]

    def backward(xs, cts):
        _, f = jax.vjp(fn, *xs)
        return f(cts if multiple else cts[0])

    try:
        jax.eval_shape(backward, list(invals), cts)
    except Exception:  # noqa: BLE001 - JAX's transpose has no rule for an unreduced cotangent here
        return False
    return True


def _partial_aval(x: Any, data: frozenset[str]) -> Any:
    """The cotangent type of ``x``: ``unreduced`` where ``x`` is ``reduced`` (over the data axes)."""
    if not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.inexact):
        return jax.ShapeDtypeStruct(jnp.shape(x), jax.dtypes.float0) if hasattr(x, "dtype") else x
    aval = jax.typeof(x)
    reduced = _layout.reduced_axes(x)
    spec = P(*_layout.partitions(x), unreduced=reduced & data, reduced=reduced - data)
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=NamedSharding(aval.sharding.mesh, spec))


def _row_dims(x: Any, data: frozenset[str]) -> frozenset[int]:
    """The dimensions of ``x`` split over the data axes: they index rows of the batch."""
    return frozenset(d for d, e in enumerate(_layout.partitions(x)) if data & set(_layout.spec_axes(e)))


def _not_local(eqn, why: str) -> str:
    return (
        f"value_and_grad(data_axes=...) cannot take per-copy statistics through the operation "
        f"'{eqn.primitive.name}' of loss_fn: JAX has no rule for it on parameters typed reduced over the data axes, "
        f"and it is not local to the rows ({why}), so running it on each data shard's rows would change it. Write "
        "this step of the loss so that a parameter meets the batch in a row-local operation (a matmul, an "
        "elementwise op, an embedding lookup), or keep the parameter out of the step that mixes the rows."
    )


def _opaque_call(eqn) -> str:
    if eqn.primitive.name == "shard_map":
        return (
            "value_and_grad(data_axes=...): loss_fn passes a parameter into a jax.shard_map that is manual over other "
            "axes than the data axes (a pipeline stage or model axis) while the batch's rows stay sharded over the "
            "data axes inside it. JAX takes a parameter's per-copy (reduced) type into a shard_map only when it is "
            "manual over every axis, and the shard_map's body is traced for the whole batch, so it cannot run on each "
            "data shard's rows either. Make the shard_map manual over the data axes too (add them to axis_names and "
            "shard the batch's rows over them in in_specs/out_specs): each device then gets its own copy of the "
            "parameter and the statistics are exact."
        )
    return (
        f"value_and_grad(data_axes=...): loss_fn applies '{eqn.primitive.name}' to a parameter and to the batch's rows "
        "together, JAX has no rule for its parameter on per-copy (reduced) types, and its inner computation is traced "
        "for the whole batch, so it cannot run on each data shard's rows. Apply it to the rows or to the parameter "
        "alone, or build that step from JAX operations."
    )


class _LocalVJP:
    """``eqn`` as a ``custom_vjp``: forward on the plain values, backward the equation's own VJP per data shard.

    The backward pass stacks every per-shard value on a leading axis of size ``shards`` (a data-sharded operand
    or cotangent: its rows split; an ``unreduced`` cotangent: each shard's partial) and ``vmap``\\ s the
    equation's VJP over that axis, under ``jax.sharding.auto_axes`` (one shard's block of an Explicit-mode
    program need not be Explicit-valid on its own). A ``reduced`` input's stacked cotangents become its
    ``unreduced`` partial; a data-sharded input's go back in place; a replicated one's are summed.
    """

    def __init__(self, interp: Any, eqn, red, keep_reduced):
        self.interp, self.eqn, self.red, self.keep_reduced = interp, eqn, red, keep_reduced

    def _forward(self, *xs):
        plain = [_layout.plain(x) if r else x for x, r in zip(xs, self.red, strict=True)]
        outs = self.interp.bind(self.eqn, plain)
        outs = list(outs) if self.eqn.primitive.multiple_results else [outs]
        if self.keep_reduced:
            outs = [_copies.as_reduced(o, self.interp.rows) for o in outs]
        return tuple(outs), tuple(plain)

    def _vjp_fn(self):
        eqn = self.eqn
        params = eqn.primitive.get_bind_params(
            {k: (None if isinstance(v, (NamedSharding, P)) else v) for k, v in eqn.params.items()}
        )

        def g(*xs):  # one shard's block: no trace-time context, no sharding parameters
            out = eqn.primitive.bind(*xs, **params)
            return list(out) if eqn.primitive.multiple_results else [out]

        def vjp(plain, cts):
            _, f = jax.vjp(g, *plain)
            return list(f(list(cts)))

        return vjp

    def __call__(self, *invals):
        layout = self.interp.layout
        vjp = self._vjp_fn()
        reduced_over = [_layout.reduced_axes(x) for x in invals]

        @jax.custom_vjp
        def f(*xs):
            return self._forward(*xs)[0]

        def fwd(*xs):
            return self._forward(*xs)

        def bwd(plain, cts):
            try:
                cts = [_layout.data_partial(layout, c) if hasattr(c, "shape") else c for c in cts]
                grads = _per_shard_vjp(layout, vjp, list(plain), cts, self.red)
                return tuple(
                    _layout.spread_partial(layout, g, over) if r else g
                    for g, r, over in zip(grads, self.red, reduced_over, strict=True)
                )
            except (ValueError, TypeError) as err:
                if self.eqn.primitive.name not in CUSTOM:
                    raise
                raise ValueError(custom_refusal()) from err

        f.defvjp(fwd, bwd)
        return list(f(*invals))


def _per_shard_vjp(layout: Layout, vjp, plain: list[Any], cts: list[Any], red: list[bool]) -> list[Any]:
    try:
        return _per_device_vjp(layout, vjp, plain, cts, red)
    except Exception:  # noqa: BLE001 - a block not valid on its own (an op with sharding parameters): vmap below
        return _per_shard_vmap(layout, vjp, plain, cts, red)


def _per_device_vjp(layout: Layout, vjp, plain: list[Any], cts: list[Any], red: list[bool]) -> list[Any]:
    """The VJP on each device's own rows, in a ``shard_map`` manual over the data axes (no collective: each data
    shard's rows, partial cotangent and parameter copy are on its devices). Operands split over a model axis too
    would be gathered over it at the ``shard_map``: those take the ``vmap`` path."""
    data, entry = frozenset(layout.data), layout.data_spec
    if any(_layout.axes_of(x) - data for x in [*plain, *cts] if hasattr(x, "shape")):
        raise ValueError("an operand split over a model axis: the shard_map would gather it (vmap instead)")

    def row_spec(x: Any) -> P | None:
        if not hasattr(x, "shape") or not jnp.ndim(x):
            return None
        parts = _layout.partitions(x)
        if not any(data & set(_layout.spec_axes(e)) for e in parts):
            return None
        if any(data & set(_layout.spec_axes(e)) and tuple(_layout.spec_axes(e)) != layout.data for e in parts):
            raise ValueError("rows split over more than the data axes in one dimension")
        return P(*(entry if data & set(_layout.spec_axes(e)) else None for e in parts))

    args, specs, kinds = [], [], []
    for x in [*plain, *cts]:
        if hasattr(x, "shape") and _layout.unreduced_axes(x) & data:
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
        body, mesh=layout.mesh, in_specs=tuple(specs), out_specs=out_specs, axis_names=data, check_vma=False
    )(*args)
    out = []
    for g, x, r, spec in zip(grads, plain, red, out_specs, strict=True):
        if r:
            out.append(_copies.unstack_partials(layout, g, x))  # a reduced input: each device's partial
        elif spec == P(entry):
            out.append(jnp.sum(g, axis=0))  # a replicated input: the reduction JAX's own transpose would do
        else:
            out.append(g)  # a data-sharded input: its rows, in place
    return out


def _per_shard_vmap(layout: Layout, vjp, plain: list[Any], cts: list[Any], red: list[bool]) -> list[Any]:
    res = [_copies.Stacked.of(layout, x) for x in plain]
    cot = [_copies.Stacked.of(layout, c) for c in cts]
    axes = [0 if r.stacked else None for r in res]

    def per_shard(res_vals, ct_vals):
        one = lambda rv, cv: vjp(rv, cv)  # noqa: E731
        return jax.vmap(one, in_axes=(axes, [0 if c.stacked else None for c in cot]))(res_vals, ct_vals)

    args = ([r.value for r in res], [c.value for c in cot])
    try:
        grads = per_shard(*args)
    except Exception:  # noqa: BLE001 - one shard's block is not Explicit-valid on its own (a gather): Auto inside
        data = frozenset(layout.data)
        out_specs = [P(layout.data_spec, *(_layout.strip(e, data) for e in _layout.partitions(x))) for x in plain]
        grads = jax.sharding.auto_axes(per_shard, out_sharding=out_specs)(*args)
    out = []
    for g, x, r, rs in zip(grads, plain, red, res, strict=True):
        if r:
            out.append(_copies.unstack_partials(layout, g, x))  # a reduced input: each shard's partial
        elif rs.stacked:
            out.append(rs.unstack(g))  # a data-sharded input: its rows back in place
        else:
            out.append(jnp.sum(g, axis=0))  # a replicated input: the reduction JAX's own transpose would do
    return out


def custom_refusal() -> str:
    return (
        "value_and_grad(data_axes=...): loss_fn applies a jax.custom_vjp / jax.custom_jvp function to a parameter "
        "sharded over the data axes (FSDP) before the parameter is gathered; the per-copy statistics need the rule "
        "applied to the gathered copy, and JAX checks the rule's types against the sharded one. Gather the parameter "
        "first (jax.reshard(w, P(...)) without the data axes) and apply the function to the result, or keep that "
        "parameter replicated over the data axes."
    )

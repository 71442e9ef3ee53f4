"""A loss written for Auto axes, run on Explicit ones: where Explicit types ask for a decision, GSPMD's, by class.

On a mesh with Auto axes the drop-in runs the loss with every axis made Explicit (``_convert.run``). Explicit
types then ask where a result goes wherever operands are sharded differently; a loss written for Auto axes never
says, GSPMD decides. :func:`decide` makes GSPMD's decision for an equation without a parameter's copy, from its
class (``_table``) and its operands' types:

* elementwise: operands sharded alike (a replicated operand resharded like the sharded one of the same shape;
  operands whose specs conflict gathered off the model axes, then, if they still conflict, off every axis);
* a contraction sums its partial products: its output sharded like the operands' free and batch dimensions, the
  contracted axes dropped (:func:`contraction_sharding`, also for a contraction with the rows and a copy); an axis
  splitting one operand's contracted dimension and the other's free one is gathered off the first
  (:func:`contraction_operands`);
* an operation along a dimension (sort, cumsum, top_k, rev, concatenate) split over some axes: on its operands
  gathered off those axes, as the Explicit way writes it (``jax.reshard``); several operands of one shape (a stable
  sort's keys and their positions) sharded alike, as elementwise;
* a lookup (a gather from an operand not split like its indices, or along a split dimension): sharded like its
  indices, the converted axes Auto inside (:func:`gather_indexed`);
* anything else as traced: where Explicit types cannot express it, JAX's error becomes our refusal
  (``_convert``, naming an Explicit mesh as the fix).

The loss's sharding hints for the Auto axes become constraints (:func:`hint`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from optax_adascale import _compat
from optax_adascale.gspmd import _rebind, _types
from optax_adascale.gspmd._layout import Layout
from optax_adascale.gspmd._table import Kind


def decide(layout: Layout, kind: Kind, eqn, invals: list[Any]) -> Any:
    """``eqn`` (no copy among its operands) bound with GSPMD's decision for its class (the module docstring)."""
    if kind is Kind.ELEMENTWISE:
        return _rebind.rebind(layout, eqn, _alike(layout, invals))
    if kind is Kind.CONTRACTION:
        invals = contraction_operands(eqn, invals)
        return _rebind.rebind(layout, eqn, invals, contraction_params(eqn, invals))
    if kind is Kind.ALONG:
        rank = jnp.ndim(invals[0])
        along = set(_compat.along_dims(eqn, rank))
        axes = frozenset(a for x in invals if jnp.ndim(x) for d in along for a in _spec_axes(x, d))
        return _rebind.rebind(layout, eqn, _alike(layout, [_off_axes(x, axes) for x in invals] if axes else invals))
    if looks_up(eqn, invals):
        return gather_indexed(layout, eqn, invals)
    return _rebind.rebind(layout, eqn, invals)


def looks_up(eqn, invals: list[Any]) -> bool:
    """A gather whose rows come from its indices into an operand not split like them (an embedding lookup, a copy of
    the table included), or that indexes a dimension the operand is split along: GSPMD's lookup decision
    (:func:`gather_indexed`). A gather within each row of operands split alike (``take_along_axis``) is not one."""
    if _compat.primitive_name(eqn) != "gather":
        return False
    operand, indices = invals
    split = {a for d in _compat.gather_dims(eqn)[1] for a in _spec_axes(operand, d)}
    return bool(split or _types.axes_of(indices) - _types.axes_of(operand))


def _alike(layout: Layout, invals: list[Any]) -> list[Any]:
    """Elementwise operands sharded alike: the replicated ones resharded like the one sharded operand of their shape;
    where two specs conflict, every operand gathered off the model axes, then off every axis."""
    arrays = [x for x in invals if _types.is_array(x) and jnp.ndim(x)]
    specs = {_types.partitions(x) for x in arrays if any(e is not None for e in _types.partitions(x))}
    if len(specs) <= 1:
        if len({tuple(x.shape) for x in arrays}) != 1 or not specs:
            return invals
        (spec,) = specs
        replicated = {id(x) for x in arrays if all(e is None for e in _types.partitions(x))}
        return [jax.reshard(x, P(*spec)) if id(x) in replicated else x for x in invals]
    every = frozenset(layout.axis_names)
    for axes in (every - frozenset(layout.data), every):
        out = [_off_axes(x, axes) for x in invals]
        if len({_types.partitions(x) for x in out if _types.is_array(x) and jnp.ndim(x)}) <= 1:
            return out
    return out


def _spec_axes(x: Any, d: int) -> tuple[str, ...]:
    return _types.spec_axes(_types.partitions(x)[d]) if d < jnp.ndim(x) else ()


def contraction_operands(eqn, invals: list[Any]) -> list[Any]:
    """GSPMD's operands for a ``dot_general`` whose contracted dimensions are split differently: an axis that splits
    one operand's contracted dimension but not the other's, and splits a free or batch dimension of that other, is
    gathered off the first (``x`` split along its features over ``tensor`` times a weight split along its outputs
    over ``tensor``: ``x`` gathered, the output split like the weight's outputs, as GSPMD shards a Megatron layer).
    Kept, that axis would be dropped from the output and the weight gathered whole on every device."""
    (lc, rc), _ = _compat.contraction_dims(eqn)
    lhs, rhs = (_types.partitions(x) for x in invals)
    out = list(invals)
    for i, (mine, theirs, own_c, their_c) in enumerate(((lhs, rhs, lc, rc), (rhs, lhs, rc, lc))):
        contracted = {a for d in own_c for a in _types.spec_axes(mine[d])}
        shared = {a for d in their_c for a in _types.spec_axes(theirs[d])}
        elsewhere = {a for d in range(len(theirs)) if d not in their_c for a in _types.spec_axes(theirs[d])}
        axes = frozenset((contracted - shared) & elsewhere)
        if axes:
            out[i] = _off_axes(out[i], axes)
    return out


def contraction_params(eqn, invals) -> dict[str, Any]:
    """A ``dot_general``'s parameters with GSPMD's output sharding (:func:`contraction_sharding`)."""
    return _compat.with_params(eqn, out_sharding=contraction_sharding(eqn, invals))


def contraction_sharding(eqn, invals) -> NamedSharding:
    """GSPMD's output sharding for a ``dot_general``: batch and free dimensions keep their operands' specs,
    the contracted axes (and any axis already used) are dropped: the partial products are summed."""
    (lc, rc), (lb, rb) = _compat.contraction_dims(eqn)
    lhs, rhs = (_types.partitions(x) for x in invals)
    contracted = {a for d in lc for a in _types.spec_axes(lhs[d])} | {a for d in rc for a in _types.spec_axes(rhs[d])}
    entries = [lhs[d] for d in lb]
    entries += [lhs[d] for d in range(len(lhs)) if d not in lc and d not in lb]
    entries += [rhs[d] for d in range(len(rhs)) if d not in rc and d not in rb]
    used: set[str] = set()
    out = []
    for entry in entries:
        kept = tuple(a for a in _types.spec_axes(entry) if a not in contracted and a not in used)
        used.update(kept)
        out.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return NamedSharding(jax.sharding.get_abstract_mesh(), P(*out))


def gather_indexed(layout: Layout, eqn, invals):
    """A gather traced on Auto axes (an embedding lookup): run with the converted axes Auto, its output sharded like
    its indices' batch dimensions (``.at[].get(out_sharding=)``)."""
    operand, indices = invals
    offset = set(_compat.gather_dims(eqn)[0])
    batch = iter(_types.partitions(indices)[:-1])
    out_rank = len(offset) + jnp.ndim(indices) - 1
    parts = [None if d in offset else next(batch) for d in range(out_rank)]
    parts = [_types.strip(e, frozenset(layout.axis_names) - layout.convert) for e in parts]
    fn = lambda op, idx: _rebind.rebind(layout, eqn, [op, idx])  # noqa: E731
    return jax.sharding.auto_axes(fn, axes=tuple(sorted(layout.convert)), out_sharding=P(*parts))(operand, indices)


def hint(layout: Layout, x, spec):
    """A sharding written for the Auto mesh, on the Explicit one: its axes not made Explicit, as a constraint."""
    if spec is None:
        return x
    parts = tuple(_types.strip(e, layout.convert) for e in spec.partitions)
    if all(p is None for p in parts):
        return x
    return lax.with_sharding_constraint(x, P(*parts))


def _off_axes(x: Any, axes: frozenset[str]) -> Any:
    """``x`` gathered off ``axes`` (its ``reduced`` axes kept); anything else as it is."""
    if not _types.is_array(x) or not jnp.ndim(x) or not axes & _types.axes_of(x):
        return x
    parts = tuple(_types.strip(e, axes) for e in _types.partitions(x))
    return jax.reshard(x, P(*parts, reduced=_types.reduced_axes(x)))

"""A loss written for Auto axes, run on Explicit ones: the decisions Explicit types ask for, made as GSPMD makes them.

On a mesh with Auto axes the drop-in runs the loss with every axis made Explicit (``_drop_in._converted``). An
equation that Explicit types refuse there (JAX raises: they ask where a result goes) gets GSPMD's own decision
(:func:`decide`); the loss's sharding hints for the Auto axes become constraints (:func:`hint`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from optax_adascale.gspmd import _layout


def decide(interp, eqn, invals, reduced_in: bool):
    """A loss written for Auto axes, re-evaluated on Explicit ones, where Explicit types ask for a decision GSPMD
    makes by itself: ``(outputs,)``, or ``None`` if none of GSPMD's applies. In order: same-shape operands
    sharded alike (``select_n``); a contraction over a dimension both operands shard over a model axis sums
    its partial products (the output sharded like the operands' free dimensions); any other equation runs on
    operands gathered off the model axes (the data axes kept: the batch stays the batch); an embedding
    lookup is sharded like its indices; and an equation of activations alone, failing that, on operands
    gathered off every axis (across the rows, a sort: the rows gathered, as the Explicit way writes it)."""
    tries = []
    if not reduced_in:
        aligned = _aligned(invals)
        if aligned is not None:
            tries.append(lambda: interp.bind(eqn, aligned))
    if eqn.primitive.name == "dot_general":
        params = dict(eqn.params, out_sharding=contraction_sharding(eqn, invals))
        tries.append(lambda: interp.bind(eqn, invals, params))
    every = frozenset(interp.layout.axis_names)
    model = every - interp.data
    if any(model & _layout.axes_of(x) for x in invals):
        tries.append(lambda: interp.bind(eqn, [_off_axes(x, model) for x in invals]))
    if eqn.primitive.name == "gather":
        tries.append(lambda: gather_indexed(interp, eqn, invals))
    if not reduced_in and any(interp.data & _layout.axes_of(x) for x in invals):  # across the rows (sort)
        tries.append(lambda: interp.bind(eqn, [_off_axes(x, every) for x in invals]))
    for attempt in tries:
        try:
            return (attempt(),)
        except Exception:  # noqa: BLE001 - not this decision: the next one
            continue
    return None


def contraction_sharding(eqn, invals) -> NamedSharding:
    """GSPMD's output sharding for a ``dot_general``: batch and free dimensions keep their operands' specs,
    the contracted axes (and any axis already used) are dropped: the partial products are summed."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs = (_layout.partitions(x) for x in invals)
    contracted = {a for d in lc for a in _layout.spec_axes(lhs[d])} | {a for d in rc for a in _layout.spec_axes(rhs[d])}
    entries = [lhs[d] for d in lb]
    entries += [lhs[d] for d in range(len(lhs)) if d not in lc and d not in lb]
    entries += [rhs[d] for d in range(len(rhs)) if d not in rc and d not in rb]
    used: set[str] = set()
    out = []
    for entry in entries:
        kept = tuple(a for a in _layout.spec_axes(entry) if a not in contracted and a not in used)
        used.update(kept)
        out.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return NamedSharding(jax.sharding.get_abstract_mesh(), P(*out))


def gather_indexed(interp, eqn, invals):
    """A gather traced on Auto axes that Explicit types find ambiguous (an embedding lookup): run with the
    converted axes Auto, its output sharded like its indices' batch dimensions (``.at[].get(out_sharding=)``)."""
    operand, indices = invals
    offset = set(eqn.params["dimension_numbers"].offset_dims)
    batch = iter(_layout.partitions(indices)[:-1])
    out_rank = len(offset) + jnp.ndim(indices) - 1
    parts = [None if d in offset else next(batch) for d in range(out_rank)]
    parts = [_layout.strip(e, frozenset(interp.layout.axis_names) - interp.convert) for e in parts]
    fn = lambda op, idx: interp.bind(eqn, [op, idx])  # noqa: E731
    return jax.sharding.auto_axes(fn, axes=tuple(sorted(interp.convert)), out_sharding=P(*parts))(operand, indices)


def hint(interp, x, spec):
    """A sharding written for the Auto mesh, on the Explicit one: its axes not made Explicit, as a constraint."""
    if spec is None:
        return x
    parts = tuple(_layout.strip(e, interp.convert) for e in spec.partitions)
    if all(p is None for p in parts):
        return x
    return lax.with_sharding_constraint(x, P(*parts))


def _aligned(invals: list[Any]) -> list[Any] | None:
    """Same-shape operands, the replicated ones resharded like the one sharded operand; ``None`` if not that case."""
    arrays = [x for x in invals if hasattr(x, "shape") and jnp.ndim(x)]
    shapes = {tuple(x.shape) for x in arrays}
    specs = {_layout.partitions(x) for x in arrays if any(e is not None for e in _layout.partitions(x))}
    if len(shapes) != 1 or len(specs) != 1:
        return None
    (spec,) = specs
    return [
        jax.reshard(x, P(*spec))
        if hasattr(x, "shape") and jnp.ndim(x) and all(e is None for e in _layout.partitions(x))
        else x
        for x in invals
    ]


def _off_axes(x: Any, axes: frozenset[str]) -> Any:
    """``x`` gathered off ``axes`` (its ``reduced`` axes kept); anything else as it is."""
    if not isinstance(x, jax.Array) and not hasattr(x, "aval"):
        return x
    if not jnp.ndim(x) or not axes & _layout.axes_of(x):
        return x
    parts = tuple(_layout.strip(e, axes) for e in _layout.partitions(x))
    return jax.reshard(x, P(*parts, reduced=_layout.reduced_axes(x)))


def auto_sharding(v: Any) -> bool:
    """A sharding parameter naming a mesh with Auto axes (a loss traced on such a mesh): dropped when re-bound."""
    mesh = getattr(v, "mesh", None)
    return isinstance(v, NamedSharding) and mesh is not None and bool(_layout.auto_axes(mesh))

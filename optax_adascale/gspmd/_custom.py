"""A custom rule (``custom_vjp``, ``custom_jvp``) applied to a parameter: its own backward pass, per copy.

JAX checks a rule's cotangents against the primal types: for a parameter's ``reduced`` copy it wants the
``unreduced`` per-device partial, and a rule written for plain values returns the sum (``x.T @ ct``). The
rule runs forward on plain values, as JAX runs it; its backward pass (the user's backward function, or the
transpose of the JVP rule: JAX's own VJP of the call) is traced and re-evaluated with one change: a
contraction over the rows (``dot_general``, ``reduce_sum`` over a dimension split over the data axes) whose
result reaches only the cotangents of parameters is left ``unreduced`` (each device's rows), which makes those
cotangents the per-copy partials. A cotangent of a parameter that does not come out that way (the rule mixes
the parameter's cotangent with the rows' in a way that is not a sum over rows) is refused with a ValueError.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from optax_adascale import _compat
from optax_adascale.gspmd import _auto, _layout
from optax_adascale.gspmd._layout import Layout
from optax_adascale.gspmd._table import Kind, kind_of

CONTRACTIONS = (Kind.CONTRACTION, Kind.SUM)


def per_copy(layout: Layout, evaluate, bound, eqn, invals: list[Any]) -> list[Any]:
    """``eqn`` (a custom call with ``reduced`` inputs; ``bound(*xs)`` binds it) forward on plain values, backward
    per copy. ``evaluate(jaxpr, consts, args, partial)``: the interpreter on ``jaxpr`` with the contractions
    ``partial`` (``id``\\ s of equations) left ``unreduced``."""
    red = [_layout.reduced_axes(x) if hasattr(x, "shape") else frozenset() for x in invals]
    multiple = eqn.primitive.multiple_results

    def call(*xs):
        out = bound(*xs)
        return tuple(out) if multiple else (out,)

    @jax.custom_vjp
    def rule(*xs):
        return call(*[_layout.plain(x) if r else x for x, r in zip(xs, red, strict=True)])

    def fwd(*xs):
        plain = [_layout.plain(x) if r else x for x, r in zip(xs, red, strict=True)]
        out, vjp_fn = jax.vjp(call, *plain)
        return out, vjp_fn

    def bwd(vjp_fn, cts):
        jaxpr, consts = _compat.open_jaxpr(jax.make_jaxpr(lambda c: vjp_fn(c))(cts))
        partial = _partial_contractions(jaxpr, [i for i, r in enumerate(red) if r])
        outs = evaluate(jaxpr, consts, list(jax.tree.leaves(cts)), partial)
        result = []
        for i, (g, r) in enumerate(zip(outs, red, strict=True)):
            if not r:
                result.append(g)
                continue
            over = _layout.unreduced_axes(g)
            if not over & frozenset(layout.data):
                raise ValueError(_not_a_sum(eqn, i))
            result.append(_layout.fill_partial(layout, g, r - over))
        return tuple(result)

    rule.defvjp(fwd, bwd)
    out = rule(*invals)
    return list(out) if multiple else out[0]


def _partial_contractions(jaxpr, targets: list[int]) -> frozenset[int]:
    """The contractions of ``jaxpr`` whose results reach only the outputs ``targets`` (``id``\\ s of equations): a
    walk back from the outputs, the one backward walk of the drop-in."""
    reach: dict[Any, frozenset[int]] = {}
    for i, v in enumerate(jaxpr.outvars):
        if not _compat.is_literal(v):
            reach[v] = reach.get(v, frozenset()) | {i}
    partial = set()
    wanted = frozenset(targets)
    for eqn in reversed(jaxpr.eqns):
        outs = frozenset().union(*(reach.get(v, frozenset()) for v in eqn.outvars))
        if kind_of(eqn.primitive.name) in CONTRACTIONS and outs and outs <= wanted:
            partial.add(id(eqn))
        for v in eqn.invars:
            if not _compat.is_literal(v):
                reach[v] = reach.get(v, frozenset()) | outs
    return frozenset(partial)


def contract_partial(layout: Layout, eqn, invals: list[Any]) -> Any:
    """A contraction over the rows bound with its output ``unreduced`` over the data axes it contracts: each
    device's sum over its own rows. As traced where it contracts none."""
    data = frozenset(layout.data)
    if kind_of(eqn.primitive.name) is Kind.CONTRACTION:
        (lc, rc), _ = _compat.contraction_dims(eqn)
        lhs, rhs = (_layout.partitions(x) for x in invals)
        over = {a for d in lc for a in _layout.spec_axes(lhs[d])} & {a for d in rc for a in _layout.spec_axes(rhs[d])}
        over &= data
        spec = _auto.contraction_sharding(eqn, invals).spec
    else:  # a sum
        (x,) = invals
        parts = _layout.partitions(x)
        axes = set(_compat.reduced_dims(eqn))
        over = {a for d in axes for a in _layout.spec_axes(parts[d])} & data
        spec = P(*(e for d, e in enumerate(parts) if d not in axes))
    if not over:
        return _layout.bind(layout, eqn, invals)
    traced = _compat.out_sharding(eqn)
    key = "out_sharding" if traced is None else traced[0]
    out = NamedSharding(jax.sharding.get_abstract_mesh(), P(*spec, unreduced=frozenset(over)))
    return _layout.bind(layout, eqn, invals, _compat.with_params(eqn, **{key: out}))


def keep_unreduced(eqn, invals: list[Any]) -> dict[str, Any] | None:
    """The parameters of an equation on a per-device partial (downstream of :func:`contract_partial`) whose traced
    output sharding names no ``unreduced`` axes (a reshape): the same, ``unreduced`` as its operand is; else
    ``None`` (bound as traced)."""
    over = frozenset().union(*(_layout.unreduced_axes(x) for x in invals if hasattr(x, "shape")))
    traced = _compat.out_sharding(eqn)
    if not over or traced is None or traced[1] is None:
        return None
    key, sharding = traced
    spec = getattr(sharding, "spec", sharding)
    if frozenset(getattr(spec, "unreduced", ())) == over:
        return None
    new = P(*spec, unreduced=over)
    mesh = getattr(sharding, "mesh", None) or jax.sharding.get_abstract_mesh()
    return _compat.with_params(eqn, **{key: NamedSharding(mesh, new) if isinstance(sharding, NamedSharding) else new})


def _not_a_sum(eqn, i: int) -> str:
    return (
        f"value_and_grad(data_axes=...): loss_fn applies a custom rule ({eqn.primitive.name}) to a parameter (input "
        f"{i}), and the rule's backward pass does not give that parameter's cotangent as a sum over the rows (each "
        "data shard's part of it), so the per-copy statistics cannot be taken through it. Apply the rule to the "
        "activations and the parameter outside it (e.g. gamma * rule(h) instead of rule(h, gamma)), or write its "
        "backward pass so that the parameter's cotangent is a contraction over the rows (x.T @ ct, ct.sum(0))."
    )

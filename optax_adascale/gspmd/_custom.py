"""A custom rule (``custom_vjp``, ``custom_jvp``) applied to a parameter: its own backward pass, per copy.

JAX checks a rule's cotangents against the primal types: for a parameter's ``reduced`` copy it wants the
``unreduced`` per-device partial, and a rule written for plain values returns the sum (``x.T @ ct``). The
rule runs forward on plain values, as JAX runs it; its backward pass (the user's backward function, or the
transpose of the JVP rule: JAX's own VJP of the call) is traced and re-evaluated with one change: a
contraction over the rows (``dot_general``, ``reduce_sum`` over a dimension split over the data axes) whose
result reaches only the cotangents of parameters is left ``unreduced`` (each device's rows), which makes those
cotangents the per-copy partials. A cotangent of a parameter that does not come out that way (the rule mixes
the parameter's cotangent with the rows' in a way that is not a sum over rows) is refused with a ValueError.

Every custom call the interpreter meets on a parameter, or on a converted Auto mesh, is bound again by
:func:`rebound`: JAX's own bind functions with the traced jaxprs (the function, its JVP rule or forward pass)
re-evaluated by the interpreter instead of ``core.eval_jaxpr`` (``_compat.custom_call`` reads the call's parts).
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from optax_adascale import _compat
from optax_adascale.gspmd import _auto, _copies, _rebind, _types
from optax_adascale.gspmd._layout import Layout
from optax_adascale.gspmd._table import Kind, kind_of

CONTRACTIONS = (Kind.CONTRACTION, Kind.SUM)

# --------------------------------------------------------------------------- a custom call bound again


def rebound(eqn: Any, evaluate: Any, trace_context: Any = contextlib.nullcontext, bwd_auto_axes: tuple[str, ...] = ()):
    """``bound(*xs)``: the custom call ``eqn`` bound to ``xs`` with its traced jaxprs (the function, its JVP rule or
    forward pass) run through ``evaluate(jaxpr, consts, args)`` where JAX's own bind functions run them with
    ``core.eval_jaxpr``. This mirrors ``custom_derivatives.lift_jvp``/``lift_fwd`` (JAX 0.10-0.12) with
    ``evaluate`` in its place. The user's backward function (``custom_vjp``) is Python and traces at the types it
    is given: kept. The JVP rule and forward pass are traced (lazily, at the types the loss was traced at) under
    ``trace_context()``.

    ``bwd_auto_axes``: the loss was traced with these axes Auto and runs with them Explicit. JAX checks the
    backward function's cotangents against the primal types of the trace (Auto: no sharding), so the backward
    function runs with those axes Auto again (``jax.sharding.auto_axes``), its cotangents sharded as the
    primal values the forward pass was given.
    """
    call = _compat.custom_call(eqn)
    jaxpr, consts = call.body
    num_consts = call.num_consts
    fun = _compat.wrap_fun(lambda *args: evaluate(jaxpr, consts, list(args)), like=call.subfuns[0])
    if call.jvp:

        def jvp(*xs):
            n = len(xs) // 2
            primals, tangents = xs[num_consts:n], xs[n + num_consts :]
            zeros = [_compat.is_symbolic_zero(t) for t in tangents]
            with trace_context():
                jvp_jaxpr, jvp_consts, out_zeros = call.rule.call_wrapped(*zeros)
            nonzero = [t for t in tangents if not _compat.is_symbolic_zero(t)]
            out = evaluate(jvp_jaxpr, jvp_consts, [*primals, *nonzero])
            out_primals, nz = out[: len(out_zeros)], iter(out[len(out_zeros) :])
            out_tangents = [
                _compat.symbolic_zero_of(p) if z else next(nz) for p, z in zip(out_primals, out_zeros, strict=True)
            ]
            return [*out_primals, *out_tangents]

        jvp_subfuns = (fun, _compat.wrap_fun(jvp, like=call.subfuns[1]))
        return lambda *xs: _compat.bind(eqn, xs, context=False, subfuns=jvp_subfuns)
    primal_types: list[Any] = []

    def fwd(*args):
        vals, nonzeros = args[::2], args[1::2]
        if any(nonzeros[:num_consts]):
            raise _compat.custom_vjp_error()
        primal_types[:] = [jax.typeof(v) for v in vals]
        with trace_context():
            fwd_jaxpr, fwd_consts = call.rule.call_wrapped(*nonzeros[num_consts:])
        return evaluate(fwd_jaxpr, fwd_consts, list(vals[num_consts:]))

    bwd = call.subfuns[2]
    if bwd_auto_axes:
        bwd = _compat.wrap_fun(_bwd_on_auto_axes(bwd, primal_types, bwd_auto_axes), like=call.subfuns[2])
    subfuns = (fun, _compat.wrap_fun(fwd, like=call.subfuns[1]), bwd)
    return lambda *xs: _compat.bind(eqn, xs, context=False, subfuns=subfuns)


def _bwd_on_auto_axes(flat_bwd: Any, primal_types: list[Any], axes: tuple[str, ...]):
    """The backward function ``flat_bwd`` run with ``axes`` Auto, its cotangents typed as ``primal_types`` (those
    the forward pass was given, filled in when it runs)."""

    def bwd_fn(*args):
        types = list(primal_types)
        zero_at: list[int] = []
        with_logs: list[bool] = []

        def run(*a):
            out = flat_bwd.call_wrapped(*a)
            # JAX 0.12: (cotangents, logs); 0.10-0.11: the cotangents
            with_logs[:] = [isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], (list, tuple))]
            cts = out[0] if with_logs[0] else out
            if with_logs[0] and out[1] is not None:
                raise NotImplementedError("a custom_vjp backward rule with logs, on a converted Auto mesh")
            zero_at[:] = [i for i, ct in enumerate(cts) if _compat.is_zero_cotangent(ct)]
            # a symbolic zero cannot leave auto_axes: a dense stand-in, dropped below (and by XLA)
            return [
                jnp.zeros(t.shape, jnp.float32) if i in zero_at else ct for i, (ct, t) in enumerate(zip(cts, types))
            ]

        specs = [t.sharding.spec for t in types]
        # an output's symbolic-zero cotangent is not a JAX value: dense zeros of its type, made here
        args = [_dense_zero(a) if _compat.is_symbolic_zero(a) else a for a in args]
        out = jax.sharding.auto_axes(run, axes=axes, out_sharding=specs)(*args)
        cts = [_compat.zero_cotangent(t) if i in zero_at else ct for i, (ct, t) in enumerate(zip(out, types))]
        return (cts, None) if with_logs[0] else cts

    return bwd_fn


def _dense_zero(zero: Any) -> jax.Array:
    t = _compat.symbolic_zero_type(zero)
    return jnp.zeros(t.shape, t.dtype, out_sharding=t.sharding)


# --------------------------------------------------------------------------- a custom rule on a parameter, per copy


def per_copy(layout: Layout, evaluate, bound, eqn, invals: list[Any]) -> list[Any]:
    """``eqn`` (a custom call with ``reduced`` inputs; ``bound(*xs)`` binds it) forward on plain values, backward
    per copy. ``evaluate(jaxpr, consts, args, partial)``: the interpreter on ``jaxpr`` with the contractions
    ``partial`` (``id``\\ s of equations) left ``unreduced``."""
    red = [_types.reduced_axes(x) if hasattr(x, "shape") else frozenset() for x in invals]
    multiple = _compat.multiple_results(eqn)

    def call(*xs):
        out = bound(*xs)
        return tuple(out) if multiple else (out,)

    @jax.custom_vjp
    def rule(*xs):
        return call(*[_types.plain(x) if r else x for x, r in zip(xs, red, strict=True)])

    def fwd(*xs):
        plain = [_types.plain(x) if r else x for x, r in zip(xs, red, strict=True)]
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
            over = _types.unreduced_axes(g)
            if not over & frozenset(layout.data):
                raise ValueError(_not_a_sum(eqn, i))
            result.append(_copies.fill_partial(layout, g, r - over))
        return tuple(result)

    rule.defvjp(fwd, bwd)
    out = rule(*invals)
    return list(out) if multiple else out[0]


def _partial_contractions(jaxpr, targets: list[int]) -> frozenset[int]:
    """The contractions of ``jaxpr`` whose results reach only the outputs ``targets`` (``id``\\ s of equations): a
    walk back from the outputs, the one backward walk of the drop-in."""
    partial = set()
    wanted = frozenset(targets)

    def rule(eqn, outs):
        reach = frozenset().union(*outs)
        if kind_of(_compat.primitive_name(eqn)) in CONTRACTIONS and reach and reach <= wanted:
            partial.add(id(eqn))
        return [reach] * len(_compat.inputs(eqn))

    outputs = [frozenset({i}) for i in range(len(jaxpr.outvars))]
    _compat.walk_back(jaxpr, outputs, rule, join=frozenset.union, empty=frozenset())
    return frozenset(partial)


def contract_partial(layout: Layout, eqn, invals: list[Any]) -> Any:
    """A contraction over the rows bound with its output ``unreduced`` over the data axes it contracts: each
    device's sum over its own rows. As traced where it contracts none."""
    data = frozenset(layout.data)
    if kind_of(_compat.primitive_name(eqn)) is Kind.CONTRACTION:
        (lc, rc), _ = _compat.contraction_dims(eqn)
        lhs, rhs = (_types.partitions(x) for x in invals)
        over = {a for d in lc for a in _types.spec_axes(lhs[d])} & {a for d in rc for a in _types.spec_axes(rhs[d])}
        over &= data
        spec = _auto.contraction_sharding(eqn, invals).spec
    else:  # a sum
        (x,) = invals
        parts = _types.partitions(x)
        axes = set(_compat.reduced_dims(eqn))
        over = {a for d in axes for a in _types.spec_axes(parts[d])} & data
        spec = P(*(e for d, e in enumerate(parts) if d not in axes))
    if not over:
        return _rebind.rebind(layout, eqn, invals)
    traced = _compat.out_sharding(eqn)
    key = "out_sharding" if traced is None else traced[0]
    out = NamedSharding(jax.sharding.get_abstract_mesh(), P(*spec, unreduced=frozenset(over)))
    return _rebind.rebind(layout, eqn, invals, _compat.with_params(eqn, **{key: out}))


def keep_unreduced(eqn, invals: list[Any]) -> dict[str, Any] | None:
    """The parameters of an equation on a per-device partial (downstream of :func:`contract_partial`) whose traced
    output sharding names no ``unreduced`` axes (a reshape): the same, ``unreduced`` as its operand is; else
    ``None`` (bound as traced)."""
    over = frozenset().union(*(_types.unreduced_axes(x) for x in invals if hasattr(x, "shape")))
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
        f"value_and_grad(data_axes=...): loss_fn applies a custom rule ({_compat.primitive_name(eqn)}) to a "
        f"parameter (input {i}), and the rule's backward pass does not give that parameter's cotangent as a sum "
        "over the rows (each data shard's part of it), so the per-copy statistics cannot be taken through it. Apply "
        "the rule to the activations and the parameter outside it (e.g. gamma * rule(h) instead of rule(h, gamma)), "
        "or write its backward pass so that the parameter's cotangent is a contraction over the rows (x.T @ ct, "
        "ct.sum(0))."
    )

"""The interpreter: a loss's jaxpr re-evaluated equation by equation, with one rule per class of primitive.

``RULES`` maps a primitive to its rule; every other equation is bound as traced, with three class rules around it:
an equation JAX refuses on a converted Auto mesh gets GSPMD's decision (``_auto``); an equation with a ``reduced``
input that JAX has no rule for, or whose transpose takes no per-copy cotangent, runs forward on plain values with
its VJP per copy (``_local``); a contraction in a custom rule's backward pass that reaches only parameters'
cotangents stays ``unreduced`` (``_custom``). The rules by class:

* gathers: ``reshard`` of a value derived from a parameter sharded over the data axes (FSDP) returns a ``reduced``
  copy through a probe (``_plan`` says where; ``_probe``); ``reshard`` of a ``reduced`` value keeps it
  ``reduced``, and makes it ``reduced`` over a row axis it is gathered off;
* sharding hints: ``sharding_constraint`` and casts to the Auto mesh, on a converted mesh, lose the converted axes;
* calls and control flow: ``jit`` is inlined; ``scan``, ``while``, ``cond`` (its branches agreeing on ``reduced``
  outputs) and ``remat`` are re-made around re-evaluated bodies; ``shard_map`` manual over the data axes takes a
  parameter as one copy per device, over other axes alone it is refused; ``pvary`` of a copy already varying is
  the identity;
* custom rules: ``custom_jvp``/``custom_vjp`` calls re-evaluated; on a parameter, per copy (``_custom``);
* linear maps of ``unreduced`` values: equations of the parameters alone keep their copies apart (``_local``).
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from optax_adascale import _compat
from optax_adascale.gspmd import _auto, _copies, _custom, _layout, _local, _plan
from optax_adascale.gspmd._layout import Layout

# --------------------------------------------------------------------------- the probe


def _probe(layout: Layout, value: Any, slot: Any) -> Any:
    """``value`` unchanged; the cotangent of ``slot`` (a mesh-shaped zero array) becomes each device's local
    ``‖ct‖²`` of ``value``'s unreduced cotangent, masked to count every distinct piece once."""

    @jax.custom_vjp
    def probe(v, s):
        return v

    def fwd(v, s):
        return v, None

    def bwd(_, ct):
        sample = _layout.data_partial(layout, ct)
        return ct, _layout.local_sq(layout, sample, _layout.partial_spec(sample), True)

    probe.defvjp(fwd, bwd)
    return probe(value, slot)


class Interpreter:
    """Evaluate a jaxpr equation by equation with the rules of this module (see the module docstring)."""

    def __init__(self, layout: Layout, convert: frozenset[str], probes: dict[int, Any], partial=frozenset()):
        self.layout, self.convert, self.probes = layout, convert, probes
        self.data = frozenset(layout.data)
        self.rows = layout.rows
        self.partial = partial  # ids of contractions left unreduced (a custom rule's backward pass, _custom)

    def derived(self, partial: frozenset[int]) -> Interpreter:
        """This interpreter with these contractions left ``unreduced`` (``_custom``)."""
        return Interpreter(self.layout, self.convert, self.probes, partial)

    # ------------------------------------------------------------------ the loop

    def eval(self, jaxpr, consts, args, lineage: dict[Any, frozenset] | None = None):
        literal = _compat.literal_type()
        env: dict[Any, Any] = {}
        lin: dict[Any, frozenset] = dict(lineage or {})
        gathered: dict[Any, Any] = {}

        def read(v):
            return self.constant(v.val) if isinstance(v, literal) else env[v]

        for v, x in zip(jaxpr.constvars, consts, strict=True):
            env[v] = self.constant(x)
        for v, x in zip(jaxpr.invars, args, strict=True):
            env[v] = x
        for eqn in jaxpr.eqns:
            invals = [read(v) for v in eqn.invars]
            ins_lin = [frozenset() if isinstance(v, literal) else lin.get(v, frozenset()) for v in eqn.invars]
            name = eqn.primitive.name
            if not (name in _plan.LOOPS or name in _plan.CALLS or _plan.is_remat(name)):
                axes_of = lambda _, i, xs=invals: _layout.axes_of(xs[i])  # noqa: E731 - the values' own types
                for i in _plan.gathered_inputs(eqn, [bool(x) for x in ins_lin], self.data, axes_of):
                    v = eqn.invars[i]
                    if v not in gathered:
                        gathered[v] = self.gather(invals[i], ins_lin[i])
                    invals[i] = gathered[v]
                    ins_lin[i] = frozenset()
            ans = self.equation(eqn, invals, ins_lin)
            outs = ans if eqn.primitive.multiple_results else [ans]
            pure = _plan.pure_leaves(eqn, ins_lin, literal)
            for v, x in zip(eqn.outvars, outs, strict=True):
                env[v] = x
                if pure:
                    lin[v] = pure
        return [read(v) for v in jaxpr.outvars]

    def constant(self, x: Any) -> Any:
        """A literal or captured constant; traced on the Auto mesh, its type names that mesh: re-typed here."""
        if self.convert and not isinstance(x, jax.core.Tracer) and hasattr(x, "dtype"):
            if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):  # a key closed over: rebuilt from its data
                with jax.ensure_compile_time_eval():
                    data = np.asarray(jax.random.key_data(x))
                return jax.random.wrap_key_data(jnp.asarray(data), impl=jax.random.key_impl(x))
            return np.asarray(x)  # also JAX's typed literals (TypedNdArray), which carry the trace's mesh
        return x

    def traced_mesh(self) -> Any:
        """The mesh the loss was traced on (its converted axes Auto again), to trace its custom rules at."""
        auto = {a: jax.sharding.AxisType.Auto for a in self.convert}
        return jax.sharding.use_abstract_mesh(jax.sharding.get_abstract_mesh().update_axis_types(auto))

    def bind(self, eqn, invals, params=None):
        params = eqn.primitive.get_bind_params(eqn.params if params is None else params)
        if self.convert:  # traced on the Auto mesh: bind under the Explicit context, without its Auto shardings
            params = {k: (None if _auto.auto_sharding(v) else v) for k, v in params.items()}
            return eqn.primitive.bind(*invals, **params)
        with eqn.ctx.manager:
            return eqn.primitive.bind(*invals, **params)

    # ------------------------------------------------------------------ the rules

    def equation(self, eqn, invals, lineage):
        name = eqn.primitive.name
        if id(eqn) in self.partial:
            return _custom.contract_partial(self, eqn, invals)
        if self.partial:
            eqn_params = _custom.keep_unreduced(eqn, invals)
            if eqn_params is not None:
                return self.bind(eqn, invals, eqn_params)
        rule = RULES.get("remat" if _plan.is_remat(name) else name)
        if rule is not None:
            return rule(self, eqn, invals, lineage)
        reduced_in = any(_layout.reduced_axes(x) for x in invals if isinstance(x, jax.Array) or hasattr(x, "aval"))
        if name in _local.CUSTOM:
            return self.custom(eqn, invals, reduced_in)
        if reduced_in and self.layout.extra:
            invals = self.widened(invals)
        try:
            out = self.bind(eqn, invals)
        except Exception:  # noqa: BLE001 - JAX has no reduced rule for this equation: the rule its types imply
            if self.convert:
                decided = _auto.decide(self, eqn, invals, reduced_in)
                if decided is not None:
                    return decided[0]
            if not reduced_in:
                raise
            by_rows = _local.elementwise_by_row_shard(self, eqn, invals)
            if by_rows is not None:
                return by_rows
            return _local.local(self, eqn, invals)
        if reduced_in and not _local.keeps_copies(self, eqn, invals, out):
            return _local.local(self, eqn, invals)  # the per-copy rule JAX's types imply, where JAX has none
        return out

    def widened(self, invals):
        """A parameter's copy meeting rows split over more than the data axes (a sequence axis): ``reduced`` over
        those too, so that the partial its transpose contracts is typed as the contraction makes it; the cast's
        own transpose sums it back over them."""
        over = frozenset().union(
            *(self.rows & _layout.axes_of(x) for x in invals if hasattr(x, "shape") and not _layout.reduced_axes(x))
        )
        out = []
        for x in invals:
            red = _layout.reduced_axes(x)
            wider = (over - red) - _layout.axes_of(x) if red else frozenset()
            out.append(jax.reshard(x, P(*_layout.partitions(x), reduced=red | wider)) if wider else x)
        return out

    def contraction_sharding(self, eqn, invals) -> NamedSharding:
        return _auto.contraction_sharding(eqn, invals)

    def constraint(self, eqn, invals, lineage=None):
        (x,) = invals
        if not self.convert:
            return self.bind(eqn, invals)
        return _auto.hint(self, x, getattr(eqn.params["sharding"], "spec", None))

    def call(self, eqn, invals, lineage):
        jaxpr = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
        inner = getattr(jaxpr, "jaxpr", jaxpr)
        consts = getattr(jaxpr, "consts", ())
        return self.eval(inner, consts, invals, _inner_lineage(inner, lineage))

    def custom(self, eqn, invals, reduced_in: bool):
        """A ``custom_jvp``/``custom_vjp`` call, its traced jaxprs (the function, its JVP rule or forward pass)
        re-evaluated with these rules. On ``reduced`` values alone (a rule of the parameters): their copies kept
        apart as through any equation (``_local``). On a parameter and the rows: the rule on plain values, its
        backward pass per copy (``_custom``)."""
        if not reduced_in and not self.convert:
            return self.bind(eqn, invals)
        params = _compat.custom_call_bind_params(
            eqn,
            lambda j, c, a: self.eval(j, [self.constant(x) for x in c], a),
            self.traced_mesh if self.convert else contextlib.nullcontext,
            bwd_auto_axes=tuple(sorted(self.convert)),
        )
        bound = lambda *xs: eqn.primitive.bind(*xs, **params)  # noqa: E731
        if not reduced_in:
            return bound(*invals)
        if not any(self.data & _layout.axes_of(x) for x in invals if not _layout.reduced_axes(x)):
            return _local.local(self, eqn, invals)  # of the parameters alone: its VJP per copy, as any equation's
        if not self.convert and eqn.primitive.name != "custom_jvp_call":
            for x, v in zip(invals, eqn.invars, strict=True):
                traced = getattr(getattr(getattr(v, "aval", None), "sharding", None), "spec", None)
                if traced is not None and hasattr(x, "shape") and _layout.partitions(x) != _pad(traced, jnp.ndim(x)):
                    raise ValueError(_local.custom_refusal())  # its backward rule is typed for the FSDP shards
        return _custom.per_copy(self, bound, eqn, invals)

    def gather(self, x: Any, lineage: frozenset) -> Any:
        """An FSDP leaf's value gathered off the data axes as a ``reduced`` copy, through its probe."""
        parts = tuple(_layout.strip(e, self.data) for e in _layout.partitions(x))
        out = jax.reshard(x, P(*parts, reduced=self.data | _layout.reduced_axes(x)))
        for leaf in lineage:
            if leaf in self.probes:
                out = _probe(self.layout, out, self.probes[leaf])
        return out

    def reshard(self, eqn, invals, lineage):
        (x,) = invals
        target = eqn.params["dst_sharding"]
        if _layout.auto_axes(target.mesh):  # a cast to Auto axes (how .at[].get(out_sharding=) gathers): as traced
            # traced on the Auto mesh and run on the Explicit one, the cast is the hint a constraint is
            return _auto.hint(self, x, target.spec) if self.convert else self.bind(eqn, invals)
        reduced = _layout.reduced_axes(x)
        if not reduced:
            return self.bind(eqn, invals)
        spec = target.spec
        parts = tuple(spec.partitions) + (None,) * (jnp.ndim(x) - len(spec.partitions))
        used = {a for e in parts for a in _layout.spec_axes(e)}  # a reduced value stays reduced where unsharded,
        gathered = (self.rows & _layout.axes_of(x)) - used  # and becomes reduced over a row axis it is gathered off
        return jax.reshard(x, P(*parts, reduced=(reduced | gathered) - used, unreduced=frozenset(spec.unreduced)))

    def scan(self, eqn, invals, lineage):
        params = eqn.params
        nc, ncarry = _compat.scan_counts(params)
        body = params["jaxpr"]
        consts, init, xs = invals[:nc], invals[nc : nc + ncarry], invals[nc + ncarry :]
        inner_lin = {v: lineage[i] for i, v in enumerate(body.jaxpr.invars) if lineage[i]}

        def step(carry, x):
            out = self.eval(body.jaxpr, body.consts, [*consts, *carry, *x], inner_lin)
            return out[:ncarry], out[ncarry:]

        carry, ys = lax.scan(
            step, list(init), list(xs), length=params["length"], reverse=params["reverse"], unroll=params["unroll"]
        )
        return [*carry, *ys]

    def while_loop(self, eqn, invals, lineage):
        params = eqn.params
        cn, bn = params["cond_nconsts"], params["body_nconsts"]
        cond, body = params["cond_jaxpr"], params["body_jaxpr"]
        cond_consts, body_consts, init = invals[:cn], invals[cn : cn + bn], invals[cn + bn :]
        return lax.while_loop(
            lambda c: self.eval(cond.jaxpr, cond.consts, [*cond_consts, *c])[0],
            lambda c: self.eval(body.jaxpr, body.consts, [*body_consts, *c]),
            list(init),
        )

    def cond(self, eqn, invals, lineage):
        """``cond``/``switch``, its branches re-evaluated. A branch of the parameters gives a ``reduced`` output
        where another gives a plain one (a constant): every branch's output is cast to the ``reduced`` type, so
        that the branches agree (the constant's cotangent is dropped with it)."""
        branches = [
            lambda *ops, b=b: self.eval(b.jaxpr, b.consts, list(ops), _inner_lineage(b.jaxpr, lineage[1:]))
            for b in eqn.params["branches"]
        ]
        types = [jax.eval_shape(branch, *invals[1:]) for branch in branches]
        reduced = [frozenset().union(*(_layout.reduced_axes(t[i]) for t in types)) for i in range(len(types[0]))]
        if any(reduced):

            def agreeing(branch):
                def run(*ops):
                    outs = branch(*ops)
                    return [_as_reduced_over(o, r) for o, r in zip(outs, reduced, strict=True)]

                return run

            branches = [agreeing(b) for b in branches]
        return lax.switch(invals[0], branches, *invals[1:])

    def remat(self, eqn, invals, lineage):
        params = eqn.params
        jaxpr = params["jaxpr"]
        inner = getattr(jaxpr, "jaxpr", jaxpr)
        consts = getattr(jaxpr, "consts", ())
        body = lambda *args: self.eval(inner, consts, list(args), _inner_lineage(inner, lineage))  # noqa: E731
        return jax.checkpoint(body, prevent_cse=params.get("prevent_cse", True), policy=params.get("policy"))(*invals)

    def shard_map(self, eqn, invals, lineage=None):
        """A ``shard_map`` in the loss taking ``reduced`` inputs (parameters). Over manual axes the rows are split
        over, each device's block is its own copy: the input goes in as the stacked copies, a block per device,
        whose cotangents come back as the per-device partials (``_copies.copies``). Over other manual axes (a
        model axis) it goes in ``reduced``, its in spec saying so."""
        if not any(_layout.reduced_axes(x) for x in invals):
            return self.bind(eqn, invals)
        params = eqn.params
        manual = _compat.shard_map_manual_axes(params)
        if not manual & self.rows:  # over model or stage axes: JAX takes reduced in specs only when fully manual
            return _local.local(self, eqn, invals)
        in_specs, args, stacked = [], [], []
        for x, spec in zip(invals, params["in_specs"], strict=True):
            red = _layout.reduced_axes(x)
            per_device = red & manual & self.rows
            if per_device:
                copies, entry = _copies.copies(self.layout, x, per_device)
                args.append(copies)
                in_specs.append(P(entry, *spec))
            else:
                args.append(x)
                in_specs.append(P(*spec, reduced=red) if red else spec)
            stacked.append(bool(per_device))
        body = params["jaxpr"]
        inner = getattr(body, "jaxpr", body)
        consts = getattr(body, "consts", ())

        def fn(*xs):
            return tuple(self.eval(inner, consts, [x[0] if s else x for x, s in zip(xs, stacked, strict=True)]))

        out = jax.shard_map(
            fn,
            mesh=params["mesh"],
            in_specs=tuple(in_specs),
            out_specs=tuple(params["out_specs"]),
            axis_names=manual,
            check_vma=params.get("check_vma", params.get("check_rep", True)),
        )(*args)
        return list(out)

    def pvary(self, eqn, invals, lineage=None):
        """``pvary`` (invariant → varying) on a value already varying over those axes (a parameter's copy, one per
        device, in a ``shard_map`` over the row axes): the identity over them."""
        (x,) = invals
        axes = tuple(a for a in eqn.params["axes"] if a not in _compat.varying_axes(x))
        if len(axes) == len(eqn.params["axes"]):
            return self.bind(eqn, invals)
        return self.bind(eqn, invals, dict(eqn.params, axes=axes)) if axes else x


# The rule table: primitive name -> Interpreter method (every other equation is bound as traced, with the
# implied local rule where JAX has no reduced rule for it). "remat" stands for every remat/checkpoint primitive.
RULES: dict[str, Any] = {
    **{name: Interpreter.reshard for name in _plan.GATHERS},
    "sharding_constraint": Interpreter.constraint,
    **{name: Interpreter.call for name in ("jit", "pjit", "closed_call", "core_call")},
    "scan": Interpreter.scan,
    "while": Interpreter.while_loop,
    "cond": Interpreter.cond,
    "remat": Interpreter.remat,
    "shard_map": Interpreter.shard_map,
    "pvary": Interpreter.pvary,
}


def _pad(spec: Any, ndim: int) -> tuple[Any, ...]:
    parts = tuple(spec)
    return parts + (None,) * (ndim - len(parts))


def _as_reduced_over(x: Any, axes: frozenset[str]) -> Any:
    """``x`` typed ``reduced`` over ``axes`` (a free cast of a value replicated over them); as it is if it is."""
    if not axes or _layout.reduced_axes(x) >= axes or not hasattr(x, "shape"):
        return x
    return jax.reshard(x, P(*_layout.partitions(x), reduced=_layout.reduced_axes(x) | axes))


def _inner_lineage(inner, lineage) -> dict[Any, frozenset]:
    return {v: lineage[i] for i, v in enumerate(inner.invars) if i < len(lineage) and lineage[i]}

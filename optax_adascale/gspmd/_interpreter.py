"""The interpreter: a loss's jaxpr re-evaluated equation by equation, one rule per class of primitive.

Each equation's class is looked up in ``_table`` and its rule in :data:`RULES`. A parameter's copy is a value typed
``reduced`` over the row axes (each device holds the copy its rows use); its gradient comes back ``unreduced``, the
per-device partial. The rules by class:

* array primitives (:meth:`Interpreter.array`): without a copy among the operands, as traced (on a converted Auto
  mesh, GSPMD's decision where Explicit types ask for one: ``_auto``). With one: views, broadcasts and sums as
  traced (JAX's types carry a copy through them); a contraction with the rows as traced (JAX's rule: the rows' sum
  is each device's partial); an elementwise equation with the rows with each shard's copy along them
  (``_local.by_rows``); anything else forward on plain values with its VJP per copy (``_local.local``, refused
  where it mixes the rows: ``_rows``). A copy meeting rows split over more than the data axes is ``reduced`` over
  those axes too (:meth:`Interpreter.widened`);
* gathers: ``reshard`` of a value derived from a parameter sharded over the data axes (FSDP) returns a ``reduced``
  copy through a probe (``_plan`` says where; :func:`_probe`); ``reshard`` of a copy keeps it a copy, and makes it
  ``reduced`` over a row axis it is gathered off; sharding hints on a converted mesh lose the converted axes;
* calls and control flow: ``jit`` is inlined; ``scan``, ``while``, ``cond`` (its branches agreeing on ``reduced``
  outputs) and ``remat`` are re-made around re-evaluated bodies; ``shard_map`` manual over the data axes takes a
  copy as one block per device, over other axes alone it is refused; ``pvary`` of a copy already varying is the
  identity;
* custom rules: ``custom_jvp``/``custom_vjp`` calls re-evaluated; on a copy, its backward pass per copy (``_custom``).

An equation of a primitive the table does not know is bound as traced while no copy flows through it; with one,
it is refused with our error naming it and the nearest class (``_table.unknown``). The traversal is
``_compat.walk``, under each equation's name stack: the ops keep the user's ``jax.named_scope``\\ s.
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from optax_adascale import _compat
from optax_adascale.gspmd import _auto, _copies, _custom, _local, _mesh, _plan, _rebind, _stats, _types
from optax_adascale.gspmd._layout import Layout
from optax_adascale.gspmd._table import ARRAY, Kind, kind_of, unknown

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
        sample = _copies.data_partial(layout, ct)
        return ct, _stats.local_sq(layout, sample, _types.partial_spec(sample), True)

    probe.defvjp(fwd, bwd)
    return probe(value, slot)


class Interpreter:
    """Evaluate a jaxpr equation by equation with the rules of this module (see the module docstring)."""

    def __init__(self, layout: Layout, probes: dict[int, Any], partial=frozenset()):
        self.layout, self.probes = layout, probes
        self.convert = layout.convert
        self.data = frozenset(layout.data)
        self.rows = layout.rows
        self.partial = partial  # ids of contractions left unreduced (a custom rule's backward pass, _custom)
        self.in_auto: dict[int, Any] = {}  # copies cast to Auto axes (jax.sharding.auto_axes) by id, see array

    # ------------------------------------------------------------------ the loop

    def eval(self, jaxpr, consts, args, lineage: dict[Any, frozenset] | None = None):
        """``jaxpr`` on ``args``; ``lineage``: the FSDP leaves each input derives from alone (``_plan``)."""
        lin: dict[Any, frozenset] = dict(lineage or {})
        gathered: dict[Any, Any] = {}

        def rule(eqn, invals):
            ins_lin = [frozenset() if _compat.is_literal(v) else lin.get(v, frozenset()) for v in _compat.inputs(eqn)]
            kind = kind_of(_compat.primitive_name(eqn))
            if kind not in _plan.CARRIES_LINEAGE:
                axes_of = lambda _, i, xs=invals: _types.axes_of(xs[i])  # noqa: E731 - the values' own types
                for i in _plan.gathered_inputs(eqn, [bool(x) for x in ins_lin], self.data, axes_of):
                    v = _compat.inputs(eqn)[i]
                    if v not in gathered:
                        gathered[v] = self.gather(invals[i], ins_lin[i])
                    invals[i] = gathered[v]
                    ins_lin[i] = frozenset()
            ans = self.equation(kind, eqn, invals, ins_lin)
            outs = list(ans) if _compat.multiple_results(eqn) else [ans]
            pure = _plan.pure_leaves(eqn, ins_lin)
            if pure:
                lin.update((v, pure) for v in _compat.outputs(eqn))
            return outs

        return _compat.walk(jaxpr, [self.constant(c) for c in consts], args, rule, literal=self.constant, named=True)

    def constant(self, x: Any) -> Any:
        """A literal or captured constant; traced on the Auto mesh, its type names that mesh: re-typed here."""
        if self.convert and not _compat.is_tracer(x) and hasattr(x, "dtype"):
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

    def rebind(self, eqn, invals, params=None):
        return _rebind.rebind(self.layout, eqn, invals, params)

    def evaluate(self, jaxpr, consts, args, partial=frozenset()):
        """``jaxpr`` re-evaluated with these rules, these contractions left ``unreduced`` (``_custom``)."""
        return Interpreter(self.layout, self.probes, partial).eval(jaxpr, consts, args)

    # ------------------------------------------------------------------ the rules

    def equation(self, kind: Kind | None, eqn, invals, lineage):
        if id(eqn) in self.partial:
            return _custom.contract_partial(self.layout, eqn, invals)
        if self.partial and (params := _custom.keep_unreduced(eqn, invals)) is not None:
            return self.rebind(eqn, invals, params)
        if kind is None:
            if any(_types.reduced_axes(x) for x in invals):
                raise ValueError(unknown(_compat.primitive_name(eqn), bool(_compat.sub_jaxprs(eqn))))
            return self.rebind(eqn, invals)
        return RULES[kind](self, eqn, invals, lineage)

    def array(self, eqn, invals, lineage=None):
        """An equation of an array primitive (the module docstring)."""
        kind = kind_of(_compat.primitive_name(eqn))
        if kind is Kind.GROUPED and any(id(x) in self.in_auto for x in invals):
            raise ValueError(_local.grouped_on_auto_axes(self.layout))
        copies = [_types.is_array(x) and bool(_types.reduced_axes(x)) for x in invals]
        if not any(copies):
            return _auto.decide(self.layout, kind, eqn, invals) if self.convert else self.rebind(eqn, invals)
        rows = any(self.data & _types.axes_of(x) for x, c in zip(invals, copies, strict=True) if not c)
        if rows and self.layout.extra:
            invals = self.widened(invals)
        carried = kind in (Kind.VIEW, Kind.BROADCAST, Kind.SUM)
        if carried and not rows and _compat.binds_on_reduced(_compat.primitive_name(eqn)):
            return self.rebind(eqn, invals)
        if kind is Kind.CONTRACTION and rows:
            if not self.convert:
                return self.rebind(eqn, invals)
            invals = _auto.contraction_operands(eqn, invals)
            return self.rebind(eqn, invals, _auto.contraction_params(eqn, invals))
        if kind is Kind.ELEMENTWISE and rows:
            out = _local.by_rows(self.layout, eqn, invals)
            if out is not None:
                return out
        if kind is Kind.GROUPED and rows:
            return _local.by_groups(self.layout, eqn, invals)
        if self.convert and rows and _auto.looks_up(eqn, invals):
            # GSPMD's embedding lookup forward, the gather's own VJP per data shard backward. Not JAX's transpose
            # inside auto_axes: from JAX 0.12.1 it scatters into an Auto-replicated table (the scatter-add takes
            # the operand's sharding as out_sharding), whose cast to unreduced leaves the whole sum on one device
            # (the gradient exact, every per-copy partial wrong).
            forward = lambda xs: _auto.gather_indexed(self.layout, eqn, xs)  # noqa: E731
            return _local.local(self.layout, kind, eqn, invals, forward=forward)
        return _local.local(self.layout, kind, eqn, invals)

    def opaque(self, eqn, invals, lineage=None):
        return self.rebind(eqn, invals)

    def widened(self, invals):
        """A parameter's copy meeting rows split over more than the data axes (a sequence axis): ``reduced`` over
        those too, so that the partial its transpose contracts is typed as the contraction makes it; the cast's
        own transpose sums it back over them."""
        over = frozenset().union(
            *(self.rows & _types.axes_of(x) for x in invals if hasattr(x, "shape") and not _types.reduced_axes(x))
        )
        out = []
        for x in invals:
            red = _types.reduced_axes(x)
            wider = (over - red) - _types.axes_of(x) if red else frozenset()
            out.append(jax.reshard(x, P(*_types.partitions(x), reduced=red | wider)) if wider else x)
        return out

    def constraint(self, eqn, invals, lineage=None):
        (x,) = invals
        if not self.convert:
            return self.rebind(eqn, invals)
        return _auto.hint(self.layout, x, getattr(_compat.target_sharding(eqn), "spec", None))

    def call(self, eqn, invals, lineage):
        jaxpr, consts = _compat.body(eqn)
        return self.eval(jaxpr, consts, invals, _inner_lineage(jaxpr, lineage))

    def custom(self, eqn, invals, lineage=None):
        """A ``custom_jvp``/``custom_vjp`` call, its traced jaxprs (the function, its JVP rule or forward pass)
        re-evaluated with these rules. On ``reduced`` values alone (a rule of the parameters): their copies kept
        apart as through any equation (``_local``). On a parameter and the rows: the rule on plain values, its
        backward pass per copy (``_custom``)."""
        reduced_in = any(_types.reduced_axes(x) for x in invals if _types.is_array(x))
        if not reduced_in and not self.convert:
            return self.rebind(eqn, invals)
        bound = _custom.rebound(
            eqn,
            lambda j, c, a: self.eval(j, [self.constant(x) for x in c], a),
            self.traced_mesh if self.convert else contextlib.nullcontext,
            bwd_auto_axes=tuple(sorted(self.convert)),
        )
        if not reduced_in:
            return bound(*invals)
        if not any(self.data & _types.axes_of(x) for x in invals if not _types.reduced_axes(x)):
            return _local.local(self.layout, Kind.CUSTOM, eqn, invals)  # of the parameters alone: per copy
        if not self.convert and _compat.primitive_name(eqn) != "custom_jvp_call":
            for x, v in zip(invals, _compat.inputs(eqn), strict=True):
                traced = getattr(getattr(_compat.traced_type(v), "sharding", None), "spec", None)
                if traced is not None and hasattr(x, "shape") and _types.partitions(x) != _pad(traced, jnp.ndim(x)):
                    raise ValueError(_local.custom_refusal())  # its backward rule is typed for the FSDP shards
        return _custom.per_copy(self.layout, self.evaluate, bound, eqn, invals)

    def gather(self, x: Any, lineage: frozenset) -> Any:
        """An FSDP leaf's value gathered off the data axes as a ``reduced`` copy, through its probe."""
        parts = tuple(_types.strip(e, self.data) for e in _types.partitions(x))
        out = jax.reshard(x, P(*parts, reduced=self.data | _types.reduced_axes(x)))
        for leaf in lineage:
            if leaf in self.probes:
                out = _probe(self.layout, out, self.probes[leaf])
        return out

    def reshard(self, eqn, invals, lineage):
        (x,) = invals
        target = _compat.target_sharding(eqn)
        if _mesh.auto_axes(target.mesh):  # a cast to Auto axes (how .at[].get(out_sharding=) gathers): as traced
            # traced on the Auto mesh and run on the Explicit one, the cast is the hint a constraint is
            if self.convert:
                return _auto.hint(self.layout, x, target.spec)
            if _types.reduced_axes(x) and not _compat.auto_cast_keeps_partials():
                raise ValueError(_local.copy_on_auto_axes(self.layout))
            out = self.rebind(eqn, invals)
            if _types.reduced_axes(x):  # a copy on Auto axes: JAX 0.10-0.12.0 transposes a grouped matmul of it wrongly
                self.in_auto[id(out)] = out  # kept alive: its id names it while the loss is evaluated
            return out
        reduced = _types.reduced_axes(x)
        if not reduced:
            return self.rebind(eqn, invals)
        spec = target.spec
        parts = tuple(spec.partitions) + (None,) * (jnp.ndim(x) - len(spec.partitions))
        used = {a for e in parts for a in _types.spec_axes(e)}  # a reduced value stays reduced where unsharded,
        gathered = (self.rows & _types.axes_of(x)) - used  # and becomes reduced over a row axis it is gathered off
        return jax.reshard(x, P(*parts, reduced=(reduced | gathered) - used, unreduced=frozenset(spec.unreduced)))

    def scan(self, eqn, invals, lineage):
        nc, ncarry, length, reverse, unroll = _compat.scan_params(eqn)
        body, body_consts = _compat.body(eqn)
        consts, init, xs = invals[:nc], invals[nc : nc + ncarry], invals[nc + ncarry :]
        inner_lin = _inner_lineage(body, lineage)

        def step(carry, x):
            out = self.eval(body, body_consts, [*consts, *carry, *x], inner_lin)
            return out[:ncarry], out[ncarry:]

        init = self.carry_as_the_body_makes_it(step, list(init), list(xs)) if self.convert else list(init)
        carry, ys = lax.scan(step, init, list(xs), length=length, reverse=reverse, unroll=unroll)
        return [*carry, *ys]

    def carry_as_the_body_makes_it(self, step, init: list[Any], xs: list[Any]) -> list[Any]:
        """A scan's initial carry laid out as its body returns it, on a converted Auto mesh: a carry the loss starts
        unsharded (a recurrent layer's zero state, ``jnp.zeros((batch, hidden))``: Flax's ``initialize_carry``) and
        the body returns split over the data axes (it mixes in the rows) is one type on the Auto mesh the loss was
        traced on (GSPMD decides the layout), two on the Explicit one it runs on; the carry is resharded as the body
        makes it, until the two agree (a fixed point in one or two rounds)."""
        slices = jax.eval_shape(lambda xs: [x[0] for x in xs], xs) if xs else []
        for _ in range(3):
            out = jax.eval_shape(lambda c, x: step(c, x)[0], init, slices)
            specs = [getattr(getattr(o, "sharding", None), "spec", None) for o in out]
            changed = False
            for i, (c, spec) in enumerate(zip(init, specs, strict=True)):
                if spec is not None and _types.is_array(c) and tuple(spec) != tuple(_types.partitions(c)):
                    init[i] = jax.reshard(c, spec)
                    changed = True
            if not changed:
                break
        return init

    def while_loop(self, eqn, invals, lineage):
        """``while``: JAX cannot transpose one, so no gradient reaches a parameter through it; its cond and body
        re-evaluated on plain values (a copy as the same numbers on every device: a carry keeps its type through
        the loop), its operands the cond's consts, the body's, then the carry."""
        cn, bn, (cond, cond_consts), (body, body_consts) = _compat.while_params(eqn)
        invals = [_types.plain(x) if _types.is_array(x) else x for x in invals]
        cond_args, body_args, init = invals[:cn], invals[cn : cn + bn], invals[cn + bn :]
        return lax.while_loop(
            lambda c: self.eval(cond, cond_consts, [*cond_args, *c])[0],
            lambda c: self.eval(body, body_consts, [*body_args, *c]),
            list(init),
        )

    def cond(self, eqn, invals, lineage):
        """``cond``/``switch``, its branches re-evaluated. A branch of the parameters gives a ``reduced`` output
        where another gives a plain one (a constant): every branch's output is cast to the ``reduced`` type, so
        that the branches agree (the constant's cotangent is dropped with it)."""
        branches = [
            lambda *ops, b=b, c=c: self.eval(b, c, list(ops), _inner_lineage(b, lineage[1:]))
            for b, c in _compat.cond_branches(eqn)
        ]
        types = [jax.eval_shape(branch, *invals[1:]) for branch in branches]
        reduced = [frozenset().union(*(_types.reduced_axes(t[i]) for t in types)) for i in range(len(types[0]))]
        if any(reduced):

            def agreeing(branch):
                def run(*ops):
                    outs = branch(*ops)
                    return [_as_reduced_over(o, r) for o, r in zip(outs, reduced, strict=True)]

                return run

            branches = [agreeing(b) for b in branches]
        return lax.switch(invals[0], branches, *invals[1:])

    def remat(self, eqn, invals, lineage):
        jaxpr, consts = _compat.body(eqn)
        prevent_cse, policy = _compat.remat_options(eqn)
        body = lambda *args: self.eval(jaxpr, consts, list(args), _inner_lineage(jaxpr, lineage))  # noqa: E731
        return jax.checkpoint(body, prevent_cse=prevent_cse, policy=policy)(*invals)

    def shard_map(self, eqn, invals, lineage=None):
        """A ``shard_map`` in the loss taking ``reduced`` inputs (parameters). Over manual axes the rows are split
        over, each device's block is its own copy: the input goes in as the stacked copies, a block per device,
        whose cotangents come back as the per-device partials (``_copies.copies``). Over other manual axes alone (a
        model axis), of the parameters alone it runs per copy (``_local``); with the rows it is refused."""
        if not any(_types.reduced_axes(x) for x in invals):
            return self.rebind(eqn, invals)
        sm = _compat.shard_map_params(eqn)
        if not sm.manual_axes & self.rows:  # JAX takes reduced in specs only when fully manual
            if any(self.data & _types.axes_of(x) for x in invals if not _types.reduced_axes(x)):
                raise ValueError(_manual_over_other_axes())
            return _local.local(self.layout, Kind.SHARD_MAP, eqn, invals)
        in_specs, args, stacked = [], [], []
        for x, spec in zip(invals, sm.in_specs, strict=True):
            red = _types.reduced_axes(x)
            per_device = red & sm.manual_axes & self.rows
            if per_device:
                copies, entry = _copies.copies(self.layout, x, per_device)
                args.append(copies)
                in_specs.append(P(entry, *spec))
            else:
                args.append(x)
                in_specs.append(P(*spec, reduced=red) if red else spec)
            stacked.append(bool(per_device))
        body, consts = _compat.body(eqn)

        def fn(*xs):
            return tuple(self.eval(body, consts, [x[0] if s else x for x, s in zip(xs, stacked, strict=True)]))

        out = jax.shard_map(
            fn,
            mesh=sm.mesh,
            in_specs=tuple(in_specs),
            out_specs=sm.out_specs,
            axis_names=sm.manual_axes,
            check_vma=sm.check_vma,
        )(*args)
        return list(out)

    def pvary(self, eqn, invals, lineage=None):
        """``pvary`` (invariant → varying) on a value already varying over those axes (a parameter's copy, one per
        device, in a ``shard_map`` over the row axes): the identity over them."""
        (x,) = invals
        cast = _compat.cast_axes(eqn)
        axes = tuple(a for a in cast if a not in _compat.varying_axes(x))
        if len(axes) == len(cast):
            return self.rebind(eqn, invals)
        return self.rebind(eqn, invals, _compat.with_params(eqn, axes=axes)) if axes else x


# The rule of each class of primitive (``_table.Kind``).
RULES: dict[Kind, Any] = {
    **{kind: Interpreter.array for kind in ARRAY},
    Kind.OPAQUE: Interpreter.opaque,
    Kind.GATHER: Interpreter.reshard,
    Kind.HINT: Interpreter.constraint,
    Kind.CALL: Interpreter.call,
    Kind.REMAT: Interpreter.remat,
    Kind.SCAN: Interpreter.scan,
    Kind.WHILE: Interpreter.while_loop,
    Kind.COND: Interpreter.cond,
    Kind.SHARD_MAP: Interpreter.shard_map,
    Kind.CUSTOM: Interpreter.custom,
    Kind.CAST: Interpreter.pvary,
}


def _pad(spec: Any, ndim: int) -> tuple[Any, ...]:
    parts = tuple(spec)
    return parts + (None,) * (ndim - len(parts))


def _as_reduced_over(x: Any, axes: frozenset[str]) -> Any:
    """``x`` typed ``reduced`` over ``axes`` (a free cast of a value replicated over them); as it is if it is."""
    if not axes or _types.reduced_axes(x) >= axes or not hasattr(x, "shape"):
        return x
    return jax.reshard(x, P(*_types.partitions(x), reduced=_types.reduced_axes(x) | axes))


def _inner_lineage(inner, lineage) -> dict[Any, frozenset]:
    return {v: lineage[i] for i, v in enumerate(inner.invars) if i < len(lineage) and lineage[i]}


def _manual_over_other_axes() -> str:
    return (
        "value_and_grad(data_axes=...): loss_fn passes a parameter into a jax.shard_map that is manual over other "
        "axes than the data axes (a pipeline stage or model axis) while the batch's rows stay sharded over the "
        "data axes inside it. JAX takes a parameter's per-copy (reduced) type into a shard_map only when it is "
        "manual over every axis, and the shard_map's body is traced for the whole batch, so it cannot run on each "
        "data shard's rows either. Make the shard_map manual over the data axes too (add them to axis_names and "
        "shard the batch's rows over them in in_specs/out_specs): each device then gets its own copy of the "
        "parameter and the statistics are exact."
    )

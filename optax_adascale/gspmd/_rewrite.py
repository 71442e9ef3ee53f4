"""The loss as the drop-in differentiates it: its jaxpr re-evaluated with a rule table.

:class:`Probed` traces the loss once (with the parameters as the user passes them) and re-evaluates
its jaxpr equation by equation (:class:`Interpreter`), one rule per primitive (``RULES``):

* ``reshard`` of a value derived from a parameter sharded over the data axes (FSDP), that gathers it
  over them (where: ``_plan``): the gather returns a ``reduced`` copy and passes a *probe*, whose
  backward pass records each device's ``‖partial‖²`` before the gather's transpose reduce-scatters it.
  Inside a scanned stack of layers the probe is a constant of the loop body, so its per-layer records
  add up.
* ``reshard`` of a ``reduced`` value keeps it ``reduced``: a reshard to a plain type would sum its
  cotangent onto one device.
* ``sharding_constraint``, and a cast to the Auto mesh, on a mesh whose Auto axes were made Explicit for
  the loss: those axes leave the spec (the types carry them now).
* ``shard_map`` taking a ``reduced`` value: its ``in_specs`` say so.
* any equation JAX has no ``reduced`` rule for (it raises), and ``custom_jvp``/``custom_vjp`` calls on
  ``reduced`` values: the rule JAX's types imply, per data shard (``_local``).
* ``jit`` is inlined; ``scan``, ``while``, ``cond`` and ``remat`` are re-made around re-evaluated bodies.
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
from optax_adascale.gspmd import _custom, _layout, _local, _plan
from optax_adascale.gspmd._layout import Layout

# --------------------------------------------------------------------------- the loss's value


def _shared(layout: Layout, value: Any) -> Any:
    """A loss value typed ``reduced`` (a term of the parameters alone, e.g. a penalty) as a plain value whose
    cotangent reaches every data shard's copy in equal parts (``1/n`` each, every sample's loss holding the
    whole term, as in per-replica training). A plain value is returned as it is.

    JAX seeds a ``reduced`` output's gradient differently with and without ``jax.checkpoint`` in the
    program; this rule does not depend on it.
    """
    reduced = _layout.reduced_axes(value) & layout.rows
    if not reduced:
        return value
    n = float(np.prod([layout.size(a) for a in reduced]))
    parts = _layout.partitions(value)

    @jax.custom_vjp
    def share(v):
        return jax.reshard(v, P(*parts))

    def fwd(v):
        return share(v), None

    def bwd(_, ct):
        split = jax.shard_map(
            lambda c: c / n,
            mesh=layout.mesh,
            in_specs=P(*parts),
            out_specs=P(*parts, unreduced=reduced),
            check_vma=False,
        )(ct)
        return (split,)

    share.defvjp(fwd, bwd)
    return share(value)


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


# --------------------------------------------------------------------------- the interpreter


class Probed:
    """The loss re-evaluated from its jaxpr with the rules above.

    ``fsdp``: the indices of the leaves sharded over the data axes; ``convert``: the axes made Explicit
    for the loss (their ``with_sharding_constraint``\\ s are dropped); ``trace``: ``(leaves, batch_leaves,
    batch_tree) -> (closed jaxpr, out_tree)`` of the flattened loss, or ``None`` to trace it here with the
    leaves' own types. :meth:`prepare` traces (once) and decides, per FSDP leaf, probe or hoist.
    """

    def __init__(self, loss_fn, treedef, fsdp, layout: Layout, convert, has_aux, trace=None):
        self.loss_fn, self.treedef, self.fsdp = loss_fn, treedef, tuple(fsdp)
        self.layout, self.convert, self.has_aux = layout, frozenset(convert), has_aux
        self.trace = trace
        self.closed: Any = None
        self.out_tree: Any = None
        self.probed: tuple[int, ...] = ()
        self.hoisted: tuple[int, ...] = ()

    def _flat_loss(self, n_leaves: int, batch_tree):
        def flat(*args):
            params = self.treedef.unflatten(list(args[:n_leaves]))
            out = self.loss_fn(params, *batch_tree.unflatten(list(args[n_leaves:])))
            flat_out, tree = jax.tree.flatten(out if self.has_aux else (out, None))
            self.out_tree = tree
            return flat_out

        return flat

    def prepare(self, plain_leaves: list[Any], batch: Any) -> None:
        """Trace the loss once, at these shapes (arrays or ``ShapeDtypeStruct``\\ s), and place the probes."""
        batch_leaves, batch_tree = jax.tree.flatten(batch)
        if self.trace is not None:
            self.closed, self.out_tree = self.trace(plain_leaves, batch_leaves, batch_tree)
        else:
            avals = [_aval(x) for x in [*plain_leaves, *batch_leaves]]
            self.closed = jax.make_jaxpr(self._flat_loss(len(plain_leaves), batch_tree))(*avals)
        plan = _plan.Plan()
        jaxpr = self.closed.jaxpr
        data = frozenset(self.layout.data)
        lineage = {jaxpr.invars[i]: frozenset({(i, False)}) for i in self.fsdp}
        _plan.walk(jaxpr, lineage, data, plan, _plan.typed_axes(data, typed=not self.convert))
        literal = _compat.literal_type()
        if jaxpr.outvars and not isinstance(jaxpr.outvars[0], literal):  # the loss itself from FSDP leaves alone
            plan.hoist.update(i for i in self.fsdp if jaxpr.outvars[0] in jaxpr.invars)
        self.probed = plan.probed(self.fsdp)
        self.hoisted = tuple(i for i in self.fsdp if i not in self.probed)

    def entry(self, cast: list[Any]) -> list[Any]:
        """The leaves as the loss receives them: hoisted FSDP leaves gathered here, as reduced copies."""
        data = frozenset(self.layout.data)
        leaves = list(cast)
        for i in self.hoisted:
            leaves[i] = jax.reshard(
                cast[i], P(*(_layout.strip(e, data) for e in _layout.partitions(cast[i])), reduced=data)
            )
        return leaves

    def __call__(self, leaves: list[Any], batch: tuple[Any, ...]):
        """``(value, aux, partials, probe_sq)``: probed leaves' partials reduce-scattered, their ‖·‖² arrays."""
        closed = self.closed
        batch_leaves = jax.tree.leaves(batch)
        slots = {
            i: jnp.zeros(self.layout.axis_sizes, jnp.float32, out_sharding=self.layout.mesh_spec()) for i in self.probed
        }

        def loss(leaves, slots):
            interp = Interpreter(self.layout, self.convert, probes=slots)
            lineage = {closed.jaxpr.invars[i]: frozenset({i}) for i in self.probed}
            out = interp.eval(closed.jaxpr, closed.consts, [*leaves, *batch_leaves], lineage)
            value, aux = self.out_tree.unflatten(out)
            return _shared(self.layout, value), aux

        (value, aux), (partials, probe_sq) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(leaves, slots)
        return value, aux, list(partials), dict(probe_sq)


def _aval(x: Any) -> jax.ShapeDtypeStruct:
    aval = jax.typeof(x)
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=aval.sharding, weak_type=aval.weak_type)


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
            params = {k: (None if _auto_sharding(v) else v) for k, v in params.items()}
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
                decided = self.gspmd_decision(eqn, invals, reduced_in)
                if decided is not None:
                    return decided[0]
            if not reduced_in:
                raise
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

    def gspmd_decision(self, eqn, invals, reduced_in: bool):
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
                tries.append(lambda: self.bind(eqn, aligned))
        if eqn.primitive.name == "dot_general":
            params = dict(eqn.params, out_sharding=self.contraction_sharding(eqn, invals))
            tries.append(lambda: self.bind(eqn, invals, params))
        every = frozenset(self.layout.axis_names)
        model = every - self.data
        if any(model & _layout.axes_of(x) for x in invals):
            tries.append(lambda: self.bind(eqn, [_off_axes(x, model) for x in invals]))
        if eqn.primitive.name == "gather":
            tries.append(lambda: self.gather_indexed(eqn, invals))
        if not reduced_in and any(self.data & _layout.axes_of(x) for x in invals):  # across the rows (sort)
            tries.append(lambda: self.bind(eqn, [_off_axes(x, every) for x in invals]))
        for attempt in tries:
            try:
                return (attempt(),)
            except Exception:  # noqa: BLE001 - not this decision: the next one
                continue
        return None

    def contraction_sharding(self, eqn, invals) -> NamedSharding:
        """GSPMD's output sharding for a ``dot_general``: batch and free dimensions keep their operands' specs,
        the contracted axes (and any axis already used) are dropped: the partial products are summed."""
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        lhs, rhs = (_layout.partitions(x) for x in invals)
        contracted = {a for d in lc for a in _layout.spec_axes(lhs[d])} | {
            a for d in rc for a in _layout.spec_axes(rhs[d])
        }
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

    def gather_indexed(self, eqn, invals):
        """A gather traced on Auto axes that Explicit types find ambiguous (an embedding lookup): run with the
        converted axes Auto, its output sharded like its indices' batch dimensions (``.at[].get(out_sharding=)``)."""
        operand, indices = invals
        offset = set(eqn.params["dimension_numbers"].offset_dims)
        batch = iter(_layout.partitions(indices)[:-1])
        out_rank = len(offset) + jnp.ndim(indices) - 1
        parts = [None if d in offset else next(batch) for d in range(out_rank)]
        parts = [_layout.strip(e, frozenset(self.layout.axis_names) - self.convert) for e in parts]
        fn = lambda op, idx: self.bind(eqn, [op, idx])  # noqa: E731
        return jax.sharding.auto_axes(fn, axes=tuple(sorted(self.convert)), out_sharding=P(*parts))(operand, indices)

    def reshard(self, eqn, invals, lineage):
        (x,) = invals
        target = eqn.params["dst_sharding"]
        if _layout.auto_axes(target.mesh):  # a cast to Auto axes (how .at[].get(out_sharding=) gathers): as traced
            # traced on the Auto mesh and run on the Explicit one, the cast is the hint a constraint is
            return self._hint(x, target.spec) if self.convert else self.bind(eqn, invals)
        reduced = _layout.reduced_axes(x)
        if not reduced:
            return self.bind(eqn, invals)
        spec = target.spec
        parts = tuple(spec.partitions) + (None,) * (jnp.ndim(x) - len(spec.partitions))
        used = {a for e in parts for a in _layout.spec_axes(e)}  # a reduced value stays reduced where unsharded,
        gathered = (self.rows & _layout.axes_of(x)) - used  # and becomes reduced over a row axis it is gathered off
        return jax.reshard(x, P(*parts, reduced=(reduced | gathered) - used, unreduced=frozenset(spec.unreduced)))

    def constraint(self, eqn, invals, lineage=None):
        (x,) = invals
        if not self.convert:
            return self.bind(eqn, invals)
        return self._hint(x, getattr(eqn.params["sharding"], "spec", None))

    def _hint(self, x, spec):
        """A sharding written for the Auto mesh, on the Explicit one: its axes not made Explicit, as a constraint."""
        if spec is None:
            return x
        parts = tuple(_layout.strip(e, self.convert) for e in spec.partitions)
        if all(p is None for p in parts):
            return x
        return lax.with_sharding_constraint(x, P(*parts))

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
        whose cotangents come back as the per-device partials (``_local.copies``). Over other manual axes (a
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
                copies, entry = _local.copies(self.layout, x, per_device)
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


def _pad(spec: Any, ndim: int) -> tuple[Any, ...]:
    parts = tuple(spec)
    return parts + (None,) * (ndim - len(parts))


def _as_reduced_over(x: Any, axes: frozenset[str]) -> Any:
    """``x`` typed ``reduced`` over ``axes`` (a free cast of a value replicated over them); as it is if it is."""
    if not axes or _layout.reduced_axes(x) >= axes or not hasattr(x, "shape"):
        return x
    return jax.reshard(x, P(*_layout.partitions(x), reduced=_layout.reduced_axes(x) | axes))


def _off_axes(x: Any, axes: frozenset[str]) -> Any:
    """``x`` gathered off ``axes`` (its ``reduced`` axes kept); anything else as it is."""
    if not isinstance(x, jax.Array) and not hasattr(x, "aval"):
        return x
    if not jnp.ndim(x) or not axes & _layout.axes_of(x):
        return x
    parts = tuple(_layout.strip(e, axes) for e in _layout.partitions(x))
    return jax.reshard(x, P(*parts, reduced=_layout.reduced_axes(x)))


def _auto_sharding(v: Any) -> bool:
    """A sharding parameter naming a mesh with Auto axes (a loss traced on such a mesh): dropped when re-bound."""
    mesh = getattr(v, "mesh", None)
    return isinstance(v, NamedSharding) and mesh is not None and bool(_layout.auto_axes(mesh))


def _inner_lineage(inner, lineage) -> dict[Any, frozenset]:
    return {v: lineage[i] for i, v in enumerate(inner.invars) if i < len(lineage) and lineage[i]}

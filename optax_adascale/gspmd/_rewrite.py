"""The loss as the drop-in differentiates it: called as written, or its jaxpr re-evaluated with a rule table.

:class:`Plain` calls the loss with the parameters cast to ``reduced`` over the data axes: JAX's own
rules carry the types through, and ``jax.grad`` returns each data shard's partial. Where that is not
enough, :class:`Probed` traces the loss once (with the parameters as the user passes them) and
re-evaluates its jaxpr equation by equation (:class:`Interpreter`), one rule per primitive:

* ``reshard`` of a value derived from a parameter sharded over the data axes (FSDP), that gathers it
  over them: the gather returns a ``reduced`` copy and passes a *probe*, whose backward pass records
  each device's ``‖partial‖²`` before the gather's transpose reduce-scatters it. Inside a scanned
  stack of layers the probe is a constant of the loop body, so its per-layer records add up. A leaf
  gathered more than once, or inside a loop that is not over its own layers, is gathered once at the
  loss's entry instead (it then behaves as a replicated parameter; its gathered copy lives throughout).
* ``reshard`` of a ``reduced`` value keeps it ``reduced``: a reshard to a plain type would sum its
  cotangent onto one device.
* ``sharding_constraint`` on a mesh whose Auto axes were made Explicit for the loss: those axes leave
  the spec (the types carry them now).
* ``shard_map`` taking a ``reduced`` value: its ``in_specs`` say so.
* any equation JAX has no ``reduced`` rule for (it raises), and ``custom_jvp``/``custom_vjp`` calls on
  ``reduced`` values: evaluated on the plain values, with a backward pass that applies the equation's
  own VJP to each device's partial cotangent, the data axes manual (a ``shard_map``). That is the rule
  JAX's types imply; it needs the equation to be local to the rows (its output sharded over the data
  axes where an input is), else a ``ValueError``.
* ``jit`` is inlined; ``scan``, ``while``, ``cond`` and ``remat`` are re-made around re-evaluated bodies.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from optax_adascale import _compat
from optax_adascale.gspmd import _layout
from optax_adascale.gspmd._layout import Layout

_GATHERS = ("reshard",)
_CUSTOM = ("custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr")


def _spec(x: Any) -> P:
    return jax.typeof(x).sharding.spec


def _parts(x: Any) -> tuple[Any, ...]:
    return _layout.partitions(x)


def _reduced(x: Any) -> frozenset[str]:
    try:
        return frozenset(getattr(_spec(x), "reduced", frozenset()))
    except AttributeError:
        return frozenset()


def _unreduced(x: Any) -> frozenset[str]:
    try:
        return frozenset(getattr(_spec(x), "unreduced", frozenset()))
    except AttributeError:
        return frozenset()


def _strip(entry: Any, axes: frozenset[str]) -> Any:
    kept = tuple(a for a in _layout.spec_axes(entry) if a not in axes)
    return None if not kept else kept[0] if len(kept) == 1 else kept


def _plain(x: Any) -> Any:
    """A ``reduced`` value as a plain one (forward only: the same numbers on every device)."""
    return jax.reshard(x, P(*_parts(x))) if _reduced(x) else x


# --------------------------------------------------------------------------- where FSDP leaves are gathered


_LOOPS = ("scan", "while")
_CALLS = ("jit", "pjit", "closed_call", "core_call", "cond")


def _is_remat(name: str) -> bool:
    return name.startswith("remat") or name == "checkpoint"


def _var_axes(v: Any) -> frozenset[str]:
    """The mesh axes a jaxpr variable's type is sharded over (Explicit types)."""
    aval = getattr(v, "aval", None)
    sharding = getattr(aval, "sharding", None)
    spec = getattr(sharding, "spec", None)
    if spec is None:
        return frozenset()
    return frozenset(a for e in spec.partitions for a in _layout.spec_axes(e))


def _gathered_inputs(eqn, pure: list[bool], data: frozenset[str]) -> list[int]:
    """The inputs of ``eqn`` that are FSDP gathers: values derived from FSDP leaves alone, sharded over the data
    axes, met by something else (a mixing equation) or resharded off the data axes."""
    literal = _compat.literal_type()
    real = [i for i, v in enumerate(eqn.invars) if not isinstance(v, literal)]
    if eqn.primitive.name in _GATHERS:
        v = eqn.invars[0]
        target = eqn.params["dst_sharding"].spec
        off = data & _var_axes(v) - frozenset(a for e in target.partitions for a in _layout.spec_axes(e))
        return [0] if pure[0] and off else []
    if all(pure[i] for i in real) and eqn.primitive.name in _TRANSPARENT:
        return []  # a view of the parameter (its cotangent the same numbers): evaluated as traced
    return [i for i in real if pure[i] and data & _var_axes(eqn.invars[i])]


# Equations of one parameter whose VJP hands the cotangent back unchanged but for layout or dtype: an FSDP leaf
# passes through them before its gather. Any other use gathers it first, so that the probe sees ∂L/∂θ_i itself.
_TRANSPARENT = frozenset(
    ("reshape", "transpose", "convert_element_type", "squeeze", "expand_dims", "copy", "copy_p", "sharding_constraint")
)


@dataclasses.dataclass
class _Plan:
    """Where each FSDP leaf is gathered: the distinct gathered values, and uses that rule out probing it."""

    sites: dict[int, set] = dataclasses.field(default_factory=dict)
    hoist: set = dataclasses.field(default_factory=set)

    def probed(self, fsdp: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(i for i in fsdp if i not in self.hoist and len(self.sites.get(i, ())) == 1)


def _plan(jaxpr, lineage: dict[Any, frozenset], data: frozenset[str], plan: _Plan, loop: bool = False) -> None:
    """Walk the jaxpr with each variable's FSDP lineage (``lineage[var] = {(leaf, sliced)}``: derived from those
    leaves alone; ``sliced``: a per-iteration slice of a scanned stack) and record the gathers."""
    literal = _compat.literal_type()
    for eqn in jaxpr.eqns:
        ins = [frozenset() if isinstance(v, literal) else lineage.get(v, frozenset()) for v in eqn.invars]
        name = eqn.primitive.name
        if name == "scan":
            nc, ncarry = _compat.scan_counts(eqn.params)
            body = eqn.params["jaxpr"].jaxpr
            inner = {}
            for i, v in enumerate(body.invars):
                src = ins[i] if i < len(ins) else frozenset()
                inner[v] = frozenset((leaf, True) for leaf, _ in src) if i >= nc + ncarry else src
            _plan(body, inner, data, plan, loop=True)
        elif name in _LOOPS or name in _CALLS or _is_remat(name):
            for sub in _subjaxprs(eqn):
                offset = 1 if name == "cond" else 0
                inner = {v: ins[i + offset] for i, v in enumerate(sub.invars) if i + offset < len(ins)}
                _plan(sub, inner, data, plan, loop=loop or name == "while")
        else:
            pure = [bool(lin) for lin in ins]
            for i in _gathered_inputs(eqn, pure, data):
                for leaf, sliced in ins[i]:
                    plan.sites.setdefault(leaf, set()).add(eqn.invars[i])
                    if loop and not sliced:
                        plan.hoist.add(leaf)  # the same copy gathered on every iteration
            real = [i for i, v in enumerate(eqn.invars) if not isinstance(v, literal)]
            if real and not all(pure[i] for i in real):  # a replicated FSDP-derived value meets the batch
                for i in real:
                    if pure[i] and not data & _var_axes(eqn.invars[i]):
                        plan.hoist.update(leaf for leaf, _ in ins[i])
        derived = _pure(eqn, ins, literal)
        for v in eqn.outvars:
            if derived:
                lineage[v] = derived


def _pure(eqn, ins, literal) -> frozenset:
    """The FSDP leaves an equation's outputs derive from, if they derive from parameters alone (else none)."""
    real = [lin for v, lin in zip(eqn.invars, ins, strict=True) if not isinstance(v, literal)]
    if not real or not all(real):
        return frozenset()
    return frozenset().union(*real)


def _subjaxprs(eqn) -> list[Any]:
    out = []
    for key in sorted(eqn.params):
        value = eqn.params[key]
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if hasattr(v, "eqns"):
                out.append(v)
            elif hasattr(v, "jaxpr") and hasattr(v.jaxpr, "eqns"):
                out.append(v.jaxpr)
    return out


# --------------------------------------------------------------------------- the loss's value


def _shared(layout: Layout, value: Any) -> Any:
    """A loss value typed ``reduced`` (a term of the parameters alone, e.g. a penalty) as a plain value whose
    cotangent reaches every data shard's copy in equal parts (``1/n`` each, every sample's loss holding the
    whole term, as in per-replica training). A plain value is returned as it is.

    JAX seeds a ``reduced`` output's gradient differently with and without ``jax.checkpoint`` in the
    program; this rule does not depend on it.
    """
    reduced = _reduced(value) & frozenset(layout.data)
    if not reduced:
        return value
    n = float(np.prod([layout.size(a) for a in reduced]))
    parts = _parts(value)

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
        spec = _spec(ct)
        return ct, _layout.local_sq(layout, ct, P(*_parts(ct), unreduced=frozenset(spec.unreduced)), True)

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
        plan = _Plan()
        jaxpr = self.closed.jaxpr
        _plan(jaxpr, {jaxpr.invars[i]: frozenset({(i, False)}) for i in self.fsdp}, frozenset(self.layout.data), plan)
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
            leaves[i] = jax.reshard(cast[i], P(*(_strip(e, data) for e in _parts(cast[i])), reduced=data))
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

    def __init__(self, layout: Layout, convert: frozenset[str], probes: dict[int, Any]):
        self.layout, self.convert, self.probes = layout, convert, probes
        self.data = frozenset(layout.data)

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
            if not (name in _LOOPS or name in _CALLS or _is_remat(name)):
                for i in _gathered_inputs(eqn, [bool(x) for x in ins_lin], self.data):
                    v = eqn.invars[i]
                    if v not in gathered:
                        gathered[v] = self.gather(invals[i], ins_lin[i])
                    invals[i] = gathered[v]
                    ins_lin[i] = frozenset()
            ans = self.equation(eqn, invals, ins_lin)
            outs = ans if eqn.primitive.multiple_results else [ans]
            pure = _pure(eqn, ins_lin, literal)
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
        rule = RULES.get("remat" if _is_remat(name) else name)
        if rule is not None:
            return rule(self, eqn, invals, lineage)
        reduced_in = any(_reduced(x) for x in invals if isinstance(x, jax.Array) or hasattr(x, "aval"))
        if name in _CUSTOM:
            return self.custom(eqn, invals, reduced_in)
        try:
            return self.bind(eqn, invals)
        except Exception:  # noqa: BLE001 - JAX has no reduced rule for this equation: the rule its types imply
            if self.convert and not reduced_in:
                aligned = _aligned(invals)
                if aligned is not None:  # Explicit types want same-shape operands sharded alike (select_n)
                    return self.bind(eqn, aligned)
            if name == "gather" and self.convert:
                try:
                    return self.gather_indexed(eqn, invals)
                except Exception:  # noqa: BLE001 - a reduced table auto_axes does not take: the implied rule below
                    if not reduced_in:
                        raise
            if not reduced_in:
                raise
            return self.local(eqn, invals)

    def call(self, eqn, invals, lineage):
        jaxpr = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
        inner = getattr(jaxpr, "jaxpr", jaxpr)
        consts = getattr(jaxpr, "consts", ())
        return self.eval(inner, consts, invals, _inner_lineage(inner, lineage))

    def custom(self, eqn, invals, reduced_in: bool):
        """A ``custom_jvp``/``custom_vjp`` call: on ``reduced`` values the implied local rule; traced on Auto
        axes, its jaxprs re-evaluated here too; else bound as traced."""
        if reduced_in:
            return self.local(eqn, invals)
        if not self.convert:
            return self.bind(eqn, invals)
        params = _compat.custom_call_bind_params(
            eqn,
            lambda j, c, a: self.eval(j, [self.constant(x) for x in c], a),
            self.traced_mesh,
            bwd_auto_axes=tuple(sorted(self.convert)),
        )
        return eqn.primitive.bind(*invals, **params)

    def gather(self, x: Any, lineage: frozenset) -> Any:
        """An FSDP leaf's value gathered off the data axes as a ``reduced`` copy, through its probe."""
        parts = tuple(_strip(e, self.data) for e in _parts(x))
        out = jax.reshard(x, P(*parts, reduced=self.data | _reduced(x)))
        for leaf in lineage:
            if leaf in self.probes:
                out = _probe(self.layout, out, self.probes[leaf])
        return out

    def gather_indexed(self, eqn, invals):
        """A gather traced on Auto axes that Explicit types find ambiguous (an embedding lookup): run with the
        converted axes Auto, its output sharded like its indices' batch dimensions (``.at[].get(out_sharding=)``)."""
        operand, indices = invals
        offset = set(eqn.params["dimension_numbers"].offset_dims)
        batch = iter(_parts(indices)[:-1])
        out_rank = len(offset) + jnp.ndim(indices) - 1
        parts = [None if d in offset else next(batch) for d in range(out_rank)]
        parts = [_strip(e, frozenset(self.layout.axis_names) - self.convert) for e in parts]
        fn = lambda op, idx: self.bind(eqn, [op, idx])  # noqa: E731
        return jax.sharding.auto_axes(fn, axes=tuple(sorted(self.convert)), out_sharding=P(*parts))(operand, indices)

    def reshard(self, eqn, invals, lineage):
        (x,) = invals
        target = eqn.params["dst_sharding"]
        if _layout.auto_axes(target.mesh):  # a cast to Auto axes (how .at[].get(out_sharding=) gathers): as traced
            # traced on the Auto mesh and run on the Explicit one, the cast is the hint a constraint is
            return self._hint(x, target.spec) if self.convert else self.bind(eqn, invals)
        reduced = _reduced(x)
        if not reduced:
            return self.bind(eqn, invals)
        spec = target.spec
        parts = tuple(spec.partitions) + (None,) * (jnp.ndim(x) - len(spec.partitions))
        used = {a for e in parts for a in _layout.spec_axes(e)}  # a reduced value stays reduced where unsharded
        return jax.reshard(x, P(*parts, reduced=reduced - used, unreduced=frozenset(spec.unreduced)))

    def constraint(self, eqn, invals, lineage=None):
        (x,) = invals
        if not self.convert:
            return self.bind(eqn, invals)
        return self._hint(x, getattr(eqn.params["sharding"], "spec", None))

    def _hint(self, x, spec):
        """A sharding written for the Auto mesh, on the Explicit one: its axes not made Explicit, as a constraint."""
        if spec is None:
            return x
        parts = tuple(_strip(e, self.convert) for e in spec.partitions)
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
        branches = [
            lambda *ops, b=b: self.eval(b.jaxpr, b.consts, list(ops), _inner_lineage(b.jaxpr, lineage[1:]))
            for b in eqn.params["branches"]
        ]
        return lax.switch(invals[0], branches, *invals[1:])

    def remat(self, eqn, invals, lineage):
        params = eqn.params
        jaxpr = params["jaxpr"]
        inner = getattr(jaxpr, "jaxpr", jaxpr)
        consts = getattr(jaxpr, "consts", ())
        body = lambda *args: self.eval(inner, consts, list(args), _inner_lineage(inner, lineage))  # noqa: E731
        return jax.checkpoint(body, prevent_cse=params.get("prevent_cse", True), policy=params.get("policy"))(*invals)

    def shard_map(self, eqn, invals, lineage=None):
        """A ``shard_map`` in the loss: ``reduced`` inputs get ``reduced`` in specs (over its manual data axes)."""
        if not any(_reduced(x) for x in invals):
            return self.bind(eqn, invals)
        params = eqn.params
        manual = frozenset(params.get("manual_axes", params.get("axis_names", ())))
        in_specs = []
        for x, spec in zip(invals, params["in_specs"], strict=True):
            red = _reduced(x)
            in_specs.append(P(*spec.partitions, reduced=red) if red else spec)
        body = params["jaxpr"]
        inner = getattr(body, "jaxpr", body)
        consts = getattr(body, "consts", ())
        fn = lambda *args: self.eval(inner, consts, list(args))  # noqa: E731
        out = jax.shard_map(
            fn,
            mesh=params["mesh"],
            in_specs=tuple(in_specs),
            out_specs=tuple(params["out_specs"]),
            axis_names=manual,
            check_vma=params.get("check_vma", params.get("check_rep", True)),
        )(*invals)
        return list(out)

    # ------------------------------------------------------------------ JAX has no reduced rule: the implied one

    def local(self, eqn, invals):
        """The equation on plain values; its VJP applied to each device's partial cotangent (data axes manual).

        With only ``reduced`` (replicated) inputs the outputs stay ``reduced``; with an input sharded over the
        data axes the equation must be local to the rows (its outputs sharded over them too).
        """
        data = self.data
        red = [bool(_reduced(x)) for x in invals]
        mixing = any(not r and data & _axes_of(x) for x, r in zip(invals, red, strict=True))
        plain_out = self.bind(eqn, [_plain(x) if r else x for x, r in zip(invals, red, strict=True)])
        outs = list(plain_out) if eqn.primitive.multiple_results else [plain_out]
        if mixing and any(isinstance(o, jax.Array) and jnp.ndim(o) and not data <= _axes_of(o) for o in outs):
            raise ValueError(_not_local(eqn))
        if not any(r and jnp.issubdtype(x.dtype, jnp.inexact) for x, r in zip(invals, red, strict=True)):
            return plain_out
        result = _LocalVJP(self, eqn, red, keep_reduced=not mixing)(*invals)
        return result if eqn.primitive.multiple_results else result[0]


# The rule table: primitive name -> Interpreter method (every other equation is bound as traced, with the
# implied local rule where JAX has no reduced rule for it). "remat" stands for every remat/checkpoint primitive.
RULES: dict[str, Any] = {
    **{name: Interpreter.reshard for name in _GATHERS},
    "sharding_constraint": Interpreter.constraint,
    **{name: Interpreter.call for name in ("jit", "pjit", "closed_call", "core_call")},
    "scan": Interpreter.scan,
    "while": Interpreter.while_loop,
    "cond": Interpreter.cond,
    "remat": Interpreter.remat,
    "shard_map": Interpreter.shard_map,
}


def _axes_of(x: Any) -> frozenset[str]:
    if not hasattr(x, "shape") or not jnp.ndim(x):
        return frozenset()
    return frozenset(a for e in _parts(x) for a in _layout.spec_axes(e))


def _aligned(invals: list[Any]) -> list[Any] | None:
    """Same-shape operands, the replicated ones resharded like the one sharded operand; ``None`` if not that case."""
    arrays = [x for x in invals if hasattr(x, "shape") and jnp.ndim(x)]
    shapes = {tuple(x.shape) for x in arrays}
    specs = {_parts(x) for x in arrays if any(e is not None for e in _parts(x))}
    if len(shapes) != 1 or len(specs) != 1:
        return None
    (spec,) = specs
    return [
        jax.reshard(x, P(*spec)) if hasattr(x, "shape") and jnp.ndim(x) and all(e is None for e in _parts(x)) else x
        for x in invals
    ]


def _auto_sharding(v: Any) -> bool:
    """A sharding parameter naming a mesh with Auto axes (a loss traced on such a mesh): dropped when re-bound."""
    mesh = getattr(v, "mesh", None)
    return isinstance(v, NamedSharding) and mesh is not None and bool(_layout.auto_axes(mesh))


def _inner_lineage(inner, lineage) -> dict[Any, frozenset]:
    return {v: lineage[i] for i, v in enumerate(inner.invars) if i < len(lineage) and lineage[i]}


def _not_local(eqn) -> str:
    return (
        f"value_and_grad(data_axes=...) cannot take per-copy statistics through the operation "
        f"'{eqn.primitive.name}' of loss_fn: JAX has no rule for it on parameters typed reduced over the data axes, "
        "and it is not local to the rows (its output is not sharded over the data axes where an input is), so no "
        "rule follows from the types. Build the mesh with Explicit axes and write this step of the loss so that a "
        "parameter meets the batch in a row-local operation (a matmul, an elementwise op, an embedding lookup)."
    )


class _LocalVJP:
    """``eqn`` as a ``custom_vjp``: forward on the plain values, backward the equation's own VJP per data shard.

    The backward pass stacks every per-shard value on a leading axis of size ``shards`` (a data-sharded operand
    or cotangent: its rows split; an ``unreduced`` cotangent: each shard's partial) and ``vmap``\\ s the
    equation's VJP over that axis, under ``jax.sharding.auto_axes`` (one shard's block of an Explicit-mode
    program need not be Explicit-valid on its own). A ``reduced`` input's stacked cotangents become its
    ``unreduced`` partial; a data-sharded input's go back in place; a replicated one's are summed.
    """

    def __init__(self, interp: Interpreter, eqn, red, keep_reduced):
        self.interp, self.eqn, self.red, self.keep_reduced = interp, eqn, red, keep_reduced

    def _forward(self, *xs):
        plain = [_plain(x) if r else x for x, r in zip(xs, self.red, strict=True)]
        outs = self.interp.bind(self.eqn, plain)
        outs = list(outs) if self.eqn.primitive.multiple_results else [outs]
        if self.keep_reduced:
            outs = [_reduce(o, self.interp.data) for o in outs]
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

        @jax.custom_vjp
        def f(*xs):
            return self._forward(*xs)[0]

        def fwd(*xs):
            return self._forward(*xs)

        def bwd(plain, cts):
            try:
                return tuple(_per_shard_vjp(layout, vjp, list(plain), list(cts), self.red))
            except (ValueError, TypeError) as err:
                if self.eqn.primitive.name not in _CUSTOM:
                    raise
                raise ValueError(_custom_refusal()) from err

        f.defvjp(fwd, bwd)
        return list(f(*invals))


def _per_shard_vjp(layout: Layout, vjp, plain: list[Any], cts: list[Any], red: list[bool]) -> list[Any]:
    data = frozenset(layout.data)
    res = [_Stacked.of(layout, x) for x in plain]
    cot = [_Stacked.of(layout, c) for c in cts]
    axes = [0 if r.stacked else None for r in res]

    def per_shard(res_vals, ct_vals):
        one = lambda rv, cv: vjp(rv, cv)  # noqa: E731
        return jax.vmap(one, in_axes=(axes, [0 if c.stacked else None for c in cot]))(res_vals, ct_vals)

    args = ([r.value for r in res], [c.value for c in cot])
    try:
        grads = per_shard(*args)
    except (ValueError, TypeError):  # one shard's block is not Explicit-valid on its own (a gather): Auto inside
        out_specs = [P(layout.data_spec, *_auto_free(x)) for x in plain]
        grads = jax.sharding.auto_axes(per_shard, out_sharding=out_specs)(*args)
    out = []
    for g, x, r, rs in zip(grads, plain, red, res, strict=True):
        if r:
            out.append(_unstack(layout, g, x))  # a reduced input: each shard's partial
        elif rs.stacked:
            out.append(rs.unstack(g))  # a data-sharded input: its rows back in place
        else:
            out.append(jnp.sum(g, axis=0))  # a replicated input: the reduction JAX's own transpose would do
    del data
    return out


def _custom_refusal() -> str:
    return (
        "value_and_grad(data_axes=...): loss_fn applies a jax.custom_vjp / jax.custom_jvp function to a parameter "
        "sharded over the data axes (FSDP) before the parameter is gathered; the per-copy statistics need the rule "
        "applied to the gathered copy, and JAX checks the rule's types against the sharded one. Gather the parameter "
        "first (jax.reshard(w, P(...)) without the data axes) and apply the function to the result, or keep that "
        "parameter replicated over the data axes."
    )


def _auto_free(x: Any) -> tuple[Any, ...]:
    """``x``'s partitions without the data axes (the stacked leading axis carries them)."""
    return tuple(None for _ in _parts(x))


@dataclasses.dataclass
class _Stacked:
    """A value as the per-shard ``vmap`` sees it: stacked on a leading axis of size ``shards``, or whole."""

    value: Any
    stacked: bool
    dim: int = -1
    like: Any = None

    @classmethod
    def of(cls, layout: Layout, x: Any) -> _Stacked:
        data = frozenset(layout.data)
        if not hasattr(x, "shape"):
            return cls(x, False)
        if _unreduced(x) & data:  # each shard's partial
            return cls(_stack(layout, x), True, like=x)
        if not jnp.ndim(x):
            return cls(x, False)
        parts = _parts(x)
        for d, entry in enumerate(parts):
            axes = _layout.spec_axes(entry)
            if axes[: len(layout.data)] == layout.data:
                rest = axes[len(layout.data) :]
                shape = x.shape[:d] + (layout.shards, x.shape[d] // layout.shards) + x.shape[d + 1 :]
                spec = (*parts[:d], layout.data_spec, (rest[0] if len(rest) == 1 else rest) or None, *parts[d + 1 :])
                y = x.reshape(shape, out_sharding=P(*spec))
                return cls(jnp.moveaxis(y, d, 0), True, d, x)
            if data & set(axes):
                raise ValueError(
                    f"value_and_grad(data_axes={layout.data_spec!r}): an operand sharded {P(*parts)} splits the data "
                    "axes in an order the drop-in cannot take apart per shard; shard the batch dimension over the "
                    "data axes first (in mesh order)."
                )
        return cls(x, False)

    def unstack(self, g: Any) -> Any:
        """Per-shard cotangents ``(shards, ...)`` back into the rows of the original operand."""
        y = jnp.moveaxis(g, 0, self.dim)
        shape = self.like.shape
        return y.reshape(shape, out_sharding=P(*_parts(self.like)))


def _stack(layout: Layout, u: Any) -> Any:
    """An ``unreduced`` array as ``(shards, *shape)``, row ``i`` data shard ``i``'s partial."""
    parts = _parts(u)
    others = frozenset(layout.axis_names) - frozenset(layout.data)
    spec_in = P(*parts, unreduced=_unreduced(u))
    spec_out = P(layout.data_spec, *(_strip(e, frozenset(layout.data)) for e in parts))
    del others
    return jax.shard_map(lambda b: b[None], mesh=layout.mesh, in_specs=spec_in, out_specs=spec_out, check_vma=False)(u)


def _unstack(layout: Layout, st: Any, like: Any) -> Any:
    """``(shards, *shape)`` rows back into one ``unreduced`` array typed like ``like`` (over the other axes)."""
    parts = _parts(like)
    data = frozenset(layout.data)
    spec_in = P(layout.data_spec, *(_strip(e, data) for e in parts))
    return jax.shard_map(
        lambda b: b[0], mesh=layout.mesh, in_specs=spec_in, out_specs=P(*parts, unreduced=data), check_vma=False
    )(st)


def _reduce(x: Any, data: frozenset[str]) -> Any:
    if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.inexact) and not data & _axes_of(x):
        return jax.reshard(x, P(*_parts(x), reduced=data))
    return x

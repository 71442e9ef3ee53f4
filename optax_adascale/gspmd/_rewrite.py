"""The loss as the drop-in differentiates it: traced once, re-evaluated by the interpreter, probed.

:class:`Probed` traces the loss once (with the parameters as the user passes them) and re-evaluates its jaxpr
with :class:`~optax_adascale.gspmd._interpreter.Interpreter`. An FSDP leaf's gather passes a *probe*
(``_interpreter._probe``), whose backward pass records each device's ``‖partial‖²`` before the gather's transpose
reduce-scatters it; inside a scanned stack of layers the probe is a constant of the loop body, so its per-layer
records add up. A loss value typed ``reduced`` (a term of the parameters alone) is shared equally by the copies
(:func:`_shared`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from optax_adascale import _compat
from optax_adascale.gspmd import _plan, _types
from optax_adascale.gspmd._interpreter import Interpreter
from optax_adascale.gspmd._layout import Layout

# --------------------------------------------------------------------------- the loss's value


def _shared(layout: Layout, value: Any) -> Any:
    """A loss value typed ``reduced`` (a term of the parameters alone, e.g. a penalty) as a plain value whose
    cotangent reaches every data shard's copy in equal parts (``1/n`` each, every sample's loss holding the
    whole term, as in per-replica training). A plain value is returned as it is.

    JAX seeds a ``reduced`` output's gradient differently with and without ``jax.checkpoint`` in the
    program; this rule does not depend on it.
    """
    reduced = _types.reduced_axes(value) & layout.rows
    if not reduced:
        return value
    n = float(np.prod([layout.size(a) for a in reduced]))
    parts = _types.partitions(value)

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


# --------------------------------------------------------------------------- the interpreter


class Probed:
    """The loss re-evaluated from its jaxpr with the rules above.

    ``fsdp``: the indices of the leaves sharded over the data axes (``layout.convert``: the axes made Explicit
    for the loss, whose ``with_sharding_constraint``\\ s are dropped); ``trace``: ``(leaves, batch_leaves,
    batch_tree) -> (closed jaxpr, out_tree)`` of the flattened loss, or ``None`` to trace it here with the
    leaves' own types. :meth:`prepare` traces (once) and decides, per FSDP leaf, probe or hoist.
    """

    def __init__(self, loss_fn, treedef, fsdp, layout: Layout, has_aux, trace=None):
        self.loss_fn, self.treedef, self.fsdp = loss_fn, treedef, tuple(fsdp)
        self.layout, self.has_aux = layout, has_aux
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
        _plan.walk(jaxpr, lineage, data, plan, _plan.typed_axes(data, typed=not self.layout.convert))
        if jaxpr.outvars and not _compat.is_literal(jaxpr.outvars[0]):  # the loss itself from FSDP leaves alone
            plan.hoist.update(i for i in self.fsdp if jaxpr.outvars[0] in jaxpr.invars)
        self.probed = plan.probed(self.fsdp)
        self.hoisted = tuple(i for i in self.fsdp if i not in self.probed)

    def entry(self, cast: list[Any]) -> list[Any]:
        """The leaves as the loss receives them: hoisted FSDP leaves gathered here, as reduced copies."""
        data = frozenset(self.layout.data)
        leaves = list(cast)
        for i in self.hoisted:
            leaves[i] = jax.reshard(
                cast[i], P(*(_types.strip(e, data) for e in _types.partitions(cast[i])), reduced=data)
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
            interp = Interpreter(self.layout, probes=slots)
            lineage = {closed.jaxpr.invars[i]: frozenset({i}) for i in self.probed}
            out = interp.eval(closed.jaxpr, closed.consts, [*leaves, *batch_leaves], lineage)
            value, aux = self.out_tree.unflatten(out)
            return _shared(self.layout, value), aux

        (value, aux), (partials, probe_sq) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(leaves, slots)
        return value, aux, list(partials), dict(probe_sq)


def _aval(x: Any) -> jax.ShapeDtypeStruct:
    aval = jax.typeof(x)
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=aval.sharding, weak_type=aval.weak_type)

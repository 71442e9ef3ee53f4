"""The arguments as ``k`` global micro-batches, and an aux leaf combined over them.

Micro-batch ``j`` is the ``j``-th contiguous block of every data shard's rows, so each micro-batch is a
global batch sharded as the whole one is. :class:`Split` cuts the arguments and runs a function over
the micro-batches in a ``lax.scan``, accumulating its partials and ``‖·‖²`` arrays per device.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from optax_adascale import _compat
from optax_adascale.gspmd import _types
from optax_adascale.gspmd._layout import Layout


def combine(x: Any) -> Any:
    """An aux leaf over the micro-batches (leading axis): floating leaves averaged, integers (counts) summed,
    booleans or'ed (a flag raised by any micro-batch), PRNG keys the last micro-batch's."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return x[-1]
    if x.dtype == jnp.bool_:
        return jnp.any(x, axis=0)
    return jnp.mean(x, axis=0) if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.sum(x, axis=0)


def _counts(x: Any) -> bool:
    """An aux leaf :func:`combine` sums: integers."""
    return not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) and jnp.issubdtype(x.dtype, jnp.integer)


def row_free_outputs(jaxpr, rows: list[int]) -> list[bool]:
    """Which outputs of ``jaxpr`` are state rather than counts: they depend on what the function closes over or on
    an argument that is not the batch, and not on its inputs ``rows`` (a forward walk; an equation with a
    dependent input makes all its outputs dependent). A constant (a count from shapes) is neither."""
    # each value's facts: (depends on the rows, depends on what is not the batch)
    facts = [(i in rows, i not in rows) for i in range(len(jaxpr.invars))]

    def rule(eqn, ins):
        fact = (any(r for r, _ in ins), any(s for _, s in ins))
        return [fact] * len(_compat.outputs(eqn))

    outs = _compat.walk(jaxpr, [(False, True)] * len(jaxpr.constvars), facts, rule, literal=lambda _: (False, False))
    return [state and not on_rows for on_rows, state in outs]


@dataclasses.dataclass
class Split:
    """The arguments as ``k`` global micro-batches: the leaves sharded over the data axes on their first
    dimension are cut (micro-batch ``j``: the ``j``-th block of every data shard's rows), the rest go whole.

    ``n_state``: the first ``n_state`` leaves are state the function advances (``state_argnum``): never cut,
    threaded through the micro-batches (micro-batch ``j`` starts from micro-batch ``j − 1``'s new state, which the
    function returns as ``(value, (aux, new_state))``), as the user's own accumulation threads it."""

    layout: Layout
    flat: list[Any]
    tree: Any
    rows: list[int]
    n_state: int = 0

    @classmethod
    def of(cls, layout: Layout, args: Any, n_state: int = 0) -> Split:
        flat, tree = jax.tree.flatten(args)
        data = set(layout.data)
        rows = [
            i
            for i, x in enumerate(flat)
            if i >= n_state and jnp.ndim(x) and data <= set(_types.spec_axes(_types.partitions(x)[0]))
        ]
        if layout.k > 1:
            for i in rows:
                if flat[i].shape[0] % layout.n:
                    raise ValueError(
                        f"an argument sharded over {layout.data} has {flat[i].shape[0]} rows, not divisible by data "
                        f"shards × num_microbatches = {layout.shards} × {layout.k}: each micro-batch takes the same "
                        "rows of every shard."
                    )
        return cls(layout, flat, tree, rows, n_state)

    def first_avals(self) -> Any:
        """The arguments of one micro-batch, as ``ShapeDtypeStruct``\\ s (to trace the loss at)."""
        out = []
        for i, x in enumerate(self.flat):
            aval = jax.typeof(x)
            shape = ((x.shape[0] // self.layout.k,) + x.shape[1:]) if i in self.rows else aval.shape
            out.append(jax.ShapeDtypeStruct(shape, aval.dtype, sharding=aval.sharding, weak_type=aval.weak_type))
        return self.tree.unflatten(out)

    def micro(self, x: Any) -> Any:
        """``(B, ...)`` as ``(k, B/k, ...)``: entry ``j`` of axis 0 holds the ``j``-th block of every shard's rows."""
        k, shards = self.layout.k, self.layout.shards
        parts = _types.partitions(x)
        y = x.reshape(
            (shards, k, x.shape[0] // (shards * k)) + x.shape[1:], out_sharding=P(parts[0], None, None, *parts[1:])
        )
        return jnp.moveaxis(y, 1, 0)

    def batch(self, micro: list[Any], state: list[Any] | None = None) -> Any:
        full = list(self.flat)
        for i, x in zip(self.rows, micro, strict=True):
            full[i] = x.reshape(
                (x.shape[0] * x.shape[1],) + x.shape[2:], out_sharding=P(*_types.partitions(self.flat[i]))
            )
        if state is not None:
            full[: self.n_state] = state
        return self.tree.unflatten(full)

    def loop(self, one, carry: Any, unroll: int | bool = 1):
        """``one(batch, carry) -> (carry, out)`` over the micro-batches in a ``lax.scan``, the state threaded:
        ``(carry, stacked outs, the last new state or None)``. ``out`` is ``(value, aux, ...)``; with state, ``aux``
        is ``(aux, new_state)`` and its new state goes to the next micro-batch."""
        xs = [self.micro(self.flat[i]) for i in self.rows]
        state_tree: list[Any] = []

        def body(carry, micro):
            carry, state = carry
            carry, out = one(self.batch(micro, state if self.n_state else None), carry)
            if self.n_state:
                value, (aux, new_state), *rest = out
                leaves, tree = jax.tree.flatten(new_state)
                state_tree.append(tree)
                state = [_like(new, old) for new, old in zip(leaves, state, strict=True)]
                out = (value, aux, *rest)
            return (carry, state), out

        state0 = list(self.flat[: self.n_state])
        (carry, state), outs = lax.scan(body, (carry, state0), xs, unroll=unroll)
        return carry, outs, (state_tree[-1].unflatten(state) if self.n_state else None)

    def scan(self, one, zeros: list[Any], layout: Layout, unroll: int | bool = 1, fixed: list[bool] | None = None):
        """``one`` over the micro-batches: partials and ``‖·‖²`` arrays accumulate per device, no reduction."""
        mesh_zero = jnp.zeros((len(zeros),) + layout.axis_sizes, jnp.float32, out_sharding=P(None, *layout.axis_names))

        def step(batch, carry):
            acc, sq_acc = carry
            value, aux, partials, sq = one(batch)
            acc = [a + g.astype(a.dtype) for a, g in zip(acc, partials, strict=True)]
            return (acc, sq_acc + sq), (value, aux)

        (acc, sq), (values, auxes), state = self.loop(step, (zeros, mesh_zero), unroll)
        return jnp.mean(values), self.aux(auxes, state, fixed), acc, sq

    def aux(self, stacked: Any, state: Any, fixed: list[bool] | None = None) -> Any:
        """The aux over the micro-batches (:func:`combine`), with the last new state where state is threaded.

        ``fixed[i]``: aux leaf ``i`` does not depend on the rows (state the loss advances from what it closes over,
        a constant): every micro-batch computed the same value, which is kept as it is, not summed (a warning says
        how to thread such state, ``state_argnum``)."""
        leaves, tree = jax.tree.flatten(stacked)
        # the leaves of aux come first in the function's outputs (a threaded new state after them)
        fixed = list(fixed[: len(leaves)]) if fixed is not None and len(fixed) >= len(leaves) else [False] * len(leaves)
        kept = [i for i, (x, f) in enumerate(zip(leaves, fixed, strict=True)) if f and _counts(x)]
        if kept:
            from optax_adascale.core import _checks

            _checks.warn(
                f"value_and_grad(num_microbatches={self.layout.k}): {len(kept)} integer aux value(s) of loss_fn do not "
                "depend on the batch (state the loss advances from what it closes over, such as RNG counters): "
                "each micro-batch computed the same value, which is returned as it is, not summed. To advance such "
                "state once per micro-batch, as your own accumulation would, pass it as an argument and name it "
                "state_argnum (loss_fn then returns (loss, (aux, new_state)))."
            )
        combined = tree.unflatten([x[-1] if i in kept else combine(x) for i, x in enumerate(leaves)])
        return (combined, state) if self.n_state else combined


def _like(new: Any, old: Any) -> Any:
    """A new state leaf typed as the old one (the scan's carry keeps its type)."""
    if hasattr(old, "dtype") and new.dtype != old.dtype:
        new = new.astype(old.dtype)
    spec = getattr(getattr(jax.typeof(old), "sharding", None), "spec", None)
    if spec is not None and getattr(jax.typeof(new).sharding, "spec", None) != spec:
        new = jax.reshard(new, spec)
    return new

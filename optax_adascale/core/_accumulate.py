"""Across-call accumulation (``accumulation_steps=k``): per-replica buffers, one reduction every ``k``-th call."""

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from optax_adascale.core._varying import fresh_zeros, match_varying

Array = jax.Array


def accumulate(k: int | Array, grads: Any, local_sq: Array, state: Any, step: Any):
    """Across-call accumulation: add to the per-replica buffers; every ``k``-th call reduces once and steps.

    Buffers are ``shape`` per replica, or ``(1, …, shape)`` when shard_map hands
    us our slice of a ``(replicas, …, shape)`` global array. ``k`` is a Python
    int, or a replicated int32 scalar (a :class:`BatchRamp`'s ``k_t``): then one
    program serves every ``k``.
    """
    acc_grads, acc_sq = state.acc_grads, state.acc_sq_norm
    like = lambda x, other: jnp.reshape(x, jnp.shape(other))  # noqa: E731 - buffer <-> per-replica shapes
    scalars = state._replace(acc_grads=None, acc_sq_norm=None)

    # The cond neither takes nor returns the buffers (a pass-through output
    # would be copied on every accumulating call); the reducing branch reads
    # them, and they are updated after the cond, in place.
    count = (lambda dtype: k) if isinstance(k, int) else (lambda dtype: k.astype(dtype))  # noqa: E731

    def reduce_branch(state):
        mean = lambda a, g: ((like(a, g) + g.astype(a.dtype)) / count(a.dtype)).astype(g.dtype)  # noqa: E731
        local = jax.tree.map(mean, acc_grads, grads)
        new_updates, new_state = step(local, (like(acc_sq, local_sq) + local_sq) / count(acc_sq.dtype), state)
        return new_updates, new_state._replace(micro_step=jnp.zeros_like(state.micro_step)), jnp.bool_(True)

    out_types = jax.eval_shape(reduce_branch, scalars)

    def accumulate_branch(state):
        zero_updates = jax.tree.map(lambda g, t: fresh_zeros(g, t.dtype), grads, out_types[0])
        out = (zero_updates, state._replace(micro_step=state.micro_step + 1), jnp.bool_(False))
        return match_varying(out, out_types)

    last = state.micro_step >= k - 1
    new_updates, new_state, reduced = lax.cond(last, reduce_branch, accumulate_branch, scalars)
    # `reduced` (not `last`) orders these writes after the cond's reads.
    new_acc = jax.tree.map(lambda a, g: jnp.where(reduced, 0, a + like(g.astype(a.dtype), a)), acc_grads, grads)
    new_sq = jnp.where(reduced, 0, acc_sq + like(local_sq, acc_sq))
    return new_updates, new_state._replace(acc_grads=new_acc, acc_sq_norm=new_sq)

"""Accumulation within one step: a replica's mean gradient and mean micro-batch squared norm via ``lax.scan``."""

import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from optax_adascale.core import _axes, _checks
from optax_adascale.core._norms import STAT_DTYPE, compute_dtype, leaf_sq_norm, leaf_sq_norms
from optax_adascale.core._samples import MicrobatchStats, returned_sq_norms
from optax_adascale.core._varying import match_varying


def value_and_microbatch_grad(
    loss_fn: Callable[..., Any], num_microbatches: int, *, has_aux: bool = False, unroll: int | bool = 1
) -> Callable[..., tuple[Any, Any, MicrobatchStats]]:
    """Deprecated: use ``optax_adascale.value_and_grad(loss_fn, num_microbatches=k)`` (``data_axes=None``).

    Same function as before (per replica, ``k`` contiguous micro-batches,
    ``unroll`` passed to ``lax.scan``); warns ``DeprecationWarning``.
    """
    warnings.warn(
        "optax_adascale.value_and_microbatch_grad is deprecated: use "
        "optax_adascale.value_and_grad(loss_fn, num_microbatches=k, has_aux=...) (data_axes=None is this "
        "per-replica helper; data_axes=... is the global-batch drop-in under jax.jit).",
        DeprecationWarning,
        stacklevel=2,
    )
    return per_replica(loss_fn, num_microbatches, has_aux=has_aux, unroll=unroll)


def per_replica(
    loss_fn: Callable[..., Any],
    num_microbatches: int,
    *,
    has_aux: bool = False,
    unroll: int | bool = 1,
    threaded: bool = False,
) -> Callable[..., tuple[Any, Any, MicrobatchStats]]:
    """Like ``jax.value_and_grad``, over ``k`` micro-batches with ``lax.scan``.

    The returned function takes ``(params, *batch)``; every leaf of ``batch``
    is split along its leading axis into ``k`` contiguous micro-batches
    (micro-batch ``j`` holds rows ``j·m … (j+1)·m − 1``). It returns
    ``(value, grads, stats)``: the mean loss (``(loss, aux)`` with ``has_aux``,
    ``aux`` stacked along a leading ``k`` axis), the mean gradient, and
    :class:`MicrobatchStats` with each leaf's mean micro-batch squared norm.
    Pass ``grads`` and ``microbatch_stats=stats`` to AdaScale's ``update``:
    one jitted step, one collective, no per-replica optimizer state.

    Under ``jax.shard_map`` the parameters must vary over the data axis before
    differentiation, as for ``jax.grad``: ``jax.lax.pcast(params, axis, to="varying")``.

    Why not ``optax.microbatching.microbatch``: it splits *strided* (micro-batch
    ``j`` holds rows ``j, j+k, j+2k, …``) so that a batch sharded over devices
    under a global ``jax.jit`` keeps every micro-batch spread over all shards,
    and it runs a ``fori_loop`` without ``unroll``. This helper is called *per
    replica* (inside ``shard_map``, ``pmap`` or ``vmap``), where the batch it
    sees is already local, so a contiguous split moves no data and keeps rows
    together in the order the user's input pipeline wrote them; it also needs
    ``unroll`` (XLA:CPU runs convolutions inside loops slowly) and the
    per-micro-batch squared norms, which optax's accumulators would have to
    carry as a custom accumulator. The estimator treats micro-batches as
    independent samples either way: shuffle the data, or a contiguous split of
    a batch sorted by class inflates the variance estimate (a strided one
    deflates it).

    Args:
      loss_fn: ``loss_fn(params, *batch) -> loss`` (or ``(loss, aux)``).
      num_microbatches: ``k ≥ 1``; must divide the batch's leading dimension.
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
      unroll: passed to ``lax.scan``. ``True`` trades compile time and memory
        for speed where the backend runs loop bodies slowly (XLA:CPU
        convolutions inside a loop run much slower than unrolled).
      threaded: the function takes ``(params, state, *batch)`` and returns
        ``(loss, (aux, new_state))``: ``state`` is not split, micro-batch ``j``
        gets micro-batch ``j − 1``'s new state, and ``value`` carries the last
        one (``(loss, (aux, new_state))``).

    Returns:
      A function ``(params, *batch) -> (value, grads, stats)`` (``(params, state,
      *batch)`` when ``threaded``).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import optax_adascale
      >>> loss = lambda w, x: jnp.sum(w * x)
      >>> fn = optax_adascale.value_and_grad(loss, num_microbatches=2)
      >>> value, grads, stats = fn(jnp.ones(2), jnp.array([[1.0, 0.0], [0.0, 1.0]]))
      >>> grads, stats.sq_norms, stats.num_microbatches
      (Array([0.5, 0.5], dtype=float32), Array(1., dtype=float32), 2)
    """
    _checks.check_static_int("num_microbatches", num_microbatches)
    k = num_microbatches
    grad_fn = jax.value_and_grad(loss_fn, has_aux=has_aux)

    def split(x):
        if x.shape[0] % k:
            raise ValueError(f"num_microbatches={k} must divide the batch's leading dimension, got shape {x.shape}")
        return x.reshape((k, x.shape[0] // k) + x.shape[1:])

    def fn(params, *batch):
        state, batch = (batch[0], batch[1:]) if threaded else (None, batch)
        micro = jax.tree.map(split, batch)
        # Per replica (shard_map, pmap, vmap, one device) the leaves are local: their norms in few reductions.
        norms = leaf_sq_norms if not _axes.partitioned_axes(params) else lambda gs: [leaf_sq_norm(g) for g in gs]

        def body(carry, mb):
            grad_sum, sq_sum, state = carry
            value, grads = grad_fn(params, *((state,) if threaded else ()), *mb)
            if threaded:  # (loss, (aux, new_state)): the new state goes to the next micro-batch
                loss, (aux, new_state) = value
                value = (loss, aux)
                state = jax.tree.map(
                    lambda new, old: new if new.dtype == old.dtype else new.astype(old.dtype), new_state, state
                )
            grad_sum = jax.tree.map(lambda s, g: s + g.astype(s.dtype), grad_sum, grads)
            leaves, treedef = jax.tree.flatten(grads)
            sq = treedef.unflatten(norms(leaves))
            sq_sum = jax.tree.map(lambda s, q: s + q, sq_sum, sq)
            return (grad_sum, sq_sum, state), value

        grads0 = jax.tree.map(lambda p: jnp.zeros(p.shape, compute_dtype(p.dtype)), params)
        sq0 = jax.tree.map(lambda p: jnp.zeros((), STAT_DTYPE), params)
        carry0 = (match_varying(grads0, params), match_varying(sq0, params), state)
        (grad_sum, sq_sum, state), values = lax.scan(body, carry0, micro, unroll=unroll)
        grads = jax.tree.map(lambda s, p: (s / k).astype(p.dtype), grad_sum, params)
        sq_norms = jax.tree.map(lambda s: s / k, sq_sum)
        # The returned gradients' own norms, against which update checks the gradients it is given (a clip chained
        # before AdaScale): at k = 1 they are sq_norms; else the check's own reduction of them, which the compiler
        # shares with the check's where update is given these gradients (no pass of its own).
        if k == 1:
            measured = sq_norms
        else:
            leaves, treedef = jax.tree.flatten(grads)
            measured = treedef.unflatten(returned_sq_norms(leaves))
        if has_aux:
            losses, aux = values
            value = (jnp.mean(losses), (aux, state) if threaded else aux)
        else:
            value = jnp.mean(values)
        return value, grads, MicrobatchStats(sq_norms, k, grad_sq_norms=measured)

    return fn

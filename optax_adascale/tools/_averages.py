"""The model's own moving averages on the τ clock: BatchNorm's running statistics, a weight EMA.

AdaScale's τ clock makes momentum and Adam's averages decay per base-batch step. A model's own averages advance once
per update whatever the update is worth: at ``S = 8`` over the same ``T`` base-batch steps they see about 8× fewer
updates, so they remember ``1/(1 − μ)`` updates, ``r/(1 − μ)`` base steps, and keep more of their start (measured
on Flax's NNX MNIST example, T = 500: BatchNorm's statistics at momentum 0.99 kept 37 % of their initial value at
S = 8). :func:`base_step_average` re-weights one update's advance so the average decays per base-batch step.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from optax_adascale import _state


def base_step_average(old: Any, new: Any, decay: Any, opt_state: Any, updates: int = 1) -> Any:
    r"""A moving average advanced by the last update, re-weighted so that it decays per base-batch step.

    ``new`` is ``old`` after ``updates`` steps of ``a ← decay·a + (1 − decay)·x`` (one per update; ``k`` where
    the update ran ``k`` micro-batches that each advanced it). An update worth ``r`` base-batch steps (its gain, read
    from ``opt_state``) should have decayed it by ``decay^r``, as ``r`` small-batch steps would:

    .. math::  a' = a_{old} + (a_{new} - a_{old})\,\frac{1 - \mathrm{decay}^{r}}{1 - \mathrm{decay}^{updates}}

    which keeps the mean of what the average took in (``(a_new − a_old)/(1 − decay^updates)`` is ``x̄ − a_old``)
    and gives it the weight of ``r`` base steps. At ``r = updates`` it is ``new`` itself. Works on any pytree of
    floating arrays: BatchNorm's running statistics (Flax NNX: ``nnx.state(model, nnx.BatchStat)``; Linen: the
    ``batch_stats`` collection), a weight EMA's parameters. Call it in the jitted step, after ``tx.update``.

    Args:
      old: the average before the update's forward pass: a copy (Flax NNX:
        ``jax.tree.map(lambda x: x, nnx.state(model, nnx.BatchStat))``; ``nnx.state`` alone returns the model's
        Variables, which the forward pass updates in place, and is refused).
      new: the average after it.
      decay: the average's momentum (``0.99``: Flax BatchNorm's default; PyTorch's ``momentum=0.1`` is
        ``decay = 0.9``).
      opt_state: the optimizer state after the update (its ``metrics()["gain"]`` is what the update was worth).
      updates: how many times ``new`` advanced from ``old`` (the micro-batches of an update that each did).

    Returns:
      ``new`` re-weighted, shaped and typed like it.

    Examples:
      >>> import jax.numpy as jnp, optax_adascale
      >>> tx = optax_adascale.adascale_sgd(0.1, accumulation_steps=2)
      >>> state = tx.init(jnp.zeros(1))._replace(gain=jnp.float32(4.0))  # an update worth 4 base steps
      >>> old, x = jnp.array(0.0), jnp.array(1.0)
      >>> new = 0.9 * old + 0.1 * x                                     # the model's own average, once
      >>> optax_adascale.base_step_average(old, new, 0.9, state).round(4)  # 1 − 0.9⁴ of the way
      Array(0.3439, dtype=float32)
    """
    floating = [
        (a, b)
        for a, b in zip(jax.tree.leaves(old), jax.tree.leaves(new), strict=True)
        if jnp.issubdtype(jnp.result_type(b), jnp.inexact)
    ]
    if floating and all(a is b for a, b in floating):
        raise ValueError(
            "optax_adascale.base_step_average: `old` and `new` hold the same arrays, so there is nothing to re-weight: "
            "`old` must be a copy taken before the forward pass. Flax NNX's nnx.state(model, nnx.BatchStat) returns "
            "the model's own Variables, which the forward pass updates in place: take "
            "`old = jax.tree.map(lambda x: x, nnx.state(model, nnx.BatchStat))` before it."
        )
    gain = jnp.asarray(_state.metrics(opt_state)["gain"], jnp.float32)
    decay = jnp.asarray(decay, jnp.float32)
    taken = -jnp.expm1(updates * jnp.log(decay))  # 1 − decay^updates
    wanted = -jnp.expm1(gain * jnp.log(decay))  # 1 − decay^r
    factor = jnp.where(taken > 0, wanted / jnp.where(taken > 0, taken, 1.0), 1.0)

    def reweight(a, b):
        if not jnp.issubdtype(jnp.result_type(b), jnp.inexact):
            return b
        return (a + (b - a) * factor.astype(jnp.result_type(b))).astype(jnp.result_type(b))

    return jax.tree.map(reweight, old, new)

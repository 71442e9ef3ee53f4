"""Estimator experiments that did not win their studies: kept for reproducing them, not for training.

The main namespace holds what a user of AdaScale needs. What lives here lost a
study in ``benchmarks/`` and stays so that the study can be re-run:

* ``averaging="paper"`` (Appendix B.3's plain mean while ``t < 1/(1−θ)``):
  FairScale's ``debias_ewma=False``; no better than the debiased average.
* ``gain_exponent`` (AdaptDL's AdamScale uses ``r^½``): slightly behind the raw
  gain with Adam on every task of ``benchmarks/adam``.
* ``precondition`` with :func:`adam_preconditioner`: statistics in Adam's
  geometry; more spread across seeds than the raw gain.
* ``memory_fraction`` (``benchmarks/estimator``): a memory of ``c·τ`` base
  steps, needing no run length; with ``c = 0.05`` and ``unbiased_sqr=True``
  it tracked the true gain within 10 % in 17 of 19 cells, short of the goal
  (every cell) that would have made it the default.

These may change or go without a deprecation period.
"""

from typing import Any

import optax

from optax_adascale._adam import adam_preconditioner
from optax_adascale._adascale import build

__all__ = ("adam_preconditioner", "adascale")


def adascale(
    inner: optax.GradientTransformation,
    learning_rate: optax.ScalarOrSchedule,
    *,
    axis_name: str | tuple[str, ...] | None = None,
    accumulation_steps: int = 1,
    scale: float | None = None,
    smoothing: float | None = None,
    eps: float = 1e-6,
    param_labels: Any = None,
    param_specs: Any = None,
    shard_optimizer_state: int | None = None,
    delayed_gain: bool = False,
    horizon: float | tuple[float, float] | None = None,
    unbiased_sqr: bool = False,
    averaging: str = "debiased",
    gain_exponent: float = 1.0,
    precondition: Any = None,
    memory_fraction: float | None = None,
) -> optax.GradientTransformationExtraArgs:
    """:func:`optax_adascale.adascale` with the estimator experiments.

    Every argument of :func:`optax_adascale.adascale` keeps its meaning; with
    the three below at their defaults this is that function exactly.

    Args:
      inner: see :func:`optax_adascale.adascale`.
      learning_rate: see :func:`optax_adascale.adascale`.
      axis_name: see :func:`optax_adascale.adascale`.
      accumulation_steps: see :func:`optax_adascale.adascale`.
      scale: see :func:`optax_adascale.adascale`.
      smoothing: see :func:`optax_adascale.adascale`.
      eps: see :func:`optax_adascale.adascale`.
      param_labels: see :func:`optax_adascale.adascale`.
      param_specs: see :func:`optax_adascale.adascale`.
      shard_optimizer_state: see :func:`optax_adascale.adascale`.
      delayed_gain: see :func:`optax_adascale.adascale`.
      horizon: see :func:`optax_adascale.adascale`.
      unbiased_sqr: see :func:`optax_adascale.adascale`.
      averaging: ``"debiased"`` (FairScale's default) or ``"paper"``
        (Appendix B.3: the plain mean of the samples while ``t < 1/(1−θ)``,
        then the moving average).
      gain_exponent: ``p``: the step is ``r^p·lr(⌊τ⌋)`` while τ still advances
        by ``r`` (AdaptDL's ``AdamScale`` uses ``p = 1/2``). 1 is AdaScale.
      precondition: ``inner_state -> multipliers`` (a tree like the params, or
        ``None``): the statistics are taken on ``P ⊙ g_i`` instead of ``g_i``,
        e.g. :func:`adam_preconditioner`. One more read of ``P`` per squared
        norm; not with ``shard_optimizer_state`` or ``microbatch_stats``.
      memory_fraction: ``c``: the averages remember ``c·τ_t`` base-batch steps
        (``θ_t = exp(−r_{t−1}/(c·τ_t))``), a fixed fraction of the progress so
        far: a memory that needs no run length. Not with ``horizon`` or
        ``smoothing``.

    Returns:
      An ``optax.GradientTransformationExtraArgs``.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from optax_adascale import experimental, metrics
      >>> tx = experimental.adascale(optax.identity(), 0.1, accumulation_steps=2, gain_exponent=0.5)
      >>> state = tx.init(jnp.zeros(2))
      >>> _, state = tx.update(jnp.array([1.0, 0.0]), state)
      >>> updates, state = tx.update(jnp.array([0.0, 1.0]), state)
      >>> metrics(state)["gain"], updates  # gain 2, step 2^½ · 0.1 · ḡ
      (Array(2., dtype=float32), Array([-0.07071068, -0.07071068], dtype=float32))
    """
    return build(
        inner,
        learning_rate,
        axis_name=axis_name,
        accumulation_steps=accumulation_steps,
        scale=scale,
        smoothing=smoothing,
        eps=eps,
        param_labels=param_labels,
        param_specs=param_specs,
        shard_optimizer_state=shard_optimizer_state,
        delayed_gain=delayed_gain,
        horizon=horizon,
        unbiased_sqr=unbiased_sqr,
        averaging=averaging,
        gain_exponent=gain_exponent,
        precondition=precondition,
        memory_fraction=memory_fraction,
    )

"""Estimator experiments that did not win their studies: kept for reproducing them, not for training.

The main namespace holds what a user of AdaScale needs. What lives here lost a
study in ``benchmarks/`` and stays so that the study can be re-run:

* ``averaging="paper"`` (Appendix B.3's plain mean while ``t < 1/(1−θ)``):
  FairScale's ``debias_ewma=False``; no better than the debiased average.
* ``gain_exponent`` (AdaptDL's AdamScale uses ``r^½``): slightly behind the raw
  gain with Adam on every task of ``benchmarks/adam``.
* ``precondition`` with :func:`adam_preconditioner`: statistics in Adam's
  geometry; more spread across seeds than the raw gain.

``memory_fraction`` was here in 0.2; it won ``benchmarks/estimator`` and is the
default :class:`optax_adascale.Estimator` now.

These may change or go without a deprecation period.
"""

import inspect
from typing import Any

import optax

from optax_adascale import _factories
from optax_adascale.core import _options
from optax_adascale.core._adam import adam_preconditioner

__all__ = ("adam_preconditioner", "adascale")


def adascale(
    inner: optax.GradientTransformation,
    learning_rate: optax.ScalarOrSchedule,
    *,
    averaging: str = "debiased",
    gain_exponent: float = 1.0,
    precondition: Any = None,
    **options: Any,
) -> optax.GradientTransformationExtraArgs:
    """:func:`optax_adascale.adascale` with the estimator experiments.

    Takes every keyword of :func:`optax_adascale.adascale` (``**options``) with
    its meaning; with the three below at their defaults this is that function
    exactly.

    Args:
      inner: see :func:`optax_adascale.adascale`.
      learning_rate: see :func:`optax_adascale.adascale`.
      averaging: ``"debiased"`` (FairScale's default) or ``"paper"``
        (Appendix B.3: the plain mean of the samples while ``t < 1/(1−θ)``,
        then the moving average).
      gain_exponent: ``p``: the step is ``r^p·lr(⌊τ⌋)`` while τ still advances
        by ``r`` (AdaptDL's ``AdamScale`` uses ``p = 1/2``). 1 is AdaScale.
      precondition: ``inner_state -> multipliers`` (a tree like the params, or
        ``None``): the statistics are taken on ``P ⊙ g_i`` instead of ``g_i``,
        e.g. :func:`adam_preconditioner`. One more read of ``P`` per squared
        norm; not with ``shard_optimizer_state`` or ``microbatch_stats``.
      **options: any keyword of :func:`optax_adascale.adascale`.

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
    kwargs = _options.unwrap(options, "options")
    known = set(inspect.signature(_factories.adascale).parameters) - {"inner", "learning_rate", "deprecated"}
    deprecated = {k: kwargs.pop(k) for k in list(kwargs) if k not in known}
    settings = _options.create(
        **kwargs,
        averaging=averaging,
        gain_exponent=gain_exponent,
        precondition=precondition,
        deprecated=deprecated,
        factory="experimental.adascale",
    )
    return _factories.build(inner, learning_rate, settings)

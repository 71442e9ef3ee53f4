"""The AdaScale estimator as pure functions of arrays.

Nothing here knows about pytrees of parameters, named axes or optax state: the
inputs are per-group float32 vectors of shape ``[G]`` (one entry per parameter
group, ``G = 1`` without labels) and Python or array scalars. Every function is
jit-, vmap- and ``lax.fori_loop``-safe, which is how the tests exercise it.

Notation (Johnson et al., 2020, Appendix B.3; FairScale 0.4.13):

* ``n`` samples ``g_i`` are averaged into ``ḡ``;
* ``a = mean_i ‖g_i‖²`` and ``b = ‖ḡ‖²``;
* ``S`` is the scale: base batches per update.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

Array = jax.Array

DEBIASED = "debiased"
PAPER = "paper"
AVERAGING_MODES = (DEBIASED, PAPER)


@dataclasses.dataclass(frozen=True)
class Estimator:
    """How the gain is estimated: the factory's estimator options, checked and resolved once.

    Attributes:
      eps: floor of each step's variance estimate.
      smoothing: ``θ``, or ``None`` for FairScale's ``max(1 − n/1000, 0)``.
      horizon: ``(H_σ², H_μ²)``, the averages' memories in base-batch steps, or ``None``.
      averaging: ``"debiased"`` or ``"paper"``.
      unbiased_sqr: average ``μ̂²`` unfloored, floor only the average.
      delayed_gain: the gain of update ``t`` from the averages through ``t − 1``.
      gain_exponent: ``p`` in the step ``r^p·lr`` (1 is AdaScale).
      memory_fraction: ``c``: a memory of ``c·τ_t`` base-batch steps, a fixed
        fraction of the progress so far (no run length needed), or ``None``.
    """

    eps: Any = 1e-6
    smoothing: Any = None
    horizon: tuple[Any, Any] | None = None
    averaging: str = DEBIASED
    unbiased_sqr: bool = False
    delayed_gain: bool = False
    gain_exponent: float = 1.0
    memory_fraction: Any = None

    def smoothings(self, num_samples: int, last_gain: Array, tau: Array | None = None) -> tuple[Any, Any]:
        """``θ`` of the σ² and μ² averages for an update of ``n`` samples: the one place ``θ`` is decided.

        ``tau`` is ``τ_t`` before this update (only ``memory_fraction`` reads it).
        """
        if self.memory_fraction is not None:
            if tau is None:
                raise ValueError("memory_fraction needs τ: pass tau to Estimator.smoothings")
            memory = horizon_smoothing(last_gain, jnp.asarray(self.memory_fraction, jnp.float32) * tau)
            return memory, memory
        if self.horizon is None:
            theta = default_smoothing(num_samples) if self.smoothing is None else self.smoothing
            return theta, theta
        return horizon_smoothing(last_gain, self.horizon[0]), horizon_smoothing(last_gain, self.horizon[1])

    def step_size(self, gain: Array, learning_rate: Array) -> Array:
        """``r^p · lr`` (``p = 1``: AdaScale's ``r · lr``)."""
        if self.gain_exponent == 1:
            return gain * learning_rate
        return gain ** jnp.float32(self.gain_exponent) * learning_rate


def default_smoothing(num_samples: int) -> float:
    """FairScale's EMA factor ``θ = max(1 − n/1000, 0)`` for ``n`` samples per update."""
    return max(1.0 - num_samples / 1000.0, 0.0)


def step_moments(
    mean_sq_norm: Array,
    sq_norm_of_mean: Array,
    num_samples: int,
    scale: float | Array,
    eps: float | Array,
    floor_sqr: bool = True,
) -> tuple[Array, Array]:
    """This step's estimates of ``σ²`` and ``μ²`` in base-batch units.

    ``σ̂² = S/(n−1)·(a − b)`` is unbiased for the variance of one base-batch
    gradient (each sample is ``S/n`` base batches, so its variance is
    ``σ²·n/S``, and ``E[a − b] = (n−1)/n · σ²·n/S``). ``μ̂² = b − σ̂²/S``
    removes the noise that ``b`` carries. The variance is floored at ``eps``
    and ``μ̂²`` at zero *before* they enter the moving averages, as FairScale
    does.

    Args:
      mean_sq_norm: ``a``, float32 ``[G]``.
      sq_norm_of_mean: ``b``, float32 ``[G]``.
      num_samples: ``n ≥ 2``, a Python int.
      scale: ``S ≥ 1``.
      eps: floor of the variance estimate.
      floor_sqr: floor ``μ̂²`` at 0 (FairScale). ``False`` leaves it unbiased
        (possibly negative); the average is then floored where it is used.

    Returns:
      ``(σ̂², μ̂²)``, float32 ``[G]`` each.
    """
    var = scale / (num_samples - 1) * (mean_sq_norm - sq_norm_of_mean)
    sqr = sq_norm_of_mean - var / scale
    return jnp.maximum(var, eps), jnp.maximum(sqr, 0.0) if floor_sqr else sqr


def horizon_smoothing(last_gain: Array, horizon: float | Array) -> tuple[Array, Array]:
    """``(θ_t, 1 − θ_t)`` with ``θ_t = exp(−r_{t−1}/H)``: a memory of ``H`` base-batch steps (τ), not updates.

    An update worth ``r`` base steps ages the average by ``r/H`` e-folds, so the
    average forgets at the pace at which training (and the schedule, which
    runs on τ) moves, whatever the scale. ``r_{t−1}`` is the gain of the last
    update (1 before the first), so the rate does not depend on this step's
    own estimate.

    ``1 − θ`` is returned as ``−expm1(−r/H)``: for ``H ≳ 3·10⁷·r`` the float32
    ``θ`` rounds to 1, and ``1 − θ`` computed from it would be 0 (the
    averages 0/0); ``expm1`` keeps its value (≈ ``r/H``).
    """
    x = -jnp.asarray(last_gain, jnp.float32) / jnp.asarray(horizon, jnp.float32)
    return jnp.exp(x), -jnp.expm1(x)


def ema_rate(count: Array, weight: Array, smoothing: float | Array, averaging: str = DEBIASED) -> tuple[Array, Array]:
    """The weight ``α_t`` of this step's sample in ``avg ← avg + α_t (x − avg)``.

    Both averaging modes are written as one incremental mean:

    * ``"debiased"`` (FairScale's default ``debias_ewma=True``): the biased EMA
      ``m ← θm + (1−θ)x`` divided by its weight ``w ← θw + (1−θ)``. Its ratio
      ``m/w`` obeys the recursion above with ``α_t = (1−θ)/w_t``.
    * ``"paper"`` (Appendix B.3, FairScale's ``debias_ewma=False``): the plain
      mean of the samples while ``t < 1/(1−θ)``, then the EMA. That is
      ``α_t = max(1/t, 1−θ)``: ``1/t`` is the running mean's weight, and it
      drops below ``1−θ`` exactly when ``t ≥ 1/(1−θ)``.

    Args:
      count: ``t``, the 1-based index of this sample (int32 scalar).
      weight: ``w_{t−1}``, the debiasing weight before this sample.
      smoothing: ``θ ∈ [0, 1)``, or the pair ``(θ, 1 − θ)`` where ``1 − θ`` is
        known more precisely than float32 ``θ`` gives it (:func:`horizon_smoothing`).
      averaging: ``"debiased"`` or ``"paper"``.

    Returns:
      ``(α_t, w_t)``; ``w_t`` is carried in the state for both modes.
    """
    if isinstance(smoothing, tuple):
        theta, rest = (jnp.asarray(x, jnp.float32) for x in smoothing)
    else:
        theta = jnp.asarray(smoothing, jnp.float32)
        rest = 1 - theta
    new_weight = theta * weight + rest
    if averaging == DEBIASED:
        alpha = rest / new_weight
    elif averaging == PAPER:
        alpha = jnp.maximum(1 / count.astype(jnp.float32), rest)
    else:
        raise ValueError(f"averaging must be one of {AVERAGING_MODES}, got averaging={averaging!r}")
    return alpha, new_weight


def ema_update(average: Array, sample: Array, alpha: Array) -> Array:
    """``average + α·(sample − average)``; with ``α = 1`` this is exactly ``sample``."""
    return jnp.where(alpha == 1, sample, average + alpha * (sample - average))


def gain_ratio(grad_var: Array, grad_sqr: Array, scale: float | Array) -> Array:
    """The gain ``r = (σ² + μ²)/(σ²/S + μ²)``, clipped to ``[1, S]``.

    ``r`` is the number of base-batch steps one step at scale ``S`` is worth.
    Mathematically it already lies in ``[1, S]``; the clip removes float
    rounding (e.g. ``S·(1 + 1e-7)`` for orthogonal samples). A zero
    denominator (no statistics yet) gives 1.
    """
    scale = jnp.asarray(scale, jnp.float32)
    grad_sqr = jnp.maximum(grad_sqr, 0.0)  # an unbiased average may dip below 0
    num = grad_var + grad_sqr
    den = grad_var / scale + grad_sqr
    safe = den > 0
    ratio = jnp.where(safe, num / jnp.where(safe, den, 1.0), 1.0)
    return jnp.clip(ratio, 1.0, scale)


def advance_tau(whole: Array, frac: Array, gain: Array) -> tuple[Array, Array]:
    """``τ ← τ + r`` with ``τ = whole + frac``, exactly.

    ``whole`` is int32 and ``frac ∈ [0, 1)`` float32. Exactness: a float32
    ``r ≥ 1`` is a multiple of ``2⁻²³``, so its fractional part ``r − ⌊r⌋`` is
    exact, every ``frac`` reached is a multiple of ``2⁻²³``, and
    ``frac + (r − ⌊r⌋) < 2`` is representable: no addition rounds. ``⌊τ⌋`` is
    therefore the floor of the exact (float64) sum of the gains, up to
    ``2³¹`` base steps.
    """
    gain = jnp.asarray(gain, jnp.float32)
    gain_whole = jnp.floor(gain)
    total = frac + (gain - gain_whole)
    carry = jnp.floor(total)
    new_whole = whole + (gain_whole + carry).astype(jnp.int32)
    return new_whole, total - carry

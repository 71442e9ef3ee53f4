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


DEFAULT_MEMORY_FRACTION = 0.05
DEFAULT_MIN_UPDATES = 4.0


@dataclasses.dataclass(frozen=True)
class Estimator:
    r"""How AdaScale estimates the gain: how long the moving averages of ``σ²`` and ``μ²`` remember.

    Each update gives one noisy estimate ``σ̂²``, ``μ̂²`` (base-batch units); the
    gain ``r = (σ̄² + μ̄²)/(σ̄²/S + μ̄²)`` is taken from their moving averages. A
    long memory is quiet but lags a gain that grows during training; a short
    one follows it but is noisy. Pass one of these as ``estimator=``:

    * ``Estimator()``, the default: a memory of ``c·τ`` base-batch steps
      (``c = memory_fraction = 0.05``), a fixed fraction of the progress so far,
      so it needs no run length, and of at least ``m = min_updates = 4``
      updates: ``θ_t = exp(−r_{t−1}/max(c·τ_t, m·r_{t−1}))``. ``μ̂²`` is
      averaged unfloored (``unbiased_sqr``). Measured in ``benchmarks/estimator``:
      within 10 % of the true gain in 25 of 27 task × scale cells (mean error
      6 %), FairScale's in 1 of 27 (34 %). ``Estimator(memory_fraction=c)`` names a
      memory of its own, without the floor unless ``min_updates`` is given.
    * ``Estimator(horizon=H)``: a memory of ``H`` base-batch steps,
      ``θ_t = exp(−r_{t−1}/H)`` (``H = T/100`` for a run of ``T`` base steps
      tracked in 24 of 25 cells); a pair ``(H_σ², H_μ²)`` gives each average its own.
    * ``Estimator(smoothing=θ)``: a fixed ``θ`` per update.
    * ``"fairscale"`` (``Estimator(fairscale=True)``): FairScale 0.4.13's
      ``AdaScale`` exactly: ``θ = max(1 − n/1000, 0)`` for ``n`` samples per update
      (or ``smoothing``), each step's ``μ̂²`` floored at 0 before it is averaged.
      Use it to reproduce FairScale, or runs made with optax_adascale 0.2.

    Every average is debiased (``m ← θm + (1−θ)x``, ``w ← θw + (1−θ)``, the
    estimate is ``m/w``), and every step's ``σ̂²`` is floored at ``eps``.

    Attributes:
      memory_fraction: ``c > 0``: a memory of ``c·τ`` base-batch steps. The
        default when no other memory is named.
      horizon: ``H > 0`` base-batch steps, or a pair ``(H_σ², H_μ²)``.
      smoothing: ``θ ∈ [0, 1)`` per update.
      unbiased_sqr: average each step's ``μ̂²`` unfloored and floor only the
        average. FairScale floors each step's estimate, which biases ``μ̄²`` up
        (the gain down) once ``μ²`` is small next to its noise. ``None``:
        ``True``, or ``False`` with ``fairscale``.
      eps: floor of each step's variance estimate (squared-gradient units).
      fairscale: FairScale 0.4.13's estimator (with ``smoothing`` if given).
      min_updates: with ``memory_fraction``: a memory of at least this many
        updates (``max(c·τ, m·r_{t−1})`` base steps), against the noise of a
        memory of one or two updates early in a run at a large ``S``. ``4``
        in the default ``Estimator()``; ``None`` (no floor) once a memory is named.

    Raises:
      ValueError: more than one memory named, ``fairscale`` with
        ``memory_fraction``, ``horizon`` or ``unbiased_sqr=True``, or a value
        out of range.

    Examples:
      >>> import optax_adascale
      >>> e = optax_adascale.Estimator()  # the default
      >>> e.memory_fraction, e.min_updates, e.unbiased_sqr, e.fairscale
      (0.05, 4.0, True, False)
      >>> tx = optax_adascale.adascale_sgd(0.1, momentum=0.9, estimator=optax_adascale.Estimator(horizon=40.0))
      >>> tx = optax_adascale.adascale_sgd(0.1, momentum=0.9, estimator="fairscale")
    """

    memory_fraction: float | None = None
    horizon: float | tuple[float, float] | None = None
    smoothing: float | None = None
    unbiased_sqr: bool | None = None
    eps: float = 1e-6
    fairscale: bool = False
    min_updates: float | None = None

    def __post_init__(self) -> None:
        from optax_adascale.core import _checks

        _checks.check_bool("fairscale", self.fairscale)
        if self.unbiased_sqr is not None:
            _checks.check_bool("unbiased_sqr", self.unbiased_sqr)
        _checks.check_number("memory_fraction", self.memory_fraction, low=0.0, low_open=True)
        _checks.check_number("smoothing", self.smoothing, low=0.0, high=1.0, high_open=True)
        _checks.check_number("eps", self.eps, low=0.0, low_open=True)
        _checks.check_number("min_updates", self.min_updates, low=0.0, low_open=True)
        horizon = _checks.check_horizon(self.horizon)
        named = {k: v for k, v in self._memories().items() if v is not None}
        if len(named) > 1:
            raise ValueError(
                "Estimator takes one memory: memory_fraction (a fraction of τ), horizon (base-batch steps) or "
                f"smoothing (θ per update), got {', '.join(f'{k}={v!r}' for k, v in named.items())}"
            )
        if self.fairscale and (self.memory_fraction is not None or horizon is not None or self.unbiased_sqr):
            raise ValueError(
                "Estimator(fairscale=True) is FairScale's estimator: θ = max(1 − n/1000, 0) or smoothing, each "
                "step's μ̂² floored; it takes no memory_fraction, horizon or unbiased_sqr=True, got "
                f"memory_fraction={self.memory_fraction!r}, horizon={self.horizon!r}, "
                f"unbiased_sqr={self.unbiased_sqr!r}"
            )
        if self.min_updates is not None and (self.horizon is not None or self.smoothing is not None or self.fairscale):
            raise ValueError(
                f"min_updates={self.min_updates!r} bounds the memory_fraction memory; it takes no horizon, "
                f"smoothing or fairscale, got horizon={self.horizon!r}, smoothing={self.smoothing!r}, "
                f"fairscale={self.fairscale!r}"
            )
        if horizon is not None:
            object.__setattr__(self, "horizon", horizon[0] if horizon[0] is horizon[1] else horizon)
        if not named and not self.fairscale:
            object.__setattr__(self, "memory_fraction", DEFAULT_MEMORY_FRACTION)
            if self.min_updates is None:
                object.__setattr__(self, "min_updates", DEFAULT_MIN_UPDATES)
        if self.unbiased_sqr is None:
            object.__setattr__(self, "unbiased_sqr", not self.fairscale)

    def _memories(self) -> dict[str, Any]:
        return {"memory_fraction": self.memory_fraction, "horizon": self.horizon, "smoothing": self.smoothing}


FAIRSCALE = "fairscale"


def resolve(estimator: Any) -> Estimator:
    """``estimator=``: ``None`` (the default), ``"fairscale"`` or an :class:`Estimator`, as an :class:`Estimator`."""
    if estimator is None:
        return Estimator()
    if isinstance(estimator, str) and estimator == FAIRSCALE:
        return Estimator(fairscale=True)
    if isinstance(estimator, Estimator):
        return estimator
    raise TypeError(
        "estimator must be optax_adascale.Estimator(...) or the string 'fairscale' (FairScale 0.4.13's "
        f"estimator), got estimator={estimator!r}"
    )


@dataclasses.dataclass(frozen=True)
class Settings:
    """The estimator as one update runs it: the user's :class:`Estimator` and the step options around it.

    Attributes:
      estimator: the moving averages' memory, ``eps``, ``unbiased_sqr``.
      delayed_gain: the gain of update ``t`` from the averages through ``t − 1``.
      averaging: ``"debiased"`` or ``"paper"`` (experimental).
      gain_exponent: ``p`` in the step ``r^p·lr`` (1 is AdaScale; experimental).
    """

    estimator: Estimator = Estimator()
    delayed_gain: bool = False
    averaging: str = DEBIASED
    gain_exponent: float = 1.0

    @property
    def eps(self) -> float:
        return self.estimator.eps

    @property
    def unbiased_sqr(self) -> bool:
        return bool(self.estimator.unbiased_sqr)

    def smoothings(self, num_samples: int, last_gain: Array, tau: Array | None = None) -> tuple[Any, Any]:
        """``θ`` of the σ² and μ² averages for an update of ``n`` samples: the one place ``θ`` is decided.

        ``tau`` is ``τ_t`` before this update (only ``memory_fraction`` reads it).
        """
        e = self.estimator
        if e.memory_fraction is not None:
            if tau is None:
                raise ValueError("memory_fraction needs τ: pass tau to Settings.smoothings")
            length = jnp.asarray(e.memory_fraction, jnp.float32) * tau
            if e.min_updates is not None:
                length = jnp.maximum(length, jnp.asarray(e.min_updates, jnp.float32) * last_gain)
            memory = horizon_smoothing(last_gain, length)
            return memory, memory
        if e.horizon is not None:
            h_var, h_sqr = e.horizon if isinstance(e.horizon, tuple) else (e.horizon, e.horizon)
            return horizon_smoothing(last_gain, h_var), horizon_smoothing(last_gain, h_sqr)
        theta = default_smoothing(num_samples) if e.smoothing is None else e.smoothing
        return theta, theta

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
      num_samples: ``n ≥ 2``, a Python int, or a traced one (a :class:`BatchRamp`'s
        ``n_t``; then ``S/(n−1)`` is computed in float32).
      scale: ``S ≥ 1``.
      eps: floor of the variance estimate.
      floor_sqr: floor ``μ̂²`` at 0 (FairScale). ``False`` leaves it unbiased
        (possibly negative); the average is then floored where it is used.

    Returns:
      ``(σ̂², μ̂²)``, float32 ``[G]`` each.
    """
    if not isinstance(num_samples, int):  # traced n_t: the arithmetic in float32, whatever n's dtype
        num_samples = jnp.asarray(num_samples, jnp.float32)
        scale = jnp.asarray(scale, jnp.float32)
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

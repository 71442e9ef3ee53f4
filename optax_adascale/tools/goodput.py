r"""Which batch scale ``S`` to train at next: a host-side *goodput* advisor for AdaScale.

AdaScale measures how much a step at scale ``S`` (``S`` base batches per update) is
worth; your hardware decides how long it takes. This module puts the two together,
in plain NumPy, between training steps, from the two numbers AdaScale already keeps
(``optax_adascale.metrics(opt_state)["grad_var"]`` and ``["grad_sqr"]``). It adds
nothing to the jitted step: no computation, no host sync. Call it every few hundred
iterations with values you fetched anyway (for logging, or with the loop's ``τ``).

The maths
---------

With ``σ̄²`` the variance and ``μ̄²`` the squared mean of one base-batch gradient
(AdaScale's moving averages, in base-batch units), a step at scale ``S`` is worth

.. math::

   r(S) = \frac{σ̄² + μ̄²}{σ̄²/S + μ̄²} = \frac{S\,(σ̄² + μ̄²)}{σ̄² + S\,μ̄²} \in [1, S]

base-batch steps (the AdaScale gain; :func:`gain`). It is ≈ ``S`` while
``S ≪ B_noise = σ̄²/μ̄²`` (the gradient noise scale of McCandlish et al., the
critical batch in base batches) and saturates at ``1 + B_noise`` beyond it. If an
iteration at scale ``S`` takes ``t(S)`` seconds, training progresses at

.. math::

   \mathrm{goodput}(S) = \frac{r(S)}{t(S)}
     = \underbrace{\frac{S}{t(S)}}_{\text{throughput}}
       \cdot \underbrace{\frac{r(S)}{S}}_{\text{efficiency}}

base-batch steps of ``τ`` per second: throughput (base batches per second) times
statistical efficiency, Pollux's goodput (AdaptDL's ``GoodputFunction`` is this times
the base batch size ``M0``, i.e. in examples per second). :func:`choose_scale`
returns the candidate ``S`` that maximises it, i.e. that minimises the wall-clock
time ``t(S)/r(S)`` per unit of ``τ``. Ties go to the smallest ``S``.

For the affine step time ``t(S) = t₀ + t₁·S`` (fixed per-iteration overhead ``t₀``,
``t₁`` per base batch) the optimum has a closed form: setting
``d/dS log(r/t) = σ̄²/(S(σ̄² + Sμ̄²)) − t₁/(t₀ + t₁S) = 0`` gives ``σ̄²t₀ = t₁μ̄²S²``,

.. math::

   S^* = \sqrt{B_\mathrm{noise} \cdot t_0 / t_1},

the geometric mean of the noise scale and the overhead ratio. As ``B_noise`` grows
during training (``μ̄²`` shrinks), so does the best ``S``: re-ask every so often.

Step times
----------

``step_time`` is a :class:`StepTimeModel`, a callable ``S -> seconds per iteration``
(vectorised or not), or a mapping ``{S: seconds}`` of measured times. A mapping is
read as :meth:`StepTimeModel.interpolate`: piecewise-linear in ``S`` through the
measurements (exact at each measured ``S``), extended beyond the measured range
along the line through the two outermost points on that side. For noisy
measurements use :meth:`StepTimeModel.fit`, the least-squares line
``t(S) = t₀ + t₁·S``. Every predicted time must be positive and finite.

Caveat: at ``S = 1`` with one gradient sample per update AdaScale is the identity
and estimates nothing, so its ``σ̄²``, ``μ̄²`` stop changing. Keep ``S ≥ 2``
among the candidates if the choice should be able to grow again.

References:
  McCandlish, Kaplan, Amodei, OpenAI Dota Team, `An Empirical Model of
  Large-Batch Training <https://arxiv.org/abs/1812.06162>`_, 2018 (the noise scale
  ``B_noise`` and the ``1 + B_noise/B`` trade-off).

  Qiao, Choe, Subramanya, Neiswanger, Ho, Zhang, Ganger, Xing, `Pollux:
  Co-adaptive Cluster Scheduling for Goodput-Optimized Deep Learning
  <https://www.usenix.org/conference/osdi21/presentation/qiao>`_, OSDI 2021
  (goodput = throughput × statistical efficiency; AdaptDL).

  Johnson, Agrawal, Gu, Guestrin, `AdaScale SGD <https://arxiv.org/abs/2007.05105>`_,
  ICML 2020 (the gain ``r``).

Examples:
  >>> from optax_adascale import goodput
  >>> print(goodput.gain([1, 2, 4, 8, 16], grad_var=4.0, grad_sqr=1.0))
  [1.         1.66666667 2.5        3.33333333 4.        ]
  >>> model = goodput.StepTimeModel.linear(0.020, 0.0015)      # 20 ms + 1.5 ms per base batch
  >>> choice = goodput.choose_scale({"grad_var": 16.0, "grad_sqr": 1.0}, model, [1, 2, 4, 8, 16, 32, 64])
  >>> choice.scale                                             # S* = sqrt(16 · 20/1.5) ≈ 14.6
  16
  >>> print(choice.table())
  noise scale B = σ̄²/μ̄² = 16 base batches (σ̄² = 16, μ̄² = 1); step time: t(S) = 0.02 + 0.0015·S s
        S     gain  efficiency  step time (s)      τ/s  relative
        1     1.00       1.000         0.0215     46.5     0.241
        2     1.89       0.944         0.0230     82.1     0.425
        4     3.40       0.850         0.0260    130.8     0.677
        8     5.67       0.708         0.0320    177.1     0.917
  *    16     8.50       0.531         0.0440    193.2     1.000
       32    11.33       0.354         0.0680    166.7     0.863
       64    13.60       0.212         0.1160    117.2     0.607
  >>> f"{choice.tau_per_second[4] / choice.tau_per_second[0]:.2f}x the progress per second of S = 1"
  '4.15x the progress per second of S = 1'
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from optax_adascale.core import _read

__all__ = ("Choice", "StepTimeModel", "choose_scale", "gain")

_NO_STATISTICS = (
    "no gradient statistics yet (σ̄² = μ̄² = 0: before the first update, or only S = 1 updates): "
    "chose the smallest candidate"
)


# --------------------------------------------------------------------------- the gain


def _check_statistic(name: str, value: Any) -> float:
    try:
        v = float(np.asarray(value, dtype=np.float64))
    except (TypeError, ValueError) as err:
        raise ValueError(f"{name} must be a non-negative finite scalar, got {value!r}") from err
    if not math.isfinite(v) or v < 0:
        raise ValueError(f"{name} must be a non-negative finite scalar, got {name}={v!r}")
    return v


def _check_scales(name: str, scale: Any) -> np.ndarray:
    s = np.asarray(scale, dtype=np.float64)
    if s.size and (not np.all(np.isfinite(s)) or np.any(s < 1)):
        raise ValueError(f"{name} must be finite and >= 1 (base batches per update), got {name}={scale!r}")
    return s


def gain(scale: Any, grad_var: float, grad_sqr: float) -> Any:
    """AdaScale's gain ``r(S) = (σ̄² + μ̄²)/(σ̄²/S + μ̄²)``: base-batch steps one step at scale ``S`` is worth.

    Vectorised over ``scale``; the value AdaScale would use at that ``S`` with these
    statistics, clipped to ``[1, S]`` against float rounding. ``S = 1`` gives 1;
    ``μ̄² = 0 < σ̄²`` (pure noise) gives ``S``; ``σ̄² = 0`` (no noise) gives 1; both 0
    (no statistics yet) gives 1.

    Args:
      scale: ``S ≥ 1``, a number or an array of them.
      grad_var: ``σ̄² ≥ 0``, the variance of a base-batch gradient (``metrics(...)["grad_var"]``).
      grad_sqr: ``μ̄² ≥ 0``, its squared mean (``metrics(...)["grad_sqr"]``).

    Returns:
      ``r(S)``: a NumPy float64 array shaped like ``scale`` (a NumPy scalar for a scalar).

    Raises:
      ValueError: a scale below 1 or not finite, or a negative or non-finite statistic.

    Examples:
      >>> from optax_adascale.goodput import gain
      >>> print(gain(4, grad_var=4.0, grad_sqr=1.0))   # (4 + 1)/(4/4 + 1)
      2.5
      >>> print(gain([1, 4, 16], grad_var=3.0, grad_sqr=0.0), gain([1, 4, 16], grad_var=0.0, grad_sqr=2.0))
      [ 1.  4. 16.] [1. 1. 1.]
    """
    s = _check_scales("scale", scale)
    var = _check_statistic("grad_var", grad_var)
    sqr = _check_statistic("grad_sqr", grad_sqr)
    den = var + s * sqr
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where(den > 0, s * (var + sqr) / np.where(den > 0, den, 1.0), 1.0)
    return np.clip(r, 1.0, s)[()]


# --------------------------------------------------------------------------- step times


def _positive_times(name: str, scales: np.ndarray, times: Any) -> np.ndarray:
    t = np.broadcast_to(np.asarray(times, dtype=np.float64), scales.shape)
    bad = ~(np.isfinite(t) & (t > 0))
    if np.any(bad):
        i = np.flatnonzero(bad.ravel())[0]
        raise ValueError(
            f"{name} must give a positive, finite time per iteration at every scale; "
            f"got {name}(S={scales.ravel()[i]:g}) = {t.ravel()[i]!r}"
        )
    return t


@dataclasses.dataclass(frozen=True)
class StepTimeModel:
    """Seconds per iteration (one update) as a function of the scale ``S``.

    Build one with :meth:`linear` (``t₀ + t₁·S``, e.g. a stated synthetic model),
    :meth:`fit` (least-squares line through measurements), :meth:`interpolate`
    (piecewise-linear through measurements) or :meth:`from_callable`. Calling it
    checks that every time is positive and finite (``ValueError`` otherwise).

    Attributes:
      fn: ``S -> seconds``, vectorised over a float64 array of scales.
      description: how the model was made (shown by :meth:`Choice.table`).

    Examples:
      >>> from optax_adascale.goodput import StepTimeModel
      >>> m = StepTimeModel.fit({1: 0.021, 4: 0.027, 16: 0.044})
      >>> print(m.description)
      least-squares line t(S) = 0.02017 + 0.0015·S s through 3 measurements
      >>> print(StepTimeModel.interpolate({2: 0.02, 8: 0.05})([2, 4, 8, 16]))
      [0.02 0.03 0.05 0.09]
    """

    fn: Callable[[np.ndarray], Any]
    description: str = "user-supplied step-time function"

    def __call__(self, scale: Any) -> np.ndarray:
        """``t(S)`` in seconds per iteration, as float64, shaped like ``scale``."""
        s = _check_scales("scale", scale)
        return _positive_times("step_time", s, self.fn(s))[()]

    @classmethod
    def linear(cls, t0: float, t1: float, description: str | None = None) -> StepTimeModel:
        """``t(S) = t0 + t1·S``: ``t0`` seconds of fixed cost per iteration plus ``t1`` per base batch."""
        t0, t1 = float(t0), float(t1)
        if not (math.isfinite(t0) and math.isfinite(t1) and t0 >= 0 and t1 >= 0 and t0 + t1 > 0):
            raise ValueError(f"step_time: t0 and t1 must be finite, >= 0 and not both 0; got t0={t0!r}, t1={t1!r}")
        return cls(lambda s: t0 + t1 * s, description or f"t(S) = {t0:.4g} + {t1:.4g}·S s")

    @classmethod
    def fit(cls, step_times: Mapping[float, float]) -> StepTimeModel:
        """The least-squares line ``t(S) = t₀ + t₁·S`` through measured ``{S: seconds per iteration}``.

        One measurement gives the constant ``t(S) = t`` (no information on how time grows).
        A fitted line that predicts a non-positive time at some ``S`` raises when asked there.
        """
        s, t = _measurements(step_times)
        if len(s) == 1:
            t0, t1 = float(t[0]), 0.0
        else:
            t1, t0 = (float(c) for c in np.polyfit(s, t, 1))
        desc = f"least-squares line t(S) = {t0:.4g} + {t1:.4g}·S s through {len(s)} measurement{'s' * (len(s) > 1)}"
        return cls(lambda x: t0 + t1 * x, desc)

    @classmethod
    def interpolate(cls, step_times: Mapping[float, float]) -> StepTimeModel:
        """Piecewise-linear in ``S`` through measured ``{S: seconds per iteration}``.

        Exact at each measured ``S``; beyond the measured range, extended along the
        line through the two outermost measurements on that side. One measurement
        gives the constant ``t(S) = t``.
        """
        s, t = _measurements(step_times)

        def fn(x: np.ndarray) -> np.ndarray:
            if len(s) == 1:
                return np.full(np.shape(x), t[0])
            y = np.interp(x, s, t)
            lo = t[0] + (t[1] - t[0]) / (s[1] - s[0]) * (x - s[0])
            hi = t[-1] + (t[-1] - t[-2]) / (s[-1] - s[-2]) * (x - s[-1])
            return np.where(x < s[0], lo, np.where(x > s[-1], hi, y))

        points = ", ".join(f"{a:g}: {b:.4g}" for a, b in zip(s, t))
        return cls(fn, f"piecewise-linear in S through measured {{{points}}} s")

    @classmethod
    def from_callable(cls, fn: Callable[[float], float], description: str | None = None) -> StepTimeModel:
        """Wrap ``S -> seconds`` (called once per scale, with a Python float)."""
        return cls(
            lambda s: np.vectorize(lambda x: float(fn(float(x))), otypes=[np.float64])(s),
            str(description or getattr(fn, "__name__", "user-supplied step-time function")),
        )


def _measurements(step_times: Mapping[float, float]) -> tuple[np.ndarray, np.ndarray]:
    if not isinstance(step_times, Mapping) or not step_times:
        raise ValueError(f"step_time must be a non-empty mapping {{S: seconds per iteration}}, got {step_times!r}")
    s = _check_scales("step_time", sorted(float(k) for k in step_times))
    t = np.asarray([float(step_times[k]) for k in sorted(step_times, key=float)], dtype=np.float64)
    _positive_times("step_time", s, t)
    return s, t


def _as_model(step_time: Any) -> StepTimeModel:
    if isinstance(step_time, StepTimeModel):
        return step_time
    if isinstance(step_time, Mapping):
        return StepTimeModel.interpolate(step_time)
    if callable(step_time):
        return StepTimeModel.from_callable(step_time)
    raise TypeError(
        "step_time must be a StepTimeModel, a callable S -> seconds per iteration, or a mapping "
        f"{{S: seconds per iteration}}; got {type(step_time).__name__}"
    )


# --------------------------------------------------------------------------- the choice


@dataclasses.dataclass(frozen=True)
class Choice:
    """The scale :func:`choose_scale` picked, and the numbers behind it (one entry per candidate).

    Attributes:
      scale: the chosen ``S`` (an ``int`` where the candidate is a whole number).
      candidates: the candidate scales, sorted ascending, without duplicates.
      gain: ``r(S)`` per candidate (base-batch steps per iteration).
      step_time: ``t(S)``, seconds per iteration.
      tau_per_second: goodput ``r(S)/t(S)``, base-batch steps of ``τ`` per second (the maximised quantity).
      efficiency: ``r(S)/S`` ∈ ``(0, 1]``, statistical efficiency.
      grad_var: ``σ̄²`` used.
      grad_sqr: ``μ̄²`` used.
      note: why the choice is not an argmax (e.g. no statistics yet), or ``""``.
      step_time_model: the step-time model's description.
    """

    scale: float
    candidates: np.ndarray
    gain: np.ndarray
    step_time: np.ndarray
    tau_per_second: np.ndarray
    efficiency: np.ndarray
    grad_var: float
    grad_sqr: float
    note: str = ""
    step_time_model: str = ""

    @property
    def index(self) -> int:
        """Position of :attr:`scale` in :attr:`candidates`."""
        return int(np.flatnonzero(self.candidates == self.scale)[0])

    @property
    def noise_scale(self) -> float:
        """``B_noise = σ̄²/μ̄²`` in base batches, read as ``optax_adascale.metrics`` reads it: ``inf`` for pure
        noise (``μ̄² = 0 < σ̄²``), NaN without statistics (``σ̄² = μ̄² = 0``: nothing measured yet, or a statistic
        that is not finite). The reader is ``metrics``' own (``core/_read.noise_scale``), not a copy of it."""
        b, _ = _read.noise_scale(self.grad_var, self.grad_sqr, True)
        return float(b)

    @property
    def seconds_per_tau(self) -> np.ndarray:
        """``t(S)/r(S)``: wall-clock seconds per base-batch step of progress (the minimised quantity)."""
        return 1.0 / self.tau_per_second

    def table(self) -> str:
        """A plain-text table, one row per candidate, the chosen one marked ``*``; ``relative`` is goodput/max."""
        lines = [
            f"noise scale B = σ̄²/μ̄² = {self.noise_scale:.4g} base batches "
            f"(σ̄² = {self.grad_var:.4g}, μ̄² = {self.grad_sqr:.4g})"
            + (f"; step time: {self.step_time_model}" if self.step_time_model else ""),
            f"  {'S':>5} {'gain':>8} {'efficiency':>11} {'step time (s)':>14} {'τ/s':>8} {'relative':>9}",
        ]
        best = float(np.max(self.tau_per_second))
        for i, s in enumerate(self.candidates):
            mark = "*" if i == self.index else " "
            lines.append(
                f"{mark} {s:>5g} {self.gain[i]:>8.2f} {self.efficiency[i]:>11.3f} {self.step_time[i]:>14.4f} "
                f"{self.tau_per_second[i]:>8.1f} {self.tau_per_second[i] / best:>9.3f}"
            )
        if self.note:
            lines.append(f"note: {self.note}")
        return "\n".join(lines)


def _scalar_statistics(var: Any, sqr: Any) -> tuple[float, float]:
    if np.ndim(var) or np.ndim(sqr):
        raise ValueError(
            f"expected scalar grad_var and grad_sqr, got shapes {np.shape(var)} and {np.shape(sqr)} "
            "(a pmap-stacked state? pass jax.tree.map(lambda a: a[0], opt_state))"
        )
    return _check_statistic("grad_var", var), _check_statistic("grad_sqr", sqr)


def _statistics(stats: Any) -> tuple[float, float]:
    """``(σ̄², μ̄²)`` from a metrics dict, or from an optimizer state via :func:`optax_adascale.metrics`."""
    # A metrics dict (or any mapping of the two numbers); a checkpoint restored as a dict has ``tau_whole`` too.
    if isinstance(stats, Mapping) and "grad_var" in stats and "grad_sqr" in stats and "tau_whole" not in stats:
        return _scalar_statistics(stats["grad_var"], stats["grad_sqr"])
    from optax_adascale._state import metrics  # only for an optimizer state

    m = metrics(stats)
    return _scalar_statistics(np.asarray(m["grad_var"]), np.asarray(m["grad_sqr"]))


def choose_scale(stats: Any, step_time: Any, candidates: Iterable[float] | None = None) -> Choice:
    """The candidate scale ``S`` with the highest goodput ``r(S)/t(S)``: the most ``τ`` per second.

    Host-side NumPy, for between training steps: reads only ``σ̄²`` and ``μ̄²``.
    Ties go to the smallest ``S``. With no statistics yet (``σ̄² = μ̄² = 0``:
    before the first update) it returns the smallest candidate and says so in
    :attr:`Choice.note`.

    Args:
      stats: the dict of :func:`optax_adascale.metrics` (or any mapping with
        scalar ``"grad_var"`` and ``"grad_sqr"``), or an optimizer state
        (``metrics`` is then called on it: one small device read).
      step_time: seconds per iteration at scale ``S``: a :class:`StepTimeModel`,
        a callable ``S -> seconds``, or measured ``{S: seconds}`` (interpolated
        piecewise-linearly in ``S``, see :meth:`StepTimeModel.interpolate`).
      candidates: the scales to choose from (each ``≥ 1``); default: the keys
        of a ``step_time`` mapping.

    Returns:
      A :class:`Choice`: ``.scale`` and per-candidate ``gain``, ``step_time``,
      ``tau_per_second``, ``efficiency``; ``.table()`` prints them.

    Raises:
      ValueError: no candidates, a candidate below 1, a negative statistic, or
        a step time that is not positive and finite (the message names ``step_time``).

    Examples:
      >>> from optax_adascale.goodput import choose_scale
      >>> measured = {2: 0.030, 4: 0.034, 8: 0.042, 16: 0.058}   # seconds per iteration
      >>> c = choose_scale({"grad_var": 8.0, "grad_sqr": 1.0}, measured)
      >>> c.scale, [round(float(x), 1) for x in c.tau_per_second]
      (8, [60.0, 88.2, 107.1, 103.4])
      >>> choose_scale({"grad_var": 0.0, "grad_sqr": 0.0}, measured).note[:29]
      'no gradient statistics yet (σ'
    """
    model = _as_model(step_time)
    if candidates is None:
        if not isinstance(step_time, Mapping):
            raise ValueError("candidates is required unless step_time is a mapping {S: seconds per iteration}")
        candidates = list(step_time)
    raw = sorted({float(c) for c in np.asarray(list(candidates), dtype=np.float64).ravel()})
    if not raw:
        raise ValueError("candidates must name at least one scale S")
    scales = _check_scales("candidates", raw)
    var, sqr = _statistics(stats)
    r = np.atleast_1d(gain(scales, var, sqr))
    t = np.atleast_1d(model(scales))
    goodput = r / t
    note = ""
    if var == 0 and sqr == 0:
        best, note = 0, _NO_STATISTICS
    else:
        best = int(np.argmax(goodput))  # the first maximum: ties go to the smallest S
        if var == 0:
            note = "σ̄² = 0 (no gradient noise measured): the gain is 1 at every S"
        elif sqr == 0:
            note = "μ̄² = 0 (pure noise): the gain is S at every S"
    chosen = float(scales[best])
    return Choice(
        scale=int(chosen) if chosen.is_integer() else chosen,
        candidates=scales,
        gain=r,
        step_time=t,
        tau_per_second=goodput,
        efficiency=r / scales,
        grad_var=var,
        grad_sqr=sqr,
        note=note,
        step_time_model=model.description,
    )

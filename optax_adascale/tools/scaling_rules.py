r"""Fixed learning-rate scaling rules: the baselines AdaScale is compared with.

Each rule turns the schedule ``lr(t)`` that works at the base batch size (``t``
counts base-batch steps) into a schedule over the *real* iterations of training
with ``S`` times larger batches, for plain ``optax.sgd`` (or any optimizer that
takes a schedule):

* :func:`identity`: ``lr(t)``;
* :func:`linear`: ``S·lr(S·t)``;
* :func:`square_root`: ``√S·lr(S·t)``;
* :func:`linear_warmup` (LSW, Goyal et al.): ``S·lr(S·t)``, warmed up
  linearly from ``lr(0)`` to ``S·lr(0)`` over the first 5.5 % of ``⌈T/S⌉``
  iterations;
* :func:`stretched_linear_warmup` (LSW+): LSW stretched to ``N`` iterations
  (e.g. as many as AdaScale took): ``S·lr(t·T/N)``, warmed up over the first
  5.5 % of ``N``.

``T`` is the base-batch step budget. Linear, square-root and LSW rules run
``⌈T/S⌉`` iterations; the identity rule runs ``T`` (it only adds samples per
step); LSW+ runs ``N``. Unlike :func:`optax_adascale.adascale`, which evaluates
``lr`` at its scale-invariant clock ``⌊τ⌋``, these rules are fixed in advance:
they ignore the gradient noise.

The warm-up is Goyal et al.'s, written as their Detectron code applies it: a
factor on the scaled schedule that grows linearly from ``1/S`` to ``1``,

.. math::

   \mathrm{lr}_{\mathrm{LSW}}(t) = w(t)\,S\,\mathrm{lr}(S t), \qquad
   w(t) = \tfrac{1}{S} + \bigl(1 - \tfrac{1}{S}\bigr)\min(t/W, 1).

For a base schedule that is constant during the warm-up (step decay, as in the
paper and in Goyal et al.) this is exactly the linear ramp from ``lr(0)`` to
``S·lr(0)``; for one that decays during it the rate stays continuous, and
``S = 1`` is the identity. The 5.5 % is theirs too: 5 of 90 ImageNet epochs.

All schedules are pure ``jax.numpy``: they can be called under ``jit``, with
traced steps, and ``scale``, ``total_steps`` and ``num_iterations`` may be
traced arrays (then they are not validated).

References:
  Johnson, Agrawal, Gu, Guestrin, `AdaScale SGD: A User-Friendly Algorithm for
  Distributed Training <https://arxiv.org/abs/2007.05105>`_, ICML 2020, §4 and
  Appendix B.

  Goyal et al., `Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour
  <https://arxiv.org/abs/1706.02677>`_, 2017.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from optax_adascale.core import _checks

Array = jax.Array
Schedule = Callable[[Any], Array]
ScalarOrSchedule = float | Array | Schedule

WARMUP_FRACTION = 0.055
"""Goyal et al.'s warm-up length as a fraction of the iterations (5 of 90 epochs)."""

__all__ = (
    "WARMUP_FRACTION",
    "identity",
    "linear",
    "linear_warmup",
    "square_root",
    "stretched_linear_warmup",
)


# --------------------------------------------------------------------------- validation (one style: _checks)


def _check_schedule(learning_rate: Any) -> Schedule:
    _checks.check_learning_rate(learning_rate)
    return learning_rate if callable(learning_rate) else (lambda count: learning_rate)


def _check_scale(scale: Any) -> None:
    _checks.check_number("scale", scale, low=1.0)


def _check_positive_int(name: str, value: Any) -> None:
    _checks.check_number(name, value, low=1.0, integer=True)


def _check_fraction(warmup_fraction: Any) -> None:
    _checks.check_number("warmup_fraction", warmup_fraction, low=0.0, high=1.0)


# --------------------------------------------------------------------------- helpers


def _f32(x: Any) -> Array:
    return jnp.asarray(x, jnp.float32)


def _warmup_factor(scale: Any, t: Array, warmup_steps: Array) -> Array:
    """``w(t) = 1/S + (1 − 1/S)·min(t/W, 1)``; 1 when ``W = 0``."""
    inv = 1.0 / _f32(scale)
    progress = jnp.minimum(t / jnp.maximum(warmup_steps, jnp.finfo(jnp.float32).tiny), 1.0)
    return jnp.where(t < warmup_steps, inv + (1.0 - inv) * progress, 1.0)


# --------------------------------------------------------------------------- rules


def identity(learning_rate: ScalarOrSchedule) -> Schedule:
    """The identity rule: the base schedule, unchanged, over ``T`` iterations.

    Larger batches only reduce the gradient noise; no step gets longer, so the
    run takes as many iterations as at the base batch size.

    Args:
      learning_rate: the base schedule ``lr(t)`` (a float or an optax schedule
        of the base-batch step).

    Returns:
      A schedule ``t -> lr(t)`` (float32).

    Examples:
      >>> import optax
      >>> from optax_adascale import scaling_rules
      >>> schedule = scaling_rules.identity(optax.exponential_decay(0.1, 100, 0.5))
      >>> print(schedule(0), schedule(100))
      0.1 0.05

    References:
      Johnson et al., `AdaScale SGD <https://arxiv.org/abs/2007.05105>`_, ICML 2020, §2.
    """
    lr = _check_schedule(learning_rate)
    return lambda count: _f32(lr(count))


def linear(learning_rate: ScalarOrSchedule, scale: float) -> Schedule:
    """The linear scaling rule: ``S·lr(S·t)`` over ``⌈T/S⌉`` iterations.

    Each iteration with ``S`` times the batch is treated as ``S`` base steps
    (Krizhevsky, 2014; Goyal et al., 2017). Exact when the gradient noise
    dominates; too aggressive when it does not.

    Args:
      learning_rate: the base schedule ``lr(t)``.
      scale: ``S ≥ 1``, base batches per iteration.

    Returns:
      A schedule ``t -> S·lr(S·t)`` (float32).

    Examples:
      >>> import optax
      >>> from optax_adascale import scaling_rules
      >>> schedule = scaling_rules.linear(optax.exponential_decay(0.1, 100, 0.5), scale=4)
      >>> print(schedule(0), schedule(25))
      0.4 0.2

    References:
      Goyal et al., `Accurate, Large Minibatch SGD <https://arxiv.org/abs/1706.02677>`_, 2017.
    """
    lr = _check_schedule(learning_rate)
    _check_scale(scale)
    return lambda count: _f32(scale) * _f32(lr(_f32(scale) * _f32(count)))


def square_root(learning_rate: ScalarOrSchedule, scale: float) -> Schedule:
    """The square-root scaling rule: ``√S·lr(S·t)`` over ``⌈T/S⌉`` iterations.

    Keeps the variance of the update (not its mean) as at the base batch size
    (Krizhevsky, 2014; Hoffer et al., 2017).

    Args:
      learning_rate: the base schedule ``lr(t)``.
      scale: ``S ≥ 1``, base batches per iteration.

    Returns:
      A schedule ``t -> √S·lr(S·t)`` (float32).

    Examples:
      >>> import optax
      >>> from optax_adascale import scaling_rules
      >>> schedule = scaling_rules.square_root(optax.exponential_decay(0.1, 100, 0.5), scale=4)
      >>> print(schedule(0), schedule(25))
      0.2 0.1

    References:
      Krizhevsky, `One weird trick for parallelizing convolutional neural
      networks <https://arxiv.org/abs/1404.5997>`_, 2014.
    """
    lr = _check_schedule(learning_rate)
    _check_scale(scale)
    return lambda count: jnp.sqrt(_f32(scale)) * _f32(lr(_f32(scale) * _f32(count)))


def linear_warmup(
    learning_rate: ScalarOrSchedule,
    scale: float,
    total_steps: int,
    *,
    warmup_fraction: float = WARMUP_FRACTION,
) -> Schedule:
    r"""Linear scaling with warm-up (LSW, Goyal et al.) over ``⌈T/S⌉`` iterations.

    With ``W = warmup_fraction·⌈T/S⌉`` iterations (not rounded),

    .. math::

       \mathrm{lr}_{\mathrm{LSW}}(t) = w(t)\,S\,\mathrm{lr}(S t), \qquad
       w(t) = \tfrac{1}{S} + \bigl(1 - \tfrac{1}{S}\bigr)\min(t/W, 1):

    a linear ramp from ``lr(0)`` to ``S·lr(0)`` when ``lr`` is constant during
    the warm-up, continuous otherwise, and the identity for ``S = 1``.

    Args:
      learning_rate: the base schedule ``lr(t)``.
      scale: ``S ≥ 1``, base batches per iteration.
      total_steps: ``T``, the base-batch step budget (an int ≥ 1).
      warmup_fraction: the ramp's length as a fraction of ``⌈T/S⌉``.

    Returns:
      A schedule of the iteration (float32). Train for ``⌈T/S⌉`` iterations.

    Examples:
      ``T = 1000`` base steps at ``S = 5`` is 200 iterations; the ramp takes
      ``0.055·200 = 11`` of them:

      >>> import optax
      >>> from optax_adascale import scaling_rules
      >>> base = optax.piecewise_constant_schedule(0.1, {500: 0.5})
      >>> schedule = scaling_rules.linear_warmup(base, scale=5, total_steps=1000)
      >>> print(schedule(0), schedule(5.5), schedule(11), schedule(100))
      0.1 0.3 0.5 0.25

    References:
      Goyal et al., `Accurate, Large Minibatch SGD: Training ImageNet in 1
      Hour <https://arxiv.org/abs/1706.02677>`_, 2017, §2.2.

      Johnson et al., `AdaScale SGD <https://arxiv.org/abs/2007.05105>`_, ICML
      2020, §4 ("LSW").
    """
    lr = _check_schedule(learning_rate)
    _check_scale(scale)
    _check_positive_int("total_steps", total_steps)
    _check_fraction(warmup_fraction)

    def schedule(count):
        t = _f32(count)
        iterations = jnp.ceil(_f32(total_steps) / _f32(scale))
        main = _f32(scale) * _f32(lr(_f32(scale) * t))
        return _warmup_factor(scale, t, _f32(warmup_fraction) * iterations) * main

    return schedule


def stretched_linear_warmup(
    learning_rate: ScalarOrSchedule,
    scale: float,
    total_steps: int,
    num_iterations: int,
    *,
    warmup_fraction: float = WARMUP_FRACTION,
) -> Schedule:
    r"""LSW+: linear scaling with warm-up, stretched to ``N`` iterations.

    The paper's fairer baseline: as many iterations as AdaScale took at the
    same scale (``N = count`` of its final state), the base schedule run at
    ``T/N`` base steps per iteration. With ``W = warmup_fraction·N`` and the
    warm-up factor ``w`` of :func:`linear_warmup`,

    .. math::

       \mathrm{lr}_{\mathrm{LSW+}}(t) = w(t)\,S\,\mathrm{lr}(t\,T/N).

    For ``N = T/S`` this is :func:`linear_warmup`.

    Args:
      learning_rate: the base schedule ``lr(t)``.
      scale: ``S ≥ 1``, base batches per iteration.
      total_steps: ``T``, the base-batch step budget (an int ≥ 1).
      num_iterations: ``N``, the iterations to train for (an int ≥ 1).
      warmup_fraction: the ramp's length as a fraction of ``N``.

    Returns:
      A schedule of the iteration (float32). Train for ``N`` iterations.

    Examples:
      ``T = 1000`` stretched to ``N = 400`` iterations at ``S = 5``: the ramp
      takes 22 iterations and the decay at base step 500 comes at iteration 200:

      >>> import optax
      >>> from optax_adascale import scaling_rules
      >>> base = optax.piecewise_constant_schedule(0.1, {500: 0.5})
      >>> schedule = scaling_rules.stretched_linear_warmup(base, 5, total_steps=1000, num_iterations=400)
      >>> print(schedule(0), schedule(11), schedule(22), schedule(199), schedule(200))
      0.1 0.3 0.5 0.5 0.25

    References:
      Johnson et al., `AdaScale SGD <https://arxiv.org/abs/2007.05105>`_, ICML
      2020, §4 ("LSW+").
    """
    lr = _check_schedule(learning_rate)
    _check_scale(scale)
    _check_positive_int("total_steps", total_steps)
    _check_positive_int("num_iterations", num_iterations)
    _check_fraction(warmup_fraction)

    def schedule(count):
        t = _f32(count)
        base_step = t * (_f32(total_steps) / _f32(num_iterations))
        main = _f32(scale) * _f32(lr(base_step))
        return _warmup_factor(scale, t, _f32(warmup_fraction) * _f32(num_iterations)) * main

    return schedule

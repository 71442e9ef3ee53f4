"""Ready-made AdaScale optimizers: ``adascale_sgd`` (PyTorch SGD semantics), ``adascale_adamw`` (experimental)."""

from typing import Any

import jax
import optax

from optax_adascale._factories import adascale
from optax_adascale.core import _checks, _clock, _keeps_state, _options
from optax_adascale.core._ramp import BatchRamp


def _decayed_weights(weight_decay: Any) -> optax.GradientTransformation:
    """``g + wd·p``, skipped where ``wd`` is a concrete 0; the same (empty) state either way.

    ``optax.inject_hyperparams`` turns ``weight_decay=0.0`` into an array, so
    the choice cannot change the state's structure.
    """
    zero = _checks.concrete_float(weight_decay) == 0.0

    def update_fn(updates, state, params=None):
        if zero:
            return updates, state
        if params is None:
            traced = _checks.concrete_float(weight_decay) is None  # optax.inject_hyperparams: unknown until run
            shown = "weight_decay (a hyperparameter of optax.inject_hyperparams)" if traced else "weight_decay > 0"
            raise ValueError(f"{shown} needs params: call update(grads, opt_state, params)")
        return jax.tree.map(lambda g, p: g + weight_decay * p, updates, params), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


TAU_CLOCK = "tau"
UPDATE_CLOCK = "update"
# Each alias's default clock, from benchmarks/scale_quality: the τ clock for both. AdamW's (√r·lr) kept every cell of
# the study within noise where the update clock over-credited; SGD's, with the stability guard (core/_clock), removed
# the update clock's over-credit without the losses near its stability limit that kept it off by default in 0.3.
DEFAULT_CLOCK = {"sgd": TAU_CLOCK, "adamw": TAU_CLOCK}


def _resolve_clock(clock: str | None, estimator: Any, default: str) -> str:
    """``clock``: ``"tau"`` (the moment averages count base-batch steps, ``core/_clock``) or ``"update"`` (the
    paper's and FairScale's: they decay per update); ``None``: the alias's default, ``"update"`` with FairScale's
    estimator."""
    if clock is None:
        return UPDATE_CLOCK if isinstance(estimator, str) and estimator == "fairscale" else default
    _checks.check_choice("clock", clock, (TAU_CLOCK, UPDATE_CLOCK))
    return clock


def adascale_sgd(
    learning_rate: optax.ScalarOrSchedule,
    momentum: float | None = None,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    *,
    axis_name: str | tuple[str, ...] | None = None,
    accumulation_steps: int | BatchRamp = 1,
    scale: float | None = None,
    estimator: Any = None,
    clock: str | None = None,
    **options: Any,
) -> optax.GradientTransformationExtraArgs:
    """AdaScale around SGD with PyTorch's semantics (FairScale's ``AdaScale(SGD(...))``).

    ``weight_decay`` is added to the *averaged* gradient before momentum
    (``d = ḡ + wd·p``) and is never part of the gain statistics; the step is
    ``−r_t·lr(⌊τ_t⌋)·m``. It is :func:`adascale` with ``inner =
    optax.chain(optax.add_decayed_weights(wd), trace(μ))``: SGD's keywords, the
    four AdaScale options most users set, the clock, and any other keyword of
    :func:`adascale` (``param_labels``, ``shard_optimizer_state``,
    ``delayed_gain``, ``param_specs``).

    The clock (``benchmarks/scale_quality``; ``docs/noise_scale.md``, "What the
    gain models"): by default (``clock="tau"``) the momentum counts base-batch
    steps (:func:`optax_adascale.trace`): an update worth ``r`` base steps
    decays the buffer by ``μ^r`` and adds ``d`` with the weight ``(1 − μ^r)/(1 −
    μ)`` of ``r`` base steps, and a stability guard caps the gain where the step
    would pass half the stability limit along the curvature the momentum
    measured, and lets it grow by at most 10 % an update. ``clock="update"`` is
    0.3's, the paper's and FairScale's arithmetic (``m ← μm + d``, Nesterov ``d +
    μm``, the gain times the whole step), which over-credits at large ``S``;
    ``estimator="fairscale"`` implies it.
    ``optax.inject_hyperparams(adascale_sgd)(learning_rate=..., ...)`` needs no
    ``static_args`` (a learning-rate *schedule* does: ``static_args=("learning_rate",)``,
    so that it runs on ``τ``; ``accumulation_steps > 1`` too).

    Args:
      learning_rate: float or schedule of the base-batch step, evaluated at ``⌊τ⌋``.
      momentum: PyTorch momentum ``μ``, or ``None`` for plain SGD.
      nesterov: Nesterov momentum (requires ``momentum``).
      weight_decay: L2 coefficient added to the averaged gradient.
      axis_name: as in :func:`adascale`.
      accumulation_steps: as in :func:`adascale`.
      scale: as in :func:`adascale`.
      estimator: as in :func:`adascale`.
      clock: ``None`` or ``"tau"`` (the guarded τ clock above; ``None`` means
        ``"update"`` with ``estimator="fairscale"``) or ``"update"``.
      **options: any other keyword of :func:`adascale`.

    Returns:
      An ``optax.GradientTransformationExtraArgs``.

    Raises:
      ValueError: ``clock`` other than ``"tau"``, ``"update"`` or ``None``.

    Examples:
      >>> import jax.numpy as jnp
      >>> import optax_adascale
      >>> tx = optax_adascale.adascale_sgd(0.1, momentum=0.9, accumulation_steps=2, clock="update")
      >>> params = jnp.zeros(2)
      >>> state = tx.init(params)
      >>> _, state = tx.update(jnp.array([1.0, 0.0]), state, params)
      >>> updates, state = tx.update(jnp.array([0.0, 1.0]), state, params)
      >>> optax_adascale.metrics(state)["gain"]  # orthogonal samples: the gain is S = 2
      Array(2., dtype=float32)
      >>> print(updates.round(6))  # the first momentum step is ḡ = (0.5, 0.5), times 2 · 0.1
      [-0.1 -0.1]
      >>> tx = optax_adascale.adascale_sgd(0.1, momentum=0.9, accumulation_steps=2)  # the default clock
      >>> _, state = tx.update(jnp.array([1.0, 0.0]), tx.init(params), params)
      >>> _, state = tx.update(jnp.array([0.0, 1.0]), state, params)
      >>> optax_adascale.metrics(state)["gain"]  # the guard: the gain starts at 1 and grows ≤ 10 % an update
      Array(1.1, dtype=float32)

    References:
      Johnson, Agrawal, Gu, Guestrin, `AdaScale SGD
      <https://arxiv.org/abs/2007.05105>`_, ICML 2020.
    """
    if nesterov and momentum is None:
        raise ValueError("nesterov=True requires a momentum, got momentum=None")
    _checks.check_number("momentum", momentum, low=0.0)
    _checks.check_number("weight_decay", weight_decay, low=0.0)
    options = _options.unwrap(options, "options")
    clock = _resolve_clock(clock, estimator, DEFAULT_CLOCK["sgd"])
    if momentum is not None and clock == TAU_CLOCK:  # the guard reads its input: the decay inside the trace
        parts = [_clock.trace(decay=momentum, nesterov=nesterov, weight_decay=weight_decay)]
    else:
        parts = [_decayed_weights(weight_decay)]
        if momentum is not None:
            parts.append(_keeps_state.trace(decay=momentum, nesterov=nesterov))
    return adascale(
        _keeps_state.keeps_state(optax.chain(*parts)),
        learning_rate,
        axis_name=axis_name,
        accumulation_steps=accumulation_steps,
        scale=scale,
        estimator=estimator,
        **options,
    )


def adascale_adamw(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Any = None,
    weight_decay: float = 1e-4,
    mask: Any = None,
    *,
    nesterov: bool = False,
    axis_name: str | tuple[str, ...] | None = None,
    accumulation_steps: int | BatchRamp = 1,
    scale: float | None = None,
    estimator: Any = None,
    clock: str | None = None,
    **options: Any,
) -> optax.GradientTransformationExtraArgs:
    """AdaScale around AdamW (experimental): ``optax.adamw``'s keywords, the gain from the raw gradients.

    ``inner = optax.chain(scale_by_adam(b1, b2, eps, eps_root, mu_dtype,
    nesterov=nesterov), optax.add_decayed_weights(weight_decay, mask))`` and the
    step is ``−r_t·lr(⌊τ_t⌋)·inner(ḡ)``. On the τ clock (``clock="tau"``, the
    default since 0.4.0; :func:`optax_adascale.scale_by_adam`) an update worth
    ``r`` base-batch steps averages with ``b1^r`` and ``b2^r`` and Adam's
    direction is scaled by ``r^{−½}``: the Adam step is ``√r·lr`` (Adam already
    divides by the smaller noise of an ``S``-times larger batch, which makes
    its direction ``√r`` times longer per unit of progress), while the
    decoupled weight decay keeps ``r·lr·wd``, the small batch's decay per base
    step. ``clock="update"`` is 0.3's rule: the gain multiplies the whole AdamW
    step (``r·lr``) with Adam's per-update averages. The gain's statistics are
    the raw gradients' (``benchmarks/adam``). Experimental: small tasks; see
    ``benchmarks/scale_quality`` (S up to 64, three learning rates, against
    plain AdamW with the same examples) and ``benchmarks/ramp``. At S = 1 it is
    ``optax.adamw`` (bit for bit, on either clock; with ``nesterov=True`` to
    float32 rounding, ~2e-7 after 200 steps).

    Args:
      learning_rate: float or schedule of the base-batch step.
      b1: see ``optax.adamw``.
      b2: see ``optax.adamw``.
      eps: Adam's ``ε`` (see ``optax.adamw``); AdaScale's variance floor is ``Estimator.eps``.
      eps_root: see ``optax.adamw``.
      mu_dtype: see ``optax.adamw``.
      weight_decay: decoupled weight decay (see ``optax.adamw``).
      mask: see ``optax.adamw``.
      nesterov: see ``optax.adamw``.
      axis_name: as in :func:`adascale`.
      accumulation_steps: as in :func:`adascale`.
      scale: as in :func:`adascale`.
      estimator: as in :func:`adascale`.
      **options: any other keyword of :func:`adascale`, and ``clock``: ``"tau"``
        (Adam's averages count base-batch steps and the step is ``√r·lr``),
        ``"update"`` (per update, the step ``r·lr``), or ``None``: ``"tau"``,
        and ``"update"`` with ``estimator="fairscale"``.

    Returns:
      An ``optax.GradientTransformationExtraArgs``.

    Raises:
      ValueError: ``clock`` other than ``"tau"``, ``"update"`` or ``None``.

    Examples:
      >>> import jax, jax.numpy as jnp, optax_adascale
      >>> tx = optax_adascale.adascale_adamw(1e-3, weight_decay=0.0, axis_name="i")
      >>> params = jnp.zeros(2)
      >>> step = jax.vmap(tx.update, in_axes=(0, None, None), out_axes=(None, None), axis_name="i")
      >>> updates, state = step(jnp.eye(2), tx.init(params), params)  # orthogonal samples: gain 2
      >>> optax_adascale.metrics(state)["gain"]  # the step: −√2 · 1e-3 · ḡ/(|ḡ| + ε) per coordinate
      Array(2., dtype=float32)
      >>> print(updates.round(6))
      [-0.001414 -0.001414]
    """
    options = _options.unwrap(options, "options")
    clock = _resolve_clock(clock, estimator, DEFAULT_CLOCK["adamw"])
    adam = _clock.scale_by_adam if clock == TAU_CLOCK else _keeps_state.scale_by_adam
    inner = _keeps_state.keeps_state(
        optax.chain(
            adam(b1=b1, b2=b2, eps=eps, eps_root=eps_root, mu_dtype=mu_dtype, nesterov=nesterov),
            optax.add_decayed_weights(weight_decay, mask),
        )
    )
    return adascale(
        inner,
        learning_rate,
        axis_name=axis_name,
        accumulation_steps=accumulation_steps,
        scale=scale,
        estimator=estimator,
        **options,
    )

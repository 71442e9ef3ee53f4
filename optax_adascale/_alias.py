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
DEFAULT_CLOCK = UPDATE_CLOCK


def _resolve_clock(clock: str | None, estimator: Any) -> str:
    """``clock``: ``"tau"`` (the moment averages count base-batch steps, ``core/_clock``) or ``"update"`` (the
    paper's and FairScale's: they decay per update); ``None``: the default, ``"update"`` with FairScale's estimator."""
    if clock is None:
        return UPDATE_CLOCK if isinstance(estimator, str) and estimator == "fairscale" else DEFAULT_CLOCK
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
    (``d = ḡ + wd·p``; ``m ← μm + d``; Nesterov uses ``d + μm``) and is never
    part of the gain statistics; the step is ``−r_t·lr(⌊τ_t⌋)·m``. It is
    :func:`adascale` with ``inner = optax.chain(optax.add_decayed_weights(wd),
    optax.trace(μ))``: SGD's keywords, the four AdaScale options most users set,
    and any other keyword of :func:`adascale` (``param_labels``,
    ``shard_optimizer_state``, ``delayed_gain``, ``param_specs``).
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
      **options: any other keyword of :func:`adascale`.

    Returns:
      An ``optax.GradientTransformationExtraArgs``.

    Examples:
      >>> import jax.numpy as jnp
      >>> import optax_adascale
      >>> tx = optax_adascale.adascale_sgd(0.1, momentum=0.9, accumulation_steps=2)
      >>> params = jnp.zeros(2)
      >>> state = tx.init(params)
      >>> _, state = tx.update(jnp.array([1.0, 0.0]), state, params)
      >>> updates, state = tx.update(jnp.array([0.0, 1.0]), state, params)
      >>> updates, optax_adascale.metrics(state)["gain"]
      (Array([-0.1, -0.1], dtype=float32), Array(2., dtype=float32))

    References:
      Johnson, Agrawal, Gu, Guestrin, `AdaScale SGD
      <https://arxiv.org/abs/2007.05105>`_, ICML 2020.
    """
    if nesterov and momentum is None:
        raise ValueError("nesterov=True requires a momentum, got momentum=None")
    _checks.check_number("momentum", momentum, low=0.0)
    _checks.check_number("weight_decay", weight_decay, low=0.0)
    parts = [_decayed_weights(weight_decay)]
    if momentum is not None:
        trace = _clock.trace if _resolve_clock(clock, estimator) == TAU_CLOCK else _keeps_state.trace
        parts.append(trace(decay=momentum, nesterov=nesterov))
    return adascale(
        _keeps_state.keeps_state(optax.chain(*parts)),
        learning_rate,
        axis_name=axis_name,
        accumulation_steps=accumulation_steps,
        scale=scale,
        estimator=estimator,
        **_options.unwrap(options, "options"),
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

    ``inner = optax.chain(optax.scale_by_adam(b1, b2, eps, eps_root, mu_dtype,
    nesterov=nesterov), optax.add_decayed_weights(weight_decay, mask))`` and the
    step is ``−r_t·lr(⌊τ_t⌋)·inner(ḡ)``: the gain multiplies the whole AdamW
    step, decoupled weight decay included, so the decay per base-batch step is
    the S = 1 schedule's. The gain's statistics are the raw gradients' (rule
    (a) of ``benchmarks/adam.py``): on a byte-level LM and on MNIST-1D, with a
    warm-up + cosine schedule tuned once at S = 1, it kept S = 1 quality at
    S = 4 and 16 (3 seeds) where square-root and linear-with-warm-up scaling
    of AdamW did not, and came ahead of AdaptDL's ``gain^½`` and of
    preconditioned statistics. Experimental: two small tasks; see the README's
    "Adam" section. With ``accumulation_steps=BatchRamp(...)`` it ramps as SGD
    does (``benchmarks/ramp``: its best result was AdamW's); there a step at
    S = 32 was worth more than its gain claimed (0.19 nats/byte lower at equal
    ``τ`` than S = 2, against 0.06 for SGD): the raw gain is conservative for
    AdamW, so ``τ`` runs slow at a large ``S``, never fast. At S = 1 it is ``optax.adamw`` (bit for bit; with
    ``nesterov=True`` to float32 rounding, ~2e-7 after 200 steps).

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
      **options: any other keyword of :func:`adascale`.

    Returns:
      An ``optax.GradientTransformationExtraArgs``.

    Examples:
      >>> import jax, jax.numpy as jnp, optax_adascale
      >>> tx = optax_adascale.adascale_adamw(1e-3, weight_decay=0.0, axis_name="i")
      >>> params = jnp.zeros(2)
      >>> step = jax.vmap(tx.update, in_axes=(0, None, None), out_axes=(None, None), axis_name="i")
      >>> updates, state = step(jnp.eye(2), tx.init(params), params)  # orthogonal samples: gain 2
      >>> optax_adascale.metrics(state)["gain"]  # the step: −2 · 1e-3 · ḡ/(|ḡ| + ε) per coordinate
      Array(2., dtype=float32)
      >>> print(updates.round(6))
      [-0.002 -0.002]
    """
    adam = _clock.scale_by_adam if _resolve_clock(clock, estimator) == TAU_CLOCK else _keeps_state.scale_by_adam
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
        **_options.unwrap(options, "options"),
    )

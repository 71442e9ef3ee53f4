"""One AdaScale update from reduced statistics: moments, gain, learning rate, skip, ``inner``, new state.

Everything here runs after the reduction, on values identical on every replica
(or, with ``shard_optimizer_state``, on each replica's row of them), so every
replica takes the same branch of the skip. The reduction strategies that call
:func:`apply` are in ``_reduce``.
"""

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_adascale.core import _axes, _clock, _groups, _inner, _norms
from optax_adascale.core import _estimator as est

Array = jax.Array


@dataclasses.dataclass(frozen=True, eq=False)
class Update:
    """What one update does once the statistics are reduced: ``inner``, the schedule, the estimator.

    ``lr_magnitude``: the schedule's largest ``|lr|`` found at construction (0 if unknown); a
    negative value within ``1e-6`` of it is float rounding (``linear_schedule(lr, 0, n)`` under jit
    gives ``−7e-10`` past ``n``) and counts as 0.
    """

    inner: optax.GradientTransformationExtraArgs
    learning_rate: Any
    estimator: est.Settings
    lr_magnitude: float = 0.0


class Shape(NamedTuple):
    """Static facts of one update: groups, the call's axes, ``n`` samples, scale ``S``.

    ``n`` (and ``S = n``) is a traced int32 under a :class:`BatchRamp`, where ``k_t`` is in the state.
    """

    groups: _groups.Groups
    axes: _axes.Axes
    n: Any
    S: Any


class _Statistics(NamedTuple):
    """The moving averages after this step, and the gains this update applies."""

    count: Array  # type: ignore[assignment]  # a field named like tuple.count, as in optax's states
    weight: Array
    sqr_weight: Array
    grad_var: Array  # [G]
    grad_sqr: Array  # [G]
    gain: Array  # applied
    group_gains: Array  # [G], applied
    floored: Array  # bool: this step's variance estimate was zero up to rounding
    ok: Array  # bool: every statistic the step depends on is finite


def _statistics(estimator: est.Settings, shape: Shape, a: Array, b: Array, state) -> _Statistics:
    """σ̂², μ̂² of this step, the moving averages, and the gain (of this step, or of the last with ``delayed_gain``)."""
    groups, n, S = shape.groups, shape.n, shape.S
    old_var, old_sqr = groups.unpack(state.grad_var), groups.unpack(state.grad_sqr)
    count = optax.safe_increment(state.count)
    if isinstance(n, int) and n == 1:  # S = n = 1: the identity; no variance to estimate.
        ones = jnp.ones((groups.size,), jnp.float32)
        ok = jnp.all(jnp.isfinite(a if estimator.delayed_gain else b))
        return _Statistics(
            count,
            state.ema_weight,
            state.sqr_weight,
            old_var,
            old_sqr,
            jnp.ones([], jnp.float32),
            ones,
            jnp.bool_(False),
            ok,
        )
    var_t, sqr_t = est.step_moments(a, b, n, S, estimator.eps, floor_sqr=not estimator.unbiased_sqr)
    tau = state.tau_whole.astype(jnp.float32) + state.tau_frac
    theta_var, theta_sqr = estimator.smoothings(n, state.gain, tau)
    alpha_var, weight = est.ema_rate(count, state.ema_weight, theta_var, estimator.averaging)
    alpha_sqr, sqr_weight = est.ema_rate(count, state.sqr_weight, theta_sqr, estimator.averaging)
    grad_var = est.ema_update(old_var, var_t, alpha_var)
    grad_sqr = est.ema_update(old_sqr, sqr_t, alpha_sqr)
    floored = jnp.sum(a - b) <= 1e-5 * jnp.sum(a)
    # The averages too: a state restored from a broken run (or 0/0 weights) must skip, not train on NaN.
    stats_finite = jnp.all(
        jnp.isfinite(jnp.concatenate([a, b, var_t, sqr_t, grad_var, grad_sqr, jnp.stack([weight, sqr_weight])]))
    )
    if estimator.delayed_gain:
        # The gain of the averages through the last update; this sample enters them
        # afterwards. The skip reads `a` alone (finite a ⇒ finite ḡ), so nothing
        # needs ‖ḡ‖² before the update is written.
        group_gains = est.gain_ratio(old_var, old_sqr, S)
        gain = est.gain_ratio(jnp.sum(old_var), jnp.sum(old_sqr), S)
        keep = ~stats_finite
        grad_var, grad_sqr = jnp.where(keep, old_var, grad_var), jnp.where(keep, old_sqr, grad_sqr)
        weight = jnp.where(keep, state.ema_weight, weight)
        sqr_weight = jnp.where(keep, state.sqr_weight, sqr_weight)
        ok = jnp.all(jnp.isfinite(a))
    else:
        group_gains = est.gain_ratio(grad_var, grad_sqr, S)
        gain = est.gain_ratio(jnp.sum(grad_var), jnp.sum(grad_sqr), S)
        ok = stats_finite
    return _Statistics(count, weight, sqr_weight, grad_var, grad_sqr, gain, group_gains, floored, ok)


class Reduced(NamedTuple):
    """What the reduction strategy (``sharding/_reduce``) hands an update besides ``ḡ``, ``a`` and ``b``: the guard's
    probe (``BaseSteps.probe``, ``None`` without a guarded trace), and how an ``inner`` takes the squared norm of a
    tree whose leaves may be split over model axes or ZeRO rows (``BaseSteps.sq_norm``)."""

    probe: Any = None
    sq_norm: Any = _clock.local_sq_norm


def _learning_rates(
    update: Update, shape: Shape, stats: _Statistics, state: Any
) -> tuple[_Statistics, Array, Array, Array, Array, Array]:
    """The gains after the τ clock's stability guard, ``lr(⌊τ⌋)``, the step ``r·lr``, each group's step, whether
    they are finite, whether ``lr < 0``.

    A negative ``lr`` within float rounding of zero (``1e-6`` of the schedule's magnitude) is zero. The guard holds
    where ``inner`` holds a τ-clock momentum (:func:`_clock.trace`): each gain (the global one and each group's) is
    at most ``GAIN_GROWTH`` times its last applied value (at least 1), and at most the limit the curvature measured
    along the last steps sets (:func:`_clock.gain_limit`); ``min`` is the estimated gain bit for bit wherever neither
    binds. τ is credited with the gain applied.
    """
    lr = _schedule(update, state.tau_whole)
    if _clock.has_guard(state.inner_state):
        limit = _clock.gain_limit(state.inner_state)
        last = shape.groups.unpack(state.group_gains) if shape.groups.labels is not None else state.gain
        grown = jnp.float32(_clock.GAIN_GROWTH) * jnp.maximum(state.gain, 1.0)
        grown_groups = jnp.float32(_clock.GAIN_GROWTH) * jnp.maximum(last, 1.0)
        stats = stats._replace(
            gain=jnp.minimum(stats.gain, jnp.minimum(grown, limit)),
            group_gains=jnp.minimum(stats.group_gains, jnp.minimum(grown_groups, limit)),
        )
    step_size = update.estimator.step_size(stats.gain, lr)
    group_steps = update.estimator.step_size(stats.group_gains, lr)
    finite = jnp.isfinite(step_size) & jnp.all(jnp.isfinite(group_steps))
    return stats, lr, step_size, group_steps, finite, finite & (lr < 0)


def _schedule(update: Update, tau_whole: Array) -> Array:
    """``lr(⌊τ⌋)`` in float32; a negative value within float rounding of zero is zero."""
    schedule = update.learning_rate
    lr = jnp.asarray(schedule(tau_whole) if callable(schedule) else schedule, jnp.float32)
    if update.lr_magnitude > 0:
        lr = jnp.where((lr < 0) & (lr >= -1e-6 * update.lr_magnitude), jnp.zeros_like(lr), lr)
    return lr


def _base_steps(
    update: Update,
    shape: Shape,
    stats: _Statistics,
    lr: Array,
    group_steps: Array,
    grads: Any,
    state: Any,
    reduced: Reduced,
) -> _clock.BaseSteps:
    """What this update tells every ``inner`` (:class:`_clock.BaseSteps`): its gain and step (each leaf its group's,
    with labels), ``lr(⌊τ⌋)``, the last applied update's step (from the state: ``r^p·lr`` of its gain and learning
    rate, 0 before the first), the next update's learning rate ``lr(⌊τ + r⌋)``, the expected squared norm ``σ̄²/S``
    of the averaged gradient's noise, and the strategy's probe and squared norm. The noise reads the averages through
    the last update: an input of the program, so every program that reaches the same state reads the same bits (this
    step's average is recomputed where it is fused, 1 ulp apart between an accumulation and a ramp pinned at the same
    ``k``).
    ``taken`` is set by ``_inner.run``."""
    groups = shape.groups
    gain: Any = stats.gain
    step: Any = update.estimator.step_size(stats.gain, lr)
    last: Any = update.estimator.step_size(state.gain, state.base_lr)
    if groups.labels is not None:
        treedef = jax.tree.structure(grads)
        last_steps = update.estimator.step_size(groups.unpack(state.group_gains), state.base_lr)
        per_leaf = lambda v: treedef.unflatten([v[g] for g in groups.leaf_group])  # noqa: E731
        gain, step, last = per_leaf(stats.group_gains), per_leaf(group_steps), per_leaf(last_steps)
    next_whole, _ = est.advance_tau(state.tau_whole, state.tau_frac, stats.gain)
    noise = jnp.sum(groups.unpack(state.grad_var)) / jnp.asarray(shape.S, jnp.float32)
    return _clock.BaseSteps(
        gain=gain,
        learning_rate=lr,
        step=step,
        last_step=last,
        next_learning_rate=_schedule(update, next_whole),
        noise=noise,
        taken=None,
        probe=reduced.probe,
        sq_norm=reduced.sq_norm,
    )


def _scale_updates(leaves: list[Array], steps: Array, leaf_group: tuple[int, ...], ok: Array) -> list[Array]:
    """``−step_g · u`` per leaf (in float32 or wider, complex kept), zero where the update is skipped."""

    def scale(u, g):
        dtype = _norms.compute_dtype(u.dtype)
        real = jnp.finfo(dtype).dtype
        return jnp.where(ok, u.astype(dtype) * (-steps[g]).astype(real), 0).astype(u.dtype)

    return [scale(u, g) for u, g in zip(leaves, leaf_group, strict=True)]


def apply(update: Update, shape: Shape, mean_grads, a, b, state, params, extra_args, reduced: Reduced | None = None):
    """One AdaScale update from reduced (replica-identical) statistics ``ḡ``, ``a``, ``b`` and the strategy's
    :class:`Reduced` (the guard's probe, the squared norm over split leaves).

    The accumulation buffers are the caller's business: they are set aside so
    that the skip's select never touches a gradient-sized buffer.
    """
    reduced = Reduced() if reduced is None else reduced
    buffers = (state.acc_grads, state.acc_sq_norm)
    state = state._replace(acc_grads=None, acc_sq_norm=None)
    with jax.named_scope("adascale/statistics"):
        stats = _statistics(update.estimator, shape, a, b, state)
    with jax.named_scope("adascale/learning_rate"):
        stats, lr, step_size, group_steps, lr_finite, negative = _learning_rates(update, shape, stats, state)
        ok = stats.ok & lr_finite & ~negative
        negative = stats.ok & negative  # the reason recorded: non-finite statistics take precedence
    # inner's update reads the state the skip keeps: selecting after inner made XLA copy every donated state buffer
    # (Adam's μ and ν) before writing it in place (_inner's docstring says how each inner avoids it).
    with jax.named_scope("adascale/inner"):
        steps = _base_steps(update, shape, stats, lr, group_steps, mean_grads, state, reduced)
        inner_updates, kept_inner_state = _inner.run(
            update.inner, ok, mean_grads, state.inner_state, params, {**extra_args, _clock.KEYWORD: steps}
        )
    with jax.named_scope("adascale/scale_updates"):
        scaled = _scale_updates(jax.tree.leaves(inner_updates), group_steps, shape.groups.leaf_group, ok)
        new_updates = jax.tree.structure(inner_updates).unflatten(scaled)
    with jax.named_scope("adascale/state"):
        new_state = _next_state(shape, state, stats, lr, step_size, ok, negative)
    return new_updates, new_state._replace(inner_state=kept_inner_state, acc_grads=buffers[0], acc_sq_norm=buffers[1])


def _next_state(shape: Shape, state, stats: _Statistics, lr, step_size, ok, negative):
    """The scalar state after an applied update where ``ok``, else the old one with the skip counted."""
    groups = shape.groups
    tau_whole, tau_frac = est.advance_tau(state.tau_whole, state.tau_frac, stats.gain)
    stepped = state._replace(
        count=stats.count,
        gain=stats.gain,
        tau_whole=tau_whole,
        tau_frac=tau_frac,
        grad_sqr=groups.pack(stats.grad_sqr),
        grad_var=groups.pack(stats.grad_var),
        group_gains=groups.pack_gains(stats.group_gains),
        ema_weight=stats.weight,
        sqr_weight=stats.sqr_weight,
        effective_lr=step_size,
        base_lr=lr,
        scale=jnp.asarray(shape.S, jnp.float32),
        skip_streak=jnp.zeros_like(state.skip_streak),
        floored_steps=jnp.where(stats.floored, optax.safe_increment(state.floored_steps), state.floored_steps),
        inner_state=None,
    )
    skipped = state._replace(
        skipped_steps=optax.safe_increment(state.skipped_steps),
        negative_lr_steps=jnp.where(negative, optax.safe_increment(state.negative_lr_steps), state.negative_lr_steps),
        skip_streak=optax.safe_increment(state.skip_streak),
        inner_state=None,
    )
    return optax.tree.where(ok, stepped, skipped)

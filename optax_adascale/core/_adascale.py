"""AdaScale as an optax gradient transformation: the state, the factories, and the update in named steps."""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_adascale.core import (
    _accumulate,
    _axes,
    _checks,
    _collect,
    _groups,
    _norms,
    _options,
    _ramp,
    _read,
    _samples,
    _step,
)
from optax_adascale.core._samples import MicrobatchStats

Array = jax.Array


class AdaScaleState(NamedTuple):
    """State of :func:`adascale`. All scalars are per update, identical on every replica.

    Attributes:
      count: int32 ``[]``, updates applied (skipped updates and
        accumulation-only calls do not count).
      gain: float32 ``[]``, the gain ``r_t ∈ [1, S]`` of the last applied update
        (1 before the first).
      tau_whole: int32 ``[]``, ``⌊τ⌋``: the schedule's clock, exact.
      tau_frac: float32 ``[]``, ``τ − ⌊τ⌋ ∈ [0, 1)``.
      grad_sqr: float32 ``[]``, the moving average ``μ̄²`` of ``‖∇L‖²``; with
        ``param_labels``, a dict label → float32 ``[]``. (With
        ``unbiased_sqr`` it may dip below 0; readers floor it.)
      grad_var: float32 ``[]``, the moving average ``σ̄²`` of the variance of one
        base-batch gradient (base-batch units); a dict with ``param_labels``.
      group_gains: dict label → float32 ``[]``, each group's gain of the last
        applied update; ``{}`` without ``param_labels``.
      ema_weight: float32 ``[]``, the debiasing weight ``w = Σ θ^j (1−θ)`` of ``σ̄²``.
      sqr_weight: float32 ``[]``, the same for ``μ̄²`` (equal to ``ema_weight``
        unless ``horizon`` gives the two averages different memories).
      effective_lr: float32 ``[]``, ``r_t · lr(⌊τ_t⌋)`` of the last applied update
        (``metrics()["learning_rate"]``).
      base_lr: float32 ``[]``, ``lr(⌊τ_t⌋)`` of the last applied update.
      scale: float32 ``[]``, ``S`` of the last applied update (0 before the first).
      skipped_steps: int32 ``[]``, updates skipped (non-finite values, or a
        negative learning rate).
      negative_lr_steps: int32 ``[]``, of those, the updates skipped because the
        schedule's learning rate was negative (beyond float rounding: a value
        within ``1e-6`` of the schedule's largest counts as 0).
      altered_grads_steps: int32 ``[]``, of those, the accumulated updates skipped because the gradients
        ``update`` was given were not those :func:`value_and_grad`'s statistics measured (clipped or scaled
        before ``update``; with accumulation ``b`` is taken from them): :func:`done` raises on it.
      skip_streak: int32 ``[]``, updates skipped since the last applied one.
      floored_steps: int32 ``[]``, applied updates with ``n > 1`` whose variance
        estimate was zero up to rounding (at the ``eps`` floor): replicas that
        saw identical gradients.
      micro_step: int32 ``[]``, calls accumulated since the last update
        (always 0 for ``accumulation_steps=1``).
      acc_grads: ``None``, or with ``accumulation_steps > 1`` (or a
        :class:`BatchRamp`) the per-replica sum of this window's gradients,
        shaped like the params (float32 or wider).
      acc_sq_norm: ``None``, or float32 ``[G]``: the per-replica sum of this
        window's squared norms per group.
      ramp: ``None``, or with ``accumulation_steps=BatchRamp(...)`` the
        controller's :class:`RampState` (``k_t``, the loader's position).
      inner_state: the state of ``inner`` (with ``shard_optimizer_state=n``, laid
        out in ``(n, m)`` rows, one per replica).
    """

    count: Array  # type: ignore[assignment]  # a field named like tuple.count, as in optax's states
    gain: Array
    tau_whole: Array
    tau_frac: Array
    grad_sqr: Any
    grad_var: Any
    group_gains: Any
    ema_weight: Array
    sqr_weight: Array
    effective_lr: Array
    base_lr: Array
    scale: Array
    skipped_steps: Array
    negative_lr_steps: Array
    altered_grads_steps: Array
    skip_streak: Array
    floored_steps: Array
    micro_step: Array
    acc_grads: Any
    acc_sq_norm: Any
    ramp: Any
    inner_state: Any


# --------------------------------------------------------------------------- init


def _init(
    collection: _options.Options, reduction: Any, inner: optax.GradientTransformationExtraArgs, params: Any
) -> AdaScaleState:
    _checks.check_inexact(params, "params")
    groups = _groups.resolve_groups(collection.param_labels, params)
    _checks.probe_inner(inner, params)
    inner_state = reduction.init_inner(inner, params)
    _checks.check_inner_state(inner_state)
    scalar = lambda dtype=jnp.float32: jnp.zeros([], dtype)  # noqa: E731 - a fresh buffer per field (donation)
    per_group = lambda value: groups.pack(jnp.full((groups.size,), value, jnp.float32))  # noqa: E731
    acc_grads = acc_sq = None
    if collection.ramp is not None or accumulation_steps(collection, None) > 1:
        acc_grads = jax.tree.map(lambda p: jnp.zeros_like(p, dtype=_norms.compute_dtype(p.dtype)), params)
        acc_sq = jnp.zeros((groups.size,), jnp.float32)
    return AdaScaleState(
        count=scalar(jnp.int32),
        gain=jnp.ones([], jnp.float32),
        tau_whole=scalar(jnp.int32),
        tau_frac=scalar(),
        grad_sqr=per_group(0.0),
        grad_var=per_group(0.0),
        group_gains={} if groups.labels is None else per_group(1.0),
        ema_weight=scalar(),
        sqr_weight=scalar(),
        effective_lr=scalar(),
        base_lr=scalar(),
        scale=scalar(),
        skipped_steps=scalar(jnp.int32),
        negative_lr_steps=scalar(jnp.int32),
        altered_grads_steps=scalar(jnp.int32),
        skip_streak=scalar(jnp.int32),
        floored_steps=scalar(jnp.int32),
        micro_step=scalar(jnp.int32),
        acc_grads=acc_grads,
        acc_sq_norm=acc_sq,
        ramp=None if collection.ramp is None else _ramp.init_state(collection.ramp),
        inner_state=inner_state,
    )


# --------------------------------------------------------------------------- update: collect


def _update(
    collection: _options.Options,
    update: _step.Update,
    reduction: Any,
    grads: Any,
    state: AdaScaleState,
    params: Any,
    microbatch_stats: MicrobatchStats | None,
    extra_args: dict[str, Any],
):
    """Local statistics, then one AdaScale step (or an accumulation-only call)."""
    _checks.check_not_inside_multisteps()
    _checks.check_opt_state(state, AdaScaleState._fields)
    _checks.check_grads(grads, params)
    _checks.check_has_leaves(grads, "grads")
    groups = _groups.resolve_groups(collection.param_labels, grads if params is None else params)
    axes = _axes.resolve_axes(collection.axis_name, grads, params, collection.param_specs)
    ramp = collection.ramp
    k: Any = accumulation_steps(collection, state) if ramp is None else None
    keys = _collect.statistic_keys(groups, axes.model, grads)
    per_update = k if ramp is None else ramp
    samples = _samples.Samples.of(grads, microbatch_stats, per_update, collection.precondition, state.inner_state, keys)
    strategy = reduction.for_samples(samples)
    strategy.check(axes, state, params)
    local_sq = groups.sums(axes.model.mask(samples.sq_leaves))

    forgot = collection.axis_name is None and microbatch_stats is None  # a jit step that forgot the statistics?
    if ramp is None:
        n = axes.replicas * k * samples.count
        S = _scale(collection, n, axes.replicas)
        if n == 1 and forgot:
            _axes.warn_if_partitioned(grads)
        elif k > 1 and forgot:
            _axes.warn_if_partitioned(grads, calls=f"k = {k} calls: accumulation_steps={k}")
    else:  # k_t is traced: one program for every rung; S_t = n_t
        _check_ramp_state(state)
        # A window starts at a rung of this ramp's ladder: k restored from another ramp's state moves onto it here
        # (one in progress finishes at the k its calls were fed for, then moves in _decide).
        k = state.ramp.microbatches
        k = jnp.where(state.micro_step == 0, _ramp.on_ladder(ramp, k), k).astype(jnp.int32)
        state = state._replace(ramp=state.ramp._replace(microbatches=k))
        per_microbatch = axes.replicas * samples.count
        _ramp.check_samples(ramp, per_microbatch, _axes.partitioned_axes(grads) if forgot else {})
        if forgot:
            _axes.warn_if_partitioned(grads, calls="k_t calls: the BatchRamp's")
        n = S = k * per_microbatch
    shape = _step.Shape(groups=groups, axes=axes, n=n, S=S)

    def step(local_grads, local_sq, state):
        new_updates, new_state = strategy.step(update, shape, local_grads, local_sq, state, params, extra_args, samples)
        if ramp is not None:
            new_state = _decide(ramp, state, new_state, per_microbatch)
        return new_updates, new_state

    if samples.altered is not None:  # b would be taken from changed gradients: a = −∞ rides the one reduction to
        local_sq = jnp.where(samples.altered, -jnp.inf, local_sq)  # every replica (and the window), which skip it
    if ramp is None and k == 1:
        return step(grads, local_sq, state)
    _axes.check_buffers_per_replica(state.acc_sq_norm, collection.axis_name, grads)
    new_updates, new_state = _accumulate.accumulate(k, grads, local_sq, state, step)
    if ramp is not None:  # every call: the loader's position, and the samples per call (for the readers)
        new_state = new_state._replace(
            ramp=new_state.ramp._replace(
                microbatches_seen=optax.safe_increment(new_state.ramp.microbatches_seen),
                scale_per_microbatch=jnp.full([], per_microbatch, jnp.int32),
            )
        )
    return new_updates, new_state


def _check_ramp_state(state: AdaScaleState) -> None:
    if state.ramp is None:
        raise ValueError(
            "this transformation has accumulation_steps=BatchRamp(...), but opt_state has no ramp state: it was "
            "made by a transformation without one. Make it with this transformation's init, or carry it over "
            "with optax_adascale.transfer_state(old_state, tx.init(params))."
        )


def _decide(ramp: _ramp.BatchRamp, old: AdaScaleState, new: AdaScaleState, per_microbatch: int) -> AdaScaleState:
    """The controller after an update (applied, or skipped: then nothing moves); replicated scalars only."""
    total = lambda v: jnp.sum(jnp.stack([jnp.asarray(x, jnp.float32) for x in jax.tree.leaves(v)]))  # noqa: E731
    noise, _ = _read.noise_scale(total(new.grad_var), total(new.grad_sqr), new.count > 0)
    inputs = _ramp.RampInputs(
        tau=new.tau_whole.astype(jnp.float32) + new.tau_frac,
        updates=new.count,
        noise_scale=noise,
        gain=new.gain,
        microbatches=old.ramp.microbatches,
        scale_per_microbatch=jnp.full([], per_microbatch, jnp.int32),
        microbatches_seen=optax.safe_increment(old.ramp.microbatches_seen),
    )
    return new._replace(ramp=_ramp.after_update(ramp, old.ramp, inputs, new.count != old.count))


def accumulation_steps(collection: _options.Options, state: AdaScaleState | None) -> int:
    """``k``, a Python int. ``optax.inject_hyperparams`` hands the factory an int as an array of its state,
    traced in a jitted ``update``; the state it was built for then says ``k = 1`` (no buffers)."""
    k = collection.accumulation_steps
    if isinstance(k, int):
        return k
    if state is not None and state.acc_grads is None:
        return 1
    raise TypeError(
        "accumulation_steps > 1 reaches AdaScale as a traced array: optax.inject_hyperparams made it a "
        "hyperparameter of its state, but k shapes the program and cannot change inside jax.jit. Keep it "
        "static: optax.inject_hyperparams(factory, static_args=('accumulation_steps',))(..., accumulation_steps=k)."
    )


def _scale(collection: _options.Options, n: int, replicas: int) -> Any:
    """``S`` (``n`` by default); ``n = 1`` cannot estimate a variance for ``S > 1``."""
    S = n if collection.scale is None else collection.scale
    S_value = _checks.concrete_float(S)
    if n == 1 and (S_value is None or S_value > 1):
        raise ValueError(
            f"AdaScale cannot estimate the gradient variance from n=1 sample per update with scale={S!r}. "
            "Average several samples per update: set axis_name to the data-parallel axis, "
            "accumulation_steps > 1, or pass microbatch_stats from value_and_grad; or use "
            "scale=None (S = n = 1 is the identity)."
        )
    if n == 1 and collection.axis_name is not None and replicas == 1:
        _checks.warn(
            f"axis_name={collection.axis_name!r} has a single replica here, so AdaScale sees n = 1 gradient "
            "sample per update and is the identity (gain 1: your inner optimizer's own step on lr(t)). To train at "
            "a larger "
            "scale on one device, split the batch into micro-batches (optax_adascale.value_and_grad(loss, "
            "num_microbatches=k) + update(..., microbatch_stats=...)) or set accumulation_steps."
        )
    return S


# --------------------------------------------------------------------------- factories


def transform(
    inner: optax.GradientTransformation,
    learning_rate: optax.ScalarOrSchedule,
    options: _options.Options,
    reduction: Any,
) -> optax.GradientTransformationExtraArgs:
    """The transformation's closures over checked options and the reduction strategy the factory chose once
    (``sharding/_reduce``: ``init_inner``, ``for_samples``, then the chosen strategy's ``check`` and ``step``)."""
    _checks.check_learning_rate(learning_rate)
    inner = optax.with_extra_args_support(inner)
    update = _step.Update(inner, learning_rate, options.settings, _checks.schedule_magnitude(learning_rate))

    def init_fn(params):
        return _init(options, reduction, inner, params)

    rows_seen: set[tuple[int, ...]] = set()  # the drop-in's batch sizes under a ramp, for check_rows' warning only
    off_ladder_seen: set[int] = set()  # the restored k already said to leave the ladder (a window: one warning)

    def update_fn(updates, state, params=None, *, microbatch_stats=None, **extra_args):
        if options.ramp is not None and isinstance(microbatch_stats, MicrobatchStats):
            _ramp.check_rows(rows_seen, microbatch_stats.rows)
        if options.ramp is not None and getattr(state, "ramp", None) is not None:  # concrete (not under jit) only
            _ramp.warn_if_off_ladder(
                options.ramp, state.ramp.microbatches, state.micro_step, "the optimizer state", off_ladder_seen
            )
        return _update(options, update, reduction, updates, state, params, microbatch_stats, extra_args)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)

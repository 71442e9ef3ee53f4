"""AdaScale as an optax gradient transformation: the state, the factories, and the update in named steps."""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_adascale.core import _accumulate, _checks, _collect, _groups, _norms, _options, _samples, _step
from optax_adascale.core._samples import MicrobatchStats
from optax_adascale.sharding import _reduce

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
      skip_streak: int32 ``[]``, updates skipped since the last applied one.
      floored_steps: int32 ``[]``, applied updates with ``n > 1`` whose variance
        estimate was zero up to rounding (at the ``eps`` floor): replicas that
        saw identical gradients.
      micro_step: int32 ``[]``, calls accumulated since the last update
        (always 0 for ``accumulation_steps=1``).
      acc_grads: ``None``, or with ``accumulation_steps > 1`` the per-replica sum
        of this window's gradients, shaped like the params (float32 or wider).
      acc_sq_norm: ``None``, or float32 ``[G]``: the per-replica sum of this
        window's squared norms per group.
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
    skip_streak: Array
    floored_steps: Array
    micro_step: Array
    acc_grads: Any
    acc_sq_norm: Any
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
    if collection.accumulation_steps > 1:
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
        skip_streak=scalar(jnp.int32),
        floored_steps=scalar(jnp.int32),
        micro_step=scalar(jnp.int32),
        acc_grads=acc_grads,
        acc_sq_norm=acc_sq,
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
    _checks.check_opt_state(state, AdaScaleState._fields)
    _checks.check_grads(grads, params)
    groups = _groups.resolve_groups(collection.param_labels, grads if params is None else params)
    axes = _collect.resolve_axes(collection.axis_name, grads, params, collection.param_specs)
    samples = _samples.Samples.of(
        grads, microbatch_stats, collection.accumulation_steps, collection.precondition, state.inner_state
    )
    strategy = reduction.for_samples(samples)
    strategy.check(axes, state, params)
    local_sq = groups.sums(axes.model.mask(samples.sq_leaves))

    n = axes.replicas * collection.accumulation_steps * samples.count
    S = _scale(collection, n, axes.replicas)
    shape = _step.Shape(groups=groups, axes=axes, n=n, S=S)

    def step(local_grads, local_sq, state):
        return strategy.step(update, shape, local_grads, local_sq, state, params, extra_args, samples)

    if collection.accumulation_steps == 1:
        return step(grads, local_sq, state)
    _collect.check_buffers_per_replica(state.acc_sq_norm, collection.axis_name)
    return _accumulate.accumulate(collection.accumulation_steps, grads, local_sq, state, step)


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
            "sample per update and is the identity (gain 1, plain SGD on lr(t)). To train at a larger "
            "scale on one device, split the batch into micro-batches (optax_adascale.value_and_grad(loss, "
            "num_microbatches=k) + update(..., microbatch_stats=...)) or set accumulation_steps."
        )
    return S


# --------------------------------------------------------------------------- factories


def adascale(
    inner: optax.GradientTransformation,
    learning_rate: optax.ScalarOrSchedule,
    *,
    axis_name: str | tuple[str, ...] | None = None,
    accumulation_steps: int = 1,
    scale: float | None = None,
    estimator: Any = None,
    param_labels: Any = None,
    param_specs: Any = None,
    shard_optimizer_state: int | None = None,
    delayed_gain: bool = False,
    **deprecated: Any,
) -> optax.GradientTransformationExtraArgs:
    r"""AdaScale: scale a base-batch learning-rate schedule to ``S`` times larger batches.

    Each update averages ``n`` gradient samples ``g_i`` (replicas on
    ``axis_name`` × ``accumulation_steps`` × micro-batches). From
    ``a = mean_i ‖g_i‖²`` and ``b = ‖ḡ‖²`` it estimates, in base-batch units,

    .. math::

       σ̂² = \frac{S}{n-1}(a - b), \qquad μ̂² = b - σ̂²/S,

    keeps debiased moving averages of both (their memory is the
    :class:`Estimator`'s: by default ``5 %`` of the base-batch steps done so far)
    and takes the gain ``r_t = (σ̄² + μ̄²)/(σ̄²/S + μ̄²) ∈ [1, S]``. The update is

    .. math::

       u_t = -r_t \, \mathrm{lr}(\lfloor τ_t \rfloor) \, \mathrm{inner}(ḡ),
       \qquad τ_{t+1} = τ_t + r_t,

    so the schedule runs on the scale-invariant clock ``τ``: train until
    ``τ ≥ T`` (the base-batch step budget), see :func:`done`. With
    ``estimator="fairscale"`` the arithmetic is FairScale 0.4.13's ``AdaScale``,
    except that ``S = 1`` is the identity, a change of scale needs no state
    change, and the gain is clipped to ``[1, S]``.

    ``update`` is called per replica with that replica's *local* gradient. It
    reduces the gradient and its squared norm in one ``lax.psum`` over
    ``axis_name`` and returns the same update on every replica. It works in
    ``jax.pmap``, ``jax.shard_map`` (mark params varying with
    ``jax.lax.pcast(params, axis, to="varying")`` before ``jax.grad``),
    ``jax.vmap(..., axis_name=...)`` and multi-host meshes. Parameters split
    over other mesh axes (tensor parallelism) have their squared norms summed
    over those axes in one more scalar-sized ``psum``. In a ``jax.jit`` step over
    the *global* batch (GSPMD: no per-replica gradient exists), build it without
    ``axis_name`` and pass the statistics of :func:`value_and_grad` (``data_axes``
    set): ``update(grads, opt_state, params, microbatch_stats=stats)``.

    ``inner`` sees the averaged gradient and must be learning-rate free
    (``optax.trace(0.9)``, ``optax.identity()``, a chain with
    ``optax.add_decayed_weights`` or ``optax.clip_by_global_norm``); an
    ``inner`` with its own learning rate (``optax.sgd(lr)``) is rejected at
    ``init``. Transformations chained *before* AdaScale see per-replica
    gradients: clipping belongs inside ``inner``; ``optax.apply_if_finite`` is
    redundant there (AdaScale skips non-finite steps itself); for gradient
    accumulation use ``accumulation_steps``, not ``optax.MultiSteps`` (refused
    inside ``inner``, and around AdaScale at the first ``update``).

    A non-finite ``ḡ``, statistic or effective learning rate (or a negative
    one from the schedule) skips the update: zero updates, state unchanged
    except the skip counters (and a dropped accumulation window).

    Args:
      inner: learning-rate-free direction, applied to the averaged gradient.
      learning_rate: a non-negative float or an optax schedule of the
        base-batch step; evaluated at ``⌊τ⌋``.
      axis_name: the data-parallel axis (a name or a tuple of names), or
        ``None``: one replica, or statistics that arrive reduced (the GSPMD drop-in).
      accumulation_steps: ``k``: each call adds its gradient to per-replica
        buffers and returns zero updates; the ``k``-th call reduces once and
        steps. See :func:`state_axes` and :func:`state_partition_specs`.
      scale: ``S``, base batches per update. Defaults to ``n``; a sample
        (micro-batch) of ``m`` base batches means ``scale = m·n``.
      estimator: an :class:`Estimator` (how long the moving averages remember),
        ``"fairscale"`` for FairScale 0.4.13's estimator exactly, or ``None``
        for ``Estimator()``.
      param_labels: optional labels shaped like the params (or
        ``params -> labels``), as in ``optax.multi_transform``: statistics and
        gains per group, each group's update scaled by its own gain; ``τ``
        advances by the gain of the summed statistics.
      param_specs: the params' ``PartitionSpec``\ s (as given to
        ``jax.shard_map``'s ``in_specs``), where shard_map's varying types
        cannot tell which parameters are split over model axes
        (``check_vma=False``, pmap). Not needed with ``check_vma=True``.
      shard_optimizer_state: ``None`` (replicated), or ``n``, the data-parallel
        size: ZeRO. The gradient is reduce-scattered, ``inner`` runs on each
        replica's ``1/n`` shard with ``1/n`` of its state, and the update is
        all-gathered. See :func:`state_partition_specs`.
      delayed_gain: the gain of update ``t`` from the averages through update
        ``t − 1`` (the first update uses gain 1); this step's sample enters
        them afterwards. Saves the read of ``ḡ`` that a current-step gain
        needs before the update.
      **deprecated: 0.2's ``smoothing``, ``eps``, ``horizon``, ``unbiased_sqr``:
        fields of :class:`Estimator` now; they work and warn.

    Returns:
      An ``optax.GradientTransformationExtraArgs``. ``update`` also accepts
      ``microbatch_stats=``, the :class:`MicrobatchStats` of samples taken
      outside the optimizer (from :func:`value_and_grad`, or the gradient of
      :func:`fsdp_probes`), and forwards other keyword arguments to ``inner``.
      Estimator experiments (``averaging``, ``gain_exponent``,
      ``precondition``) are in :func:`optax_adascale.experimental.adascale`.

    Examples:
      Two replicas as a vmap axis; their gradients are orthogonal, so the
      gradient is all noise and the gain is ``S = 2``:

      >>> import jax, jax.numpy as jnp, optax
      >>> import optax_adascale
      >>> tx = optax_adascale.adascale(optax.identity(), 0.1, axis_name="i")
      >>> params = jnp.zeros(2)
      >>> state = tx.init(params)
      >>> step = jax.vmap(tx.update, in_axes=(0, None, None), out_axes=(None, None), axis_name="i")
      >>> updates, state = step(jnp.eye(2), state, params)
      >>> updates
      Array([-0.1, -0.1], dtype=float32)
      >>> optax_adascale.metrics(state)["gain"], optax_adascale.scale_invariant_steps(state)
      (Array(2., dtype=float32), Array(2., dtype=float32))

    References:
      Johnson, Agrawal, Gu, Guestrin, `AdaScale SGD: A User-Friendly Algorithm
      for Distributed Training <https://arxiv.org/abs/2007.05105>`_, ICML 2020.
    """
    options = _options.create(
        axis_name=axis_name,
        accumulation_steps=accumulation_steps,
        scale=scale,
        estimator=estimator,
        param_labels=param_labels,
        param_specs=param_specs,
        shard_optimizer_state=shard_optimizer_state,
        delayed_gain=delayed_gain,
        deprecated=_options.unwrap(deprecated, "deprecated"),
    )
    return build(inner, learning_rate, options)


def build(
    inner: optax.GradientTransformation, learning_rate: optax.ScalarOrSchedule, options: _options.Options
) -> optax.GradientTransformationExtraArgs:
    """The transformation's closures over checked options; the reduction strategy chosen once."""
    _checks.check_learning_rate(learning_rate)
    reduction: _reduce.AllReduce | _reduce.ZeroRows
    if options.shard_optimizer_state is None:
        reduction = _reduce.AllReduce()
    else:
        reduction = _reduce.ZeroRows(options.shard_optimizer_state)
    inner = optax.with_extra_args_support(inner)
    update = _step.Update(inner, learning_rate, options.settings, _checks.schedule_magnitude(learning_rate))

    def init_fn(params):
        return _init(options, reduction, inner, params)

    def update_fn(updates, state, params=None, *, microbatch_stats=None, **extra_args):
        return _update(options, update, reduction, updates, state, params, microbatch_stats, extra_args)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)

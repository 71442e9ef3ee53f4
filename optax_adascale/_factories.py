"""The factories: ``adascale`` (and, through it, the aliases and ``experimental.adascale``) check the options once,
choose the reduction strategy and build the core transformation."""

from typing import Any

import optax

from optax_adascale.core import _adascale, _options
from optax_adascale.core._ramp import BatchRamp
from optax_adascale.sharding import _reduce


def adascale(
    inner: optax.GradientTransformation,
    learning_rate: optax.ScalarOrSchedule,
    *,
    axis_name: str | tuple[str, ...] | None = None,
    accumulation_steps: int | BatchRamp = 1,
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
        steps. See :func:`state_axes` and :func:`state_partition_specs`. Or a
        :class:`BatchRamp`: ``k_t`` then moves with the measured noise scale,
        a traced value in the state (one compile for every ``k``), and
        ``S_t = n_t``; :func:`batch_plan` tells the loop where it stands.
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
    """The transformation over checked options, with the reduction strategy chosen once: replicated
    (``AllReduce``) or ZeRO rows (``ZeroRows``, which turns into ``FsdpRows`` for FSDP samples)."""
    reduction: _reduce.AllReduce | _reduce.ZeroRows
    if options.shard_optimizer_state is None:
        reduction = _reduce.AllReduce()
    else:
        reduction = _reduce.ZeroRows(options.shard_optimizer_state)
    return _adascale.transform(inner, learning_rate, options, reduction)

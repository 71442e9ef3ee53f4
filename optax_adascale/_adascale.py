"""AdaScale as an optax gradient transformation, and the helpers that read its state."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Hashable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from optax_adascale import _collect
from optax_adascale import _estimator as est

Array = jax.Array
ScalarOrSchedule = float | jax.Array | Callable[[jax.Array], jax.Array]


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
        ``param_labels``, a dict label → float32 ``[]``.
      grad_var: float32 ``[]``, the moving average ``σ̄²`` of the variance of one
        base-batch gradient (base-batch units); a dict with ``param_labels``.
      group_gain: dict label → float32 ``[]``, each group's gain of the last
        applied update; ``{}`` without ``param_labels``.
      ema_weight: float32 ``[]``, the debiasing weight ``w = Σ θ^j (1−θ)``.
      learning_rate: float32 ``[]``, ``r_t · lr(⌊τ_t⌋)`` of the last applied update.
      scale: float32 ``[]``, ``S`` of the last applied update (0 before the first).
      skipped_steps: int32 ``[]``, updates skipped for non-finite values.
      micro_step: int32 ``[]``, calls accumulated since the last update
        (always 0 for ``accumulation_steps=1``).
      acc_grads: ``None``, or with ``accumulation_steps > 1`` the per-replica sum
        of this window's gradients, shaped like the params (float32 or wider).
      acc_sq_norm: ``None``, or float32 ``[G]``: the per-replica sum of this
        window's squared norms per group.
      inner_state: the state of ``inner``.
    """

    count: Array
    gain: Array
    tau_whole: Array
    tau_frac: Array
    grad_sqr: Any
    grad_var: Any
    group_gain: Any
    ema_weight: Array
    learning_rate: Array
    scale: Array
    skipped_steps: Array
    micro_step: Array
    acc_grads: Any
    acc_sq_norm: Any
    inner_state: Any


# --------------------------------------------------------------------------- validation


def _concrete_float(value: Any) -> float | None:
    """``value`` as a Python float, or ``None`` if it is traced (e.g. under inject_hyperparams)."""
    if isinstance(value, jax.core.Tracer):
        return None
    try:
        arr = np.asarray(value)
    except Exception:  # noqa: BLE001 - anything non-numeric is reported by the caller
        return None
    if arr.shape != () or not np.issubdtype(arr.dtype, np.number):
        return None
    return float(arr)


def _check_number(name: str, value: Any, *, low: float, low_inclusive: bool, high: float | None = None) -> None:
    if value is None:
        return
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a number, got {name}={value!r}")
    x = _concrete_float(value)
    if x is None:
        if isinstance(value, jax.core.Tracer) or hasattr(value, "dtype"):
            return  # traced hyperparameter: validated by the caller's value
        raise TypeError(f"{name} must be a number, got {name}={value!r}")
    bad = not math.isfinite(x) or x < low or (x == low and not low_inclusive)
    if high is not None:
        bad = bad or x >= high
    if bad:
        interval = f"{'[' if low_inclusive else '('}{low}, {high if high is not None else 'inf'})"
        raise ValueError(f"{name} must be finite and in {interval}, got {name}={value!r}")


def _check_args(learning_rate, accumulation_steps, scale, smoothing, eps, averaging) -> None:
    if isinstance(accumulation_steps, jax.core.Tracer) or hasattr(accumulation_steps, "dtype"):
        raise TypeError(
            "accumulation_steps must be a static Python int, got an array "
            f"({accumulation_steps!r}). With optax.inject_hyperparams pass "
            "static_args=('accumulation_steps', ...)."
        )
    if not isinstance(accumulation_steps, int) or isinstance(accumulation_steps, bool):
        raise TypeError(f"accumulation_steps must be an int >= 1, got accumulation_steps={accumulation_steps!r}")
    if accumulation_steps < 1:
        raise ValueError(f"accumulation_steps must be an int >= 1, got accumulation_steps={accumulation_steps!r}")
    _check_number("scale", scale, low=1.0, low_inclusive=True)
    _check_number("smoothing", smoothing, low=0.0, low_inclusive=True, high=1.0)
    _check_number("eps", eps, low=0.0, low_inclusive=False)
    if not callable(learning_rate):
        _check_number("learning_rate", learning_rate, low=0.0, low_inclusive=True)
    if averaging not in est.AVERAGING_MODES:
        raise ValueError(f"averaging must be one of {est.AVERAGING_MODES}, got averaging={averaging!r}")


def _check_floating(tree: Any, name: str) -> None:
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        dtype = jnp.result_type(leaf)
        if not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(
                f"AdaScale needs floating-point {name}, got dtype {dtype} at "
                f"{name}{jax.tree_util.keystr(path)}. Integer or complex leaves cannot be "
                "scaled; keep them out of the optimized tree (e.g. optax.multi_transform "
                "with optax.set_to_zero)."
            )


def _check_grads(grads: Any, params: Any) -> None:
    _check_floating(grads, "grads")
    if params is not None and jax.tree.structure(grads) != jax.tree.structure(params):
        raise ValueError(
            "grads and params must have the same tree structure, got "
            f"grads={jax.tree.structure(grads)} and params={jax.tree.structure(params)}."
        )


# --------------------------------------------------------------------------- parameter groups


@dataclasses.dataclass(frozen=True)
class _Groups:
    """Static map from leaves to parameter groups; packs ``[G]`` vectors into state fields."""

    labels: tuple[Hashable, ...] | None  # None: one unlabelled group
    leaf_group: tuple[int, ...]

    @property
    def size(self) -> int:
        return 1 if self.labels is None else len(self.labels)

    def pack(self, vec: Array) -> Any:
        if self.labels is None:
            return vec[0]
        return {label: vec[i] for i, label in enumerate(self.labels)}

    def unpack(self, value: Any) -> Array:
        if self.labels is None:
            return jnp.reshape(value, (1,))
        return jnp.stack([value[label] for label in self.labels])


def _resolve_groups(param_labels: Any, tree: Any) -> _Groups:
    treedef = jax.tree.structure(tree)
    if param_labels is None:
        return _Groups(None, (0,) * treedef.num_leaves)
    labels = param_labels(tree) if callable(param_labels) else param_labels
    try:
        flat = treedef.flatten_up_to(labels)
    except (ValueError, TypeError) as err:
        raise ValueError(
            f"param_labels must have the structure of the params ({treedef}), got {labels!r}"
        ) from err
    try:
        order = tuple(sorted(set(flat)))
    except TypeError as err:
        labels_seen = sorted(set(map(repr, flat)))
        raise TypeError(f"param_labels must be mutually sortable (e.g. all str), got {labels_seen}") from err
    index = {label: i for i, label in enumerate(order)}
    return _Groups(order, tuple(index[label] for label in flat))


# --------------------------------------------------------------------------- the transformation


def adascale(
    inner: optax.GradientTransformation,
    learning_rate: ScalarOrSchedule,
    *,
    axis_name: str | tuple[str, ...] | None = None,
    accumulation_steps: int = 1,
    scale: float | None = None,
    smoothing: float | None = None,
    eps: float = 1e-6,
    param_labels: Any = None,
    averaging: str = "debiased",
) -> optax.GradientTransformationExtraArgs:
    r"""AdaScale: scale a base-batch learning-rate schedule to ``S`` times larger batches.

    Each update averages ``n`` gradient samples ``g_i`` (replicas on
    ``axis_name`` × ``accumulation_steps`` × micro-batches). From
    ``a = mean_i ‖g_i‖²`` and ``b = ‖ḡ‖²`` it estimates, in base-batch units,

    .. math::

       σ̂² = \frac{S}{n-1}(a - b), \qquad μ̂² = b - σ̂²/S,

    smooths both with a debiased moving average (factor
    ``θ = max(1 − n/1000, 0)`` by default) and takes the gain
    ``r_t = (σ̄² + μ̄²)/(σ̄²/S + μ̄²) ∈ [1, S]``. The update is

    .. math::

       u_t = -r_t \, \mathrm{lr}(\lfloor τ_t \rfloor) \, \mathrm{inner}(ḡ),
       \qquad τ_{t+1} = τ_t + r_t,

    so the schedule runs on the scale-invariant clock ``τ``: train until
    ``τ ≥ T`` (the base-batch step budget), see :func:`scale_invariant_steps`.
    The arithmetic is FairScale 0.4.13's ``AdaScale``, except that ``S = 1``
    is the identity, a change of scale needs no state change, and the gain is
    clipped to ``[1, S]``.

    ``update`` is called per replica with that replica's *local* gradient. It
    reduces the gradient and its squared norm in one ``lax.pmean`` over
    ``axis_name`` and returns the same update on every replica. It works in
    ``jax.pmap``, ``jax.shard_map`` (mark params varying with
    ``jax.lax.pcast(params, axis, to="varying")`` before ``jax.grad``),
    ``jax.vmap(..., axis_name=...)`` and multi-host meshes.

    ``inner`` sees the averaged gradient and must be learning-rate free
    (``optax.trace(0.9)``, ``optax.identity()``, a chain with
    ``optax.add_decayed_weights`` or ``optax.clip_by_global_norm``).
    Transformations chained *before* AdaScale see per-replica gradients:
    clipping belongs inside ``inner``; ``optax.apply_if_finite`` is redundant
    there (AdaScale skips non-finite steps itself); for gradient
    accumulation use ``accumulation_steps``, not ``optax.MultiSteps``.

    A non-finite ``ḡ``, statistic or effective learning rate (or a negative
    one from the schedule) skips the update: zero updates, state unchanged
    except ``skipped_steps`` (and a dropped accumulation window).

    Args:
      inner: learning-rate-free direction, applied to the averaged gradient.
      learning_rate: a non-negative float or an optax schedule of the
        base-batch step; evaluated at ``⌊τ⌋``.
      axis_name: the data-parallel axis (a name or a tuple of names), or
        ``None`` for a single replica.
      accumulation_steps: ``k``: each call adds its gradient to per-replica
        buffers and returns zero updates; the ``k``-th call reduces once and
        steps. See :func:`state_axes` and :func:`state_partition_specs`.
      scale: ``S``, base batches per update. Defaults to ``n``; a sample
        (micro-batch) of ``m`` base batches means ``scale = m·n``.
      smoothing: ``θ ∈ [0, 1)``; defaults to ``max(1 − n/1000, 0)``.
      eps: floor of the per-step variance estimate.
      param_labels: optional labels shaped like the params (or
        ``params -> labels``), as in ``optax.multi_transform``: statistics and
        gains per group, each group's update scaled by its own gain; ``τ``
        advances by the gain of the summed statistics.
      averaging: ``"debiased"`` (FairScale's default) or ``"paper"``
        (Appendix B.3: the plain mean of the samples while ``t < 1/(1−θ)``,
        then the moving average).

    Returns:
      An ``optax.GradientTransformationExtraArgs``. ``update`` also accepts
      ``microbatch_stats=`` from :func:`value_and_microbatch_grad` and forwards
      other keyword arguments to ``inner``.

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
    _check_args(learning_rate, accumulation_steps, scale, smoothing, eps, averaging)
    inner = optax.with_extra_args_support(inner)
    k_acc = accumulation_steps

    def init_fn(params):
        _check_floating(params, "params")
        groups = _resolve_groups(param_labels, params)
        zeros = lambda dtype=jnp.float32: jnp.zeros([], dtype)  # noqa: E731 - fresh buffer per field
        acc_grads = acc_sq = None
        if k_acc > 1:
            acc_grads = jax.tree.map(lambda p: jnp.zeros_like(p, dtype=_collect.stat_dtype(p.dtype)), params)
            acc_sq = jnp.zeros((groups.size,), jnp.float32)
        return AdaScaleState(
            count=zeros(jnp.int32),
            gain=jnp.ones([], jnp.float32),
            tau_whole=zeros(jnp.int32),
            tau_frac=zeros(),
            grad_sqr=groups.pack(jnp.zeros((groups.size,), jnp.float32)),
            grad_var=groups.pack(jnp.zeros((groups.size,), jnp.float32)),
            group_gain={} if groups.labels is None else groups.pack(jnp.ones((groups.size,), jnp.float32)),
            ema_weight=zeros(),
            learning_rate=zeros(),
            scale=zeros(),
            skipped_steps=zeros(jnp.int32),
            micro_step=zeros(jnp.int32),
            acc_grads=acc_grads,
            acc_sq_norm=acc_sq,
            inner_state=inner.init(params),
        )

    def update_fn(updates, state, params=None, *, microbatch_stats=None, **extra_args):
        grads = updates
        _check_grads(grads, params)
        leaves, treedef = jax.tree.flatten(grads)
        groups = _resolve_groups(param_labels, grads if params is None else params)

        if microbatch_stats is None:
            k_micro = 1
            sq_leaves = [_collect.leaf_sq_norm(g) for g in leaves]
        else:
            if not isinstance(microbatch_stats, _collect.MicrobatchStats):
                raise TypeError(
                    "microbatch_stats must be the MicrobatchStats returned by "
                    f"value_and_microbatch_grad, got {type(microbatch_stats).__name__}"
                )
            k_micro = microbatch_stats.num_microbatches
            try:
                sq_leaves = treedef.flatten_up_to(microbatch_stats.sq_norms)
            except (ValueError, TypeError) as err:
                raise ValueError("microbatch_stats.sq_norms must have the structure of the gradients") from err

        n = _collect.axis_size(axis_name) * k_acc * k_micro
        S = n if scale is None else scale
        S_value = _concrete_float(S)
        if n == 1 and (S_value is None or S_value > 1):
            raise ValueError(
                f"AdaScale cannot estimate the gradient variance from n=1 sample per update "
                f"with scale={S!r}. Average several samples per update: set axis_name to the "
                "data-parallel axis, accumulation_steps > 1, or pass microbatch_stats from "
                "value_and_microbatch_grad; or use scale=None (S = n = 1 is the identity)."
            )
        theta = est.default_smoothing(n) if smoothing is None else smoothing
        _collect.check_not_summed(grads, axis_name)
        _collect.check_vmap_axis_not_explicit(grads, axis_name)
        local_sq = _collect.group_sums(sq_leaves, groups.leaf_group, groups.size)

        def step(local_grads, local_sq, state):
            with jax.named_scope("adascale/reduce"):
                reduced = _collect.reduce_statistics(local_grads, local_sq, axis_name, groups.leaf_group, groups.size)
            return _apply(*reduced, state, params, extra_args, groups, n, S, theta)

        if k_acc == 1:
            return step(grads, local_sq, state)
        return _accumulate(grads, local_sq, state, step)

    def _accumulate(grads, local_sq, state, step):
        # Buffers are (shape) per replica, or (1, *shape) when shard_map hands
        # us our slice of a (replicas, *shape) global array.
        lead = state.acc_sq_norm.ndim == 2
        expand = (lambda x: x[None]) if lead else (lambda x: x)
        squeeze = (lambda x: x[0]) if lead else (lambda x: x)
        acc_grads, acc_sq = state.acc_grads, state.acc_sq_norm
        scalars = state._replace(acc_grads=None, acc_sq_norm=None)

        # The cond neither takes nor returns the buffers (a pass-through output
        # would be copied on every accumulating call); the reducing branch reads
        # them, and they are updated after the cond, in place.
        def reduce_branch(state):
            mean = lambda a, g: ((squeeze(a) + g.astype(a.dtype)) / k_acc).astype(g.dtype)
            local = jax.tree.map(mean, acc_grads, grads)
            new_updates, new_state = step(local, (squeeze(acc_sq) + local_sq) / k_acc, state)
            return new_updates, new_state._replace(micro_step=jnp.zeros_like(state.micro_step)), jnp.bool_(True)

        out_types = jax.eval_shape(reduce_branch, scalars)

        def accumulate_branch(state):
            zero_updates = jax.tree.map(_collect.fresh_zeros, grads)
            out = (zero_updates, state._replace(micro_step=state.micro_step + 1), jnp.bool_(False))
            return _collect.match_varying(out, out_types)

        last = state.micro_step >= k_acc - 1
        new_updates, new_state, reduced = lax.cond(last, reduce_branch, accumulate_branch, scalars)
        # `reduced` (not `last`) orders these writes after the cond's reads.
        new_acc = jax.tree.map(lambda a, g: jnp.where(reduced, 0, a + expand(g.astype(a.dtype))), acc_grads, grads)
        new_sq = jnp.where(reduced, 0, acc_sq + expand(local_sq))
        return new_updates, new_state._replace(acc_grads=new_acc, acc_sq_norm=new_sq)

    def _apply(mean_grads, mean_sq, b, full_state, params, extra_args, groups, n, S, theta):
        """One AdaScale update from reduced (replica-identical) statistics ``ḡ``, ``a``, ``b``.

        The accumulation buffers are the caller's business: they are set aside
        so that the skip's select never touches a gradient-sized buffer.
        """
        state = full_state._replace(acc_grads=None, acc_sq_norm=None)
        G = groups.size
        with jax.named_scope("adascale/statistics"):
            count = optax.safe_increment(state.count)
            if n > 1:
                var_t, sqr_t = est.step_moments(mean_sq, b, n, S, eps)
                alpha, weight = est.ema_rate(count, state.ema_weight, theta, averaging)
                grad_var = est.ema_update(groups.unpack(state.grad_var), var_t, alpha)
                grad_sqr = est.ema_update(groups.unpack(state.grad_sqr), sqr_t, alpha)
                group_gain = est.gain_ratio(grad_var, grad_sqr, S)
                gain = est.gain_ratio(jnp.sum(grad_var), jnp.sum(grad_sqr), S)
                finite = [mean_sq, b, var_t, sqr_t]
            else:  # S = n = 1: the identity; no variance to estimate.
                weight = state.ema_weight
                grad_var, grad_sqr = groups.unpack(state.grad_var), groups.unpack(state.grad_sqr)
                group_gain = jnp.ones((G,), jnp.float32)
                gain = jnp.ones([], jnp.float32)
                finite = [b]

        with jax.named_scope("adascale/learning_rate"):
            lr = learning_rate(state.tau_whole) if callable(learning_rate) else learning_rate
            lr = jnp.asarray(lr, jnp.float32)
            step_size = gain * lr
            group_step = group_gain * lr
            ok = jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in finite]))
            ok = ok & jnp.isfinite(step_size) & jnp.all(jnp.isfinite(group_step)) & (lr >= 0)

        inner_updates, inner_state = inner.update(mean_grads, state.inner_state, params, **extra_args)
        u_leaves, u_def = jax.tree.flatten(inner_updates)
        if u_def != jax.tree.structure(mean_grads):
            raise ValueError(
                "inner must return updates with the structure of the gradients: got "
                f"{u_def} for gradients {jax.tree.structure(mean_grads)}."
            )
        kept_inner_state = optax.tree.where(ok, inner_state, state.inner_state)

        with jax.named_scope("adascale/scale_updates"):
            # When an update leaf *is* a leaf of the new inner state (optax.trace's
            # momentum), scale the selected state leaf instead: equal whenever
            # ok, and it makes the parameter update consume the state write
            # rather than re-read the old state, which a donated (in-place)
            # state buffer would otherwise force XLA to copy first.
            selected = dict(zip(map(id, jax.tree.leaves(inner_state)), jax.tree.leaves(kept_inner_state)))

            def scale_leaf(u, g):
                u = selected.get(id(u), u)
                dtype = _collect.stat_dtype(u.dtype)
                scaled = u.astype(dtype) * (-group_step[g]).astype(dtype)
                return jnp.where(ok, scaled, 0).astype(u.dtype)

            new_updates = u_def.unflatten([scale_leaf(u, g) for u, g in zip(u_leaves, groups.leaf_group)])

        tau_whole, tau_frac = est.advance_tau(state.tau_whole, state.tau_frac, gain)
        stepped = state._replace(
            count=count,
            gain=gain,
            tau_whole=tau_whole,
            tau_frac=tau_frac,
            grad_sqr=groups.pack(grad_sqr),
            grad_var=groups.pack(grad_var),
            group_gain={} if groups.labels is None else groups.pack(group_gain),
            ema_weight=weight,
            learning_rate=step_size,
            scale=jnp.asarray(S, jnp.float32),
            inner_state=None,
        )
        new_state = optax.tree.where(ok, stepped, state._replace(inner_state=None))
        new_state = new_state._replace(
            inner_state=kept_inner_state,
            skipped_steps=jnp.where(ok, state.skipped_steps, optax.safe_increment(state.skipped_steps)),
            acc_grads=full_state.acc_grads,
            acc_sq_norm=full_state.acc_sq_norm,
        )
        return new_updates, new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def adascale_sgd(
    learning_rate: ScalarOrSchedule,
    momentum: float | None = None,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    *,
    axis_name: str | tuple[str, ...] | None = None,
    accumulation_steps: int = 1,
    scale: float | None = None,
    smoothing: float | None = None,
    eps: float = 1e-6,
    param_labels: Any = None,
    averaging: str = "debiased",
) -> optax.GradientTransformationExtraArgs:
    """AdaScale around SGD with PyTorch's semantics (FairScale's ``AdaScale(SGD(...))``).

    ``weight_decay`` is added to the *averaged* gradient before momentum
    (``d = ḡ + wd·p``; ``m ← μm + d``; Nesterov uses ``d + μm``) and is never
    part of the gain statistics; the step is ``−r_t·lr(⌊τ_t⌋)·m``. All other
    arguments are those of :func:`adascale`. Every argument is an explicit
    keyword, so ``optax.inject_hyperparams(adascale_sgd, static_args=(
    "learning_rate", "nesterov", "axis_name", "accumulation_steps", ...))``
    works (keep ``learning_rate`` static when it is a schedule, so that it
    runs on ``τ``).

    Args:
      learning_rate: float or schedule of the base-batch step.
      momentum: PyTorch momentum ``μ``, or ``None`` for plain SGD.
      nesterov: Nesterov momentum (requires ``momentum``).
      weight_decay: L2 coefficient added to the averaged gradient.
      axis_name: see :func:`adascale`.
      accumulation_steps: see :func:`adascale`.
      scale: see :func:`adascale`.
      smoothing: see :func:`adascale`.
      eps: see :func:`adascale`.
      param_labels: see :func:`adascale`.
      averaging: see :func:`adascale`.

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
    _check_number("momentum", momentum, low=0.0, low_inclusive=True)
    _check_number("weight_decay", weight_decay, low=0.0, low_inclusive=True)
    parts = []
    if not (isinstance(weight_decay, (int, float)) and weight_decay == 0):
        parts.append(optax.add_decayed_weights(weight_decay))
    if momentum is not None:
        parts.append(optax.trace(decay=momentum, nesterov=nesterov))
    inner = optax.chain(*parts) if parts else optax.identity()
    return adascale(
        inner,
        learning_rate,
        axis_name=axis_name,
        accumulation_steps=accumulation_steps,
        scale=scale,
        smoothing=smoothing,
        eps=eps,
        param_labels=param_labels,
        averaging=averaging,
    )


# --------------------------------------------------------------------------- reading state

_PER_REPLICA_FIELDS = ("acc_grads", "acc_sq_norm")


def _is_state(x: Any) -> bool:
    return isinstance(x, AdaScaleState)


# Fields a restored or NNX-split state always keeps (containers that may be empty can be dropped).
_REQUIRED_FIELDS = ("count", "gain", "tau_whole", "tau_frac", "grad_sqr", "grad_var", "learning_rate", "scale",
                    "skipped_steps", "micro_step")


def _as_state(x: Any) -> AdaScaleState | None:
    """``x`` as an AdaScaleState, also from a mapping with its field names (Orbax without target, NNX State)."""
    if isinstance(x, AdaScaleState):
        return x
    if isinstance(x, Mapping) and set(_REQUIRED_FIELDS) <= set(x.keys()):
        return AdaScaleState(**{f: x.get(f, {} if f == "group_gain" else None) for f in AdaScaleState._fields})
    return None


def get_adascale_state(opt_state: Any) -> AdaScaleState:
    """Find the :class:`AdaScaleState` inside any nested optax state.

    Works through ``optax.chain``, ``optax.inject_hyperparams``,
    ``optax.multi_transform``, Flax ``TrainState.opt_state``, and checkpoints
    restored as plain dicts (Orbax without a target).

    Args:
      opt_state: an optimizer state containing exactly one AdaScale state.

    Returns:
      The AdaScale state.

    Examples:
      >>> import jax.numpy as jnp, optax, optax_adascale
      >>> tx = optax.chain(optax_adascale.adascale_sgd(0.1), optax.scale(1.0))
      >>> optax_adascale.get_adascale_state(tx.init(jnp.zeros(2))).count
      Array(0, dtype=int32)
    """
    found: list[AdaScaleState] = []

    def visit(node):
        state = _as_state(node)
        if state is not None:
            found.append(state)
            return
        if isinstance(node, Mapping):
            children = node.values()
        elif isinstance(node, (list, tuple)):
            children = node
        else:
            children = jax.tree_util.tree_flatten(node, is_leaf=lambda x: x is not node)[0]
            if len(children) == 1 and children[0] is node:
                return
        for child in children:
            visit(child)

    visit(opt_state)
    if len(found) != 1:
        raise ValueError(f"expected exactly one AdaScaleState in opt_state, found {len(found)}")
    return found[0]


def scale_invariant_steps(opt_state: Any) -> jax.Array:
    """``τ``: base-batch steps done so far, as float32 (for display; ``⌊τ⌋`` is exact in ``tau_whole``).

    Examples:
      >>> import jax.numpy as jnp, optax_adascale
      >>> tx = optax_adascale.adascale_sgd(0.1, accumulation_steps=2)
      >>> state = tx.init(jnp.zeros(2))
      >>> optax_adascale.scale_invariant_steps(state)
      Array(0., dtype=float32)
    """
    s = get_adascale_state(opt_state)
    return _value(s.tau_whole).astype(jnp.float32) + _value(s.tau_frac)


def _value(x: Any) -> Any:
    """A plain array from a leaf (unwraps Flax NNX variables)."""
    for attr in ("get_value", "value"):
        if hasattr(x, attr) and not isinstance(x, (jax.Array, np.ndarray)):
            v = getattr(x, attr)
            return jnp.asarray(v() if callable(v) else v)
    return jnp.asarray(x)


def metrics(opt_state: Any) -> dict[str, Any]:
    """Plain arrays describing the last update, for logging.

    Keys: ``gain`` (``r_t``), ``scale_invariant_steps`` (``τ``), ``grad_sqr``
    (``μ̄²``), ``grad_var`` (``σ̄²``, base-batch units), ``learning_rate``
    (``r_t·lr(⌊τ_t⌋)``), ``scale`` (``S``), ``skipped_steps``; with
    ``param_labels``, ``group_gains`` (label → gain). Before the first
    update: gain 1, τ 0, the rest 0.

    Examples:
      >>> import jax.numpy as jnp, optax_adascale
      >>> tx = optax_adascale.adascale_sgd(0.1, accumulation_steps=2)
      >>> m = optax_adascale.metrics(tx.init(jnp.zeros(2)))
      >>> m["gain"], m["scale_invariant_steps"], m["grad_var"]
      (Array(1., dtype=float32), Array(0., dtype=float32), Array(0., dtype=float32))
    """
    s = get_adascale_state(opt_state)
    total = lambda v: sum(jax.tree.leaves(jax.tree.map(_value, v)))  # noqa: E731
    out = {
        "gain": _value(s.gain),
        "scale_invariant_steps": scale_invariant_steps(s),
        "grad_sqr": total(s.grad_sqr),
        "grad_var": total(s.grad_var),
        "learning_rate": _value(s.learning_rate),
        "scale": _value(s.scale),
        "skipped_steps": _value(s.skipped_steps),
    }
    if isinstance(s.group_gain, Mapping) and s.group_gain:
        out["group_gains"] = {k: _value(v) for k, v in s.group_gain.items()}
    return out


def _map_states(opt_state: Any, fn: Callable[[AdaScaleState], AdaScaleState], other: Callable[[Any], Any]) -> Any:
    return jax.tree.map(lambda x: fn(x) if _is_state(x) else other(x), opt_state, is_leaf=_is_state)


def state_axes(opt_state: Any) -> Any:
    """``in_axes``/``out_axes`` for the optimizer state under ``jax.vmap`` or ``jax.pmap``.

    ``0`` on the per-replica accumulation buffers, ``None`` (replicated)
    everywhere else. Together with :func:`replicate_buffers` it makes
    across-call accumulation over a vmap or pmap axis a one-liner::

        opt_state = optax_adascale.replicate_buffers(tx.init(params), n)
        axes = optax_adascale.state_axes(opt_state)
        step = jax.vmap(train_step, in_axes=(None, axes, 0), out_axes=(None, axes), axis_name="i")

    (Stacking the whole state, e.g. ``flax.jax_utils.replicate``, works too.)
    """

    def per_state(s: AdaScaleState) -> AdaScaleState:
        fields = dict.fromkeys(AdaScaleState._fields)
        for f in _PER_REPLICA_FIELDS:
            fields[f] = jax.tree.map(lambda _: 0, getattr(s, f))
        return AdaScaleState(**fields)

    return _map_states(opt_state, per_state, lambda _: None)


def state_partition_specs(opt_state: Any, axis_name: str | tuple[str, ...]) -> Any:
    """``in_specs``/``out_specs`` for the optimizer state under ``jax.shard_map``.

    ``P(axis_name)`` on the per-replica accumulation buffers (global shape
    ``(replicas, *shape)`` from :func:`replicate_buffers`; each replica sees
    ``(1, *shape)``), ``P()`` everywhere else.
    """
    P = jax.sharding.PartitionSpec
    axes = state_axes(opt_state)
    return jax.tree.map(lambda a: P() if a is None else P(axis_name), axes, is_leaf=lambda x: x is None)


def replicate_buffers(opt_state: Any, num_replicas: int) -> Any:
    """Give each of ``num_replicas`` replicas its own accumulation buffers.

    Tiles ``acc_grads`` and ``acc_sq_norm`` along a new leading axis of size
    ``num_replicas``; everything else is left replicated. A no-op without
    ``accumulation_steps > 1``. Use with :func:`state_axes` (vmap, pmap) or
    :func:`state_partition_specs` (shard_map).
    """

    def per_state(s: AdaScaleState) -> AdaScaleState:
        tile = lambda x: jnp.broadcast_to(x[None], (num_replicas,) + x.shape).copy()  # noqa: E731
        return s._replace(**{f: jax.tree.map(tile, getattr(s, f)) for f in _PER_REPLICA_FIELDS})

    return _map_states(opt_state, per_state, lambda x: x)


def transfer_state(opt_state: Any, target: Any) -> Any:
    """Carry AdaScale's statistics and the inner state from ``opt_state`` into ``target``.

    For changing the configuration at an update boundary: a different
    ``accumulation_steps``, a different number of replicas (elastic scaling),
    or a checkpoint restored into a new transformation. ``target`` is a fresh
    state of the new configuration (``new_tx.init(params)``, with
    :func:`replicate_buffers` if needed); every field is copied from
    ``opt_state`` except the accumulation buffers, which keep ``target``'s
    (zero) values. The moving averages are in base-batch units, so they stay
    valid at the new scale: no reset, no rescaling.

    Raises:
      ValueError: if ``opt_state`` is mid-accumulation (``micro_step > 0``),
        which would drop gradients; finish the window first.

    Examples:
      >>> import jax.numpy as jnp, optax_adascale
      >>> params = jnp.zeros(2)
      >>> old_tx = optax_adascale.adascale_sgd(0.1, accumulation_steps=2)
      >>> state = old_tx.init(params)
      >>> for g in (jnp.array([1.0, 0.0]), jnp.array([0.0, 1.0])):
      ...     _, state = old_tx.update(g, state, params)
      >>> new_tx = optax_adascale.adascale_sgd(0.1, accumulation_steps=4)
      >>> new_state = optax_adascale.transfer_state(state, new_tx.init(params))
      >>> optax_adascale.scale_invariant_steps(new_state)
      Array(2., dtype=float32)
    """
    source = get_adascale_state(opt_state)
    micro = np.asarray(jax.device_get(_value(source.micro_step)))
    if np.any(micro != 0):
        raise ValueError(
            f"opt_state is mid-accumulation (micro_step={micro.tolist()}): transfer_state works at "
            "an update boundary; run the remaining calls of the window first."
        )

    def per_state(s: AdaScaleState) -> AdaScaleState:
        fields = source._asdict()
        for f in _PER_REPLICA_FIELDS:
            fields[f] = getattr(s, f)
        return _conform(AdaScaleState(**fields), s)

    return _map_states(target, per_state, lambda x: x)


def _conform(source: Any, target: Any) -> Any:
    """``source``'s leaves in ``target``'s tree structure and on ``target``'s devices.

    Leaves are matched by key path, so a checkpoint restored without a target
    (plain dicts and lists where the target has NamedTuples) fits too.
    """
    name = lambda k: str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))
    key = lambda path: tuple(name(k) for k in path)
    src = {key(p): v for p, v in jax.tree_util.tree_leaves_with_path(source)}
    tgt = jax.tree_util.tree_leaves_with_path(target)
    if sorted(src) != sorted(key(p) for p, _ in tgt):
        raise ValueError("the inner transformations of opt_state and target differ in structure")

    def place(value, like):
        sharding = getattr(like, "sharding", None)
        return jax.device_put(value, sharding) if sharding is not None else value

    return jax.tree.structure(target).unflatten([place(src[key(p)], t) for p, t in tgt])

r"""Momentum and Adam's moment averages on the τ clock: their memory counts base-batch steps, as the schedule does.

AdaScale credits an update with ``r`` base-batch steps (``τ ← τ + r``) and multiplies its step by ``r``. A momentum
that decays by ``β`` *per update* then remembers ``1/(1 − β)`` updates, that is ``r/(1 − β)`` base-batch steps: at
``S = 32`` (``r ≈ 17``) the buffer still pushes along gradients taken 170 base steps ago, and every one of them is
multiplied by the gain of the update it is applied in, not the one it was taken at. That is the paper's (and
FairScale's) arithmetic, and it is what makes large scales over-credit (``benchmarks/scale_quality``).

On the τ clock an update worth ``r`` base steps decays the average by ``β^r`` and mixes the new gradient in with
``1 − β^r``, as ``r`` base steps would: the memory is ``1/(1 − β)`` base-batch steps at every scale, and each
gradient's total weight in the steps it takes part in is its own update's. This is the time rescaling under which
momentum SGD (and Adam) keep their stochastic differential equation when the batch grows (Malladi et al., 2022).

* :func:`trace` keeps ``optax.trace``'s form ``m ← β' m + c g`` with ``β' = β^r`` and ``c = (1 − β^r)/(1 − β)``:
  at ``r = 1`` it is ``optax.trace`` (``c = 1``) and a constant gradient ``g`` gives ``m = g/(1 − β)`` at every ``r``.
* :func:`scale_by_adam` averages ``g`` and ``g²`` with ``β₁^r`` and ``β₂^r``, debiases by ``1 − β^τ`` (the weight a
  run of updates worth ``τ`` base steps has given its averages), and returns ``r^{−½}`` times Adam's direction.
  The outer gain ``r`` then makes the Adam step ``√r·lr``, which moves the parameters as far per base-batch step as
  the small batch does: Adam divides by ``√v``, and ``v`` at an ``S``-times larger batch holds ``r`` times less noise
  per coordinate, so Adam's direction already grows by ``√r`` (the square-root rule of Malladi et al. for Adam).
  Decoupled weight decay chained after it still gets the full ``r``: the decay per base-batch step is the small
  batch's.

Both read the gain from the keyword AdaScale passes to ``inner`` (``adascale_gain``; ``adascale_tau``: ``τ`` before
the update). Without it (outside AdaScale, or ``n = S = 1``) they are ``core/_keeps_state``'s ``optax.trace`` and
``optax.scale_by_adam``, bit for bit; like those, given ``adascale_taken`` they select each state leaf where they
compute it, so a skipped update copies no donated state (``core/_inner``).

References:
  Malladi, Lyu, Panigrahi, Arora, `On the SDEs and Scaling Rules for Adaptive Gradient Algorithms
  <https://arxiv.org/abs/2205.10287>`_, NeurIPS 2022.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from optax_adascale.core import _keeps_state, _norms

Array = jax.Array

KEYWORD = "base_steps"
SUMS = "adascale_sums"  # internal: the reduction strategies' global sum of per-leaf scalars (model shards, ZeRO rows)
# The guard's margin: the step along the measured curvature stays within this fraction of the τ clock's stability
# limit, r·lr·h·(1 − β^r)/(1 − β) ≤ 2·GUARD_MARGIN·(1 + β^r): at 1/2, the step that lands on the minimum of the
# curvature it measured (what a larger step cannot beat: beyond it an update overshoots, and beyond 2× it diverges).
GUARD_MARGIN = 0.5
# The measured curvature is held at its peak and halves each update it is not measured again as high.
CURVATURE_DECAY = 0.5
# The gain grows by at most this factor an update. A sharper direction than the step probes (the top of the Hessian,
# which training drives to the edge of what the recent steps allowed) cannot be measured from the step; a step
# that stiffens gradually lets it relax, where a jump of the gain (a larger batch, an estimate from few samples)
# throws the parameters out of it (benchmarks/scale_quality: the byte LM at 2× its rate, S = 32).
GAIN_GROWTH = 1.1


class BaseSteps(NamedTuple):
    """What AdaScale hands an ``inner`` that counts base-batch steps: the keyword ``base_steps`` of its ``update``.

    An inner *counts base steps* when its averages decay per base-batch step (:func:`trace`,
    :func:`scale_by_adam`): it must know what an update is worth, so its ``update`` takes
    ``base_steps=BaseSteps(...)`` and refuses to run without it (our ``ValueError``), never falling back to a
    per-update average silently. AdaScale passes it to every ``inner``; inners that take no extra arguments never
    see it (``optax.with_extra_args_support``).

    Attributes:
      gain: the gain ``r`` of this update (what it is worth in base-batch steps): a float32 scalar, or with
        ``param_labels`` a tree of scalars shaped like the gradients (each leaf its group's gain).
      learning_rate: float32 ``[]``, ``lr(⌊τ⌋)``: the step AdaScale applies is ``−r·lr·inner(ḡ)``.
      noise: float32 ``[]``, ``σ̄²/S``: the expected ``‖ḡ − ∇L‖²`` of this update's gradient (0 with one sample).
      last_step: the step ``r·lr`` of the last applied update (0 before the first), shaped as ``gain``.
    """

    gain: Any
    learning_rate: Any
    noise: Any
    last_step: Any = 0.0


def required(extra_args: dict[str, Any], who: str) -> BaseSteps:
    """The ``base_steps`` keyword, or our error: an inner that counts base steps never runs as plain optax."""
    steps = extra_args.get(KEYWORD)
    if not isinstance(steps, BaseSteps):
        raise ValueError(
            f"{who} counts base-batch steps (the τ clock): its averages decay per base-batch step, so it needs what "
            "each update is worth, AdaScale's gain (the keyword base_steps=optax_adascale.BaseSteps(...)). Use it as "
            "the inner of optax_adascale.adascale(...) (or clock='tau' of adascale_sgd / adascale_adamw); outside "
            f"AdaScale use optax's own transformation. Got base_steps={steps!r}."
        )
    return steps


def probe_args() -> dict[str, Any]:
    """The keyword for running ``inner`` outside an update (the stand-in checks): an update worth one base step."""
    return {KEYWORD: BaseSteps(jnp.float32(1), jnp.float32(0), jnp.float32(0), jnp.float32(0))}


def _per_leaf(gain: Any, updates: Any) -> list[Array]:
    """The gain of each leaf of ``updates`` (a scalar for all, or a tree of scalars shaped like them)."""
    leaves = jax.tree.leaves(updates, is_leaf=lambda x: x is None)
    if jnp.ndim(gain) == 0 and not isinstance(gain, (dict, list, tuple)):
        return [jnp.asarray(gain, jnp.float32)] * len(leaves)
    gains = jax.tree.leaves(gain)
    if len(gains) != len(leaves):
        raise ValueError(
            f"base_steps.gain is a tree of {len(gains)} scalars but the updates have {len(leaves)} leaves: with "
            "param_labels each leaf gets its group's gain, so inner must see gradients shaped like the params "
            "(a transformation that changes the tree cannot count base steps per group)."
        )
    return [jnp.asarray(g, jnp.float32) for g in gains]


def _powers(decay: Any, gain: Array) -> tuple[Array, Array]:
    """``(β^r, 1 − β^r)``, with ``1 − β^r`` from ``expm1`` (``β^r`` rounds to 1 for ``β`` near 1 and small ``r``)."""
    log = jnp.log(jnp.asarray(decay, jnp.float32))
    x = jnp.asarray(gain, jnp.float32) * log
    return jnp.exp(x), -jnp.expm1(x)


def _trace_coefficients(decay: float, gain: Array) -> tuple[Array, Array]:
    """``(β^r, (1 − β^r)/(1 − β))``: what an update worth ``r`` base steps keeps of the trace and adds of the
    gradient; at ``r = 1`` exactly ``(β, 1)``, optax's ``trace``."""
    keep, fresh = _powers(decay, gain)
    one = gain == 1
    return jnp.where(one, jnp.float32(decay), keep), jnp.where(one, jnp.float32(1), fresh / jnp.float32(1.0 - decay))


def _wide(*leaves: Array, least: Any = jnp.float32) -> Any:
    """The leaves' dtypes promoted together and with ``least`` (``None``: no floor). Under the standard rules, which
    the user's ``jax_numpy_dtype_promotion="strict"`` refuses between float32 (the gain's powers) and bfloat16; what
    is returned is cast back to the user's dtype, so nothing is promoted for them."""
    with jax.numpy_dtype_promotion("standard"):
        out = jnp.dtype(least) if least is not None else leaves[0].dtype
        for leaf in leaves:
            out = jnp.promote_types(out, leaf.dtype)
    return out


def _mix(a: Array, x: Array, b: Array, y: Array, out: Any = None) -> Array:
    """``a·x + b·y`` computed at least in float32 (a bfloat16 trace mixes in float32, complex stays complex) and
    cast to ``out``: by default ``x``'s and ``y``'s own promoted dtype, what optax's moment updates return."""
    wide = _wide(x, y)
    return (a * x.astype(wide) + b * y.astype(wide)).astype(_wide(x, y, least=None) if out is None else out)


class TraceState(NamedTuple):
    """State of :func:`trace`: the momentum and what its stability guard measured along the last step.

    Attributes:
      trace: the momentum ``m``, shaped like the params (optax's ``TraceState.trace``).
      slope: float32 ``[]``, ``Σ η·(u·m)``: the update's input ``u`` along the last step, per its own step.
      reach: float32 ``[]``, ``Σ η²·(v·m)``: the last step's squared length along ``m``.
      noise: float32 ``[]``, the part of ``slope`` that is the gradient's noise (its expectation, ``σ̄²/S`` times
        the weight ``(1 − β^r)/(1 − β)`` the noise entered ``m`` with, times ``η``).
      curvature: float32 ``[]``, the curvature ``h`` measured along the steps (the secant
        ``(u_t − u_{t−1})·Δθ/‖Δθ‖²``, its noise removed), held at its peak and halved each update; 0 unmeasured.
      decay: float32 ``[]``, the momentum ``β`` (read by the guard).
      nesterov: float32 ``[]``, 1 for Nesterov momentum, else 0 (its stability limit is lower).
    """

    trace: Any
    slope: Array
    reach: Array
    noise: Array
    curvature: Array
    decay: Array
    nesterov: Array


def trace(
    decay: float, nesterov: bool = False, accumulator_dtype: Any = None, *, guard: bool = True
) -> optax.GradientTransformationExtraArgs:
    r"""``optax.trace`` on the τ clock: an update worth ``r`` base-batch steps decays the trace by ``decay^r``.

    ``m ← β^r m + (1 − β^r)/(1 − β) · g`` and the output is ``m`` (Nesterov: ``(1 − β^r)/(1 − β)·g + β^r m``). At
    ``r = 1`` this is ``optax.trace(decay, nesterov)`` bit for bit; a constant gradient gives ``g/(1 − β)`` at any
    ``r``, so the step ``r·lr·m`` is ``r`` small-batch steps in the steady state, and the trace remembers
    ``1/(1 − β)`` base-batch steps whatever the scale (the module docstring says why).

    It counts base steps: its ``update`` needs AdaScale's ``base_steps=BaseSteps(gain, learning_rate, noise)``
    and refuses to run without it. It also measures the curvature ``h`` along the steps it takes (the secant of the
    gradient along the last step, from three dot products over the buffers its update reads, its noise removed):
    AdaScale caps the gain where the step would pass half the τ clock's stability limit along ``h``
    (:func:`gain_limit`).

    Args:
      decay: ``β ∈ [0, 1)``, PyTorch's momentum.
      nesterov: Nesterov momentum.
      accumulator_dtype: the trace's dtype, as ``optax.trace``'s (``None``: the params' and updates').
      guard: measure the curvature for AdaScale's stability guard (``False``: no measurements and no guard, the
        state ``optax.TraceState``: 0.3's ``clock="tau"``, kept for studies; one gain for every leaf).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is ``optax_adascale.core._clock.TraceState``.

    Examples:
      >>> import jax.numpy as jnp, optax_adascale
      >>> tx = optax_adascale.trace(0.9)
      >>> state = tx.init(jnp.zeros(1))
      >>> worth_two = optax_adascale.BaseSteps(gain=2.0, learning_rate=0.1, noise=0.0)
      >>> m, state = tx.update(jnp.ones(1), state, base_steps=worth_two)
      >>> print(m.round(4))  # 1 + 0.9: the trace of two base steps of the same gradient
      [1.9]
    """
    plain = _keeps_state.trace(decay=decay, nesterov=nesterov, accumulator_dtype=accumulator_dtype)
    accumulator_dtype = None if accumulator_dtype is None else jax.dtypes.canonicalize_dtype(accumulator_dtype)
    if not guard:
        return _unguarded_trace(plain, decay, nesterov, accumulator_dtype)

    def init_fn(params):
        zero = lambda: jnp.zeros([], jnp.float32)  # noqa: E731 - a fresh buffer per field (donation)
        return TraceState(
            trace=plain.init(params).trace,
            slope=zero(),
            reach=zero(),
            noise=zero(),
            curvature=zero(),
            decay=jnp.full([], decay, jnp.float32),
            nesterov=jnp.full([], float(nesterov), jnp.float32),
        )

    def update_fn(updates, state, params=None, **extra_args):
        del params
        steps = required(extra_args, "optax_adascale.trace")
        taken = extra_args.get(_keeps_state.TAKEN)
        sums = extra_args.get(SUMS) or _local_sums
        leaves, treedef = jax.tree.flatten(updates)
        olds = treedef.flatten_up_to(state.trace)
        gains = _per_leaf(steps.gain, updates)
        lr = jnp.asarray(steps.learning_rate, jnp.float32)
        # The guard's measurements: the secant along the last step −η·v (``m`` its probe), from three dot products
        # per leaf over the buffers this update reads before it writes (the new gradient u and the old trace m):
        # d = u·m, e = ‖u‖², q = ‖m‖². What the next secant needs of the new trace follows from them exactly
        # (m' = k·m + w·u: u·m' = k·d + w·e, ‖m'‖² = k²q + 2kw·d + w²e), so every sum is taken in one stage before the
        # update (one collective where one is needed), each pair in its own fused multiply-reduce (no stacked copies
        # of state buffers), and the new trace, selected on a predicate that reads them, is written over the old one
        # in place (a donated state is not copied).
        parts = _norms.leaf_dots([pair for g, m in zip(leaves, olds, strict=True) for pair in ((g, m), (g, g), (m, m))])
        old_steps = _per_leaf(steps.last_step, updates)  # the last update moved the params by −η·v
        coefficients, local = [], []
        for i, (r, eta_old) in enumerate(zip(gains, old_steps, strict=True)):
            keep, weight = _trace_coefficients(decay, r)
            coefficients.append((keep, weight))
            d, e, q = parts[3 * i], parts[3 * i + 1], parts[3 * i + 2]
            slope_l = keep * d + weight * e  # u·m'
            sq_new = keep * keep * q + 2 * keep * weight * d + weight * weight * e  # ‖m'‖²
            along = weight * slope_l + keep * sq_new if nesterov else sq_new  # v·m'
            eta = r * lr
            local.append(jnp.stack([eta_old * d, eta * slope_l, eta * eta * along]))
        dots = sums(local)  # replicated (summed over model axes and ZeRO rows where those split the leaves)
        read = jnp.all((dots == dots) | (dots != dots))  # always True, after the reads
        taken_after = read if taken is None else taken & read
        new_m, out, weights = [], [], []
        for g, m, (keep, weight) in zip(leaves, olds, coefficients, strict=True):
            m_new = _keeps_state.kept(taken_after, _mix(weight, g, keep, m), m)
            new_m.append(m_new)
            out.append(_mix(weight, g, keep, m_new) if nesterov else m_new)
            weights.append(weight)
        new_steps = [r * lr for r in gains]
        crossed, slope, reach = dots[0], dots[1], dots[2]
        curvature = (state.slope - crossed - state.noise) / jnp.where(state.reach > 0, state.reach, 1.0)
        measured = (state.reach > 0) & jnp.isfinite(curvature)
        curvature = jnp.maximum(jnp.where(measured, curvature, 0.0), CURVATURE_DECAY * state.curvature)
        # E[(ξ_t − ξ_{t+1})·m_t] = weight·E‖ξ_t‖²: the noise the next secant subtracts (the smallest leaf's share)
        step_weight = jnp.min(jnp.stack([e * w for e, w in zip(new_steps, weights, strict=True)]))
        noise = step_weight * jnp.asarray(steps.noise, jnp.float32)
        scalars = (slope, reach, noise, curvature)
        old_scalars = (state.slope, state.reach, state.noise, state.curvature)
        scalars = _keeps_state.kept(taken, scalars, old_scalars)
        new_trace = optax.tree.cast(treedef.unflatten(new_m), accumulator_dtype)
        new_state = TraceState(new_trace, *scalars, state.decay, state.nesterov)
        return treedef.unflatten(out), new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _unguarded_trace(
    plain, decay: float, nesterov: bool, accumulator_dtype: Any
) -> optax.GradientTransformationExtraArgs:
    """The τ clock's trace without the guard's measurements (state ``optax.TraceState``): 0.3's ``clock="tau"``."""

    def update_fn(updates, state, params=None, **extra_args):
        del params
        gain = jnp.asarray(required(extra_args, "optax_adascale.trace").gain, jnp.float32)
        keep, weight = _trace_coefficients(decay, gain)
        new = lambda g, t: _mix(weight, g, keep, t)  # noqa: E731
        trace = _keeps_state.kept(
            extra_args.get(_keeps_state.TAKEN), jax.tree.map(new, updates, state.trace), state.trace
        )
        out = jax.tree.map(new, updates, trace) if nesterov else trace
        return out, optax.TraceState(trace=optax.tree.cast(trace, accumulator_dtype))

    return optax.GradientTransformationExtraArgs(plain.init, update_fn)


def _local_sums(parts: list[Array]) -> Array:
    """The sum over leaves of their per-leaf scalars (replicated leaves: nothing to reduce across devices)."""
    return jnp.sum(jnp.stack(parts), axis=0)


def _stability(gain: Array, decay: Array, nesterov: Array) -> Array:
    """The τ clock's step along a curvature ``h``, per ``lr·h`` and per half its stability limit: the update at gain
    ``r`` is stable while ``lr·h`` times this is below 2.

    With ``k = β^r`` and ``w = (1 − β^r)/(1 − β)`` the update maps ``(x, m)`` along ``h`` linearly; Jury's conditions on
    that map give ``r·lr·h·w < 2(1 + k)`` for the heavy ball and ``r·lr·h·w < 2(1 + k)/(1 + 2k)`` for Nesterov (its
    output adds the fresh gradient once more), so this is ``r·w·(1 + 2k·nesterov)/(1 + k)``.
    """
    keep, fresh = _powers(decay, gain)
    weight = jnp.where(decay > 0, fresh / (1.0 - decay), 1.0)
    return gain * weight * (1.0 + 2.0 * keep * nesterov) / (1.0 + keep)


def gain_limit(inner_state: Any, learning_rate: Array, last_gain: Array) -> Array:
    """The largest gain the curvature measured by ``inner``'s :func:`trace` allows at ``learning_rate``.

    The τ clock's update at gain ``r`` along a curvature ``h`` is stable while ``r·lr·h·(1 − β^r)/(1 − β) <
    2(1 + β^r)`` (``docs/noise_scale.md``); the guard keeps it within ``GUARD_MARGIN`` of that: the gain ``r`` that
    solves ``lr·h·r(1 − β^r)/((1 − β)(1 + β^r)) = 2·GUARD_MARGIN``, at least 1 (``+inf`` where nothing was measured
    or the learning rate is 0), and at most ``GAIN_GROWTH·max(last_gain, 1)``; ``+inf`` where ``inner`` holds no
    :class:`TraceState`. A scalar bisection (no pass over gradients).
    """
    found: list[TraceState] = []
    _find(inner_state, found)
    limit = jnp.full([], jnp.inf, jnp.float32)
    lr = jnp.asarray(learning_rate, jnp.float32)
    grown = jnp.maximum(jnp.asarray(last_gain, jnp.float32), 1.0) * GAIN_GROWTH
    for node in found:
        limit = jnp.minimum(limit, jnp.minimum(_largest_gain(node, lr, 2.0 * GUARD_MARGIN), grown))
    return limit


def _largest_gain(node: TraceState, lr: Array, reach: float) -> Array:
    """The gain ``r ≥ 1`` at which the τ clock's step along ``curvature`` reaches ``reach`` (``_stability``, times
    ``lr·h``); ``+inf`` where nothing was measured or ``lr = 0``. A scalar bisection on ``log r``."""
    budget = reach / (lr * node.curvature)
    active = (node.curvature > 0) & (lr > 0) & jnp.isfinite(budget)
    budget = jnp.where(active, budget, 1.0)

    def bisect(_, bounds):
        lo, hi = bounds
        mid = 0.5 * (lo + hi)
        below = _stability(jnp.exp(mid), node.decay, node.nesterov) <= budget
        return jnp.where(below, mid, lo), jnp.where(below, hi, mid)

    lo, _ = lax.fori_loop(0, 40, bisect, (jnp.float32(0), jnp.float32(24 * 0.6931472)))
    return jnp.where(active, jnp.exp(lo), jnp.inf)


def _find(node: Any, found: list[TraceState]) -> None:
    """Every :class:`TraceState` in an inner state (optax's chains, masks and named chains hold them as nodes)."""
    if isinstance(node, TraceState):
        found.append(node)
        return
    children = jax.tree_util.tree_flatten(node, is_leaf=lambda x: x is not node and isinstance(x, TraceState))[0]
    for child in children:
        if isinstance(child, TraceState):
            found.append(child)


class ScaleByAdamState(NamedTuple):
    """State of :func:`scale_by_adam`: optax's ``ScaleByAdamState`` with its own clock.

    Attributes:
      count: int32 ``[]``, updates applied (optax's field).
      base_steps: float32 ``[]``: the base-batch steps the averages have seen (the sum of the gains of the updates
        applied), which Adam's debiasing ``1 − β^τ`` reads.
      mu: the first moment (optax's field).
      nu: the second moment (optax's field).
    """

    count: Array  # type: ignore[assignment]  # optax's field name
    base_steps: Any
    mu: Any
    nu: Any


@functools.partial(jax.jit, inline=True)
def _optax_debias(decay: Any, count: Array) -> Array:
    """``1 − decay^count`` as ``optax.tree.bias_correction`` computes it (a jitted power of a traced decay)."""
    return 1 - decay**count


def scale_by_adam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Any = None,
    *,
    nesterov: bool = False,
) -> optax.GradientTransformationExtraArgs:
    r"""``optax.scale_by_adam`` on the τ clock, with the direction scaled by ``r^{−½}``.

    An update worth ``r`` base-batch steps averages with ``β₁^r`` and ``β₂^r``, debiases by ``1 − β^τ`` (``τ`` the
    base-batch steps its own state has counted, this update's included), and returns ``r^{−½}·m̂/(√v̂ + ε)``: under
    AdaScale's gain the Adam step is ``√r·lr`` (the module docstring says why). It counts base steps: its
    ``update`` needs AdaScale's ``base_steps=BaseSteps(...)`` and refuses to run without it.

    Args:
      b1: see ``optax.scale_by_adam``.
      b2: see ``optax.scale_by_adam``.
      eps: see ``optax.scale_by_adam``.
      eps_root: see ``optax.scale_by_adam``.
      mu_dtype: see ``optax.scale_by_adam``.
      nesterov: see ``optax.scale_by_adam``.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is :class:`ScaleByAdamState`.

    Examples:
      >>> import jax.numpy as jnp, optax_adascale
      >>> tx = optax_adascale.scale_by_adam()
      >>> state = tx.init(jnp.zeros(1))
      >>> worth_four = optax_adascale.BaseSteps(gain=4.0, learning_rate=1e-3, noise=0.0)
      >>> u, state = tx.update(jnp.ones(1), state, base_steps=worth_four)
      >>> print(u.round(4))  # a constant gradient: Adam's direction 1, times 4^(-1/2)
      [0.5]
    """
    plain = _keeps_state.scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nesterov)
    log1, log2 = jnp.log(jnp.float32(b1)), jnp.log(jnp.float32(b2))

    def init_fn(params):
        base = plain.init(params)
        return ScaleByAdamState(count=base.count, base_steps=jnp.zeros([], jnp.float32), mu=base.mu, nu=base.nu)

    def update_fn(updates, state, params=None, **extra_args):
        del params
        steps = required(extra_args, "optax_adascale.scale_by_adam")
        taken = extra_args.get(_keeps_state.TAKEN)
        leaves, treedef = jax.tree.flatten(updates)
        if jnp.ndim(steps.gain) != 0 or isinstance(steps.gain, (dict, list, tuple)):
            raise ValueError(
                "optax_adascale.scale_by_adam counts one clock of base-batch steps for all its averages (its "
                "debiasing reads it), but with param_labels each group has its own gain. Use clock='update' with "
                "param_labels (adascale_adamw(..., clock='update', param_labels=...)), or no param_labels."
            )
        r = jnp.asarray(steps.gain, jnp.float32)
        mus, nus = treedef.flatten_up_to(state.mu), treedef.flatten_up_to(state.nu)
        tau_new = state.base_steps + r
        one = r == 1  # optax's own arithmetic, bit for bit (n = S = 1 runs Adam through here)
        keep1, fresh1 = _powers(b1, r)
        keep2, fresh2 = _powers(b2, r)
        keep1, fresh1 = jnp.where(one, jnp.float32(b1), keep1), jnp.where(one, jnp.float32(1 - b1), fresh1)
        keep2, fresh2 = jnp.where(one, jnp.float32(b2), keep2), jnp.where(one, jnp.float32(1 - b2), fresh2)
        count = optax.safe_increment(state.count)
        # while every update was worth one base step, τ is the update count: optax's 1 − β^count exactly
        counted = tau_new == count.astype(jnp.float32)
        debias1 = jnp.where(counted, _optax_debias(b1, count), -jnp.expm1(tau_new * log1))
        debias2 = jnp.where(counted, _optax_debias(b2, count), -jnp.expm1(tau_new * log2))
        if nesterov:
            after = _optax_debias(b1, optax.safe_increment(count))
            after = jnp.where(counted, after, -jnp.expm1((tau_new + r) * log1))
        scale = jnp.where(one, jnp.float32(1), lax.rsqrt(r))
        new_mu, new_nu, out = [], [], []
        for g, m, v in zip(leaves, mus, nus, strict=True):
            m_new = _keeps_state.kept(taken, _mix(fresh1, g, keep1, m), m)
            v_new = _keeps_state.kept(taken, _mix(fresh2, jnp.square(jnp.abs(g)), keep2, v), v)
            if nesterov:
                m_hat = _mix(keep1 / after, m_new, fresh1 / debias1, g, _wide(m_new, g))
            else:
                m_hat = m_new.astype(_wide(m_new)) / debias1
            direction = m_hat / (jnp.sqrt(v_new.astype(_wide(v_new)) / debias2 + eps_root) + eps)
            out.append((direction * scale).astype(g.dtype))
            new_mu.append(m_new)
            new_nu.append(v_new)
        mu, nu = treedef.unflatten(new_mu), treedef.unflatten(new_nu)
        new_state = ScaleByAdamState(
            count=_keeps_state.kept(taken, count, state.count),
            base_steps=_keeps_state.kept(taken, tau_new, state.base_steps),
            mu=optax.tree.cast(mu, mu_dtype) if mu_dtype is not None else optax.tree.cast_like(mu, state.mu),
            nu=optax.tree.cast_like(nu, state.nu),
        )
        return treedef.unflatten(out), new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)

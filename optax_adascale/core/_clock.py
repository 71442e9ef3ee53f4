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

Both read the gain from the keyword AdaScale passes to every ``inner`` (``base_steps``, a :class:`BaseSteps`), and
refuse to run without it. At ``r = 1`` (``n = S = 1``) they are ``core/_keeps_state``'s ``optax.trace`` and
``optax.scale_by_adam``, bit for bit; like those, given ``base_steps.taken`` they select each state leaf where they
compute it, so a skipped update copies no donated state (``core/_inner``).

References:
  Malladi, Lyu, Panigrahi, Arora, `On the SDEs and Scaling Rules for Adaptive Gradient Algorithms
  <https://arxiv.org/abs/2205.10287>`_, NeurIPS 2022.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from optax_adascale import _compat
from optax_adascale.core import _keeps_state, _norms

Array = jax.Array

KEYWORD = "base_steps"
# The guard's margin: the step along the measured curvature stays within this fraction of the τ clock's stability
# limit, r·lr·h·(1 − β^r)/(1 − β) ≤ 2·GUARD_MARGIN·(1 + β^r): at 1/2, the step that lands on the minimum of the
# curvature it measured (what a larger step cannot beat: beyond it an update overshoots, and beyond 2× it diverges).
GUARD_MARGIN = 0.5
# The measured curvature is held at its peak and halves each update a measured secant is lower. An update that
# measures nothing (no step yet, a secant below its float32 resolution, a negative one: the loss concave along the
# step) keeps it: once measured, the cap does not fade because the steps stopped measuring it.
CURVATURE_DECAY = 0.5
# A secant whose numerator (the change of the gradient along the step) is below this fraction of its terms is
# float32 rounding, not curvature (near a zero loss both terms vanish together): it measures nothing.
SECANT_RESOLUTION = 1e-4
# The gain grows by at most this factor an update. A sharper direction than the step probes (the top of the Hessian,
# which training drives to the edge of what the recent steps allowed) cannot be measured from the step; a step
# that stiffens gradually lets it relax, where a jump of the gain (a larger batch, an estimate from few samples)
# throws the parameters out of it (benchmarks/scale_quality: the byte LM at 2× its rate, S = 32).
GAIN_GROWTH = 1.1
# Newton steps on the stability limit (``_largest_gain``), unrolled: 3 reach float32 accuracy from the lower bound
# it starts at (checked against a 200-step bisection over β ∈ [0.5, 0.999], Nesterov or not, budgets 1e-2 to 1e9).
NEWTON_STEPS = 4


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class BaseSteps:
    """What AdaScale hands every ``inner``: the keyword ``base_steps`` of its ``update``, every field required.

    An inner that *counts base steps* (:func:`trace`, :func:`scale_by_adam`: averages that decay per base-batch
    step) must know what an update is worth, so its ``update`` takes ``base_steps=BaseSteps(...)`` and refuses to
    run without it (our ``ValueError``), never falling back to a per-update average silently. It is also the one
    channel of everything else an inner learns from AdaScale: whether the update is applied (``taken``), and the
    the guard's measurements (``probe``) and the global squared norm over the pieces of a parameter split over model
    axes or ZeRO rows (``sq_norm``). Inners
    that take no extra arguments never see it (``optax.with_extra_args_support``).

    Attributes:
      gain: the gain ``r`` of this update (what it is worth in base-batch steps): a float32 scalar, or with
        ``param_labels`` a tree of scalars shaped like the gradients (each leaf its group's gain).
      learning_rate: float32 ``[]``, ``lr(⌊τ⌋)``.
      step: the step AdaScale applies to ``inner``'s output, ``−step·inner(ḡ)``: ``r·lr`` (``r^p·lr`` with an
        experimental ``gain_exponent``), shaped as ``gain``.
      last_step: the step of the last applied update (0 before the first), from AdaScale's state, shaped as
        ``gain``.
      next_learning_rate: float32 ``[]``, ``lr(⌊τ + r⌋)``: the learning rate of the next update if this one is
        applied (the stability guard caps the next gain at it).
      noise: float32 ``[]``, ``σ̄²/S``: the expected ``‖ḡ − ∇L‖²`` of this update's gradient (0 with one sample).
      taken: a boolean scalar, False where AdaScale skips this update, for an inner that selects its own state
        where it writes it (``KeepsStateOnSkip``); ``None`` for any other inner (AdaScale keeps its state).
      probe: for the guarded :func:`trace`, float32 ``[L, 6]``: per leaf, the dot products of the averaged gradient
        ``ḡ``, the trace ``m`` and the parameters ``θ`` (``ḡ·m, ‖ḡ‖², ḡ·θ, ‖m‖², m·θ, ‖θ‖²``) on a strided sample
        of each (``core/_probe.probe_dots``), scaled to the whole leaf and summed over its pieces: taken by AdaScale
        in its statistics' reduction, riding its all-reduce; ``None`` where ``inner`` holds no guarded trace.
      sq_norm: ``sq_norm(tree) -> ‖tree‖²`` of a tree shaped like the gradients, summed over the pieces of leaves
        split over model axes or ZeRO rows (one scalar ``psum``; a plain sum where every leaf is whole).
    """

    gain: Any
    learning_rate: Any
    step: Any
    last_step: Any
    next_learning_rate: Any
    noise: Any
    taken: Any
    probe: Any
    sq_norm: Any = dataclasses.field(metadata={"static": True})

    @classmethod
    def by_hand(cls, gain: Any, learning_rate: Any = 0.0) -> BaseSteps:
        """An applied update worth ``gain`` base steps, for running an inner by hand (the docs' examples, tests):
        every leaf whole on this device, no last step (the guard measures nothing)."""
        lr = jnp.asarray(learning_rate, jnp.float32)
        return cls(
            gain=gain,
            learning_rate=lr,
            step=jnp.asarray(gain, jnp.float32) * lr,
            last_step=jnp.float32(0),
            next_learning_rate=lr,
            noise=jnp.float32(0),
            taken=None,
            probe=None,
            sq_norm=local_sq_norm,
        )


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


def local_sq_norm(tree: Any) -> Array:
    """``‖tree‖²`` in float32, every leaf whole on this device."""
    return sum((_norms.leaf_sq_norm(x) for x in jax.tree.leaves(tree)), jnp.zeros([], jnp.float32))


def probe_args(sq_norm: Any = local_sq_norm) -> dict[str, Any]:
    """The keyword for running ``inner`` outside an update (the stand-in checks): an applied update worth one base
    step, at learning rate 0 (so the guard measures nothing), squared norms by ``sq_norm``."""
    return {KEYWORD: dataclasses.replace(BaseSteps.by_hand(jnp.float32(1)), sq_norm=sq_norm)}


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


def guarded_trace(inner_state: Any) -> Any:
    """The momentum buffer (a tree shaped like the params) of the one guarded τ-clock trace in ``inner``'s state, or
    ``None`` where there is none; our error where there are several (the guard probes one momentum)."""
    states = _trace_states(inner_state)
    if len(states) > 1:
        raise ValueError(
            f"inner holds {len(states)} guarded τ-clock momenta (optax_adascale.trace): AdaScale's stability guard "
            "measures the curvature along one. Chain one optax_adascale.trace, or pass guard=False to the others."
        )
    return states[0].trace if states else None


class TraceState(NamedTuple):
    """State of :func:`trace`: the momentum and what its stability guard measured along the last step.

    Attributes:
      trace: the momentum ``m``, shaped like the params (optax's ``TraceState.trace``).
      slope: float32 ``[]``, ``Σ η·(u·m)``: the update's input ``u`` along the new trace, times its step ``η``.
      reach: float32 ``[]``, ``Σ η²·(v·m)``: the step ``η·v`` along the new trace, times ``η``.
      noise: float32 ``[]``, the part of ``slope`` that is the gradient's noise (its expectation, ``σ̄²/S`` times
        the weight ``(1 − β^r)/(1 − β)`` the noise entered ``m`` with, times ``η``).
      curvature: float32 ``[]``, the curvature ``h`` measured along the steps (the secant
        ``(u_t − u_{t−1})·Δθ/‖Δθ‖²``, its noise removed), held at its peak, halved by a lower measurement, kept
        where an update measures nothing; 0 before the first measurement.
      limit: float32 ``[]``, the largest gain the next update may apply: half the τ clock's stability limit along
        ``curvature`` at the next update's learning rate (``+inf`` while nothing is measured).
    """

    trace: Any
    slope: Array
    reach: Array
    noise: Array
    curvature: Array
    limit: Array


def trace(
    decay: float,
    nesterov: bool = False,
    accumulator_dtype: Any = None,
    *,
    weight_decay: float = 0.0,
    guard: bool = True,
) -> optax.GradientTransformationExtraArgs:
    r"""``optax.trace`` on the τ clock: an update worth ``r`` base-batch steps decays the trace by ``decay^r``.

    ``m ← β^r m + (1 − β^r)/(1 − β) · g`` and the output is ``m`` (Nesterov: ``(1 − β^r)/(1 − β)·g + β^r m``). At
    ``r = 1`` this is ``optax.trace(decay, nesterov)`` bit for bit; a constant gradient gives ``g/(1 − β)`` at any
    ``r``, so the step ``r·lr·m`` is ``r`` small-batch steps in the steady state, and the trace remembers
    ``1/(1 − β)`` base-batch steps whatever the scale (the module docstring says why).

    It counts base steps: its ``update`` needs AdaScale's ``base_steps=BaseSteps(...)`` and refuses to run without
    it. It also guards the τ clock's stability: it measures the curvature ``h`` along the steps it takes (the
    secant of its input along the last step, its noise removed, from dot products of ``ḡ``, ``m`` and ``θ`` that
    AdaScale takes on a strided sample of each leaf in its statistics' reduction: ``BaseSteps.probe``; a chain of
    transformations before the trace other than its own ``weight_decay`` is not seen) and stores the largest gain
    the *next* update may apply: the one
    whose step reaches half the stability limit along ``h`` at the next learning rate (``TraceState.limit``; a
    closed-form start and four Newton steps, no loop). AdaScale applies ``min(estimated gain, 1.1·last gain,
    limit)``: the curvature measured in one update caps the next.

    Args:
      decay: ``β ∈ [0, 1)``, PyTorch's momentum (``β = 0`` has no trace to measure along: no guard).
      nesterov: Nesterov momentum.
      accumulator_dtype: the trace's dtype, as ``optax.trace``'s (``None``: the params' and updates').
      weight_decay: ``λ``, added to the gradient before the trace (``g + λθ``, PyTorch SGD's decay:
        ``optax.chain(optax.add_decayed_weights(λ), trace(β))``), so that the guard knows its input; needs ``params``.
      guard: measure the curvature for AdaScale's stability guard (``False``: no measurements and no guard, the
        state ``optax.TraceState``: 0.3's ``clock="tau"``, kept for studies; one gain for every leaf).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is ``optax_adascale.core._clock.TraceState``.

    Examples:
      >>> import jax.numpy as jnp, optax_adascale
      >>> tx = optax_adascale.trace(0.9)
      >>> state = tx.init(jnp.zeros(1))
      >>> worth_two = optax_adascale.BaseSteps.by_hand(gain=2.0)
      >>> m, state = tx.update(jnp.ones(1), state, base_steps=worth_two)
      >>> print(m.round(4))  # 1 + 0.9: the trace of two base steps of the same gradient
      [1.9]
    """
    plain = _keeps_state.trace(decay=decay, nesterov=nesterov, accumulator_dtype=accumulator_dtype)
    accumulator_dtype = None if accumulator_dtype is None else jax.dtypes.canonicalize_dtype(accumulator_dtype)
    if not guard:
        return _unguarded_trace(plain, decay, nesterov, accumulator_dtype, weight_decay)

    def init_fn(params):
        zero = lambda: jnp.zeros([], jnp.float32)  # noqa: E731 - a fresh buffer per field (donation)
        return TraceState(
            trace=plain.init(params).trace,
            slope=zero(),
            reach=zero(),
            noise=zero(),
            curvature=zero(),
            limit=jnp.full([], jnp.inf, jnp.float32),
        )

    def update_fn(updates, state, params=None, **extra_args):
        steps = required(extra_args, "optax_adascale.trace")
        updates = _with_weight_decay(updates, params, weight_decay)
        leaves, treedef = jax.tree.flatten(updates)
        olds = treedef.flatten_up_to(state.trace)
        gains = _per_leaf(steps.gain, updates)
        etas, old_etas = _per_leaf(steps.step, updates), _per_leaf(steps.last_step, updates)
        coefficients = [_trace_coefficients(decay, r) for r in gains]
        taken = steps.taken
        if steps.probe is not None:
            # The guard's measurements: the secant along the last step −η_old·v (``m`` its probe), from dot products
            # AdaScale took in its statistics' reduction on a sample of ḡ, m and θ (``BaseSteps.probe``): with
            # u = ḡ + λθ this update's input, d = u·m, e = ‖u‖², q = ‖m‖². What the next secant needs of the new trace
            # follows from them exactly (m' = k·m + w·u: u·m' = k·d + w·e, ‖m'‖² = k²q + 2kw·d + w²e). The sample of m
            # is read before the trace is written over in place: the write's select reads the probe (a predicate that
            # is always true), or XLA would copy the whole buffer first.
            probe, lam = steps.probe, jnp.asarray(weight_decay, jnp.float32)
            parts = []
            for i, ((keep, weight), eta, eta_old) in enumerate(zip(coefficients, etas, old_etas, strict=True)):
                gm, gg, gt, mm, mt, tt = (probe[i, j] for j in range(6))
                d, e, q = gm + lam * mt, gg + 2 * lam * gt + lam * lam * tt, mm
                slope_l = keep * d + weight * e  # u·m'
                sq_new = keep * keep * q + 2 * keep * weight * d + weight * weight * e  # ‖m'‖²
                along = weight * slope_l + keep * sq_new if nesterov else sq_new  # v·m'
                parts.append(jnp.stack([eta_old * d, eta * slope_l, eta * eta * along]))
            dots = jnp.sum(jnp.stack(parts), axis=0)
            read = jnp.all((probe == probe) | (probe != probe))  # always True, after the sample's reads
            taken = read if taken is None else taken & read
        new_m, out = [], []
        for g, m, (keep, weight) in zip(leaves, olds, coefficients, strict=True):
            m_new = _keeps_state.kept(taken, _mix(weight, g, keep, m), m)
            new_m.append(m_new)
            out.append(_mix(weight, g, keep, m_new) if nesterov else m_new)
        new_trace = optax.tree.cast(treedef.unflatten(new_m), accumulator_dtype)
        if steps.probe is None:  # run by hand (no AdaScale statistics): nothing measured
            return treedef.unflatten(out), state._replace(trace=new_trace)
        crossed, slope, reach = dots[0], dots[1], dots[2]
        change = state.slope - crossed - state.noise  # the gradient's change along the last step, its noise removed
        secant = change / jnp.where(state.reach > 0, state.reach, 1.0)
        resolved = jnp.abs(state.slope - crossed) > SECANT_RESOLUTION * (jnp.abs(state.slope) + jnp.abs(crossed))
        measured = (state.reach > 0) & jnp.isfinite(secant) & (secant > 0) & resolved
        curvature = jnp.where(measured, jnp.maximum(secant, CURVATURE_DECAY * state.curvature), state.curvature)
        # E[(ξ_t − ξ_{t+1})·m_t] = weight·E‖ξ_t‖²: the noise the next secant subtracts (the smallest leaf's share)
        step_weight = jnp.min(jnp.stack([e * w for e, (_, w) in zip(etas, coefficients, strict=True)]))
        noise = step_weight * jnp.asarray(steps.noise, jnp.float32)
        limit = _largest_gain(curvature, jnp.asarray(steps.next_learning_rate, jnp.float32), decay, nesterov)
        scalars = (slope, reach, noise, curvature, limit)
        old_scalars = (state.slope, state.reach, state.noise, state.curvature, state.limit)
        scalars = _keeps_state.kept(steps.taken, scalars, old_scalars)
        return treedef.unflatten(out), TraceState(new_trace, *scalars)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _unguarded_trace(
    plain, decay: float, nesterov: bool, accumulator_dtype: Any, weight_decay: float
) -> optax.GradientTransformationExtraArgs:
    """The τ clock's trace without the guard's measurements (state ``optax.TraceState``): 0.3's ``clock="tau"``."""

    def update_fn(updates, state, params=None, **extra_args):
        steps = required(extra_args, "optax_adascale.trace")
        updates = _with_weight_decay(updates, params, weight_decay)
        gain = jnp.asarray(steps.gain, jnp.float32)
        keep, weight = _trace_coefficients(decay, gain)
        new = lambda g, t: _mix(weight, g, keep, t)  # noqa: E731
        trace = _keeps_state.kept(steps.taken, jax.tree.map(new, updates, state.trace), state.trace)
        out = jax.tree.map(new, updates, trace) if nesterov else trace
        return out, optax.TraceState(trace=optax.tree.cast(trace, accumulator_dtype))

    return optax.GradientTransformationExtraArgs(plain.init, update_fn)


def _with_weight_decay(updates: Any, params: Any, weight_decay: Any) -> Any:
    """``g + λθ`` (PyTorch SGD's decay, added to the averaged gradient before the trace); ``g`` where ``λ`` is a
    concrete 0 (``optax.inject_hyperparams`` makes it an array: the same arithmetic either way)."""
    traced = _compat.is_tracer(weight_decay)
    if not traced and float(weight_decay) == 0.0:
        return updates
    if params is None:
        shown = "weight_decay (a hyperparameter of optax.inject_hyperparams)" if traced else "weight_decay > 0"
        raise ValueError(f"{shown} needs params: call update(grads, opt_state, params)")
    return jax.tree.map(lambda g, p: g + weight_decay * p, updates, params)


def _largest_gain(curvature: Array, lr: Array, decay: float, nesterov: bool) -> Array:
    """The gain ``r ≥ 1`` at which the τ clock's step along ``curvature`` reaches ``2·GUARD_MARGIN`` (``+inf`` where
    nothing is measured or ``lr = 0``).

    With ``k = β^r`` and ``w = (1 − β^r)/(1 − β)`` the update maps ``(x, m)`` along ``h`` linearly; Jury's conditions on
    that map give ``r·lr·h·w < 2(1 + k)`` for the heavy ball and ``r·lr·h·w < 2(1 + k)/(1 + 2k)`` for Nesterov (its
    output adds the fresh gradient once more). So the gain solves ``φ(r) = r·w·(1 + 2k·nesterov)/(1 + k) = B`` with
    ``B = 2·GUARD_MARGIN/(lr·h)``. ``log φ`` is increasing and concave in ``log r`` (slope 2 for small ``r``, 1 for
    large), so Newton's method from the lower bound ``max(√(B/c), B(1 − β)/c)`` (``c = 1 + nesterov``:
    ``φ ≤ c·min(r², r/(1 − β))``) climbs to the root monotonically: a fixed, unrolled handful of steps. ``β = 0``:
    ``φ(r) = r``.
    """
    budget = 2.0 * GUARD_MARGIN / (lr * curvature)
    active = (curvature > 0) & (lr > 0) & jnp.isfinite(budget) & (budget > 0)
    budget = jnp.where(active, budget, 1.0)
    traced = jnp.asarray(decay, jnp.float32)  # a hyperparameter of optax.inject_hyperparams: traced
    beta = jnp.where(traced > 0, traced, 0.5)  # β = 0 (φ(r) = r) below, away from log 0
    log_decay, nes = jnp.log(beta), float(nesterov)

    def log_phi(s):
        x = jnp.exp(s) * log_decay
        return s + jnp.log(-jnp.expm1(x)) - jnp.log1p(-beta) + jnp.log1p(2 * nes * jnp.exp(x)) - jnp.log1p(jnp.exp(x))

    target, c = jnp.log(budget), 1.0 + nes
    s = jnp.log(jnp.maximum(1.0, jnp.maximum(jnp.sqrt(budget / c), budget * (1.0 - beta) / c)))
    for _ in range(NEWTON_STEPS):
        value, slope = jax.value_and_grad(log_phi)(s)
        s = jnp.maximum(s - (value - target) / slope, 0.0)
    gain = jnp.where(log_phi(jnp.float32(0)) > target, 1.0, jnp.exp(s))
    gain = jnp.where(traced > 0, gain, jnp.maximum(budget, 1.0))
    return jnp.where(active, gain, jnp.inf)


def _trace_states(inner_state: Any) -> list[TraceState]:
    nodes = jax.tree.leaves(inner_state, is_leaf=lambda x: isinstance(x, TraceState))
    return [x for x in nodes if isinstance(x, TraceState)]


def has_guard(inner_state: Any) -> bool:
    """Whether ``inner`` holds a guarded τ-clock momentum (:class:`TraceState`): its gain is guarded."""
    return bool(_trace_states(inner_state))


def curvature(inner_state: Any) -> Array:
    """The largest curvature ``inner``'s τ-clock momenta hold (0 where none is measured, or none is there)."""
    states = _trace_states(inner_state)
    return jnp.max(jnp.stack([x.curvature for x in states])) if states else jnp.zeros([], jnp.float32)


def gain_limit(inner_state: Any) -> Array:
    """The largest gain this update may apply by the curvature ``inner``'s :func:`trace` measured along its last
    steps (``TraceState.limit``, the smallest where several traces are chained); ``+inf`` where ``inner`` holds no
    :class:`TraceState`."""
    limits = [x.limit for x in _trace_states(inner_state)]
    return jnp.min(jnp.stack(limits)) if limits else jnp.full([], jnp.inf, jnp.float32)


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
      >>> worth_four = optax_adascale.BaseSteps.by_hand(gain=4.0, learning_rate=1e-3)
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
        taken = steps.taken
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

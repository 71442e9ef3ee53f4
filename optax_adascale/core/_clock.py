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

from typing import Any

import jax
import jax.numpy as jnp
import optax

from optax_adascale.core import _keeps_state

Array = jax.Array

GAIN = "adascale_gain"
TAU = "adascale_tau"


def _powers(decay: Any, gain: Array) -> tuple[Array, Array]:
    """``(β^r, 1 − β^r)``, with ``1 − β^r`` from ``expm1`` (``β^r`` rounds to 1 for ``β`` near 1 and small ``r``)."""
    log = jnp.log(jnp.asarray(decay, jnp.float32))
    x = jnp.asarray(gain, jnp.float32) * log
    return jnp.exp(x), -jnp.expm1(x)


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


def trace(decay: float, nesterov: bool = False) -> optax.GradientTransformationExtraArgs:
    r"""``optax.trace`` on the τ clock: an update worth ``r`` base-batch steps decays the trace by ``decay^r``.

    ``m ← β^r m + (1 − β^r)/(1 − β) · g`` and the output is ``m`` (Nesterov: ``(1 − β^r)/(1 − β)·g + β^r m``). At
    ``r = 1``, and without AdaScale's gain, this is ``optax.trace(decay, nesterov)``; a constant gradient gives
    ``g/(1 − β)`` at any ``r``, so the step ``r·lr·m`` is ``r`` small-batch steps in the steady state, and the
    trace remembers ``1/(1 − β)`` base-batch steps whatever the scale (the module docstring says why).

    Args:
      decay: ``β ∈ [0, 1)``, PyTorch's momentum.
      nesterov: Nesterov momentum.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is ``optax.TraceState``.

    Examples:
      >>> import jax.numpy as jnp, optax_adascale
      >>> tx = optax_adascale.trace(0.9)
      >>> state = tx.init(jnp.zeros(1))
      >>> m, state = tx.update(jnp.ones(1), state, adascale_gain=2.0)  # worth two base steps
      >>> print(m.round(4))  # 1 + 0.9: the trace of two base steps of the same gradient
      [1.9]
    """
    plain = _keeps_state.trace(decay=decay, nesterov=nesterov)
    one_minus = 1.0 - decay

    def update_fn(updates, state, params=None, **extra_args):
        gain = extra_args.get(GAIN)
        if gain is None:
            return plain.update(updates, state, params, **extra_args)
        keep, fresh = _powers(decay, gain)
        weight = jnp.where(jnp.asarray(gain) == 1, jnp.float32(1), fresh / jnp.float32(one_minus))
        keep = jnp.where(jnp.asarray(gain) == 1, jnp.float32(decay), keep)

        def new(g, t):
            return _mix(weight, g, keep, t)

        new_trace = _keeps_state.kept(
            extra_args.get(_keeps_state.TAKEN), jax.tree.map(new, updates, state.trace), state.trace
        )
        out = jax.tree.map(new, updates, new_trace) if nesterov else new_trace
        return out, optax.TraceState(trace=new_trace)

    return optax.GradientTransformationExtraArgs(plain.init, update_fn)


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

    An update worth ``r`` base-batch steps averages with ``β₁^r`` and ``β₂^r``, debiases by ``1 − β^τ`` (``τ``
    after the update), and returns ``r^{−½}·m̂/(√v̂ + ε)``: under AdaScale's gain the Adam step is ``√r·lr``
    (the module docstring says why). Without AdaScale's gain this is ``optax.scale_by_adam`` exactly.

    Args:
      b1: see ``optax.scale_by_adam``.
      b2: see ``optax.scale_by_adam``.
      eps: see ``optax.scale_by_adam``.
      eps_root: see ``optax.scale_by_adam``.
      mu_dtype: see ``optax.scale_by_adam``.
      nesterov: see ``optax.scale_by_adam``.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is ``optax.ScaleByAdamState`` (``count`` counts
      updates; the debiasing reads ``τ`` from AdaScale).

    Examples:
      >>> import jax.numpy as jnp, optax_adascale
      >>> tx = optax_adascale.scale_by_adam()
      >>> state = tx.init(jnp.zeros(1))
      >>> u, state = tx.update(jnp.ones(1), state, adascale_gain=4.0, adascale_tau=0.0)
      >>> print(u.round(4))  # a constant gradient: Adam's direction 1, times 4^(-1/2)
      [0.5]
    """
    plain = _keeps_state.scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nesterov)

    def update_fn(updates, state, params=None, **extra_args):
        gain = extra_args.get(GAIN)
        if gain is None:
            return plain.update(updates, state, params, **extra_args)
        gain = jnp.asarray(gain, jnp.float32)
        tau = jnp.asarray(extra_args.get(TAU, 0.0), jnp.float32) + gain
        keep1, fresh1 = _powers(b1, gain)
        keep2, fresh2 = _powers(b2, gain)
        taken = extra_args.get(_keeps_state.TAKEN)
        mu = jax.tree.map(lambda g, m: _mix(fresh1, g, keep1, m), updates, state.mu)
        mu = _keeps_state.kept(taken, mu, state.mu)
        nu = jax.tree.map(lambda g, v: _mix(fresh2, jnp.square(jnp.abs(g)), keep2, v), updates, state.nu)
        nu = _keeps_state.kept(taken, nu, state.nu)
        debias1 = -jnp.expm1(tau * jnp.log(jnp.float32(b1)))
        debias2 = -jnp.expm1(tau * jnp.log(jnp.float32(b2)))
        if nesterov:
            after = -jnp.expm1((tau + gain) * jnp.log(jnp.float32(b1)))
            mu_hat = jax.tree.map(lambda m, g: _mix(keep1 / after, m, fresh1 / debias1, g, _wide(m, g)), mu, updates)
        else:
            mu_hat = jax.tree.map(lambda m: m.astype(_wide(m)) / debias1, mu)
        scale = jax.lax.rsqrt(gain)
        out = jax.tree.map(
            lambda m, v, g: (scale * m / (jnp.sqrt(v.astype(_wide(v)) / debias2 + eps_root) + eps)).astype(g.dtype),
            mu_hat,
            nu,
            updates,
        )
        new_state = optax.ScaleByAdamState(
            count=_keeps_state.kept(taken, optax.safe_increment(state.count), state.count),
            mu=optax.tree.cast(mu, mu_dtype) if mu_dtype is not None else optax.tree.cast_like(mu, state.mu),
            nu=optax.tree.cast_like(nu, state.nu),
        )
        return out, new_state

    return optax.GradientTransformationExtraArgs(plain.init, update_fn)

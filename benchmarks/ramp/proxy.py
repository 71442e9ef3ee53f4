"""Check the proxy: is the controller's noise scale ``B = σ̄²/μ̄²`` the critical batch measured by branching?

At checkpoints of the baseline run (``fixed-min``, seed 0) at ``τ = c·T``, the state is branched and trained with a
plain optimizer (AdaScale's own ``inner`` and its state from the checkpoint, then ``−m·lr(τ_c)``: no gain) at
``S ∈ {1, 2, 4, …, 32}`` base batches per step for at most ``H`` steps, at two learning-rate multipliers ``m``
(SGD: ``√S`` and ``S``; AdamW: ``S^¼`` and ``√S``; ``m = 1`` at ``S = 1``), keeping the better. The target is
the validation loss the ``S = 1`` branch reaches after ``H`` steps. ``steps(S)`` is the first evaluation step at
which the branch's validation loss is at or below it.

**Critical batch (measured).** McCandlish et al.'s model ``steps(S) = S_min·(1 + B_crit/S)`` is fitted by least
squares in ``1/S`` over the ``S`` that reached the target: ``B_crit`` = slope / intercept, the ``S`` at which
the fitted steps are twice their minimum ``S_min`` (the large-batch limit). It is compared with the controller's
``B`` (``metrics(opt_state)["noise_scale"]``) at the same checkpoint.
"""

from __future__ import annotations

import functools
import math
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

import optax_adascale
from benchmarks.ramp import ramp
from benchmarks.ramp.tasks import REPLICAS, Task

CHECKPOINTS = (0.1, 0.3, 0.6)
SCALES = (1, 2, 4, 8, 16, 32)
HORIZON = 64
EVAL_STEPS = tuple(int(s) for s in np.unique(np.round(np.geomspace(1, HORIZON, 28))))


def multipliers(task: Task, scale: int) -> tuple[float, ...]:
    if scale == 1:
        return (1.0,)
    return (scale**0.25, scale**0.5) if task.optimizer == "adamw" else (scale**0.5, float(scale))


def inner_of(task: Task) -> optax.GradientTransformation:
    """The direction AdaScale wraps (``adascale_sgd``'s / ``adascale_adamw``'s ``inner``), state for state."""
    if task.optimizer == "adamw":
        return optax.chain(
            optax.scale_by_adam(b1=0.9, b2=0.99, eps=1e-8, eps_root=0.0), optax.add_decayed_weights(task.weight_decay)
        )
    return optax.chain(optax.add_decayed_weights(task.weight_decay), optax.trace(decay=0.9))


@functools.cache
def _to_checkpoint(task: Task):
    """A jitted ``(params, key, target, data) -> (params, opt_state, calls)``: the baseline to ``τ ≥ target``."""

    def run(params, key, target, data):
        tx = ramp.build(task, "fixed-min")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt_state = tx.init(params)

        def replica(params, opt_state, batch):
            return tx.update(jax.grad(task.loss)(params, batch), opt_state, params)

        step = jax.vmap(replica, in_axes=(None, None, 0), out_axes=(None, None), axis_name=ramp.AXIS)

        def body(c):
            params, opt_state, call = c
            updates, opt_state = step(params, opt_state, task.sample(data, jax.random.fold_in(key, call)))
            return optax.apply_updates(params, updates), opt_state, call + 1

        more = lambda c: optax_adascale.get_adascale_state(c[1]).tau_whole < target  # noqa: E731
        return lax.while_loop(more, body, (params, opt_state, jnp.int32(0)))

    return jax.jit(run)


def batch_of(task: Task, data, key, scale: int):
    """``scale`` base batches (drawn as ``⌈scale/R⌉`` calls of ``task.sample``), leading axis examples."""
    calls = -(-scale // REPLICAS)
    drawn = jax.vmap(lambda k: task.sample(data, k))(jax.random.split(key, calls))
    flat = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[3:]), drawn)
    return jax.tree.map(lambda x: x[: scale * task.batch_size], flat)


def _as_optax(inner_state):
    """The τ clock's states as optax's (the momentum, Adam's moments and count): the proxy's small steps are optax's."""
    from optax_adascale.core import _clock

    def convert(x):
        if isinstance(x, _clock.TraceState):
            return optax.TraceState(trace=x.trace)
        if isinstance(x, _clock.ScaleByAdamState):
            return optax.ScaleByAdamState(count=x.count, mu=x.mu, nu=x.nu)
        return x

    out = jax.tree.map(
        convert, inner_state, is_leaf=lambda x: isinstance(x, (_clock.TraceState, _clock.ScaleByAdamState))
    )
    # SGD's τ clock adds the weight decay inside its trace (0.5): optax's chain has it as a stage of its own
    if isinstance(out, tuple) and len(out) == 1 and isinstance(out[0], optax.TraceState):
        out = (optax.EmptyState(), out[0])
    return out


@functools.cache
def _branch(task: Task, scale: int):
    """A jitted ``(params, inner_state, lr, key, target, data) -> steps`` (``HORIZON + 1`` if never reached)."""
    evals = jnp.asarray(EVAL_STEPS, jnp.int32)

    def run(params, inner_state, lr, key, target, data):
        tx = optax.chain(inner_of(task), optax.scale(-1.0))

        def body(c):
            params, state, step, reached = c
            grads = jax.grad(task.loss)(params, batch_of(task, data, jax.random.fold_in(key, step), scale))
            updates, state = tx.update(grads, state, params)
            params = optax.apply_updates(params, jax.tree.map(lambda u: lr * u, updates))
            step = step + 1
            check = jnp.any(evals == step)
            loss = lax.cond(check, lambda p: task.evaluate(p, data), lambda p: jnp.float32(jnp.inf), params)
            reached = jnp.where((reached > HORIZON) & (loss <= target), step, reached)
            return params, state, step, reached

        state = (_as_optax(inner_state), optax.EmptyState())
        more = lambda c: (c[2] < HORIZON) & (c[3] > HORIZON)  # noqa: E731
        params, _, _, reached = lax.while_loop(more, body, (params, state, jnp.int32(0), jnp.int32(HORIZON + 1)))
        return reached, task.evaluate(params, data)

    return jax.jit(run)


def fit_critical(scales, steps) -> tuple[float, float]:
    """``(B_crit, S_min)`` of ``steps = S_min·(1 + B_crit/S)`` by least squares in ``1/S``; NaN if ill-posed."""
    s, n = np.asarray(scales, np.float64), np.asarray(steps, np.float64)
    ok = np.isfinite(n)
    if ok.sum() < 3:
        return math.nan, math.nan
    slope, intercept = np.polyfit(1.0 / s[ok], n[ok], 1)
    if intercept <= 0 or slope <= 0:
        return math.nan, float(intercept)
    return float(slope / intercept), float(intercept)


def run_task(task: Task, *, checkpoints=CHECKPOINTS, scales=SCALES, seed: int = 0, log=print) -> dict:
    """The proxy check on one task: ``{"checkpoints": [...]}`` with the measured and the estimated noise scale."""
    start = time.perf_counter()
    k_init, k_data = jax.random.split(jax.random.key(seed))
    params0 = task.init(k_init)
    out = []
    for c in checkpoints:
        tau_c = round(c * task.total_steps)
        params, opt_state, _ = _to_checkpoint(task)(params0, k_data, jnp.int32(tau_c), task.data)
        estimate = float(optax_adascale.metrics(opt_state)["noise_scale"])
        lr_c = float(task.schedule()(tau_c))
        inner_state = optax_adascale.get_adascale_state(opt_state).inner_state
        branch_key = jax.random.fold_in(jax.random.key(seed + 1000), tau_c)
        base_loss = float(task.evaluate(params, task.data))
        _, target = _branch(task, 1)(
            params, inner_state, jnp.float32(lr_c), branch_key, jnp.float32(-jnp.inf), task.data
        )
        target = float(target)
        steps = {}
        for scale in scales:
            best = math.inf
            for m in multipliers(task, scale):
                reached, _ = _branch(task, scale)(
                    params, inner_state, jnp.float32(m * lr_c), branch_key, jnp.float32(target), task.data
                )
                best = min(best, int(reached) if int(reached) <= HORIZON else math.inf)
            steps[scale] = best
        measured, s_min = fit_critical(scales, [steps[s] if math.isfinite(steps[s]) else math.nan for s in scales])
        if target >= base_loss:  # the S = 1 branch made no progress in H steps: nothing to measure
            measured = math.nan
        out.append(
            {
                "tau": tau_c,
                "loss": base_loss,
                "target": target,
                "steps": {str(s): (None if not math.isfinite(v) else v) for s, v in steps.items()},
                "b_crit": measured,
                "s_min": s_min,
                "b_noise": estimate,
            }
        )
        log(
            f"  proxy {task.name:9s} τ={tau_c:5d}  steps={[steps[s] for s in scales]}  B_crit={measured:.2f}  "
            f"B_noise={estimate:.2f}",
            flush=True,
        )
    return {"task": task.name, "seed": seed, "checkpoints": out, "wall_s": time.perf_counter() - start}

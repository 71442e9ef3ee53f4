"""One compiled program per (task, method, S): every (learning rate, seed) of the cell runs as one vmapped batch.

A run trains with AdaScale over ``S`` replicas (a vmap axis: replica ``i`` takes base batch ``i``, so an update
averages ``n = S`` samples of one base batch each) until ``τ ≥ T``, and evaluates the task's loss at ``τ = kT/K``.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

import optax_adascale as oa
from optax_adascale.core._keeps_state import keeps_state

AXIS = "replicas"
NUM_EVALS = 10


METHODS = {
    "paper": "the paper's and FairScale's placement: the momentum decays per update, the gain multiplies it "
    '(`clock="update"`; AdamW: the gain multiplies the Adam step)',
    "tau": 'the τ clock without its stability guard (0.3\'s `clock="tau"`): the momentum decays by β^r per update '
    "worth r base steps; AdamW: β₁^r, β₂^r and the step √r·lr",
    "guarded": 'the τ clock with its stability guard (0.4\'s default, `clock="tau"`): the gain capped where the '
    "step would pass half the stability limit along the curvature the momentum measured (SGD only; AdamW's τ clock "
    "has no guard, so its `tau` cells are its default)",
    "gain_before": "the gain before the buffer: `chain(adascale(identity), trace(β))`, each gradient enters at its own "
    "gain (SGD only)",
    "no_momentum": "plain SGD at the same effective step, lr/(1 − β) (SGD only)",
}


def make_tx(task, method: str, schedule):
    """The optimizer a method's name spells, for the task's optimizer."""
    wd, beta = task.weight_decay, task.momentum
    if task.optimizer == "adamw":
        if method not in ("paper", "tau", "guarded"):
            raise ValueError(f"method {method!r} is for SGD tasks; {task.name} trains with AdamW")
        clock = "update" if method == "paper" else "tau"  # AdamW's τ clock has no guard: `guarded` is `tau`
        return oa.adascale_adamw(schedule, weight_decay=wd, axis_name=AXIS, clock=clock)
    if method == "paper":
        return oa.adascale_sgd(schedule, momentum=beta, weight_decay=wd, axis_name=AXIS, clock="update")
    if method == "guarded":
        return oa.adascale_sgd(schedule, momentum=beta, weight_decay=wd, axis_name=AXIS, clock="tau")
    if method == "tau":  # the τ clock without the guard: the alias's inner with a trace that measures nothing
        inner = optax.chain(optax.add_decayed_weights(wd), oa.trace(beta, guard=False))
        return oa.adascale(keeps_state(inner), schedule, axis_name=AXIS)
    if method == "gain_before":
        return optax.chain(oa.adascale(optax.add_decayed_weights(wd), schedule, axis_name=AXIS), optax.trace(beta))
    if method == "no_momentum":
        return oa.adascale_sgd(lambda t: schedule(t) / (1 - beta), weight_decay=wd, axis_name=AXIS)
    raise ValueError(f"unknown method {method!r}; expected one of {sorted(METHODS)}")


@functools.cache
def compiled(task, method: str, scale: int, num_evals: int = NUM_EVALS):
    """``(keys, lr multipliers) -> (losses at the checkpoints, iterations, τ, gain sums)``, vmapped, jitted. The
    sums over the updates: the applied gain, the estimated gain (before the stability guard), the updates the guard
    held below 0.99 of it, and those updates' ratio applied/estimated."""
    T = task.total_steps
    max_iters = T + 1

    def run(key, mult):
        k_init, k_data = jax.random.split(key)
        tx = make_tx(task, method, task.schedule(mult * task.learning_rate))
        params = task.init(k_init)
        state = tx.init(params)

        def replica(p, s, batch):
            return tx.update(jax.grad(task.loss)(p, batch), s, p)

        step = jax.vmap(replica, in_axes=(None, None, 0), out_axes=None, axis_name=AXIS)

        def body(carry):
            p, s, it, gains = carry
            updates, s = step(p, s, task.sample(jax.random.fold_in(k_data, it), scale))
            m = oa.metrics(s)
            held = m["gain"] < 0.99 * m["estimated_gain"]
            ratio = jnp.where(held, m["gain"] / m["estimated_gain"], 0.0)
            sums = jnp.stack([m["gain"], m["estimated_gain"], held.astype(jnp.float32), ratio])
            return optax.apply_updates(p, updates), s, it + 1, gains + sums

        def segment(carry, target):
            carry = lax.while_loop(
                lambda c: (oa.get_adascale_state(c[1]).tau_whole < target) & (c[2] < max_iters), body, carry
            )
            return carry, (task.evaluate(carry[0]), carry[2])

        targets = jnp.asarray([round(T * (k + 1) / num_evals) for k in range(num_evals)], jnp.int32)
        start = (params, state, jnp.int32(0), jnp.zeros(4, jnp.float32))
        (p, s, it, gains), (losses, its) = lax.scan(segment, start, targets)
        return losses, its, oa.scale_invariant_steps(s), gains, it

    return jax.jit(jax.vmap(run))


def run_cell(task, method: str, scale: int, runs):
    """The ``(learning-rate multiplier, seed)`` runs of one cell as one batched program; a list of records."""
    keys = jnp.stack([jax.random.key(s) for _, s in runs])
    ms = jnp.asarray([m for m, _ in runs], jnp.float32)
    start = time.perf_counter()
    losses, its, tau, gains, count = jax.device_get(compiled(task, method, scale)(keys, ms))
    wall = time.perf_counter() - start
    out = []
    for i, (m, s) in enumerate(runs):
        out.append(
            {
                "task": task.name,
                "method": method,
                "scale": scale,
                "lr_mult": m,
                "seed": s,
                "config": task.config(),
                "final_loss": float(losses[i, -1]),
                "losses": [float(x) for x in losses[i]],
                "iterations": int(its[i, -1]),
                "checkpoint_iterations": [int(x) for x in its[i]],
                "examples": int(its[i, -1]) * scale * task.batch_size,
                "tau": float(tau[i]),
                "mean_gain": float(gains[i, 0] / max(count[i], 1)),
                # the stability guard: the estimator's gain, and how often and how far the applied gain fell below it
                "mean_estimated_gain": float(gains[i, 1] / max(count[i], 1)),
                "held_share": float(gains[i, 2] / max(count[i], 1)),
                "held_ratio": float(gains[i, 3] / gains[i, 2]) if gains[i, 2] > 0 else float("nan"),
                "wall_s": wall / len(runs),
            }
        )
    return out


@functools.cache
def compiled_fixed(task, scale: int, updates: int):
    """Plain ``optax.adamw`` (or SGD with momentum) at a fixed batch of ``S`` base batches for ``updates`` updates,
    the warm-up + cosine schedule stretched over them (the same peak): ``(keys, multipliers) -> final loss``."""

    def run(key, mult):
        k_init, k_data = jax.random.split(key)
        unit = optax.warmup_cosine_decay_schedule(0.0, 1.0, max(1, round(task.warmup_fraction * updates)), updates, 0.0)
        schedule = lambda t: mult * task.learning_rate * unit(t)  # noqa: E731 - a traced peak
        if task.optimizer == "adamw":
            tx = optax.adamw(schedule, weight_decay=task.weight_decay)
        else:
            tx = optax.chain(optax.add_decayed_weights(task.weight_decay), optax.sgd(schedule, task.momentum))
        params = task.init(k_init)

        def body(carry, i):
            p, s = carry
            batch = task.sample(jax.random.fold_in(k_data, i), scale)
            grads = jax.tree.map(lambda g: g.mean(0), jax.vmap(jax.grad(task.loss), in_axes=(None, 0))(p, batch))
            u, s = tx.update(grads, s, p)
            return (optax.apply_updates(p, u), s), None

        (p, _), _ = lax.scan(body, (params, tx.init(params)), jnp.arange(updates))
        return task.evaluate(p)

    return jax.jit(jax.vmap(run))


def run_fixed(task, scale: int, updates: int, mults, seeds):
    """Every (multiplier, seed) of a fixed-batch run; a list of records."""
    runs = [(m, s) for m in mults for s in seeds]
    keys = jnp.stack([jax.random.key(s) for _, s in runs])
    start = time.perf_counter()
    losses = jax.device_get(compiled_fixed(task, scale, updates)(keys, jnp.asarray([m for m, _ in runs], jnp.float32)))
    wall = time.perf_counter() - start
    return [
        {
            "task": task.name,
            "method": f"fixed-{task.optimizer}",
            "scale": scale,
            "lr_mult": m,
            "seed": s,
            "config": task.config(),
            "final_loss": float(losses[i]),
            "iterations": updates,
            "examples": updates * scale * task.batch_size,
            "wall_s": wall / len(runs),
        }
        for i, (m, s) in enumerate(runs)
    ]


@functools.cache
def compiled_tracking(task, method: str, replicas: int, switch_microbatches: int):
    """The quadratic (known ``H`` and ``Σ``) with every update logged: the estimated and the true gain.

    ``replicas`` vmap replicas feed one base batch each per call; with ``switch_microbatches = k > 1`` the update
    takes 1 micro-batch per replica until ``τ ≥ T/2`` and ``k`` after (a ``BatchRamp`` whose policy is that switch),
    so ``S`` jumps from ``replicas`` to ``k·replicas`` in the middle of the run. ``(keys) -> logs``.
    """
    h, noise = task.hessian
    T = task.total_steps
    sigma2 = jnp.sum(noise) / task.batch_size
    ramp = None
    if switch_microbatches > 1:
        ramp = oa.BatchRamp(
            1,
            switch_microbatches,
            ladder=(1, switch_microbatches),
            policy=lambda inp: jnp.where(inp.tau >= T / 2, switch_microbatches, 1),
            patience=1,
        )
    max_calls = T * (switch_microbatches if ramp else 1) + 1

    def run(key):
        k_init, k_data = jax.random.split(key)
        schedule = task.schedule(task.learning_rate)
        clock = "update" if method == "paper" else "tau"
        tx = oa.adascale_sgd(
            schedule,
            momentum=task.momentum,
            axis_name=AXIS,
            clock=clock,
            accumulation_steps=ramp if ramp is not None else 1,
        )
        params = task.init(k_init)
        state = tx.init(params)
        if ramp is not None:
            state = oa.replicate_buffers(state, replicas)
            axes = oa.state_axes(state)
        else:
            axes = None

        def replica(p, s, batch):
            return tx.update(jax.grad(task.loss)(p, batch), s, p)

        step = jax.vmap(replica, in_axes=(None, axes, 0), out_axes=(None, axes), axis_name=AXIS)

        def body(carry, i):
            p, s = carry
            before = oa.get_adascale_state(s).count
            u, s = step(p, s, task.sample(jax.random.fold_in(k_data, i), replicas))
            st = oa.get_adascale_state(s)
            m = oa.metrics(s)
            mu2 = jnp.sum((h * p) ** 2)  # the true μ² where the update's gradients were taken
            S = m["scale"]
            true_gain = (sigma2 + mu2) / (sigma2 / jnp.maximum(S, 1) + mu2)
            new = st.count != before
            row = {
                "update": new,
                "tau": m["scale_invariant_steps"],
                "scale": S,
                "gain": m["gain"],
                "true_gain": true_gain,
                "grad_var": m["grad_var"],
                "grad_sqr": m["grad_sqr"],
                "mu2": mu2,
            }
            return (optax.apply_updates(p, u), s), row

        _, rows = lax.scan(body, (params, state), jnp.arange(max_calls))
        return rows

    return jax.jit(jax.vmap(run))


def run_tracking(task, method: str, replicas: int, switch_microbatches: int, seeds) -> list[dict]:
    """Per seed: the logged updates (calls that applied one) up to ``τ ≥ T``, as lists."""
    rows = jax.device_get(
        compiled_tracking(task, method, replicas, switch_microbatches)(jnp.stack([jax.random.key(s) for s in seeds]))
    )
    out = []
    for i, seed in enumerate(seeds):
        keep = np.asarray(rows["update"][i]) & (np.asarray(rows["tau"][i]) <= task.total_steps + 1e3)
        first_done = np.argmax(np.asarray(rows["tau"][i]) >= task.total_steps)
        keep[first_done + 1 :] = False
        out.append({k: np.asarray(v[i])[keep].tolist() for k, v in rows.items() if k != "update"} | {"seed": seed})
    return out

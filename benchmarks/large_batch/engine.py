"""Fixed-rule runs at ``S`` times the batch, for ``⌈T/S⌉`` iterations or stretched to AdaScale's count.

Shared by this study (the scaling benchmark's SGD tasks) and the Adam study's fair comparison
(``python -m benchmarks.adam --fair``). A :class:`Problem` adapts a task of either study; a method is
an optimizer family (``optax.sgd``/``adamw``/``lamb``/``lars``) with a scaling rule, run for
``N = ⌈T/S⌉`` iterations or ``N`` = AdaScale's iterations at the same ``S`` and seed (``+``, the
stretched rows: the same examples as AdaScale). Every rule is ``c(t)·lr(t·T/N)`` (:func:`rule_schedule`):
the base schedule run at ``T/N`` base steps per iteration, times a factor ``c``:

* ``id``: ``c = 1``;  ``sqrt``: ``c = √S``;
* ``LSW``: ``c`` ramps ``1 → S`` over the first 5.5 % of ``N`` (``scaling_rules.stretched_linear_warmup``);
* ``sqrtW``: ``c`` ramps ``1 → √S`` over the first 5.5 % of ``N`` (square root with warm-up, LAMB's rule).

A whole run is one jitted program (a ``lax.scan`` over evaluation checkpoints of ``lax.while_loop``
steps) with the rule, ``N``, the peak learning rate and the data as arguments, so one compilation
serves every rule and learning rate of a family at one ``S``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from optax_adascale import scaling_rules

AXIS = "replicas"
RULES = ("id", "sqrt", "LSW", "sqrtW")


@dataclasses.dataclass(frozen=True, eq=False)
class Problem:
    """A task seen by the fixed-rule runs. Hashed by identity (compiled runs are cached per problem).

    ``unit_schedule`` is the base schedule at peak learning rate 1 (every base schedule here is linear in
    its learning rate); ``make_tx(family, schedule)`` builds the optimizer of a family; ``keys(seed)`` gives
    ``(init key, data key)`` exactly as the study's AdaScale runs split them, so a fixed-rule run starts
    from AdaScale's initialisation and sees its stream of batches.
    """

    name: str
    total_steps: int
    unit_schedule: optax.Schedule
    init: Callable[[jax.Array], Any]
    loss: Callable[[Any, Any], jax.Array]
    sample: Callable[[Any, jax.Array, int], Any]
    evaluate: Callable[[Any, Any], dict]
    data: Any
    make_tx: Callable[[str, optax.Schedule], optax.GradientTransformation]
    keys: Callable[[int], tuple[jax.Array, jax.Array]]
    settings: dict
    metric: str = "metric"
    higher_is_better: bool = True
    tolerance: float = 0.0
    chance_loss: float = float("inf")
    title: str = ""

    def config(self) -> dict:
        """Everything that determines a run's result (stored with cached cells)."""
        return self.settings


def rule_schedule(unit: optax.Schedule, rule, scale, total_steps, num_iterations, peak, *, warmup_fraction=None):
    """``t -> peak·c(t)·unit(t·T/N)``; ``rule`` an index into :data:`RULES` (may be traced, as may ``N``, ``peak``).

    With ``rule = "LSW"`` this is ``scaling_rules.stretched_linear_warmup`` (checked in the tests).
    """
    wf = scaling_rules.WARMUP_FRACTION if warmup_fraction is None else warmup_fraction
    s = jnp.float32(scale)
    n = jnp.asarray(num_iterations, jnp.float32)

    def ramp(c, t):  # 1/c → 1 over the first wf·N iterations, then 1 (scaling_rules' warm-up factor)
        w = jnp.float32(wf) * n
        return jnp.where(t < w, 1.0 / c + (1.0 - 1.0 / c) * jnp.minimum(t / jnp.maximum(w, 1e-30), 1.0), 1.0)

    def schedule(count):
        t = jnp.asarray(count, jnp.float32)
        base = jnp.asarray(unit(t * (jnp.float32(total_steps) / n)), jnp.float32)
        r = jnp.sqrt(s)
        c = jnp.where(rule == 0, 1.0, jnp.where(rule == 1, r, jnp.where(rule == 2, s * ramp(s, t), r * ramp(r, t))))
        return jnp.asarray(peak, jnp.float32) * c * base

    return schedule


@functools.cache
def compiled_run(problem: Problem, family: str, scale: int, num_evals: int):
    """``(params, key, targets, rule, num_iterations, peak, data) -> (iterations, evals, lr at each target)``."""
    max_iterations = problem.total_steps  # stretched runs never exceed T (AdaScale's gain is ≥ 1)

    def run(params, key, targets, rule, num_iterations, peak, data):
        lr = rule_schedule(problem.unit_schedule, rule, scale, problem.total_steps, num_iterations, peak)
        tx = problem.make_tx(family, lr)
        opt_state = tx.init(params)

        def replica_step(params, opt_state, batch):
            loss, grads = jax.value_and_grad(problem.loss)(params, batch)
            grads = lax.pmean(grads, AXIS)  # plain data parallelism: the mean gradient of S·B examples
            updates, opt_state = tx.update(grads, opt_state, params)
            return lax.pmean(loss, AXIS), updates, opt_state

        step = jax.vmap(replica_step, in_axes=(None, None, 0), out_axes=None, axis_name=AXIS)

        def body(carry):
            params, opt_state, it = carry
            batch = problem.sample(data, jax.random.fold_in(key, it), scale)
            _, updates, opt_state = step(params, opt_state, batch)
            return optax.apply_updates(params, updates), opt_state, it + 1

        def segment(carry, target):
            carry = lax.while_loop(lambda c: (c[2] < target) & (c[2] < max_iterations), body, carry)
            params, _, it = carry
            return carry, {"it": it, "lr": lr(it - 1), **problem.evaluate(params, data)}

        (_, _, it), evals = lax.scan(segment, (params, opt_state, jnp.int32(0)), targets)
        return it, evals

    return jax.jit(run)


def run_cell(
    problem: Problem, family: str, rule: str, scale: int, seed: int, num_iterations: int, peak: float, *, num_evals: int
) -> dict:
    """Train one fixed-rule cell for ``num_iterations`` and return a JSON-able record."""
    if rule not in RULES:
        raise ValueError(f"unknown rule={rule!r}; expected one of {RULES}")
    if not 1 <= num_iterations <= problem.total_steps:
        raise ValueError(f"num_iterations={num_iterations!r} must lie in [1, T={problem.total_steps}]")
    start = time.perf_counter()
    k_init, k_data = problem.keys(seed)
    params = problem.init(k_init)
    targets = np.asarray([math.ceil(k * num_iterations / num_evals) for k in range(1, num_evals + 1)], np.int32)
    first = jax.jit(problem.evaluate)(params, problem.data)
    fn = compiled_run(problem, family, scale, num_evals)
    it, ev = fn(params, k_data, targets, RULES.index(rule), num_iterations, peak, problem.data)
    ev = jax.device_get(ev)
    steps = problem.total_steps / num_iterations  # base-batch steps per iteration (τ of a fixed rule)
    evals = [{"tau": 0.0, "it": 0, "lr": float("nan"), **{k: float(v) for k, v in first.items()}}]
    evals += [{"tau": float(ev["it"][j]) * steps, **{k: float(ev[k][j]) for k in ev}} for j in range(num_evals)]
    last = evals[-1]
    return {
        "task": problem.name,
        "family": family,
        "rule": rule,
        "scale": scale,
        "seed": seed,
        "peak_lr": peak,
        "config": problem.config(),
        "iterations": int(it),
        "tau": last["tau"],
        "final": {k: last[k] for k in ("metric", "val_loss", "train_loss")},
        "curve": {k: [e[k] for e in evals] for k in evals[0]},
        "wall_s": time.perf_counter() - start,
    }

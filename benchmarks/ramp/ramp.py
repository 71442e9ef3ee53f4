"""The batch follows the noise: AdaScale with a batch that grows during training, against fixed batches and ramps.

Three tasks (``tasks.py``: a byte-level LM with AdamW and with SGD, an MNIST-1D CNN with SGD), each with one base
batch, one base-batch budget ``T`` and one warm-up + cosine schedule on ``τ``. Two replicas are a ``jax.vmap``
axis; each call feeds one base batch per replica, and an update takes ``k`` calls, so ``S = 2k``. Every arm runs
AdaScale to ``τ ≥ T`` on the same stream of micro-batches (call ``i`` of a seed feeds the same examples in every
arm); only how many calls make an update differs:

* ``fixed-min`` (``k = 1``, ``S = 2``) and ``fixed-max`` (``k = 16``, ``S = 32``): ``accumulation_steps=k``;
* ``linear-f``: MaxText's rule, ``k`` from 1 to 16 in unit increments, linear in the examples seen, reaching 16
  after ``f·T`` base batches (``f`` ∈ {0.25, 0.5, 1}): ``BatchRamp(1, 16, ladder=1…16, policy=…)``;
* ``seesaw``: ``k`` doubles each time the schedule's ``lr(τ)`` halves (Seesaw, 2025), up to 16;
* ``measured-e``: ``BatchRamp(1, 16, efficiency=e)`` (powers of two, hysteresis 2, patience 64 samples), ``e`` ∈
  {0.5, 0.6, 0.7, 0.9}; ``e = 0.5`` is the critical batch (McCandlish et al. 2018).

A run is one jitted program (``lax.scan`` over evaluation points in ``τ``, each a ``lax.while_loop`` of calls);
the ramp arms of a family share one compiled program (the arm is a traced argument: ``k_t`` is a value, not a
shape). Cells are cached as JSON in ``benchmarks/ramp/cells/`` (one per task × arm × seed); ``--smoke`` runs a
tiny grid.
"""

from __future__ import annotations

import functools
import json
import math
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

import optax_adascale
from benchmarks.harness import stats
from benchmarks.ramp.tasks import REPLICAS, Task

AXIS = "replicas"
K_MIN, K_MAX = 1, 16
LINEAR = (0.25, 0.5, 1.0)
EFFICIENCIES = (0.5, 0.6, 0.7, 0.9)
ARMS = (
    "fixed-min",
    "fixed-max",
    *(f"linear-{f:g}" for f in LINEAR),
    "seesaw",
    *(f"measured-{e:g}" for e in EFFICIENCIES),
)
NUM_EVALS = 40
LOG_POINTS = 300
MAX_SKIP_STREAK = 50
LOG_KEYS = ("scale", "gain", "noise_scale", "lr", "tau", "calls")


def family(arm: str) -> str:
    """The compiled program an arm runs in."""
    if arm.startswith("fixed"):
        return arm
    return "measured" if arm.startswith("measured") else "schedule"


def arm_parameter(arm: str) -> float:
    """The traced number that picks an arm inside its family's program."""
    if arm.startswith("linear-"):
        return float(arm.split("-")[1])
    if arm == "seesaw":
        return 0.0
    if arm.startswith("measured-"):
        return float(arm.split("-")[1])
    return 0.0


def scheduled_microbatches(task: Task, inputs: optax_adascale.RampInputs, parameter) -> jax.Array:
    """The fixed ramps' ``k``: linear in the examples seen (``parameter = f > 0``) or Seesaw's (``parameter = 0``)."""
    seen = inputs.microbatches_seen.astype(jnp.float32) * REPLICAS  # base batches fed
    length = jnp.maximum(parameter, 1e-6) * task.total_steps
    linear = K_MIN + (K_MAX - K_MIN) * jnp.minimum(seen / length, 1.0)
    schedule = task.schedule()
    peak = schedule(round(task.warmup_fraction * task.total_steps))
    lr = schedule(inputs.tau.astype(jnp.int32))
    warm = inputs.tau >= task.warmup_fraction * task.total_steps
    halvings = jnp.where(warm & (lr > 0), jnp.floor(jnp.log2(peak / jnp.maximum(lr, 1e-30))), 0.0)
    seesaw = 2.0 ** jnp.clip(halvings, 0, math.log2(K_MAX))
    return jnp.where(parameter > 0, linear, seesaw)


def build(task: Task, fam: str, parameter=None) -> optax.GradientTransformationExtraArgs:
    """AdaScale for one family; ``parameter`` is traced where the family has one."""
    if fam == "fixed-min":
        steps = K_MIN
    elif fam == "fixed-max":
        steps = K_MAX
    elif fam == "measured":
        steps = optax_adascale.BatchRamp(K_MIN, K_MAX, efficiency=parameter)
    elif fam == "schedule":
        policy = functools.partial(lambda inputs, p: scheduled_microbatches(task, inputs, p), p=parameter)
        steps = optax_adascale.BatchRamp(
            K_MIN, K_MAX, ladder=tuple(range(K_MIN, K_MAX + 1)), hysteresis=1.0, patience=1, policy=policy
        )
    else:
        raise ValueError(f"unknown family {fam!r}")
    common = dict(axis_name=AXIS, accumulation_steps=steps, clock=task.clock)
    if task.optimizer == "adamw":
        return optax_adascale.adascale_adamw(task.schedule(), b1=0.9, b2=0.99, weight_decay=task.weight_decay, **common)
    return optax_adascale.adascale_sgd(task.schedule(), momentum=0.9, weight_decay=task.weight_decay, **common)


@functools.cache
def compiled_run(task: Task, fam: str, num_evals: int):
    """A jitted run ``(params, key, targets, parameter, data) -> (params, evals, logs, calls)``."""
    max_updates = task.total_steps + 1
    max_calls = task.total_steps * K_MAX + K_MAX

    def run(params, key, targets, parameter, data):
        tx = build(task, fam, parameter)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt_state = optax_adascale.replicate_buffers(tx.init(params), REPLICAS)
        axes = optax_adascale.state_axes(opt_state)

        def replica_step(params, opt_state, batch):
            grads = jax.grad(task.loss)(params, batch)
            return tx.update(grads, opt_state, params)

        step = jax.vmap(replica_step, in_axes=(None, axes, 0), out_axes=(None, axes), axis_name=AXIS)

        def body(carry):
            params, opt_state, call, logs = carry
            batch = task.sample(data, jax.random.fold_in(key, call))
            updates, opt_state = step(params, opt_state, batch)
            params = optax.apply_updates(params, updates)
            s = optax_adascale.get_adascale_state(opt_state)
            m = optax_adascale.metrics(opt_state)
            boundary = s.micro_step == 0
            idx = jnp.maximum(s.count - 1, 0)
            new = {
                "scale": m["scale"],
                "gain": m["gain"],
                "noise_scale": m["noise_scale"],
                "lr": m["learning_rate"],
                "tau": m["scale_invariant_steps"],
                "calls": (call + 1).astype(jnp.float32),
            }
            logs = {k: logs[k].at[idx].set(jnp.where(boundary, new[k], logs[k][idx])) for k in LOG_KEYS}
            return params, opt_state, call + 1, logs

        def segment(carry, target):
            def more(c):
                s = optax_adascale.get_adascale_state(c[1])
                stuck = s.skip_streak >= MAX_SKIP_STREAK  # every update skipped (diverged): τ cannot advance
                return ((s.tau_whole < target) | (s.micro_step > 0)) & (c[2] < max_calls) & ~stuck

            carry = lax.while_loop(more, body, carry)
            params, opt_state, call, _ = carry
            s = optax_adascale.get_adascale_state(opt_state)
            record = {
                "tau": optax_adascale.scale_invariant_steps(opt_state),
                "updates": s.count,
                "calls": call,
                "val_loss": task.evaluate(params, data),
            }
            return carry, record

        logs = {k: jnp.full((max_updates,), jnp.nan, jnp.float32) for k in LOG_KEYS}
        carry = (params, opt_state, jnp.int32(0), logs)
        (params, opt_state, calls, logs), evals = lax.scan(segment, carry, targets)
        return params, evals, logs, calls

    return jax.jit(run)


def run_cell(task: Task, arm: str, seed: int, *, num_evals: int = NUM_EVALS) -> dict:
    """Train one cell; a JSON-able record (examples in base batches: one call feeds ``REPLICAS`` of them)."""
    k_init, k_data = jax.random.split(jax.random.key(seed))
    params = task.init(k_init)
    T = task.total_steps
    targets = np.asarray([math.ceil(j * T / num_evals) for j in range(1, num_evals + 1)], np.int32)
    fn = compiled_run(task, family(arm), num_evals)
    args = (params, k_data, targets, jnp.float32(arm_parameter(arm)), task.data)
    t0 = time.perf_counter()
    compiled = fn.lower(*args).compile()
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    _, ev, logs, calls = compiled(*args)
    calls = int(calls)
    ev, logs = jax.device_get((ev, logs))
    run_s = time.perf_counter() - t0
    first = float(jax.jit(task.evaluate)(params, task.data))
    curve = {"tau": [0.0], "updates": [0], "examples": [0], "val_loss": [first]}
    for j in range(num_evals):
        curve["tau"].append(float(ev["tau"][j]))
        curve["updates"].append(int(ev["updates"][j]))
        curve["examples"].append(int(ev["calls"][j]) * REPLICAS)
        curve["val_loss"].append(float(ev["val_loss"][j]))
    n = curve["updates"][-1]
    keep = stats.thin(n, LOG_POINTS)
    return {
        "task": task.name,
        "method": arm,
        "scale": 0,
        "seed": seed,
        "config": task.config(),
        "updates": n,
        "examples": calls * REPLICAS,
        "tau": curve["tau"][-1],
        "final": curve["val_loss"][-1],
        "curve": curve,
        "logs": {"update": [int(i) for i in keep], **{k: [float(v) for v in np.asarray(logs[k])[keep]] for k in logs}},
        "run_s": run_s,
        "compile_s": compile_s,
    }


def cell_name(task: Task, arm: str, scale: int, seed: int) -> str:
    del scale
    return f"{task.name}_{arm}_seed{seed}"


def cached(cache, task: Task, arm: str, seed: int, *, only_cached: bool) -> dict | None:
    """A cell from the cache. To run, its configuration must be the task's; to report (``only_cached``), any
    committed cell counts: the LM's corpus is this Python's standard library, so a report on another Python
    version reads the cells as they were made (their configuration, corpus included, is in each file)."""
    record = cache.get(task, arm, 0, seed)
    if record is None and only_cached and cache.directory is not None and cache.path(task, arm, 0, seed).exists():
        record = json.loads(cache.path(task, arm, 0, seed).read_text())
    return record


def run_grid(tasks, arms, seeds, cache, *, num_evals=NUM_EVALS, only_cached=False, log=print):
    """Every cell (cached ones loaded); ``{(task, arm, seed): record}``."""
    results = {}
    for seed in seeds:  # seed-major: a partial grid already compares every arm
        for task in tasks:
            for arm in arms:
                record = cached(cache, task, arm, seed, only_cached=only_cached)
                if record is None and not only_cached:
                    record = run_cell(task, arm, seed, num_evals=num_evals)
                    cache.put(record, task)
                    log(
                        f"  {task.name:9s} {arm:13s} seed={seed}  updates={record['updates']:5d}  "
                        f"examples={record['examples']:6d}  τ={record['tau']:.0f}  val={record['final']:.4f}  "
                        f"run {record['run_s']:.0f} s + compile {record['compile_s']:.0f} s",
                        flush=True,
                    )
                if record is not None:
                    results[(task.name, arm, seed)] = record
    return results

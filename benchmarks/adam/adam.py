"""AdaScale with Adam: which gain rule keeps the S = 1 quality of AdamW at S times the batch?

Two tasks where Adam is the natural optimizer, each with one base batch ``B``,
one base-batch budget ``T`` and one warm-up + cosine schedule tuned once at
``S = 1`` (``--tune``):

* ``lm``: a byte-level pre-LayerNorm decoder on the standard library's source, metric: validation
  loss in nats/byte;
* ``mnist1d``: MNIST-1D generated locally, a small 1-D CNN; metric: validation accuracy (and loss);

both in ``tasks.py``, their data from ``examples/datasets.py``.

At each ``S`` (``S`` replicas of batch ``B``, a ``jax.vmap`` axis) the
candidates train from the same initialisation on the same stream of batches:

* ``adamw``: ``optax.adamw(lr)`` at ``S = 1``, the baseline (AdaScale at
  ``S = 1`` is the identity, so every AdaScale candidate equals it there);
* ``AS-a``: ``adascale(chain(scale_by_adam, add_decayed_weights), lr)``: the
  raw-gradient gain ``r`` times ``lr(⌊τ⌋)`` on the Adam direction;
* ``AS-b``: the same with ``gain_exponent=0.5`` (step ``r^½·lr``, τ advances by ``r``);
* ``AS-c``: ``AS-a`` with ``precondition=adam_preconditioner(b2, eps)``: the gain
  from Adam-preconditioned gradients (``v̂`` of the previous update);
* ``AS-c'``: ``AS-c`` with ``gain_exponent=0.5`` (AdaptDL's AdamScale);
* ``sqrt``: ``optax.adamw(scaling_rules.square_root(lr, S))`` for ``⌈T/S⌉`` iterations;
* ``LSW``: ``optax.adamw(scaling_rules.linear_warmup(lr, S, T))`` for ``⌈T/S⌉`` iterations.

AdaScale candidates train until ``τ ≥ T``. A whole run is one jitted program: a
``lax.scan`` over evaluation checkpoints, each a ``lax.while_loop`` of steps;
the data sets are arguments of that program, not constants in it. Each cell
(task, method, S, seed, lr) is cached as JSON under ``benchmarks/adam/cells/``,
so an interrupted grid resumes where it stopped; ``--smoke`` runs a tiny grid
uncached (with ``--cache DIR`` it caches there).

Files: ``adam.py`` (this: optimizers, compiled runs, one cell, the grid), ``tasks.py`` (the two
tasks), ``results.py`` (tables, plots, the README section), ``__main__.py`` (the command line).

Usage::

    python -m benchmarks.adam --tune                  # the S = 1 learning-rate sweep (1 seed)
    python -m benchmarks.adam --no-report             # the grid (resumable), no report
    python -m benchmarks.adam --report                # tables and plots from the cache only
    python -m benchmarks.adam                         # the grid, then the report
    python -m benchmarks.adam --smoke --cache /tmp/a --results /tmp/a/README.md   # < 60 s

Outputs: the "adam" section of ``benchmarks/adam/README.md`` (``--results``) and
``benchmarks/adam/plots/adam_*.png`` (``plots/`` next to the results file).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import dataclasses  # noqa: E402
import functools  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402

import optax_adascale  # noqa: E402
from benchmarks.adam.tasks import Task  # noqa: E402
from benchmarks.harness import stats  # noqa: E402
from optax_adascale import scaling_rules  # noqa: E402

AXIS = "replicas"
BASELINE = "adamw"
ADASCALE = {  # name -> (gain_exponent, preconditioned statistics)
    "AS-a": (1.0, False),
    "AS-b": (0.5, False),
    "AS-c": (1.0, True),
    "AS-c'": (0.5, True),
}
FIXED = ("sqrt", "LSW")
METHODS = (*ADASCALE, *FIXED)
SCALES = (1, 4, 16)
NUM_EVALS = 12  # evaluation checkpoints per run (plus the initial one)
LOG_POINTS = 300  # per-iteration logs are thinned to about this many points in the cache
TUNE_RATES = {"lm": (1e-3, 3e-3, 1e-2), "mnist1d": (1e-3, 3e-3, 1e-2, 3e-2)}  # 3e-2: 1e-2 was the edge

HERE = Path(__file__).resolve().parent

# --------------------------------------------------------------------------- optimizers


def program_of(method: str) -> str:
    """The compiled program a method runs in: each AdaScale candidate its own, the fixed rules one shared."""
    return method if method in ADASCALE else "fixed"


def build_optimizer(task: Task, program: str, scale: int, use_sqrt=None):
    """``(tx, lr_fn)``; ``lr_fn`` is ``None`` for AdaScale.

    ``"fixed"`` is ``optax.adamw`` on the square-root rule where the (traced)
    ``use_sqrt`` flag is set and on LSW elsewhere; at ``S = 1`` both are the
    base schedule (the ``adamw`` baseline).
    """
    base = task.schedule()
    adam = dict(b1=task.b1, b2=task.b2, eps=task.eps)
    if program in ADASCALE:
        exponent, preconditioned = ADASCALE[program]
        inner = optax.chain(optax.scale_by_adam(**adam), optax.add_decayed_weights(task.weight_decay, task.decay_mask))
        precondition = (
            optax_adascale.experimental.adam_preconditioner(b2=task.b2, eps=task.eps) if preconditioned else None
        )
        tx = optax_adascale.experimental.adascale(
            inner, base, axis_name=AXIS, gain_exponent=exponent, precondition=precondition
        )
        return tx, None
    if program != "fixed":
        raise ValueError(f"unknown program={program!r}")
    sqrt = scaling_rules.square_root(base, scale)
    lsw = scaling_rules.linear_warmup(base, scale, task.total_steps)
    lr = lambda count: jnp.where(use_sqrt, sqrt(count), lsw(count))  # noqa: E731
    return optax.adamw(lr, weight_decay=task.weight_decay, mask=task.decay_mask, **adam), lr


def num_iterations_for(task: Task, method: str, scale: int) -> int:
    if method in ADASCALE:
        return task.total_steps  # an upper bound (gain ≥ 1); the stop is τ ≥ T
    return math.ceil(task.total_steps / scale)


@functools.cache
def compiled_run(task: Task, program: str, scale: int, num_evals: int):
    """A jitted run ``(params, opt_state, key, targets, use_sqrt, data) -> (params, it, evals, logs)``.

    ``targets`` are int32 progress marks (``⌊τ⌋`` for AdaScale, iterations for
    the fixed rules); after reaching each the run evaluates. Batches come from
    ``fold_in(key, iteration)``: every method sees the same stream.
    """
    log_size = task.total_steps

    def run(params, opt_state, key, targets, use_sqrt, data):
        tx, lr_fn = build_optimizer(task, program, scale, use_sqrt)
        is_as = program in ADASCALE

        def replica_step(params, opt_state, batch):
            loss, grads = jax.value_and_grad(task.loss)(params, batch)
            if not is_as:
                grads = lax.pmean(grads, AXIS)  # plain data-parallel AdamW; AdaScale reduces inside
            updates, opt_state = tx.update(grads, opt_state, params)
            return lax.pmean(loss, AXIS), updates, opt_state

        step = jax.vmap(replica_step, in_axes=(None, None, 0), out_axes=None, axis_name=AXIS)

        def progress(opt_state, it):
            return optax_adascale.get_adascale_state(opt_state).tau_whole if is_as else it

        def body(carry):
            params, opt_state, it, logs = carry
            batch = task.sample(data, jax.random.fold_in(key, it), scale)
            loss, updates, opt_state = step(params, opt_state, batch)
            params = optax.apply_updates(params, updates)
            if is_as:
                m = optax_adascale.metrics(opt_state)
                new = {"lr": m["learning_rate"], "gain": m["gain"], "noise_scale": m["noise_scale"], "loss": loss}
            else:
                nan = jnp.float32(jnp.nan)
                new = {"lr": lr_fn(it), "gain": nan, "noise_scale": nan, "loss": loss}
            logs = {k: logs[k].at[it].set(jnp.asarray(v, jnp.float32)) for k, v in new.items()}
            return params, opt_state, it + 1, logs

        def segment(carry, target):
            carry = lax.while_loop(lambda c: (progress(c[1], c[2]) < target) & (c[2] < log_size), body, carry)
            params, opt_state, it, _ = carry
            if is_as:
                tau = optax_adascale.scale_invariant_steps(opt_state)
                skipped = optax_adascale.metrics(opt_state)["skipped_steps"]
            else:
                tau, skipped = it.astype(jnp.float32) * scale, jnp.int32(0)
            record = {"tau": tau, "it": it, "skipped": skipped, **task.evaluate(params, data)}
            return carry, record

        logs = {k: jnp.full((log_size,), jnp.nan, jnp.float32) for k in ("lr", "gain", "noise_scale", "loss")}
        carry = (params, opt_state, jnp.int32(0), logs)
        (params, opt_state, it, logs), evals = lax.scan(segment, carry, targets)
        return params, it, evals, logs

    return jax.jit(run)


# --------------------------------------------------------------------------- one cell


def run_cell(task: Task, method: str, scale: int, seed: int, *, num_evals: int = NUM_EVALS) -> dict:
    """Train one cell and return a JSON-able record."""
    start = time.perf_counter()
    k_init, k_data = jax.random.split(jax.random.key(seed))
    params = task.init(k_init)
    program = program_of(method)
    tx, _ = build_optimizer(task, program, scale, True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt_state = tx.init(params)
    n = num_iterations_for(task, method, scale)
    T = task.total_steps
    if program in ADASCALE:
        targets = [round(k * T / num_evals) for k in range(1, num_evals + 1)]
    else:
        targets = [math.ceil(k * n / num_evals) for k in range(1, num_evals + 1)]
    first = jax.jit(task.evaluate)(params, task.data)
    fn = compiled_run(task, program, scale, num_evals)
    t0 = time.perf_counter()
    _, it, ev, logs = fn(params, opt_state, k_data, np.asarray(targets, np.int32), method == "sqrt", task.data)
    it = int(it)
    ev, logs = jax.device_get((ev, logs))
    run_s = time.perf_counter() - t0
    evals = [{"tau": 0.0, "it": 0, "skipped": 0, **{k: float(v) for k, v in first.items()}}]
    evals += [{k: float(ev[k][j]) for k in ev} for j in range(num_evals)]
    keep = stats.thin(it, LOG_POINTS)
    last = evals[-1]
    return {
        "task": task.name,
        "method": method,
        "scale": scale,
        "seed": seed,
        "config": task.config(),
        "iterations": it,
        "tau": last["tau"],
        "skipped": int(last["skipped"]),
        "final": {k: last[k] for k in ("metric", "val_loss", "train_loss")},
        "curve": {k: [e[k] for e in evals] for k in evals[0]},
        "logs": {"it": [int(i) for i in keep], **{k: [float(v) for v in np.asarray(logs[k])[keep]] for k in logs}},
        "wall_s": time.perf_counter() - start,
        "run_s": run_s,  # the compiled run alone (includes compilation on its first call in a process)
    }


# --------------------------------------------------------------------------- the grid


def _cell_name(task: Task, method: str, scale: int, seed: int) -> str:
    tag = method.replace("'", "p")  # AS-c' → AS-cp
    return f"{task.name}_{tag}_S{scale}_seed{seed}_lr{task.learning_rate:g}"


def cells(scales, seeds, methods=METHODS):
    """``(method, S, seed)`` of the grid: the baseline at ``S = 1``, every candidate at each ``S > 1``."""
    out = []
    for seed in seeds:  # seed-major: a partial grid already compares every candidate
        out += [(BASELINE, 1, seed)] if 1 in scales else []
        out += [(m, s, seed) for s in scales if s > 1 for m in methods]
    return out


def run_grid(tasks, scales, seeds, cache, *, num_evals, methods=METHODS, only_cached=False, log=None):
    """All cells (cached ones loaded; with ``only_cached`` nothing runs); ``{(task, method, S, seed): record}``."""
    log = log or functools.partial(print, flush=True)
    results = {}
    for task in tasks:
        for method, scale, seed in cells(scales, seeds, methods):
            record = cache.get(task, method, scale, seed)
            if record is None and not only_cached:
                record = run_cell(task, method, scale, seed, num_evals=num_evals)
                cache.put(record, task)
                log(
                    f"  {task.name:8s} {method:6s} S={scale:<3d} seed={seed}  iters={record['iterations']:5d}  "
                    f"τ={record['tau']:.0f}  {task.metric}={record['final']['metric']:.4f}  "
                    f"val loss={record['final']['val_loss']:.4f}  {record['wall_s']:.0f} s"
                )
            if record is not None:
                results[(task.name, method, scale, seed)] = record
    return results


# --------------------------------------------------------------------------- tuning


def tune(tasks, cache, rates, log=None):
    """The S = 1 learning-rate sweep, one seed (AdaScale at S = 1 is AdamW on ``lr(t)``)."""
    log = log or functools.partial(print, flush=True)
    for task in tasks:
        for lr in rates[task.name]:
            t = dataclasses.replace(task, learning_rate=lr)
            record = cache.get(t, BASELINE, 1, 0)
            if record is None:
                record = run_cell(t, BASELINE, 1, 0)
                cache.put(record, t)
            f = record["final"]
            log(
                f"{task.name:8s} lr={lr:<7g} {task.metric}={f['metric']:.4f}  val loss={f['val_loss']:.4f}  "
                f"train loss={f['train_loss']:.4f}  ({record['wall_s']:.0f} s)"
            )

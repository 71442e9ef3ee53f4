"""LAMB and LARS as large-batch baselines against AdaScale SGD, at equal examples, on the scaling tasks.

The scaling study's three SGD tasks (``benchmarks/scaling/tasks.py``: MNIST-1D MLP, digits MLP, noisy linear
regression), each with its base batch ``B``, budget ``T`` and S = 1 schedule. At each ``S`` and seed,
from the same initialisation on the same stream of batches:

* ``AS``: ``optax_adascale.adascale_sgd(lr, momentum)`` until ``τ ≥ T`` (``scaling.run_cell``), ``N_AS``
  iterations; at S = 1 it is momentum SGD, the baseline;
* ``LSW+``: momentum SGD, linear scaling with warm-up stretched to ``N_AS`` (the scaling study's LSW+);
* ``LAMB`` / ``LAMB+``: ``optax.lamb(lr)`` (optax's defaults: β = 0.9, 0.999, ε = 1e-6, no weight decay),
  square-root scaling with warm-up (``c: 1 → √S`` over 5.5 % of ``N``) for ``N = ⌈T/S⌉`` / ``N_AS``;
* ``LARS`` / ``LARS+``: ``optax.lars(lr, momentum)`` (trust coefficient 0.001, no weight decay, trust ratio on
  every leaf), linear scaling with warm-up, likewise.

LAMB's and LARS's peak rates are tuned at S = 1 (seed 0, ``RATES``) on each task's own schedule shape and never
per S. The fixed-rule runs are ``engine.py``'s; cells are cached as JSON under ``benchmarks/large_batch/cells/``.

Usage::

    python -m benchmarks.large_batch                       # the grid (resumable), then README.md
    python -m benchmarks.large_batch --tasks digits --scales 4 16 --no-report
    python -m benchmarks.large_batch --report              # README.md from the cache only
"""

from __future__ import annotations

import dataclasses
import functools
import math
from pathlib import Path

import jax
import optax

from benchmarks.large_batch import engine, grid
from benchmarks.scaling import scaling

HERE = Path(__file__).resolve().parent
SECTION = "large-batch"
SCALES = (4, 16, 64)
NUM_EVALS = 8
LARGE_BATCH = {"LAMB": ("lamb", "sqrtW"), "LARS": ("lars", "LSW")}  # label -> (family, its usual rule)
RATES = {"lamb": (1e-3, 3e-3, 1e-2, 3e-2, 1e-1), "lars": (0.3, 1.0, 3.0, 10.0, 30.0)}
SETUP = """The scaling study's tasks, base batches, budgets T and S = 1 schedules (step decay ×0.1 at T/2 and 3T/4
for the MLPs, ×0.01 exponential decay for the regression; no warm-up), momentum 0.9; its `tasks.py` is imported,
not copied. S replicas are a `jax.vmap` axis, each drawing the base batch B i.i.d.; for each seed every method
starts from the same initialisation and, at a given S, sees the same stream of batches. Every fixed rule is
`c(t)·lr(t·T/N)`: the base schedule run at T/N base steps per iteration, times c ramping 1 → S (LSW, LARS) or
1 → √S (LAMB) over the first 5.5 % of N. N = ⌈T/S⌉ (the S = 1 examples), or for the `+` rows AdaScale's
iterations at that S and seed (AdaScale's examples). `SGD LSW+` is the scaling study's LSW+, re-run here.
LAMB: `optax.lamb(lr)` (β = 0.9, 0.999, ε = 1e-6, no weight decay); LARS: `optax.lars(lr, momentum=0.9)` (trust
coefficient 0.001, no weight decay, trust ratio on every leaf); their peak rates tuned once at S = 1 on seed 0
(the sweep under each table), never per S.

Columns: mean ± std over seeds; Δ vs its S = 1: against the same optimizer at S = 1 (momentum SGD for AS and
LSW+), positive = higher, with 2 SE (unpaired); ✗ worse than that by more than 2 SE and the tolerance (1 point;
10 % of the S = 1 excess risk), or a seed failed; ~ beyond 2 SE within the tolerance. vs AdaScale: the mean of the
per-seed differences from AS at the same S (same initialisation and batch stream), signed so that + means better
than AS, with 2 SE of that mean."""


def problem_of(task) -> engine.Problem:
    """The fixed-rule view of a scaling-study task (keys split as ``scaling.run_cell`` splits them)."""
    unit = dataclasses.replace(task, learning_rate=1.0).schedule()  # step / exponential decay: linear in lr

    def make_tx(family, lr):
        if family == "sgd":
            return optax.sgd(lr, momentum=task.momentum)
        if family == "lamb":
            return optax.lamb(lr)
        if family == "lars":
            return optax.lars(lr, momentum=task.momentum)
        raise ValueError(f"unknown family={family!r}")

    config = {k: v for k, v in task.config().items() if k != "learning_rate"}
    return engine.Problem(
        name=task.name,
        total_steps=task.total_steps,
        unit_schedule=unit,
        init=task.init,
        loss=task.loss,
        sample=lambda data, key, n: task.sample(key, n),
        evaluate=lambda params, data: task.evaluate(params),
        data={},
        make_tx=make_tx,
        keys=lambda seed: tuple(jax.random.split(jax.random.key(seed), 3)[:2]),
        settings={**config, "study": "large-batch"},
        metric=task.metric,
        higher_is_better=task.higher_is_better,
        tolerance=task.tolerance,
        chance_loss=math.log(10) if task.higher_is_better else math.inf,
        title=task.title,
    )


def run(task, caches, scales, seeds, *, num_evals=NUM_EVALS, only_cached=False, log=None):
    """Every cell of one task: ``(problem, {(label, S, seed): record}, {label: (tuned lr, sweep rows)})``."""
    log = log or functools.partial(print, flush=True)
    problem = problem_of(task)
    cells = grid.FixedCells(problem, caches, num_evals=num_evals, log=log)
    results, tuned = {}, {}
    T = task.total_steps

    def as_cell(scale, seed):
        record = caches.get(task, "AS", scale, seed)
        if record is None and not only_cached:
            record = scaling.run_cell(task, "AS", scale, seed, num_evals=num_evals)
            for key in ("logs",):  # per-iteration logs are not needed here: keep the cache small
                record.pop(key, None)
            caches.put(record, task)
            log(
                f"  {task.name:10s} AS     S={scale:<3d} seed={seed} iters={record['iterations']:5d}  "
                f"{task.metric}={record['final']['metric']:.4g}  ({record['wall_s']:.1f} s)"
            )
        return record

    for seed in seeds:
        results[("SGD", 1, seed)] = as_cell(1, seed)
    for scale in scales:
        for seed in seeds:
            results[("AS", scale, seed)] = as_cell(scale, seed)
    for scale in scales:
        for seed in seeds:
            a = results[("AS", scale, seed)]
            if a is not None:
                results[("LSW+", scale, seed)] = cells.run(
                    "LSW+", "sgd", "LSW", scale, seed, a["iterations"], task.learning_rate, only_cached=only_cached
                )
    for label, (family, rule) in LARGE_BATCH.items():
        lr, rows = cells.tune(label, family, RATES[family], only_cached=only_cached)
        tuned[label] = (lr, rows)
        if lr is None:
            continue
        for seed in seeds:
            results[(label, 1, seed)] = cells.run(label, family, "id", 1, seed, T, lr, only_cached=only_cached)
        for scale in scales:
            for seed in seeds:
                a = results.get(("AS", scale, seed))
                results[(label, scale, seed)] = cells.run(
                    label, family, rule, scale, seed, math.ceil(T / scale), lr, only_cached=only_cached
                )
                if a is not None:
                    results[(label + "+", scale, seed)] = cells.run(
                        label + "+", family, rule, scale, seed, a["iterations"], lr, only_cached=only_cached
                    )
    return problem, {k: v for k, v in results.items() if v is not None}, tuned


def recs_of(results, label, scale, seeds):
    """The records of the seeds that ran (``None`` if none did); tables say how many in their per-seed column."""
    recs = [r for r in (results.get((label, scale, seed)) for seed in seeds) if r is not None]
    return recs or None


def task_section(problem, results, tuned, scales, seeds, *, baseline="SGD", adascale="AS", rules=("LSW+",)):
    """The table of one task and its S = 1 sweep line."""
    base = recs_of(results, baseline, 1, seeds)
    rows = [(1, baseline, base, None, None)]
    rows += [(1, label, recs_of(results, label, 1, seeds), None, None) for label in tuned]
    for scale in scales:
        ada = recs_of(results, adascale, scale, seeds)
        if ada is None:
            continue
        rows.append((scale, adascale, ada, base, ada))
        rows += [(scale, f"{baseline} {r}", recs_of(results, r, scale, seeds), base, ada) for r in rules]
        for label in tuned:
            own = recs_of(results, label, 1, seeds)
            rows += [(scale, name, recs_of(results, name, scale, seeds), own, ada) for name in (label, label + "+")]
    rows = [row for row in rows if row[2] is not None or row[0] == 1 and row[1] == baseline]  # cells that ran
    out = [f"### {problem.title}", "", grid.table(problem, rows)]
    sweep = []
    for label, (lr, sweep_rows) in tuned.items():
        items = ", ".join(
            (f"**{r_lr:g}**" if r_lr == lr else f"{r_lr:g}") + f": {r['final']['metric']:.4g}" for r_lr, r in sweep_rows
        )
        if items:
            sweep.append(f"{label} {items}")
    if sweep:
        out += ["", f"S = 1 sweep of the peak rate, seed 0 ({problem.metric}; **bold** = chosen): " + "; ".join(sweep)]
    return "\n".join(out)

"""The fair comparison: AdaScale-AdamW against fixed rules given the same examples, and LAMB and LARS.

On the Adam study's two tasks (``tasks.py``), at each ``S`` and seed, AdaScale-AdamW (rule (a),
``AS-a``, 0.3's ``optax_adascale.adascale_adamw``, ``clock="update"`` since 0.4) trains until ``τ ≥ T`` and takes
``N_AS`` iterations.
Against it, from the same initialisation on the same stream of batches
(``benchmarks/large_batch/engine.py``: every rule is ``c(t)·lr(t·T/N)``):

* ``id``, ``sqrt``, ``LSW``: ``optax.adamw`` with the identity (``c = 1``), square-root (``c = √S``) and
  linear-with-warm-up rule (``c: 1 → S`` over 5.5 % of ``N``) for ``N = ⌈T/S⌉`` iterations (the same examples
  as S = 1);
* ``id+``, ``sqrt+``, ``LSW+``: the same rules **stretched** to ``N = N_AS`` (the same examples as AdaScale);
* ``LAMB``/``LAMB+``: ``optax.lamb`` (weight decay and mask as AdamW's), square root with warm-up
  (``c: 1 → √S``), at ``⌈T/S⌉`` / stretched to ``N_AS``; its peak rate tuned at S = 1 (seed 0);
* ``LARS``/``LARS+``: ``optax.lars`` (momentum 0.9, trust coefficient 0.001, no weight decay, trust ratio on
  every leaf: optax's defaults), linear scaling with warm-up, likewise.

AdamW at S = 1 and ``AS-a`` are the Adam study's own cells (``adam.run_cell``, cached in the same
``benchmarks/adam/cells/``). Usage::

    python -m benchmarks.adam.fair --tasks mnist1d            # AS-a, the six AdamW rows, LAMB, LARS
    python -m benchmarks.adam.fair --tasks lm --no-lamb-lars  # the AdamW rows only
    python -m benchmarks.adam.fair --report                   # the section from the cache only
    python -m benchmarks.adam.fair --smoke --cache /tmp/f --results /tmp/f/README.md   # < 15 s

Output: the "adam-fair" section of ``benchmarks/adam/README.md`` (its hand-written reading is kept).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import optax  # noqa: E402

from benchmarks.adam import adam  # noqa: E402
from benchmarks.adam.tasks import Task, make_tasks  # noqa: E402
from benchmarks.harness import cache as cell_cache  # noqa: E402
from benchmarks.harness import report  # noqa: E402
from benchmarks.large_batch import engine, grid, large_batch  # noqa: E402

SECTION = "adam-fair"
ADASCALE = "AS-a"
ADAMW_RULES = {  # label -> (rule, stretched to AdaScale's iterations)
    "id": ("id", False),
    "sqrt": ("sqrt", False),
    "LSW": ("LSW", False),
    "id+": ("id", True),
    "sqrt+": ("sqrt", True),
    "LSW+": ("LSW", True),
}
LARGE_BATCH = {"LAMB": ("lamb", "sqrtW"), "LARS": ("lars", "LSW")}  # label -> (family, usual rule)
RATES = {"lamb": (1e-3, 3e-3, 1e-2, 3e-2), "lars": (0.1, 0.3, 1.0, 3.0, 10.0)}  # 10: 3 was the LM grid's top
SCALES = (4, 16)


def problem_of(task: Task) -> engine.Problem:
    """The fixed-rule view of an Adam-study task (keys split as ``adam.run_cell`` splits them)."""
    unit = dataclasses.replace(task, learning_rate=1.0).schedule()  # warm-up + cosine is linear in its peak
    adam_kw = dict(b1=task.b1, b2=task.b2, eps=task.eps)

    def make_tx(family, lr):
        if family == "adamw":
            return optax.adamw(lr, weight_decay=task.weight_decay, mask=task.decay_mask, **adam_kw)
        if family == "lamb":
            return optax.lamb(lr, weight_decay=task.weight_decay, mask=task.decay_mask, **adam_kw)
        if family == "lars":
            return optax.lars(lr, momentum=0.9)
        raise ValueError(f"unknown family={family!r}")

    config = {k: v for k, v in task.config().items() if k != "learning_rate"}
    return engine.Problem(
        name=task.name,
        total_steps=task.total_steps,
        unit_schedule=unit,
        init=task.init,
        loss=task.loss,
        sample=task.sample,
        evaluate=task.evaluate,
        data=task.data,
        make_tx=make_tx,
        keys=lambda seed: tuple(jax.random.split(jax.random.key(seed))),
        settings={**config, "study": "adam-fair"},
        metric=task.metric,
        higher_is_better=task.higher_is_better,
        tolerance=task.tolerance,
        chance_loss=task.chance_loss,
        title=task.title,
    )


def run(
    task,
    cache,
    scales,
    seeds,
    *,
    lamb_lars,
    num_evals,
    rules=tuple(ADAMW_RULES),
    baseline_seeds=None,
    only_cached=False,
    log=None,
):
    """Every cell of one task; returns ``(results {(label, S, seed): record}, tuned {label: (lr, sweep rows)})``."""
    log = log or functools.partial(print, flush=True)
    problem = problem_of(task)
    cells = grid.FixedCells(problem, cache, num_evals=num_evals, log=log)
    results, tuned = {}, {}
    T = task.total_steps

    def adam_cell(method, scale, seed):
        record = cache.get(task, method, scale, seed)
        if record is None and not only_cached:
            record = adam.run_cell(task, method, scale, seed, num_evals=num_evals)
            cache.put(record, task)
            log(
                f"  {task.name:10s} {method:6s} S={scale:<3d} seed={seed} iters={record['iterations']:5d}  "
                f"{task.metric}={record['final']['metric']:.4g}  ({record['wall_s']:.1f} s)"
            )
        return record

    for seed in seeds[:baseline_seeds]:
        results[("AdamW", 1, seed)] = adam_cell(adam.BASELINE, 1, seed)
    for scale in scales:
        for seed in seeds:
            as_record = results[(ADASCALE, scale, seed)] = adam_cell(ADASCALE, scale, seed)
            if as_record is None:
                continue
            for label in rules:
                rule, stretched = ADAMW_RULES[label]
                n = as_record["iterations"] if stretched else math.ceil(T / scale)
                results[(label, scale, seed)] = cells.run(
                    label, "adamw", rule, scale, seed, n, task.learning_rate, only_cached=only_cached
                )
    if lamb_lars:
        for label, (family, rule) in LARGE_BATCH.items():
            lr, rows = cells.tune(label, family, RATES[family], only_cached=only_cached)
            tuned[label] = (lr, rows)
            if lr is None:
                continue
            for seed in seeds:
                results[(label, 1, seed)] = cells.run(label, family, "id", 1, seed, T, lr, only_cached=only_cached)
            for scale in scales:
                for seed in seeds:
                    as_record = results.get((ADASCALE, scale, seed))
                    results[(label, scale, seed)] = cells.run(
                        label, family, rule, scale, seed, math.ceil(T / scale), lr, only_cached=only_cached
                    )
                    if as_record is not None:
                        results[(label + "+", scale, seed)] = cells.run(
                            label + "+",
                            family,
                            rule,
                            scale,
                            seed,
                            as_record["iterations"],
                            lr,
                            only_cached=only_cached,
                        )
    return problem, {k: v for k, v in results.items() if v is not None}, tuned


def section(tasks_results, scales, seeds, command, elapsed, cached_under) -> str:
    out = [
        "## Adam: the fair comparison, and LAMB and LARS",
        "",
        "Given the examples AdaScale-AdamW used, does a fixed rule do as well? And do LAMB and LARS, the "
        "optimizers built for large batches, beat AdaScale at equal examples?",
        "",
        f"Command: `{command}` ({len(seeds)} seeds, S ∈ {{{', '.join(map(str, scales))}}}; this invocation "
        f"{elapsed:.0f} s, " + (f"cells cached under `{cached_under}`)." if cached_under else "cells not cached)."),
        "",
        report.kept_reading(Path(tasks_results[0][3]), SECTION) if tasks_results else "",
        "",
        "### Setup",
        "",
        "Same tasks, schedules, seeds and batch streams as the study above (`python -m benchmarks.adam.fair`'s "
        "docstring has the details). Every fixed rule is `c(t)·lr(t·T/N)`: the tuned S = 1 warm-up + cosine "
        "schedule run at T/N base steps per iteration, times c = 1 (id), √S (sqrt), 1 → S over the first 5.5 % "
        "of N (LSW) or 1 → √S likewise (LAMB's square root with warm-up). N = ⌈T/S⌉ (same examples as S = 1) or, "
        "for the `+` rows, AdaScale-AdamW's (AS-a) iterations at that S and seed (same examples as AS-a). "
        "LAMB: `optax.lamb`, AdamW's β, ε, weight decay and mask. LARS: `optax.lars(lr, momentum=0.9)` (trust "
        "coefficient 0.001, no weight decay, trust ratio on every leaf). Their peak rates were tuned at S = 1 "
        "on seed 0 (table at the end) and never per S.",
        "",
        "Columns: mean ± std over seeds; Δ vs its S = 1: against the same optimizer at S = 1 (AdamW for AS-a and "
        "the AdamW rules), positive = higher, with 2 SE (unpaired); ✗ worse than that by more than 2 SE and the "
        "tolerance (or a seed failed), ~ beyond 2 SE within the tolerance. vs AdaScale: the mean of the per-seed "
        "differences from AS-a at the same S (same initialisation and batch stream), signed so that + means "
        "better than AS-a, with 2 SE of that mean.",
    ]
    for problem, results, tuned, _ in tasks_results:
        out += [
            "",
            large_batch.task_section(
                problem, results, tuned, scales, seeds, baseline="AdamW", adascale=ADASCALE, rules=tuple(ADAMW_RULES)
            ),
        ]
    return "\n".join(out)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.adam.fair", description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny models and grid (< 15 s on CPU)")
    parser.add_argument("--cache", type=Path, default=None, help="cell cache (default benchmarks/adam/cells)")
    parser.add_argument("--results", type=Path, default=None, help="results file (default benchmarks/adam/README.md)")
    parser.add_argument("--tasks", nargs="+", default=None, choices=("lm", "mnist1d"))
    parser.add_argument("--scales", nargs="+", type=int, default=None)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--only-seeds", nargs="+", type=int, default=None, help="run these seeds only (for chunks)")
    parser.add_argument("--no-lamb-lars", action="store_true", help="skip LAMB and LARS")
    parser.add_argument("--baseline-seeds", type=int, default=None, help="seeds of AdamW at S = 1 (default: all)")
    parser.add_argument("--rules", nargs="+", default=tuple(ADAMW_RULES), choices=ADAMW_RULES, help="AdamW rows")
    parser.add_argument("--no-report", action="store_true", help="run cells only")
    parser.add_argument("--report", action="store_true", help="the section from cached cells only; run nothing")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    if args.smoke:
        jax.config.update("jax_disable_most_optimizations", True)
        cache_dir, scales, seeds, num_evals = args.cache, (4,), [0], 2
    else:
        cache_dir, scales, seeds, num_evals = args.cache or adam.HERE / "cells", SCALES, list(range(args.seeds)), 12
    scales = tuple(args.scales) if args.scales else scales
    seeds = args.only_seeds if args.only_seeds is not None else seeds
    results_path = args.results or adam.HERE / "README.md"
    cache = cell_cache.CellCache(cache_dir, adam._cell_name)
    fixed_cache = cell_cache.CellCache(cache_dir, grid.cell_name)
    all_tasks = make_tasks(smoke=args.smoke, cache_dir=cache_dir)
    names = args.tasks or (["mnist1d"] if args.smoke else ["mnist1d", "lm"])
    done = []
    for name in names:
        both = grid.SplitCache(cache, fixed_cache)
        problem, results, tuned = run(
            all_tasks[name],
            both,
            scales,
            seeds,
            lamb_lars=not args.no_lamb_lars,
            rules=tuple(args.rules),
            baseline_seeds=args.baseline_seeds,
            num_evals=num_evals,
            only_cached=args.report,
        )
        done.append((problem, results, tuned, str(results_path)))
    if args.no_report:
        return 0
    cached_under = str(args.cache) if args.cache else (None if args.smoke else "benchmarks/adam/cells/")
    command = report.command_line("adam.fair", argv)
    body = section(done, scales, seeds, command, time.perf_counter() - start, cached_under)
    report.write_section(results_path, SECTION, body)
    print(f"wrote {results_path} in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

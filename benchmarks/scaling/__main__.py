"""``python -m benchmarks.scaling``: the grid, its tables and plots (the study: ``scaling.py``'s docstring)."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before JAX reads its configuration

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402

from benchmarks.harness import cache as cell_cache  # noqa: E402
from benchmarks.harness import report  # noqa: E402
from benchmarks.scaling import scaling as study  # noqa: E402
from benchmarks.scaling import tasks as scaling_tasks  # noqa: E402
from benchmarks.scaling.results import make_plots, make_tracking_plot, tracking_table, write_report  # noqa: E402
from benchmarks.scaling.scaling import (  # noqa: E402
    ESTIMATORS,
    HERE,
    NUM_EVALS,
    OFFLINE_BATCHES,
    SCALES,
    _cell_name,
    estimator_options,
    run_grid,
    tune,
)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scaling", description=study.__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny grid, no cache, every code path")
    parser.add_argument("--out", type=Path, default=None, help="output directory (default: benchmarks/scaling/)")
    parser.add_argument("--tasks", nargs="+", default=None, choices=("mnist1d", "digits", "regression"))
    parser.add_argument("--scales", nargs="+", type=int, default=None)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--no-report", action="store_true", help="run cells only (for chunks)")
    parser.add_argument("--tune", action="store_true", help="S = 1 learning-rate sweep")
    parser.add_argument(
        "--estimators",
        nargs="+",
        default=None,
        metavar="AS-…",
        help=f"AdaScale estimator variants run beside AS, e.g. 'AS-H(T/20)' (default: {' '.join(ESTIMATORS)})",
    )
    parser.add_argument("--estimator-seeds", type=int, default=None, help="seeds for the variants (default: all)")
    parser.add_argument("--no-baselines", action="store_true", help="skip LSW+, LSW and the elastic run")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    out = args.out or HERE
    if args.smoke:
        # Compilation dominates a smoke run: ask XLA for less optimisation work.
        jax.config.update("jax_disable_most_optimizations", True)
        cache = cell_cache.CellCache(None, _cell_name)
        scales, seeds, num_evals, offline, elastic_tasks = (1, 8), [0], 4, 50, {"digits"}
        estimator_tasks = {"regression"}
    else:
        cache = cell_cache.CellCache(out / "cells", _cell_name)
        scales, seeds, num_evals, offline, elastic_tasks = (
            SCALES,
            list(range(args.seeds)),
            NUM_EVALS,
            OFFLINE_BATCHES,
            None,
        )
        estimator_tasks = None
    scales = tuple(args.scales) if args.scales else scales
    data_cache = None if args.smoke else HERE / ".cache"
    all_tasks = scaling_tasks.make_tasks(smoke=args.smoke, cache_dir=data_cache)
    tasks = [all_tasks[n] for n in (args.tasks or all_tasks)]

    if args.tune:
        tune(tasks, (0.01, 0.02, 0.05, 0.1, 0.2), seeds)
        return 0

    if args.estimators is not None:
        estimators = tuple(args.estimators)
    else:  # smoke: the last variant alone covers every code path of the variants (the package options have tests)
        estimators = ("AS-fairscale",) if args.smoke else ESTIMATORS
    for method in estimators:
        estimator_options(tasks[0], method)  # fail on a typo before any training
    results = run_grid(
        tasks,
        scales,
        seeds,
        cache,
        num_evals=num_evals,
        offline_batches=offline,
        elastic_tasks=elastic_tasks,
        estimators=estimators,
        estimator_seeds=args.estimator_seeds,
        estimator_tasks=estimator_tasks,
        baselines=not args.no_baselines,
    )
    print(tracking_table(tasks, results, scales, seeds, ("AS", *estimators)))
    if args.no_report:
        return 0
    plot_paths = make_plots(tasks, results, scales, seeds, out / "plots")
    tracking = make_tracking_plot(tasks, results, scales, seeds[0], ("AS", *estimators[:1]), out / "plots")
    plot_paths += [tracking] if tracking is not None else []
    command = report.command_line("scaling", argv)
    written = write_report(
        out / "README.md",
        tasks,
        results,
        scales,
        seeds,
        plot_paths,
        command,
        time.perf_counter() - start,
        smoke=args.smoke,
        estimators=estimators,
    )
    print(f"wrote {written} and {len(plot_paths)} plots in {time.perf_counter() - start:.1f} s")
    return 0


sys.exit(main())

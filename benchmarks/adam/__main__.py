"""``python -m benchmarks.adam``: the grid, its tables and plots (the study: ``adam.py``'s docstring)."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before JAX reads its configuration

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402

from benchmarks.adam import adam as study  # noqa: E402
from benchmarks.adam.adam import HERE, METHODS, NUM_EVALS, SCALES, TUNE_RATES, _cell_name, run_grid, tune  # noqa: E402
from benchmarks.adam.results import make_plots, write_report  # noqa: E402
from benchmarks.adam.tasks import make_tasks  # noqa: E402
from benchmarks.harness import cache as cell_cache  # noqa: E402
from benchmarks.harness import (
    report,  # noqa: E402
    xla,  # noqa: E402
)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.adam", description=study.__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny models and grid (< 60 s on CPU)")
    parser.add_argument(
        "--cache",
        type=Path,
        default=None,
        help="cell cache directory (default benchmarks/adam/cells; none in smoke mode unless given)",
    )
    parser.add_argument(
        "--results",
        type=Path,
        default=None,
        help="results file (default benchmarks/adam/README.md); the plots go to plots/ next to it",
    )
    parser.add_argument("--tasks", nargs="+", default=None, choices=("lm", "mnist1d"))
    parser.add_argument("--scales", nargs="+", type=int, default=None)
    parser.add_argument("--methods", nargs="+", default=None, choices=METHODS)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--tune", action="store_true", help="S = 1 learning-rate sweep (1 seed)")
    parser.add_argument("--no-report", action="store_true", help="run cells only")
    parser.add_argument("--report", action="store_true", help="report from cached cells only; run nothing")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    results_path = args.results or HERE / "README.md"
    if args.smoke:
        # Compilation dominates a smoke run: ask XLA for less work (the legacy CPU emitters compile ~2× faster).
        # XLA reads XLA_FLAGS when the backend starts, which nothing above has done yet.
        xla.add_flags("--xla_cpu_use_fusion_emitters=false")  # where this XLA still knows it
        jax.config.update("jax_disable_most_optimizations", True)
        cache_dir, scales, seeds, num_evals = args.cache, (1, 4), [0], 3
    else:
        cache_dir = args.cache or HERE / "cells"
        scales, seeds, num_evals = SCALES, list(range(args.seeds)), NUM_EVALS
    scales = tuple(args.scales) if args.scales else scales
    cache = cell_cache.CellCache(cache_dir, _cell_name)
    all_tasks = make_tasks(smoke=args.smoke, cache_dir=cache_dir)
    tasks = [all_tasks[n] for n in (args.tasks or all_tasks)]
    methods = tuple(args.methods) if args.methods else METHODS

    if args.tune:
        tune(tasks, cache, {k: (v[:1] if args.smoke else v) for k, v in TUNE_RATES.items()})
        return 0
    results = run_grid(tasks, scales, seeds, cache, num_evals=num_evals, methods=methods, only_cached=args.report)
    if args.no_report:
        return 0
    plot_paths = make_plots(tasks, results, scales, seeds, results_path.parent / "plots")
    command = report.command_line("adam", argv)
    path = write_report(
        results_path,
        tasks,
        results,
        scales,
        seeds,
        plot_paths,
        command,
        time.perf_counter() - start,
        cache,
        smoke=args.smoke,
    )
    print(f"wrote {path} and {len(plot_paths)} plots in {time.perf_counter() - start:.1f} s")
    return 0


sys.exit(main())

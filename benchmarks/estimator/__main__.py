"""Command line of the estimator study: ``python -m benchmarks.estimator [--smoke] [...]``."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from benchmarks.estimator import estimator, results, tasks
from benchmarks.harness import cache as cache_mod
from benchmarks.harness import report

HERE = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.estimator", description=__doc__)
    p.add_argument("--tasks", nargs="+", default=None, help="default: all five, not lm_full (--smoke: regression)")
    p.add_argument("--scales", nargs="+", type=int, default=list(estimator.SCALES))
    p.add_argument("--seeds", type=int, default=3, help="seeds 0 … n−1")
    p.add_argument("--candidates", nargs="+", default=None, help="default: CANDIDATES (--smoke: two)")
    p.add_argument(
        "--smoke", action="store_true", help="the tiny regression, S = 4, one seed, two candidates, no cache (seconds)"
    )
    p.add_argument("--out", type=Path, default=None, help="folder for README.md and plots/ (default: this study's)")
    p.add_argument("--no-report", action="store_true", help="run (and cache) the cells only")
    p.add_argument("--report", action="store_true", help="the report of the cached cells only (runs nothing)")
    p.add_argument("--offline-batches", type=int, default=estimator.OFFLINE_BATCHES, help="per checkpoint")
    p.add_argument("--plot", nargs="+", default=["frac(0.05)+unb"], help="candidates plotted beside the default")
    p.add_argument("--tune", action="store_true", help="the S = 1 learning-rate sweep of digits32 and lm")
    args = p.parse_args(argv)

    if args.tune:
        estimator.tune(tasks.digits32, (0.05, 0.1, 0.2, 0.4))
        estimator.tune(tasks.lm, (3e-3, 1e-2, 3e-2))
        return
    start = time.perf_counter()
    setups = tasks.make_setups(smoke=args.smoke)
    scales, seeds = args.scales, list(range(args.seeds))
    num_evals, offline = estimator.NUM_EVALS, args.offline_batches
    names = args.tasks or (["regression"] if args.smoke else [n for n in setups if n not in tasks.OPT_IN])
    candidates = args.candidates or (
        [estimator.FAIRSCALE, "frac(0.1)+unb"] if args.smoke else list(estimator.CANDIDATES)
    )
    if args.smoke:
        scales, seeds, num_evals, offline = [4], [0], 4, 16
    chosen = [setups[name] for name in names]
    out = args.out or HERE
    cache_dir = None if args.smoke else HERE / "cells"
    cache = cache_mod.CellCache(cache_dir, estimator.cell_name)
    res = estimator.run_grid(
        chosen, candidates, scales, seeds, cache, num_evals=num_evals, offline_batches=offline, cached_only=args.report
    )
    if args.no_report:
        return
    results.write_report(
        out / "README.md",
        chosen,
        res,
        candidates,
        scales,
        seeds,
        out / "plots",
        report.command_line("estimator", argv),
        time.perf_counter() - start,
        chosen=[c for c in args.plot if c in candidates],
        cached_under=None if cache_dir is None else "benchmarks/estimator/cells/",
    )


if __name__ == "__main__":
    main()

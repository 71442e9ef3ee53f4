"""``python -m benchmarks.scale_quality``: the S sweep, the diagnosis, the Adam comparison, the report.

Usage::

    python -m benchmarks.scale_quality                 # every cell (resumable, cached under cells/), then README.md
    python -m benchmarks.scale_quality --report        # tables and plots from the committed cells only
    python -m benchmarks.scale_quality --smoke --cache /tmp/q --results /tmp/q/README.md    # tiny, about a minute
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before JAX reads its configuration

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402

from benchmarks.harness import report, xla  # noqa: E402
from benchmarks.scale_quality import diagnosis, engine, results, scale_quality  # noqa: E402
from benchmarks.scale_quality.tasks import TUNE_CENTERS, make_tasks  # noqa: E402

HERE = Path(__file__).resolve().parent


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale_quality", description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny tasks, one seed, S ≤ 8")
    parser.add_argument("--cache", type=Path, default=None, help="cells (default benchmarks/scale_quality/cells)")
    parser.add_argument("--results", type=Path, default=None, help="results file (default its README.md)")
    parser.add_argument("--tasks", nargs="+", default=None)
    parser.add_argument("--methods", nargs="+", default=None, choices=sorted(engine.METHODS))
    parser.add_argument("--seeds", type=int, default=None, help="seeds per cell (default: 8 small tasks, 2 large)")
    parser.add_argument("--scales", type=int, nargs="+", default=None, help="only these S (default: the sweep's)")
    parser.add_argument("--report", action="store_true", help="report from cached cells only; run nothing")
    parser.add_argument("--tune", action="store_true", help="the learning-rate sweep at S = 2, then stop")
    parser.add_argument("--no-report", action="store_true", help="run the cells only")
    parser.add_argument("--no-diagnosis", action="store_true", help="skip the closed-form and tracking runs")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    log = functools.partial(print, flush=True)
    results_path = args.results or HERE / "README.md"
    if args.smoke:
        xla.add_flags("--xla_cpu_use_fusion_emitters=false")
        jax.config.update("jax_disable_most_optimizations", True)
        cache, scales, mults = args.cache, (2, 4), (1.0,)
    else:
        cache, scales, mults = args.cache or HERE / "cells", scale_quality.SCALES, scale_quality.MULTS
        scales = tuple(args.scales) if args.scales else scales
    all_tasks = make_tasks(smoke=args.smoke)
    default_tasks = ("quadratic", "lm_adamw") if args.smoke else all_tasks
    tasks = [all_tasks[n] for n in (args.tasks or default_tasks)]
    methods = tuple(args.methods or (*scale_quality.METHODS, *scale_quality.DIAGNOSIS_METHODS))
    if args.tune:
        centred = make_tasks(smoke=args.smoke, learning_rates=TUNE_CENTERS)
        for task in tasks:
            scale_quality.tune(centred[task.name], cache, log=log)
        return 0
    records = []
    for task in tasks:
        seeds = list(range(args.seeds or (1 if args.smoke else scale_quality.SEEDS[task.name])))
        task_methods = methods if task.name in scale_quality.DIAGNOSED and not args.smoke else scale_quality.METHODS
        largest = task.name in scale_quality.AT_LARGEST and not args.smoke and not args.scales
        task_scales = (*scales, scale_quality.LARGEST) if largest else scales
        records += scale_quality.run_grid(
            [task],
            [m for m in task_methods if m in methods],
            task_scales,
            mults,
            seeds,
            cache,
            only_cached=args.report,
            log=log,
        )
    adam = scale_quality.adam_comparison(
        [t for t in tasks if t.optimizer == "adamw"],
        records,
        cache,
        scale=scales[-1] if args.smoke else 32,
        mults=mults,
        only_cached=args.report,
        log=log,
    )
    skip = args.report or args.no_diagnosis
    analytic = diagnosis.analytic_tables(all_tasks["quadratic"], smoke=args.smoke, cache=cache, only_cached=skip)
    tracking = diagnosis.tracking_table(all_tasks["quadratic"], cache=cache, smoke=args.smoke, only_cached=skip)
    if args.no_report:
        return 0
    plot_dir = results_path.parent / "plots"
    if not args.smoke and any(t.name in scale_quality.AT_LARGEST for t in tasks):
        scales = (*scales, scale_quality.LARGEST)
    idx = results.index(records)
    plot_paths = [results.plot_sweep(idx, tasks, scale_quality.METHODS, scales, mults, plot_dir / "sweep.png")]
    if analytic["rows"]:
        plot_paths.append(diagnosis.plot_analytic(analytic, plot_dir / "analytic.png"))
    path = scale_quality.write_report(
        results_path,
        tasks,
        records,
        scales,
        mults,
        adam,
        analytic,
        tracking,
        plot_paths,
        report.command_line("scale_quality", argv),
        time.perf_counter() - start,
    )
    log(f"wrote {path} ({len(records)} runs) in {time.perf_counter() - start:.0f} s")
    if args.smoke and cache is not None:
        (cache / "smoke.json").write_text(json.dumps({"runs": len(records)}))
    return 0


sys.exit(main())

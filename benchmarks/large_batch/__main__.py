"""``python -m benchmarks.large_batch``: the grid and its README section (the study: ``large_batch.py``)."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before JAX reads its configuration

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402

from benchmarks.harness import cache as cell_cache  # noqa: E402
from benchmarks.harness import report  # noqa: E402
from benchmarks.large_batch import grid  # noqa: E402
from benchmarks.large_batch import large_batch as study  # noqa: E402
from benchmarks.scaling import scaling  # noqa: E402
from benchmarks.scaling import tasks as scaling_tasks  # noqa: E402

INTRO = """Does AdaScale SGD beat LAMB and LARS, the optimizers built for large batches, when all three see the
same examples? On the scaling study's three SGD tasks, each optimizer tuned at S = 1 and scaled with its usual
rule, run for ⌈T/S⌉ iterations and stretched to AdaScale's iteration count (`+`)."""


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.large_batch", description=study.__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny tasks and grid, no cache (< 15 s)")
    parser.add_argument("--out", type=Path, default=None, help="output directory (default: benchmarks/large_batch/)")
    parser.add_argument("--tasks", nargs="+", default=None, choices=("mnist1d", "digits", "regression"))
    parser.add_argument("--scales", nargs="+", type=int, default=None)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--no-report", action="store_true", help="run cells only")
    parser.add_argument("--report", action="store_true", help="README section from cached cells only; run nothing")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    out = args.out or study.HERE
    if args.smoke:
        jax.config.update("jax_disable_most_optimizations", True)
        cache_dir, scales, seeds, num_evals = None, (4,), [0], 2
        study.RATES.update({"lamb": (1e-2,), "lars": (1.0,)})
    else:
        cache_dir, scales, seeds, num_evals = out / "cells", study.SCALES, list(range(args.seeds)), study.NUM_EVALS
    scales = tuple(args.scales) if args.scales else scales
    caches = grid.SplitCache(
        cell_cache.CellCache(cache_dir, scaling._cell_name), cell_cache.CellCache(cache_dir, grid.cell_name)
    )
    all_tasks = scaling_tasks.make_tasks(smoke=args.smoke, cache_dir=None if args.smoke else out / ".cache")
    names = args.tasks or (["digits"] if args.smoke else list(all_tasks))
    sections = []
    for name in names:
        problem, results, tuned = study.run(
            all_tasks[name], caches, scales, seeds, num_evals=num_evals, only_cached=args.report
        )
        sections.append(study.task_section(problem, results, tuned, scales, seeds))
    if args.no_report:
        return 0
    results_path = out / "README.md"
    command = report.command_line("large_batch", argv)
    body = "\n".join(
        [
            "## LAMB and LARS against AdaScale SGD",
            "",
            INTRO,
            "",
            f"Command: `{command}` ({len(seeds)} seeds, S ∈ {{{', '.join(map(str, scales))}}}; this invocation "
            f"{time.perf_counter() - start:.0f} s).",
            "",
            report.kept_reading(results_path, study.SECTION),
            "",
            "### Setup",
            "",
            study.SETUP,
            "",
            *[s + "\n" for s in sections],
        ]
    )
    report.write_section(results_path, study.SECTION, body)
    print(f"wrote {results_path} in {time.perf_counter() - start:.1f} s")
    return 0


sys.exit(main())

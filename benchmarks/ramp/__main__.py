"""``python -m benchmarks.ramp``: the grid, the proxy check, the tables and plots (the study: ``ramp.py``'s docstring).

Usage::

    python -m benchmarks.ramp --tune                  # the learning-rate sweep of the baseline arm (seed 0)
    python -m benchmarks.ramp                         # the grid and the proxy check (resumable), then the report
    python -m benchmarks.ramp --report                # tables and plots from the committed cells only
    python -m benchmarks.ramp --smoke --cache /tmp/r --results /tmp/r/README.md    # tiny, < 2 min
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before JAX reads its configuration

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402

from benchmarks.harness import cache as cell_cache  # noqa: E402
from benchmarks.harness import report, xla  # noqa: E402
from benchmarks.ramp import proxy, ramp, results  # noqa: E402
from benchmarks.ramp.tasks import make_tasks  # noqa: E402

HERE = Path(__file__).resolve().parent
TUNE_RATES = {
    "lm_adamw": (1e-3, 3e-3),
    "lm_sgd": (0.01, 0.03, 0.1),
    "mnist1d": (0.01, 0.03, 0.1),
    "teacher": (0.005, 0.01, 0.02),
}


def proxy_text(tasks, cache, only_cached: bool, checkpoints, scales, plot_dir: Path, log) -> tuple[str, list[Path]]:
    """Run (or load) the proxy check of every task; its table and plot."""
    rows, found = [], {}
    for task in tasks:
        record = ramp.cached(cache, task, "proxy", 0, only_cached=only_cached)
        if record is None and not only_cached:
            record = {"method": "proxy", "scale": 0, "seed": 0, "config": task.config()}
            record.update(proxy.run_task(task, checkpoints=checkpoints, scales=scales, log=log))
            cache.put(record, task)
        if record is None:
            continue
        found[task.name] = record
        for c in record["checkpoints"]:
            steps = " / ".join("—" if c["steps"][str(s)] is None else str(c["steps"][str(s)]) for s in scales)
            rows.append(
                f"| {task.name} | {c['tau']} | {c['loss']:.3f} → {c['target']:.3f} | {steps} | "
                f"{c['b_crit']:.1f} | {c['b_noise']:.1f} | "
                + (f"{c['b_noise'] / c['b_crit']:.2f} |" if c["b_crit"] > 0 else "— |")
            )
    if not rows:
        return "_(no proxy cells)_", []
    minutes = sum(r["wall_s"] for r in found.values()) / 60
    text = "\n".join(
        [
            "### Check the proxy: the controller's noise scale against the critical batch measured by branching",
            "",
            proxy.__doc__.split("\n\n", 1)[1].strip(),
            f"Seed 0, horizon H = {proxy.HORIZON} steps; {minutes:.0f} min of wall time when it ran.",
            "",
            f"| task | τ | val. loss → target | steps at S = {' / '.join(map(str, scales))} | "
            "B_crit (measured) | B_noise (controller) | ratio |",
            "|---|---:|---:|---|---:|---:|---:|",
            *rows,
        ]
    )
    plt = results.plots.pyplot()
    fig, ax = plt.subplots(figsize=(4.6, 4.2))
    for i, (name, record) in enumerate(found.items()):
        pts = [(c["b_crit"], c["b_noise"]) for c in record["checkpoints"]]
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], color=f"C{i}", label=name)
    ax.set_xscale("log")
    ax.set_yscale("log")
    lims = [0.3, 300]
    ax.plot(lims, lims, color="0.6", lw=0.8)
    ax.set_xlabel("critical batch, measured by branching (base batches)")
    ax.set_ylabel("controller's B_noise = σ̄²/μ̄² (base batches)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return text, [results.plots.save(fig, plot_dir / "ramp_proxy.png")]


def _shown(path: Path) -> str:
    """A folder as the report names it: relative to the repository where it lies inside it."""
    root = HERE.parent.parent
    path = path.resolve()
    return f"{path.relative_to(root)}/" if path.is_relative_to(root) else str(path)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ramp", description=ramp.__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny models, one seed, short runs")
    parser.add_argument("--cache", type=Path, default=None, help="cells (default benchmarks/ramp/cells; smoke: none)")
    parser.add_argument("--results", type=Path, default=None, help="results file (default benchmarks/ramp/README.md)")
    parser.add_argument("--tasks", nargs="+", default=None, choices=("lm_adamw", "lm_sgd", "mnist1d", "teacher"))
    parser.add_argument("--arms", nargs="+", default=None, choices=ramp.ARMS)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument(
        "--clock", choices=("tau", "update"), default="tau", help="the aliases' clock= (cells_update_clock/: update)"
    )
    parser.add_argument("--no-proxy", action="store_true", help="skip the proxy check")
    parser.add_argument("--tune", action="store_true", help="the baseline arm's learning-rate sweep (seed 0)")
    parser.add_argument("--no-report", action="store_true", help="run cells only")
    parser.add_argument("--report", action="store_true", help="report from cached cells only; run nothing")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    log = functools.partial(print, flush=True)
    results_path = args.results or HERE / "README.md"
    if args.smoke:
        xla.add_flags("--xla_cpu_use_fusion_emitters=false")
        jax.config.update("jax_disable_most_optimizations", True)
        cache_dir, seeds, num_evals = args.cache, [0], 8
        checkpoints, scales = (0.5,), (1, 2, 4)
    else:
        cache_dir, seeds, num_evals = args.cache or HERE / "cells", list(range(args.seeds)), ramp.NUM_EVALS
        checkpoints, scales = proxy.CHECKPOINTS, proxy.SCALES
    cache = cell_cache.CellCache(cache_dir, ramp.cell_name)
    all_tasks = make_tasks(smoke=args.smoke, cache_dir=HERE / ".cache")  # MNIST-1D, generated once
    tasks = [dataclasses.replace(all_tasks[n], clock=args.clock) for n in (args.tasks or all_tasks)]
    arms = tuple(args.arms) if args.arms else ramp.ARMS

    if args.tune:
        for task in tasks:
            for lr in TUNE_RATES[task.name][:1] if args.smoke else TUNE_RATES[task.name]:
                t = dataclasses.replace(task, name=f"tune-{task.name}-lr{lr:g}", learning_rate=lr)
                record = cache.get(t, "fixed-min", 0, 0) or ramp.run_cell(t, "fixed-min", 0, num_evals=num_evals)
                cache.put(record, t)
                log(f"{task.name:9s} lr={lr:<6g} final val. loss {record['final']:.4f}")
        return 0
    grid = ramp.run_grid(tasks, arms, seeds, cache, num_evals=num_evals, only_cached=args.report, log=log)
    plot_dir = results_path.parent / "plots"
    text, proxy_plots = ("_(proxy check skipped)_", [])
    if not args.no_proxy:
        text, proxy_plots = proxy_text(tasks, cache, args.report, checkpoints, scales, plot_dir, log)
    if args.no_report:
        return 0
    plot_paths = results.make_plots(tasks, grid, seeds, plot_dir) + proxy_plots
    path = results.write_report(
        results_path,
        tasks,
        grid,
        seeds,
        plot_paths,
        report.command_line("ramp", argv),
        time.perf_counter() - start,
        proxy_text=text,
        cached_under=None if cache_dir is None else _shown(cache_dir),
    )
    log(f"wrote {path} and {len(plot_paths)} plots in {time.perf_counter() - start:.0f} s")
    return 0


sys.exit(main())

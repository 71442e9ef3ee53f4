"""Where does quality break as S grows, and why? The final loss at τ = T against S = 2's, on tasks nobody tuned.

Every run trains with AdaScale over ``S`` vmap replicas (one base batch each) until ``τ ≥ T`` and evaluates the
task's loss there; the baseline is the same rule at ``S = 2``. A step worth ``r`` base steps that really did the
work of ``r`` small steps ends where ``S = 2`` ends: above it means the gain over-credits (quality lost), below it
that it under-credits (examples spent that a smaller batch would not have needed).

Cells are ``(task, method, S)`` files under ``cells/<task>/``, each holding every (learning-rate multiplier, seed)
run of that cell (they run as one vmapped program); a cell counts while its task's configuration is unchanged.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from benchmarks.scale_quality import engine

SCALES = (2, 4, 8, 16, 32, 64)
LARGEST = 128  # also run at S = 128 where the task allows it on a CPU (the small models; the LMs stop at 64)
AT_LARGEST = ("quadratic", "teacher", "mnist1d")
MULTS = (0.5, 1.0, 2.0)
METHODS = ("paper", "tau", "guarded")
GUARDED = "guarded"
DIAGNOSIS_METHODS = ("gain_before", "no_momentum")


def cell_path(cache: Path, task, method: str, scale: int) -> Path:
    return cache / task.name / f"{method}_S{scale}.json"


def load(cache: Path | None, task, method: str, scale: int, *, any_config: bool = False) -> list[dict]:
    """The cached runs of a cell whose configuration is the task's (``[]`` if none). ``any_config``: every committed
    run (a report on another Python reads the LM's cells as they were made: its corpus is that Python's standard
    library, and each run's configuration says which)."""
    if cache is None:
        return []
    path = cell_path(cache, task, method, scale)
    if not path.exists():
        return []
    config = json.loads(json.dumps(task.config()))
    return [r for r in json.loads(path.read_text()) if any_config or r["config"] == config]


def run_grid(tasks, methods, scales, mults, seeds, cache: Path | None, *, only_cached=False, log=print) -> list[dict]:
    """Every run of the grid (cached ones loaded, missing ones run one batched program per cell); the records."""
    records = []
    for task in tasks:
        for method in methods:
            if task.optimizer == "adamw" and method in (*DIAGNOSIS_METHODS, GUARDED):
                continue  # AdamW's τ clock has no guard: its `tau` cells are its default
            for scale in scales:
                have = load(cache, task, method, scale, any_config=only_cached)
                done = {(r["lr_mult"], r["seed"]) for r in have}
                missing = [(m, s) for m in mults for s in seeds if (m, s) not in done]
                if missing and not only_cached:
                    start = time.perf_counter()
                    new = engine.run_cell(task, method, scale, missing)
                    have = have + new
                    if cache is not None:
                        path = cell_path(cache, task, method, scale)
                        path.parent.mkdir(parents=True, exist_ok=True)
                        path.write_text(json.dumps(have))
                    seconds = time.perf_counter() - start
                    log(f"{task.name:10s} {method:12s} S={scale:3d}: {len(new)} runs in {seconds:.0f} s")
                records += [r for r in have if r["lr_mult"] in mults and r["seed"] in seeds]
    return records


SEEDS = {"quadratic": 32, "teacher": 4, "lm_sgd": 3, "lm_adamw": 3, "mnist1d": 6}
DIAGNOSED = ("quadratic", "teacher")  # the tasks the momentum diagnosis (gain_before, no_momentum) runs on
ADAM_SCALE = 32


def adam_comparison(tasks, records, cache: Path | None, *, scale: int, mults, only_cached=False, log=print) -> list:
    """AdaScale-AdamW at ``S`` against plain AdamW at the same batch, learning rate and examples.

    The plain run takes as many updates as the AdaScale run of the same learning rate took to ``τ = T`` (mean over
    seeds), its warm-up + cosine schedule stretched over them: the same examples, the same peak learning rate.
    """
    rows = []
    for task in tasks:
        for mult in mults:
            for method in METHODS:
                runs = [
                    r
                    for r in records
                    if (r["task"], r["method"], r["scale"], r["lr_mult"]) == (task.name, method, scale, mult)
                ]
                if not runs:
                    continue
                updates = round(sum(r["iterations"] for r in runs) / len(runs))
                seeds = sorted(r["seed"] for r in runs)
                path = None if cache is None else cache / task.name / f"fixed_S{scale}_x{mult:g}_u{updates}.json"
                fixed = None
                if path is not None and path.exists():
                    config = json.loads(json.dumps(task.config()))
                    fixed = [r for r in json.loads(path.read_text()) if only_cached or r["config"] == config] or None
                if fixed is None and not only_cached:
                    fixed = engine.run_fixed(task, scale, updates, [mult], seeds)
                    if path is not None:
                        path.parent.mkdir(parents=True, exist_ok=True)
                        path.write_text(json.dumps(fixed))
                    log(f"{task.name}: plain {task.optimizer} at S = {scale}, lr ×{mult:g}, {updates} updates")
                if fixed:
                    rows.append(
                        {
                            "task": task.name,
                            "mult": mult,
                            "method": method,
                            "updates": updates,
                            "adascale": [r["final_loss"] for r in runs],
                            "plain": [r["final_loss"] for r in fixed],
                        }
                    )
    return rows


def write_report(path: Path, tasks, records, scales, mults, adam, analytic, tracking, plot_paths, command, seconds):
    """The study's section of its README (the hand-written reading kept)."""
    from benchmarks.harness import report
    from benchmarks.scale_quality import diagnosis, results

    idx = results.index(records)
    methods = [m for m in (*METHODS, *DIAGNOSIS_METHODS) if any(k[1] == m for k in idx)]
    seeds = {t.name: sorted({r["seed"] for r in records if r["task"] == t.name}) for t in tasks}
    minutes = sum(r.get("wall_s", 0) for r in records) / 60
    out = [
        "## Quality at every scale",
        "",
        f"Command: `{command}` ({len(records)} runs; the cells took {minutes:.0f} min of wall time when they ran, "
        f"this invocation {seconds:.0f} s). Every method is AdaScale with the package's default estimator; the "
        "baseline of a row is the same method at S = 2 with the same learning rate and seeds. Seeds per task: "
        + ", ".join(f"{k} {len(v)}" for k, v in seeds.items())
        + ".",
        "",
        "Methods:",
        "",
        *[f"- `{m}`: {engine.METHODS[m]}" for m in methods],
        "",
        report.kept_reading(path, "scale-quality"),
        "",
        "### Summary: the goal",
        "",
        results.summary_table(idx, tasks, METHODS, scales, mults),
        "",
        f"![final loss against S = 2's]({report.relative(plot_paths[0], path)})",
        "",
    ]
    for task in tasks:
        out += [
            f"### {task.title}",
            "",
            f"Base batch {task.batch_size}, T = {task.total_steps} base-batch steps, "
            f"peak lr {task.learning_rate:g} (warm-up 5 % + cosine to 0).",
            "",
            results.task_table(idx, task, methods, scales, mults),
            "",
        ]
    if adam:
        out += [
            "### Adam: AdaScale-AdamW against plain AdamW with the same examples",
            "",
            "Plain AdamW runs at the same batch (S base batches per update), the same peak learning rate and "
            "as many updates as the AdaScale run took (its schedule stretched over them).",
            "",
            "| task | lr | method | updates | AdaScale-AdamW | plain AdamW | AdaScale − plain |",
            "|---|---:|---|---:|---:|---:|---:|",
        ]
        for row in adam:
            a, p = np.asarray(row["adascale"]), np.asarray(row["plain"])
            out.append(
                f"| {row['task']} | ×{row['mult']:g} | `{row['method']}` | {row['updates']} | "
                f"{a.mean():.4f} ± {a.std() / np.sqrt(len(a)):.4f} | {p.mean():.4f} ± "
                f"{p.std() / np.sqrt(len(p)):.4f} | {a.mean() - p.mean():+.4f} |"
            )
        out.append("")
    out += diagnosis.report_lines(analytic, tracking, [report.relative(p, path) for p in plot_paths[1:]])
    return report.write_section(path, "scale-quality", "\n".join(out))


TUNE_MULTS = (0.25, 0.5, 1.0, 2.0, 4.0)


def tune(task, cache: Path | None, *, seeds=(0, 1), only_cached=False, log=print) -> list[dict]:
    """The learning-rate sweep at S = 2 (``paper``; the τ clock is the same rule at S = 2 up to its first steps):
    runs at ``TUNE_MULTS`` × the task's peak rate."""
    path = None if cache is None else cache / task.name / "tune.json"
    config = json.loads(json.dumps(task.config()))
    if path is not None and path.exists():
        have = [r for r in json.loads(path.read_text()) if r["config"] == config]
        if have:
            return have
    if only_cached:
        return []
    runs = engine.run_cell(task, "paper", 2, [(m, s) for m in TUNE_MULTS for s in seeds])
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(runs))
    for m in TUNE_MULTS:
        vals = [r["final_loss"] for r in runs if r["lr_mult"] == m]
        each = ", ".join(f"{v:.4f}" for v in vals)
        log(f"{task.name:10s} lr {m * task.learning_rate:<8g} final loss {np.mean(vals):.4f} ({each})")
    return runs

"""The Adam study's tables, plots and README section, from the grid's records."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np

from benchmarks.adam.adam import ADASCALE, BASELINE, METHODS, TUNE_RATES
from benchmarks.adam.tasks import Task
from benchmarks.harness import plots, report, stats

DESCRIPTIONS = {
    BASELINE: "`optax.adamw(lr)`, S = 1, T iterations",
    "AS-a": "`adascale(chain(scale_by_adam, add_decayed_weights), lr)`: r·lr(⌊τ⌋), raw-gradient gain",
    "AS-b": "AS-a with `gain_exponent=0.5`: r^½·lr(⌊τ⌋), τ += r",
    "AS-c": "AS-a with `precondition=adam_preconditioner(b2, eps)`: gain of Adam-preconditioned gradients",
    "AS-c'": "AS-c with `gain_exponent=0.5` (AdaptDL's AdamScale)",
    "sqrt": "`optax.adamw(scaling_rules.square_root(lr, S))`, ⌈T/S⌉ iterations",
    "LSW": "`optax.adamw(scaling_rules.linear_warmup(lr, S, T))`, ⌈T/S⌉ iterations",
}


# --------------------------------------------------------------------------- tables


def worse_by(task: Task, base_values, values) -> tuple[float, float]:
    """``(how much worse than S = 1, two standard errors of the difference)``; positive is worse."""
    return stats.worse_by(task.higher_is_better, base_values, values)


def failed(task: Task, record) -> bool:
    """A run that did not train: final training loss non-finite or no better than uniform guessing (ln K)."""
    loss = record["final"]["train_loss"]
    return not math.isfinite(loss) or loss > 0.98 * task.chance_loss


def flag(task: Task, base_values, values, num_failed=0) -> str:
    """``✗``: worse than S = 1 by more than 2 SE of the difference *and* the task's tolerance, or a seed failed;
    ``~``: beyond 2 SE but within the tolerance."""
    if num_failed or not np.all(np.isfinite(values)):
        return " ✗"
    diff, se2 = worse_by(task, base_values, values)
    if diff > max(se2, task.tolerance):
        return " ✗"
    if diff > se2 and diff > 0:
        return " ~"
    return ""


def _recs(results, task, method, scale, seeds):
    recs = [results.get((task.name, method, scale, seed)) for seed in seeds]
    return None if any(r is None for r in recs) else recs


def table(task: Task, results, scales, seeds) -> str:
    digits = 2 if task.higher_is_better else 4
    show_val = task.metric != "val. loss (nats/byte)"  # the LM's metric is its validation loss
    head = f"| S | method | {task.metric} | Δ vs S = 1 |" + (" val. loss |" if show_val else "")
    head += " train loss | iterations | mean gain | examples ÷ S=1 | per seed |"
    lines = [head, "|---:|---|---:|---:|" + ("---:|" if show_val else "") + "---:|---:|---:|---:|---:|"]
    base = _recs(results, task, BASELINE, 1, seeds)
    base_metric = [r["final"]["metric"] for r in base] if base else None
    T = task.total_steps
    rows = [(1, BASELINE)] + [(s, m) for s in scales if s > 1 for m in METHODS]
    for scale, method in rows:
        recs = _recs(results, task, method, scale, seeds)
        if recs is None:
            lines.append(f"| {scale} | {method} | — | — |" + (" — |" if show_val else "") + " — | — | — | — | — |")
            continue
        metric = [r["final"]["metric"] for r in recs]
        mark = delta = ""
        num_failed = sum(failed(task, r) for r in recs)
        if base_metric is not None and scale > 1:
            mark = flag(task, base_metric, metric, num_failed)
            if num_failed:
                mark += f" ({num_failed}/{len(recs)} failed)"
            diff, se2 = worse_by(task, base_metric, metric)
            signed = -diff if task.higher_is_better else diff
            delta = f"{signed:+.{digits}f} (2 SE {se2:.{digits}f})"
        iters = stats.mean_std([r["iterations"] for r in recs])[0]
        gain = stats.mean_std([r["tau"] / r["iterations"] for r in recs])[0] if method in ADASCALE else float("nan")
        row = f"| {scale} | {method} | {stats.fmt(*stats.mean_std(metric)[:2], digits)}{mark} | {delta} |"
        if show_val:
            row += f" {stats.fmt(*stats.mean_std([r['final']['val_loss'] for r in recs])[:2], 4)} |"
        row += (
            f" {stats.fmt(*stats.mean_std([r['final']['train_loss'] for r in recs])[:2], 4)} | {iters:.0f} | "
            f"{'' if math.isnan(gain) else f'{gain:.2f}'} | {iters * scale / T:.2f} | "
            + " / ".join(f"{v:.{max(digits - 1, 1)}f}" for v in metric)
            + " |"
        )
        lines.append(row)
    return "\n".join(lines)


def tune_table(tasks, cache, rates) -> str:
    lines = ["| task | lr (peak) | metric (seed 0, S = 1) | val. loss | train loss |", "|---|---:|---:|---:|---:|"]
    for task in tasks:
        for lr in rates[task.name]:
            r = cache.get(dataclasses.replace(task, learning_rate=lr), BASELINE, 1, 0)
            if r is None:
                continue
            bold = "**" if lr == task.learning_rate else ""
            f = r["final"]
            lines.append(
                f"| {task.name} | {bold}{lr:g}{bold} | {f['metric']:.4f} | {f['val_loss']:.4f} | "
                f"{f['train_loss']:.4f} |"
            )
    return "\n".join(lines) if len(lines) > 2 else "_(no `--tune` cells in the cache)_"


# --------------------------------------------------------------------------- plots


STYLES = {
    "AS-a": ("C0", "-"),
    "AS-b": ("C1", "-"),
    "AS-c": ("C2", "-"),
    "AS-c'": ("C3", "-"),
    "sqrt": ("C4", ":"),
    "LSW": ("C5", ":"),
    BASELINE: ("k", "--"),
}


def make_plots(tasks, results, scales, seeds, plot_dir: Path) -> list[Path]:
    plt = plots.pyplot()

    plot_dir.mkdir(parents=True, exist_ok=True)
    big = [s for s in scales if s > 1]
    paths = []

    # τ-aligned validation curves: one row per S > 1 (the largest last), S = 1 dashed.
    fig, axes = plt.subplots(len(big), len(tasks), figsize=(5.2 * len(tasks), 3.6 * len(big)), squeeze=False)
    for i, s in enumerate(big):
        for j, task in enumerate(tasks):
            ax = axes[i, j]
            for method in (BASELINE, *METHODS):
                tau, val = plots.mean_curve(results, task.name, method, 1 if method == BASELINE else s, seeds)
                if tau is None:
                    continue
                color, ls = STYLES[method]
                label = "S=1 (adamw)" if method == BASELINE else method
                ax.plot(tau[1:], val[1:], color=color, ls=ls, marker="." if method != BASELINE else None, label=label)
            ax.set_title(f"{task.title}, S={s}", fontsize=9)
            ax.set_xlabel("τ (base-batch steps)")
            ax.set_ylabel(task.metric)
            if task.higher_is_better:
                lo = min(50.0, ax.get_ylim()[1] - 1)
                ax.set_ylim(bottom=max(ax.get_ylim()[0], lo))
            else:
                ax.set_yscale("log")
            ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(plots.save(fig, plot_dir / "adam_curves.png"))

    # Gain trajectories (seed 0) of the AdaScale candidates at every S > 1.
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.2 * len(tasks), 3.8), squeeze=False)
    for j, task in enumerate(tasks):
        ax = axes[0, j]
        for s, ls in zip(big, ("--", "-", "-."), strict=False):
            for method in ADASCALE:
                r = results.get((task.name, method, s, seeds[0]))
                if r is not None:
                    ax.plot(
                        plots.log_tau(r),
                        r["logs"]["gain"],
                        color=STYLES[method][0],
                        ls=ls,
                        lw=1,
                        label=f"{method}, S={s}",
                    )
            ax.axhline(s, color="grey", lw=0.5)
        ax.set_xlabel("τ (base-batch steps)")
        ax.set_ylabel("gain r_t")
        ax.set_yscale("log")
        ax.set_title(f"{task.title}: gain (seed {seeds[0]})", fontsize=9)
        ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    paths.append(plots.save(fig, plot_dir / "adam_gain.png"))

    # Step size actually taken vs τ at the largest S, S = 1 dashed.
    s = big[-1] if big else 1
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.2 * len(tasks), 3.6), squeeze=False)
    for j, task in enumerate(tasks):
        ax = axes[0, j]
        for method in (BASELINE, *METHODS):
            r = results.get((task.name, method, 1 if method == BASELINE else s, seeds[0]))
            if r is None:
                continue
            color, ls = STYLES[method]
            ax.plot(plots.log_tau(r), r["logs"]["lr"], color=color, ls=ls, lw=1, label=method)
        ax.set_xlabel("τ (base-batch steps)")
        ax.set_ylabel("step size (lr × gain factor)")
        ax.set_yscale("log")
        ax.set_title(f"{task.title}: step size, S={s} (seed {seeds[0]})", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(plots.save(fig, plot_dir / "adam_lr.png"))
    return paths


PLOT_CAPTIONS = {
    "adam_curves.png": "validation metric vs τ (base-batch steps; S·t for the fixed rules) for every candidate "
    "at S = 4 (top) and the largest S (bottom), means over seeds; S = 1 AdamW dashed.",
    "adam_gain.png": "gain r_t vs τ of the four AdaScale candidates (seed 0); dashed S = 4, solid S = 16, "
    "grey lines at r = S.",
    "adam_lr.png": "step size actually taken (r^p·lr(⌊τ⌋) for AdaScale, the rule's lr for sqrt/LSW) vs τ at the "
    "largest S (seed 0), S = 1 dashed.",
}


# --------------------------------------------------------------------------- report


def write_report(path: Path, tasks, results, scales, seeds, plot_paths, command, wall_s, cache, *, smoke=False):
    """Write the "adam" section of ``path`` (the study's README.md); its hand-written reading is kept."""
    rel = lambda p: report.relative(p, path)  # noqa: E731
    reading = report.kept_reading(path, "adam")
    run_s = sum(r["wall_s"] for r in results.values())
    out = [
        "## Adam",
        "",
        "Does AdaScale carry over to Adam(W)? Which gain rule keeps the S = 1 quality when the batch is S× larger, "
        "with a warm-up + cosine schedule tuned once at S = 1?",
        "",
        f"Command: `{command}` ({len(seeds)} seed{'s' if len(seeds) > 1 else ''}, "
        f"S ∈ {{{', '.join(map(str, scales))}}}; "
        + ("smoke mode: tiny models and budgets" if smoke else "cells cached under `benchmarks/adam/cells/`")
        + f"; the {len(results)} cells took {run_s / 60:.0f} min of wall time when they ran, compilation included, "
        f"this invocation {wall_s:.0f} s).",
        "",
        reading,
        "",
        "### Setup",
        "",
        "S replicas are a `jax.vmap` axis, each with the base batch B drawn i.i.d. with replacement; a whole run is "
        "one jitted program (`lax.scan` over evaluation checkpoints of `lax.while_loop` steps). For each seed every "
        "method starts from the same initialisation and, at a given S, sees the same stream of batches. The "
        "schedule is `optax.warmup_cosine_decay_schedule(0, lr, 5 % of T, T, lr/10)` of the base-batch step, tuned "
        "once at S = 1 (`--tune`, one seed) and never per S; weight decay is decoupled (AdamW), on the weight "
        "matrices (and the LM's tied embedding) only.",
        "",
        "| task | model | params | B | T (base steps) | peak lr | weight decay | β₁, β₂, ε |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for t in tasks:
        unit = "windows" if t.name == "lm" else "examples"
        out.append(
            f"| {t.name} | {t.info['model']} | {t.num_params():,} | {t.batch_size} {unit} | {t.total_steps} | "
            f"{t.learning_rate:g} | {t.weight_decay:g} | {t.b1}, {t.b2}, {t.eps:g} |"
        )
    lm = next((t for t in tasks if t.name == "lm"), None)
    if lm is not None:
        c = lm.config()
        out += [
            "",
            f"LM data: {c['files']} files `{c['corpus']}` (Python {c['python']}), {c['bytes']:,} bytes (sha256 "
            f"{c['sha256']}…); the first 95 % cut into {c['train_windows']:,} fixed windows of ctx+1 bytes for "
            f"training, the last 5 % into windows of which {c['val_windows']} evenly spaced ones are the validation "
            f"set ({c['train_eval_windows']} training windows for the training loss).",
        ]
    out += ["", "Methods:", ""]
    out += [f"- **{m}**: {DESCRIPTIONS[m]}" for m in (BASELINE, *METHODS)]
    out += [
        "",
        "Columns: mean ± std over seeds at the end (τ = T); Δ: difference of the means from S = 1 (positive = higher) "
        "with two standard errors of that difference; mean gain: τ/iterations; examples ÷ S=1: iterations·S/T. "
        "✗: worse than S = 1 by more than 2 SE of the difference *and* by the practical tolerance "
        + ", ".join(f"{t.tolerance:g} ({t.metric})" for t in tasks)
        + ", or a seed failed (final training loss non-finite or within 2 % of uniform guessing, ln K); "
        "~: beyond 2 SE but within the tolerance. Per seed: the final metric of seeds 0, 1, 2.",
    ]
    for t in tasks:
        out += ["", f"### {t.title}", "", table(t, results, scales, seeds)]
    out += ["", "### Learning-rate sweep at S = 1 (`--tune`)", "", tune_table(tasks, cache, TUNE_RATES)]
    out += ["", "### Plots", ""]
    for p in plot_paths:
        out += [f"- `{rel(p)}`: {PLOT_CAPTIONS.get(Path(p).name, '')}", "", f"  ![{Path(p).stem}]({rel(p)})", ""]
    return report.write_section(path, "adam", "\n".join(out))

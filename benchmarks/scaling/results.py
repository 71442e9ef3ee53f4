"""The scaling study's tables, plots and README section, from the grid's records."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from benchmarks.harness import plots, report, stats
from benchmarks.scaling.scaling import (
    ELASTIC_PHASES,
    METHODS,
    OFFLINE_BATCHES,
    check_closed_form,
)

# --------------------------------------------------------------------------- tables


def is_worse(task, base_values, values):
    """Significantly worse than ``S = 1``: beyond 2 standard errors of the difference *and* the task's tolerance."""
    if not np.all(np.isfinite(values)):
        return True
    diff, se2 = stats.worse_by(task.higher_is_better, base_values, values)
    tol = task.tolerance if task.higher_is_better else task.tolerance * abs(stats.mean_std(base_values)[0])
    return diff > max(se2, tol)


def _fmt_sci(mean, std):
    if not math.isfinite(mean):
        return "diverged"
    return f"{mean:.3g} ± {std:.2g}"


def _diverged(record):
    """A run that ended with a non-finite training loss or one above its initial loss."""
    loss = record["final"]["train_loss"]
    return not math.isfinite(loss) or loss > record["curve"]["train_loss"][0]


def table(task, results, scales, seeds):
    """Markdown table in the layout of the paper's Table 2."""
    head = "| S |" + "".join(f" {m} {task.metric} | {m} train loss | {m} iters |" for m in METHODS)
    lines = [head, "|---:|" + "---:|---:|---:|" * len(METHODS)]
    fmt = (lambda m, s: stats.fmt(m, s, 2)) if task.higher_is_better else _fmt_sci
    for scale in scales:
        row = f"| {scale} |"
        for method in METHODS:
            recs = [results.get((task.name, method, scale, seed)) for seed in seeds]
            if any(r is None for r in recs):
                row += " — | — | — |"
                continue
            metric = [r["final"]["metric"] for r in recs]
            loss = [r["final"]["train_loss"] for r in recs]
            diverged = sum(_diverged(r) for r in recs)
            base = [results[(task.name, method, scales[0], seed)]["final"]["metric"] for seed in seeds]
            flag = " ✗" if scale != scales[0] and (diverged or is_worse(task, base, metric)) else ""
            if diverged:
                flag += f" ({diverged}/{len(recs)} diverged)"
            iters = stats.mean_std([r["iterations"] for r in recs])[0]
            row += f" {fmt(*stats.mean_std(metric)[:2])}{flag} | {_fmt_sci(*stats.mean_std(loss)[:2])} | {iters:.0f} |"
        lines.append(row)
    return "\n".join(lines)


def elastic_table(tasks, results, seeds):
    lines = [
        "| task | run | " + "metric | train loss | iters | τ at end |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for task in tasks:
        if (task.name, "elastic", ELASTIC_PHASES[-1][0], seeds[0]) not in results:
            continue
        fmt = (lambda m, s: stats.fmt(m, s, 2)) if task.higher_is_better else _fmt_sci
        for label, method, scale in (("AS, S = 2", "AS", 2), ("AS, S = 2→4→8", "elastic", 8), ("AS, S = 8", "AS", 8)):
            recs = [results.get((task.name, method, scale, seed)) for seed in seeds]
            if any(r is None for r in recs):
                continue
            metric = stats.mean_std([r["final"]["metric"] for r in recs])
            loss = stats.mean_std([r["final"]["train_loss"] for r in recs])
            iters = stats.mean_std([r["iterations"] for r in recs])[0]
            tau = stats.mean_std([r["tau"] for r in recs])[0]
            lines.append(
                f"| {task.name} ({task.metric}) | {label} | {fmt(*metric[:2])} | {_fmt_sci(*loss[:2])} | "
                f"{iters:.0f} | {tau:.0f} |"
            )
    return "\n".join(lines)


def gain_error_table(tasks, results, scales, seed):
    """Online gain relative to the closed form (regression) and to the offline estimate (classification)."""
    scales = [s for s in scales if s > 1]  # S = 1: the gain is 1 by definition
    lines = [
        "| task | online gain vs | " + " | ".join(f"S={s}" for s in scales) + " |",
        "|---|---|" + "---:|" * len(scales),
    ]
    for task in tasks:
        row_true, row_off, batches = [], [], OFFLINE_BATCHES
        for s in scales:
            r = results.get((task.name, "AS", s, seed))
            if r is None:
                row_true.append("—")
                row_off.append("—")
                continue
            track = gain_tracking(task, r, s)
            if "closed" in track:
                row_true.append(f"{_pct(track['closed'][0])} / {_pct(track['closed'][1])}")
            if "offline" in track:
                batches = r["offline"].get("batches", OFFLINE_BATCHES)
                row_off.append(f"{_pct(track['offline'][0])} / {_pct(track['offline'][1])}")
            else:
                row_off.append("—")
        if task.moments is not None:
            lines.append(f"| {task.name} | closed form (mean after 10 % of iters / at end) | {' | '.join(row_true)} |")
        if any(x != "—" for x in row_off):
            lines.append(
                f"| {task.name} | offline, {batches} fresh batches (mean over checkpoints / at end) | "
                f"{' | '.join(row_off)} |"
            )
    return "\n".join(lines)


def _pct(x):
    return f"{100 * x:+.0f} %"


def gain_tracking(task, record, scale):
    """How closely a run's online gain followed the truth: relative deviations (negative: online lower).

    Returns a dict with, where available,

    * ``"closed"``: ``(mean after the first 10 % of iterations, at the end, mean absolute deviation after
      10 %)`` against the closed form (regression; the means weight the thinned logs by the iterations each
      covers);
    * ``"offline"``: ``(mean over checkpoints, at the end, noise, standard error of the mean)`` against the
      offline estimate, where ``noise`` is the RMS relative standard error of the offline gain itself, from its
      two halves (``|r₁ − r₂|/2`` estimates the standard error of their mean), and the standard error is the
      spread of the deviations over the checkpoints ``/ √K``.
    """
    out = {}
    it = np.asarray(record["logs"]["it"], np.float64)
    gain = np.asarray(record["logs"]["gain"])
    if task.moments is not None:
        true = np.asarray(record["logs"]["true_gain"])
        late = it >= 0.1 * record["iterations"]
        rel = gain[late] / true[late] - 1.0
        weights = np.gradient(it[late]) if late.sum() > 1 else None  # the logs are thinned unevenly
        out["closed"] = (
            float(np.average(rel, weights=weights)),
            float(rel[-1]),
            float(np.average(np.abs(rel), weights=weights)),
        )
    if "offline" in record:
        off = offline_gain(record, scale)
        rel = np.interp(record["offline"]["tau"], plots.log_tau(record), gain) / off - 1.0
        noise = float("nan")
        halves = record["offline"].get("halves")
        if halves is not None:
            g1, g2 = (_gain(np.asarray(sig), np.asarray(mu), scale) for sig, mu in zip(*halves.values(), strict=True))
            noise = float(np.sqrt(np.mean(((g1 - g2) / 2 / off) ** 2)))
        se = float(np.std(rel, ddof=1) / math.sqrt(len(rel))) if len(rel) > 1 else float("nan")
        out["offline"] = (float(np.mean(rel)), float(rel[-1]), noise, se)
    return out


def tracking_table(tasks, results, scales, seeds, methods):
    """:func:`gain_tracking` of each method at each ``S > 1``, as a Markdown table.

    Closed form (regression): means over the seeds of (mean deviation after 10 % of iterations / at the end /
    mean absolute deviation). Offline (first seed only): mean deviation over the checkpoints ± its standard error
    / at the end; a first row gives the offline estimate's own noise.
    """
    scales = [s for s in scales if s > 1]
    lines = [
        "| task | reference | estimator | " + " | ".join(f"S={s}" for s in scales) + " |",
        "|---|---|---|" + "---:|" * len(scales),
    ]
    for task in tasks:
        if task.moments is not None:
            for method in methods:
                cells = []
                for s in scales:
                    recs = [results.get((task.name, method, s, seed)) for seed in seeds]
                    tracks = [gain_tracking(task, r, s)["closed"] for r in recs if r is not None]
                    if not tracks:
                        cells.append("—")
                        continue
                    mean, end, dev = np.mean(tracks, axis=0)
                    cells.append(f"{_pct(mean)} / {_pct(end)} / {100 * dev:.0f} %")
                n = sum((task.name, method, scales[-1], seed) in results for seed in seeds)
                label = f"closed form, {n} seed{'s' if n > 1 else ''}: mean / end / mean abs."
                lines.append(f"| {task.name} | {label} | {_label(method)} | {' | '.join(cells)} |")
        offline = {s: results.get((task.name, "AS", s, seeds[0]), {}).get("offline") for s in scales}
        if not any(offline.values()):
            continue
        noise = [gain_tracking(task, results[(task.name, "AS", s, seeds[0])], s)["offline"][2] for s in scales]
        lines.append(
            f"| {task.name} | offline estimate's own noise (RMS) | — | "
            + " | ".join("—" if not math.isfinite(x) else f"±{100 * x:.0f} %" for x in noise)
            + " |"
        )
        for method in methods:
            cells = []
            for s in scales:
                r = results.get((task.name, method, s, seeds[0]))
                t = gain_tracking(task, r, s).get("offline") if r is not None else None
                cells.append("—" if t is None else f"{100 * t[0]:+.0f} ± {100 * t[3]:.0f} % / {_pct(t[1])}")
            label = f"offline, seed {seeds[0]}: mean ± s.e. over checkpoints / end"
            lines.append(f"| {task.name} | {label} | {_label(method)} | {' | '.join(cells)} |")
    return "\n".join(lines)


def _quality_flags(task, results, method, scale, seeds, scales):
    """``(records, flag)``: ✗ significantly worse than S = 1 or a diverged seed; ↓ worse than AS at this S."""
    recs = [results.get((task.name, method if scale > 1 else "AS", scale, seed)) for seed in seeds]
    if any(r is None for r in recs):
        return None, ""
    metric = [r["final"]["metric"] for r in recs]
    base = [results[(task.name, "AS", scales[0], seed)]["final"]["metric"] for seed in seeds]
    flag = " ✗" if scale != scales[0] and (any(map(_diverged, recs)) or is_worse(task, base, metric)) else ""
    if method != "AS" and scale > 1:
        ref = [results[(task.name, "AS", scale, seed)]["final"]["metric"] for seed in seeds]
        flag += " ↓" if is_worse(task, ref, metric) else ""
    return recs, flag


def estimator_table(task, results, scales, seeds, methods):
    """Final metric and iterations of AS and its estimator variants, the variants' iterations relative to AS."""
    head = "| S |" + "".join(
        f" {_label(m)} {task.metric} | {_label(m)} iters |" + ("" if m == "AS" else " vs AS |") for m in methods
    )
    lines = [head, "|---:|" + "".join("---:|---:|" + ("" if m == "AS" else "---:|") for m in methods)]
    fmt = (lambda m, s: stats.fmt(m, s, 2)) if task.higher_is_better else _fmt_sci
    for scale in scales:
        row = f"| {scale} |"
        as_iters = None
        for method in methods:
            recs, flag = _quality_flags(task, results, method, scale, seeds, scales)
            if recs is None:
                row += " — | — |" + ("" if method == "AS" else " — |")
                continue
            iters = stats.mean_std([r["iterations"] for r in recs])[0]
            row += f" {fmt(*stats.mean_std([r['final']['metric'] for r in recs])[:2])}{flag} | {iters:.0f} |"
            if method == "AS":
                as_iters = iters
            else:
                row += f" {100 * (iters / as_iters - 1):+.0f} % |" if as_iters else " — |"
        lines.append(row)
    return "\n".join(lines)


def iterations_saved_table(tasks, results, scales, seeds, method):
    """AS's iterations → the variant's, per task and ``S``, with the quality flags of :func:`estimator_table`."""
    scales_up = [s for s in scales if s > 1]
    lines = ["| task | " + " | ".join(f"S={s}" for s in scales_up) + " |", "|---|" + "---:|" * len(scales_up)]
    for task in tasks:
        cells = []
        for s in scales_up:
            as_recs, _ = _quality_flags(task, results, "AS", s, seeds, scales)
            recs, flag = _quality_flags(task, results, method, s, seeds, scales)
            if as_recs is None or recs is None:
                cells.append("—")
                continue
            a, b = (stats.mean_std([r["iterations"] for r in rs])[0] for rs in (as_recs, recs))
            cells.append(f"{a:.0f} → {b:.0f} ({100 * (b / a - 1):+.0f} %){flag}")
        lines.append(f"| {task.name} | {' | '.join(cells)} |")
    return "\n".join(lines)


def _label(method):
    return "AS (default)" if method == "AS" else f"`{method}`"


def _gain(sigma2, mu2, scale):
    mu2 = np.maximum(mu2, 0.0)
    return (sigma2 + mu2) / (sigma2 / scale + mu2)


def offline_gain(record, scale):
    return _gain(np.asarray(record["offline"]["sigma2"]), np.asarray(record["offline"]["mu2"]), scale)


# --------------------------------------------------------------------------- plots


def make_plots(tasks, results, scales, seeds, plot_dir):
    plt = plots.pyplot()

    plot_dir.mkdir(parents=True, exist_ok=True)
    colors = plt.cm.viridis(np.linspace(0, 0.9, len(scales)))
    paths = []

    # Fig. 1 / 3: validation metric vs τ, AdaScale (top) and LSW (bottom).
    fig, axes = plt.subplots(2, len(tasks), figsize=(4.5 * len(tasks), 7), squeeze=False)
    for j, task in enumerate(tasks):
        for row, method in enumerate(("AS", "LSW")):
            ax = axes[row, j]
            for c, s in zip(colors, scales, strict=True):
                tau, val = plots.mean_curve(results, task.name, method, s, seeds)
                if tau is not None:
                    ax.plot(tau, val, color=c, label=f"S={s}")
            ax.set_title(f"{task.title}: {method}")
            ax.set_xlabel("τ (base-batch steps)" if method == "AS" else "S·t (base-batch steps)")
            ax.set_ylabel(task.metric)
            if not task.higher_is_better:
                ax.set_yscale("log")
            else:
                ax.set_ylim(bottom=max(0.0, ax.get_ylim()[0]))
        axes[0, j].legend(fontsize=7)
    fig.tight_layout()
    paths.append(plots.save(fig, plot_dir / "scaling_curves.png"))

    # Effective learning rate vs iteration: AdaScale's warm-up emerges.
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.5 * len(tasks), 3.6), squeeze=False)
    for j, task in enumerate(tasks):
        ax = axes[0, j]
        for c, s in zip(colors, scales, strict=True):
            r = results.get((task.name, "AS", s, seeds[0]))
            if r is not None:
                ax.plot(np.asarray(r["logs"]["it"]) + 1, r["logs"]["lr"], color=c, label=f"AS S={s}")
        r = results.get((task.name, "LSW", scales[-1], seeds[0]))
        if r is not None:
            ax.plot(np.asarray(r["logs"]["it"]) + 1, r["logs"]["lr"], "k--", lw=1, label=f"LSW S={scales[-1]}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("iteration")
        ax.set_ylabel("effective learning rate r_t·lr(⌊τ_t⌋)")
        ax.set_title(task.title)
    axes[0, 0].legend(fontsize=7)
    fig.tight_layout()
    paths.append(plots.save(fig, plot_dir / "scaling_lr.png"))

    # Gain: online vs closed form (regression) and vs offline estimate (classification).
    show = [s for s in scales if s in (4, 16, 64)] or [scales[-1]]
    reg = [t for t in tasks if t.moments is not None]
    off = [t for t in tasks if any("offline" in results.get((t.name, "AS", s, seeds[0]), {}) for s in scales)]
    panels = reg + off
    if panels:
        fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.8), squeeze=False)
        for j, task in enumerate(panels):
            ax = axes[0, j]
            for c, s in zip(plt.cm.plasma(np.linspace(0, 0.8, len(show))), show, strict=True):
                r = results.get((task.name, "AS", s, seeds[0]))
                if r is None:
                    continue
                tau = plots.log_tau(r)
                ax.plot(tau, r["logs"]["gain"], color=c, lw=1, label=f"online, S={s}")
                if task.moments is not None:
                    ax.plot(tau, r["logs"]["true_gain"], color=c, ls="--", lw=1.5, label=f"closed form, S={s}")
                if "offline" in r:
                    ax.plot(r["offline"]["tau"], offline_gain(r, s), "o", color=c, ms=4, label=f"offline, S={s}")
            ax.set_xlabel("τ (base-batch steps)")
            ax.set_ylabel("gain r_t")
            ax.set_title(f"{task.title}: gain")
            ax.legend(fontsize=6)
        fig.tight_layout()
        paths.append(plots.save(fig, plot_dir / "scaling_gain.png"))

    # Elastic: S = 2 → 4 → 8 at τ = T/4, T/2.
    el = [t for t in tasks if (t.name, "elastic", ELASTIC_PHASES[-1][0], seeds[0]) in results]
    if el:
        fig, axes = plt.subplots(2, len(el), figsize=(4.5 * len(el), 6.5), squeeze=False)
        for j, task in enumerate(el):
            ax = axes[0, j]
            for label, method, s, style in (
                ("S=2", "AS", 2, ":"),
                ("S=8", "AS", 8, "--"),
                ("S=2→4→8", "elastic", 8, "-"),
            ):
                tau, val = plots.mean_curve(results, task.name, method, s, seeds)
                if tau is not None:
                    ax.plot(tau, val, style, label=label)
            for _, frac in ELASTIC_PHASES[:-1]:
                ax.axvline(frac * task.total_steps, color="grey", lw=0.5)
            ax.set_title(f"{task.title}: elastic AdaScale")
            ax.set_xlabel("τ")
            ax.set_ylabel(task.metric)
            if not task.higher_is_better:
                ax.set_yscale("log")
            ax.legend(fontsize=7)
            ax = axes[1, j]
            r = results[(task.name, "elastic", ELASTIC_PHASES[-1][0], seeds[0])]
            ax.plot(plots.log_tau(r), r["logs"]["gain"], lw=1, label="gain r_t")
            scale_at = np.asarray([_elastic_scale(t, task) for t in plots.log_tau(r)])
            ax.plot(plots.log_tau(r), scale_at, "k--", lw=1, label="S")
            ax.set_xlabel("τ")
            ax.set_ylabel("gain")
            ax.legend(fontsize=7)
        fig.tight_layout()
        paths.append(plots.save(fig, plot_dir / "scaling_elastic.png"))
    return paths


def make_tracking_plot(tasks, results, scales, seed, methods, plot_dir):
    """Online gain of AS and its estimator variants vs the closed form (regression) and the offline estimate."""
    shown = [s for s in scales if s in (16, 64)] or [max(scales)]
    plt = plots.pyplot()

    panels = [t for t in tasks if t.moments is not None]
    panels += [t for t in tasks if any("offline" in results.get((t.name, "AS", s, seed), {}) for s in shown)]
    if not panels or len(methods) < 2:
        return None
    fig, axes = plt.subplots(len(panels), len(shown), figsize=(5.5 * len(shown), 3.4 * len(panels)), squeeze=False)
    colors = ["0.55", "tab:red", "tab:blue", "tab:green"]
    for i, task in enumerate(panels):
        for j, s in enumerate(shown):
            ax = axes[i, j]
            for method, color in zip(methods, colors, strict=False):
                r = results.get((task.name, method, s, seed))
                if r is None:
                    continue
                tau = plots.log_tau(r)
                ax.plot(tau, r["logs"]["gain"], color=color, lw=0.9, label=f"online, {_label(method).strip('`')}")
                if task.moments is not None:
                    ax.plot(tau, r["logs"]["true_gain"], color=color, ls="--", lw=1.3, label="closed form (same run)")
                if "offline" in r:
                    ax.plot(
                        r["offline"]["tau"],
                        offline_gain(r, s),
                        "o",
                        color=color,
                        mec="k",
                        mew=0.5,
                        ms=5,
                        label="offline (same run)",
                    )
            ax.set_title(f"{task.title}, S = {s}, seed {seed}")
            ax.set_xlabel("τ (base-batch steps)")
            ax.set_ylabel("gain r_t")
            ax.set_ylim(0, s * 1.05)
            ax.legend(fontsize=6)
    fig.tight_layout()
    return plots.save(fig, plot_dir / "scaling_tracking.png")


def _elastic_scale(tau, task):
    for s, frac in ELASTIC_PHASES:
        if tau < frac * task.total_steps:
            return s
    return ELASTIC_PHASES[-1][0]


# --------------------------------------------------------------------------- report


PLOT_CAPTIONS = {
    "scaling_curves.png": "validation metric vs τ for AdaScale (top; the curves of all S should align, paper "
    "Fig. 3) and vs S·t for LSW (bottom); means over seeds.",
    "scaling_lr.png": "AdaScale's effective learning rate r_t·lr(⌊τ_t⌋) vs iteration (seed 0), LSW at the largest "
    "S dashed: AdaScale's warm-up emerges from the gain (paper Fig. 1).",
    "scaling_gain.png": "online gain vs the closed-form gain (regression) and vs the offline estimate from fresh "
    "batches at checkpoints (MNIST-1D), seed 0 (paper Fig. 2).",
    "scaling_elastic.png": "elastic AdaScale, S = 2 → 4 → 8 at τ = T/4 and T/2, against constant S = 2 and S = 8 "
    "(top, means over seeds), and its gain (bottom, seed 0).",
    "scaling_tracking.png": "online gain of the default estimator (grey) and of the horizon estimator (colour) vs the "
    "closed form of the same run (regression, dashed) and vs the offline estimate at its checkpoints (MNIST-1D, "
    "dots), at S = 16 and 64, seed 0.",
}


def write_report(path, tasks, results, scales, seeds, plot_paths, command, wall_s, *, smoke=False, estimators=()):
    """Write the "scaling" section of ``path`` (the study's README.md); its hand-written reading is kept."""
    rel = lambda p: report.relative(p, path)  # noqa: E731
    reading = report.kept_reading(path, "scaling")
    out = [
        "## Scaling",
        "",
        "AdaScale vs. fixed scaling rules: a miniature of the paper's Table 2 and Figures 1-3.",
        "",
        f"Command: `{command}` ({len(seeds)} seed{'s' if len(seeds) > 1 else ''}, "
        f"S ∈ {{{', '.join(map(str, scales))}}}; "
        + (
            "smoke mode: tiny budgets, nothing cached"
            if smoke
            else "cells are cached under `benchmarks/scaling/cells/`"
        )
        + f"; this invocation took {wall_s:.0f} s).",
        "",
        reading,
        "",
        "### Setup",
        "",
        "S replicas are a `jax.vmap` axis, each with the base batch B (drawn i.i.d. with replacement); a whole run "
        "is one jitted program (`lax.scan` over evaluation checkpoints of `lax.while_loop` steps). For each seed "
        "the three methods start from the same initialisation and see the same stream of batches. One schedule "
        "per task, tuned once at S = 1 (`--tune`) and never per S:",
        "",
        "| task | model | B | T (base steps) | schedule lr(t) | momentum |",
        "|---|---|---:|---:|---|---:|",
    ]
    for t in tasks:
        sched = f"{t.learning_rate:g}, " + ("×0.1 at T/2 and at 3T/4" if t.decay == "step" else "·0.01^(t/T)")
        model = t.config().get("sizes", f"linear, d = {t.config().get('dim')}")
        out.append(f"| {t.name} | {model} | {t.batch_size} | {t.total_steps} | {sched} | {t.momentum} |")
    out += [
        "",
        "- **AS**: `optax_adascale.adascale_sgd(lr, momentum, axis_name=...)`, trained until τ ≥ T.",
        "- **LSW+**: `optax.sgd(scaling_rules.stretched_linear_warmup(lr, S, T, N), momentum)` with N = AS's "
        "iteration count at the same S and seed; gradients averaged with `lax.pmean`.",
        "- **LSW**: `optax.sgd(scaling_rules.linear_warmup(lr, S, T), momentum)`, T/S iterations.",
        "",
        "Columns: mean ± std over seeds of the final validation metric and the final training loss (full training "
        "set; for the streaming regression, the population loss ½(eᵀΣe + s²)) and the mean iteration count. "
        "✗: significantly worse than S = 1 — worse by more than two standard errors of the difference and by more "
        "than 1 accuracy point (classification) or 10 % of the excess risk (regression) — or a seed diverged "
        "(final training loss non-finite or above the initial one). At S = 1 the three methods are the same "
        "algorithm (AdaScale with one replica is the identity), so their rows agree.",
    ]
    reg = [t for t in tasks if t.moments is not None]
    if reg:
        err_sigma, err_mu, n = check_closed_form(reg[0], num_batches=2_000 if smoke else 50_000)
        out += [
            "",
            "**Closed-form gain (regression).** x ~ N(0, Σ), Σ = diag(λ), y = x·w* + ε, ε ~ N(0, s²), loss "
            "½(x·w − y)², e = w − w*. The per-example gradient g = x(xᵀe − ε) has mean Σe and, by Isserlis' "
            "theorem, covariance Σeeᵀ Σ + (eᵀΣe + s²)Σ. For a base batch of B examples "
            "μ² = ‖Σe‖² and σ² = (‖Σe‖² + (eᵀΣe + s²)·tr Σ)/B, and the true gain at scale S is "
            "(σ² + μ²)/(σ²/S + μ²), evaluated at every iteration's parameters. Monte-Carlo check at a random w "
            f"({n:,} batches): σ² off by {100 * err_sigma:+.2f} %, μ² by {100 * err_mu:+.2f} %.",
        ]
    for t in tasks:
        out += ["", f"### {t.title} ({t.metric})", "", table(t, results, scales, seeds)]
    out += ["", "### Elastic AdaScale: S = 2 → 4 → 8 at τ = T/4 and T/2", ""]
    out += [
        "The optimizer state is carried over unchanged; only the vmap axis grows (AdaScale's statistics are in "
        "base-batch units).",
        "",
        elastic_table(tasks, results, seeds),
    ]
    out += [
        "",
        "### Gain estimates (seed 0)",
        "",
        "Relative deviation of AdaScale's online gain from the reference (negative: the online gain is lower).",
        "",
        gain_error_table(tasks, results, scales, seeds[0]),
    ]
    variants = [m for m in estimators if any(k[1] == m for k in results)]
    if variants:
        out += ["", estimator_section(tasks, results, scales, seeds, variants)]
    out += ["", "### Plots", ""]
    for p in plot_paths:
        out += [f"- `{rel(p)}`: {PLOT_CAPTIONS.get(Path(p).name, '')}", "", f"  ![{Path(p).stem}]({rel(p)})", ""]
    return report.write_section(path, "scaling", "\n".join(out))


def estimator_section(tasks, results, scales, seeds, variants):
    """The "A gain that keeps up" subsection: tracking, quality and iterations of the estimator variants."""
    tasks = [t for t in tasks if any(k[0] == t.name and k[1] == variants[0] for k in results)]
    v_seeds = [
        seed for seed in seeds if all((t.name, variants[0], s, seed) in results for t in tasks for s in scales if s > 1)
    ]
    methods = ("AS", *variants)
    out = [
        "### A gain that keeps up: estimator options",
        "",
        "AS is the package default (`Estimator()`: moving averages whose memory is max(0.05·τ, 4 updates) "
        'base-batch steps, each step\'s μ̂² averaged unfloored). `AS-fairscale` is `estimator="fairscale"`, '
        "the 0.1–0.2 default (FairScale's θ = 1 − S/1000 per update, each step's μ̂² floored at 0). `AS-H(h)` is "
        "`estimator=Estimator(horizon=h)`: a memory of h base-batch steps of τ (θ_t = exp(−r_{t−1}/h)); "
        "`AS-H(h_σ,h_μ)` gives σ̄² and μ̄² their own; `T/k` is the task's budget over k (MNIST-1D 3072, digits "
        "1536, regression 2048 base steps). `+floored` is `unbiased_sqr=False`. `AS-delayed` is "
        "`delayed_gain=True` with the default averages: the gain of update t from the averages through update "
        "t − 1 (a fidelity check of the cheaper mode, not a "
        "tracking option). At S = 1 every "
        f"variant is AS (the identity). Variants: seeds {', '.join(map(str, v_seeds))}.",
        "",
        "**Tracking.** Relative deviation of the online gain from the closed form (regression: mean after the "
        "first 10 % of iterations / at the end / mean absolute deviation, averaged over the seeds) and from the "
        "offline 1000-batch estimate (MNIST-1D, seed 0: mean over the 16 checkpoints ± its standard error / at "
        "the end; the offline estimate's own noise, from its two halves, in the first row).",
        "",
        tracking_table(tasks, results, scales, v_seeds, methods),
        "",
        "**Quality and iterations** (mean ± std over the variants' seeds; ✗: significantly worse than S = 1 as in "
        "the tables above; ↓: significantly worse than AS at the same S, by the same test).",
    ]
    for t in tasks:
        out += ["", f"{t.title} ({t.metric}):", "", estimator_table(t, results, scales, v_seeds, methods)]
    for method in variants:
        out += [
            "",
            f"**Iterations at equal quality**, AS → {_label(method)} (mean over seeds; flags as above):",
            "",
            iterations_saved_table(tasks, results, scales, v_seeds, method),
        ]
    return "\n".join(out)

"""Tables, the tracking plot and the README section of the estimator study."""

from __future__ import annotations

import math

import numpy as np

from benchmarks.estimator import estimator
from benchmarks.harness import plots, report, stats

SECTION = "estimator"
GOAL = 0.10  # tracking error the default must stay within
LABELS = {
    "fairscale": 'FairScale (`estimator="fairscale"`, the 0.1–0.2 default)',
    "H(T/100)+unb": "horizon=T/100, unbiased_sqr",
    "unb": "unbiased_sqr",
    "M(100)+unb": "θ = 1 − n/100, unbiased_sqr",
    "s(0)+unb": "θ = 0 (per step), unbiased_sqr",
}


def label(method: str) -> str:
    """A candidate's name (``frac(0.05)+floor(4)+unb``) as the table spells it."""
    if method in LABELS:
        return LABELS[method]
    words = {"unb": "unbiased_sqr"}
    parts = []
    for part in method.split("+"):
        if part.startswith("frac(") and part.endswith(")"):
            parts.append(f"memory {part[5:-1]}·τ")
        elif part.startswith("floor(") and part.endswith(")"):
            parts.append(f"≥ {part[6:-1]} updates")
        else:
            parts.append(words.get(part, part))
    text = ", ".join(parts)
    return f"{text} (**the default**)" if method == estimator.PACKAGE_DEFAULT else text


def _records(results, task, method, scale, seeds):
    return [results[(task, method, scale, s)] for s in seeds if (task, method, scale, s) in results]


def _failed(record) -> bool:
    loss = record["final"]["train_loss"]
    return not math.isfinite(loss) or loss > record["initial"]["train_loss"]


def quality_flag(setup, results, method, scale, seeds) -> str:
    """``"✗"``: worse than S = 1 by > 2 SE and > the tolerance, or a seed failed; ``"~"``: > 2 SE only."""
    base = [r["final"]["metric"] for r in _records(results, setup.name, estimator.BASELINE, 1, seeds)]
    recs = _records(results, setup.name, method, scale, seeds)
    if not recs or not base:
        return ""
    if any(_failed(r) for r in recs):
        return "✗"
    diff, two_se = stats.worse_by(setup.higher_is_better, base, [r["final"]["metric"] for r in recs])
    tol = setup.tolerance * (abs(np.mean(base)) if setup.relative_tolerance else 1.0)
    if diff > two_se and diff > tol:
        return "✗"
    return "~" if diff > two_se else ""


def tracking_summary(results, task, method, scale, seeds):
    """``(bias, error, worst, spread, noise)`` of the online gain against the reference, after 5 % of τ.

    Per window of T/5 in τ, the gain applied (``Δτ/Δiterations``) relative to the reference's harmonic mean
    over the window (:func:`estimator.tracking`), averaged over the seeds: ``bias`` is its mean over the
    windows, ``error`` the mean of its absolute value (the tracking error), ``worst`` its largest absolute value.
    ``spread`` is the mean absolute deviation of the last update's gain at each checkpoint (per seed: the
    per-update noise included); ``noise`` the offline reference's own RMS noise. ``None`` without a reference.
    """
    tracks = [estimator.tracking(r) for r in _records(results, task, method, scale, seeds)]
    tracks = [t for t in tracks if t is not None]
    if not tracks:
        return None
    n = min(len(t["window"]) for t in tracks)
    rel = np.mean([t["window"][-n:] for t in tracks], axis=0)
    spread = np.mean([np.mean(np.abs(t["point"])) for t in tracks])
    noise = np.mean([t["noise"] for t in tracks])
    return float(np.mean(rel)), float(np.mean(np.abs(rel))), float(np.max(np.abs(rel))), float(spread), float(noise)


def _pct(x: float) -> str:
    return f"{100 * x:+.0f}"


def tracking_table(setups, results, candidates, scales, seeds) -> str:
    head = "| task | reference | estimator | " + " | ".join(f"S={s}" for s in scales) + " |"
    lines = [head, "|---|---|---|" + "---:|" * len(scales)]
    for setup in setups:
        kinds = {r["reference"]["kind"] for k, r in results.items() if k[0] == setup.name and "reference" in r}
        ref_kind = " / ".join(sorted(kinds)) or "—"
        noise = [tracking_summary(results, setup.name, estimator.FAIRSCALE, s, seeds) for s in scales]
        if setup.moments is None and any(noise):
            cells = [f"±{100 * t[4]:.0f} %" if t else "" for t in noise]
            lines.append(f"| {setup.name} | {ref_kind} | (reference's own noise) | " + " | ".join(cells) + " |")
        for method in candidates:
            cells = []
            for s in scales:
                t = tracking_summary(results, setup.name, method, s, seeds)
                if t is None:
                    cells.append("")
                    continue
                mark = " ✓" if t[1] <= GOAL else ""
                cells.append(f"{_pct(t[0])} / {100 * t[1]:.0f} / {100 * t[2]:.0f} ({100 * t[3]:.0f}) %{mark}")
            lines.append(f"| {setup.name} | {ref_kind} | {label(method)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def quality_table(setup, results, candidates, scales, seeds) -> str:
    digits = 4 if setup.relative_tolerance else (3 if setup.tolerance < 0.1 else 2)
    fmt = (lambda m, s: f"{m:.2e} ± {s:.1e}") if setup.relative_tolerance else (lambda m, s: stats.fmt(m, s, digits))
    base = _records(results, setup.name, estimator.BASELINE, 1, seeds)
    m0, s0, _ = stats.mean_std([r["final"]["metric"] for r in base])
    it0 = setup.total_steps
    head = f"| estimator | S = 1: {fmt(m0, s0)}, {it0} it. | " + " | ".join(f"S={s}" for s in scales) + " |"
    lines = [head, "|---|---|" + "---:|" * len(scales)]
    for method in candidates:
        cells = []
        for s in scales:
            recs = _records(results, setup.name, method, s, seeds)
            if not recs:
                cells.append("")
                continue
            m, sd, _ = stats.mean_std([r["final"]["metric"] for r in recs])
            iters = np.mean([r["iterations"] for r in recs])
            dflt = _records(results, setup.name, estimator.FAIRSCALE, s, seeds)
            saved = ""
            if dflt and method != estimator.FAIRSCALE:
                saved = f" ({100 * (iters / np.mean([r['iterations'] for r in dflt]) - 1):+.0f} %)"
            flag = quality_flag(setup, results, method, s, seeds)
            cells.append(f"{fmt(m, sd)}{' ' + flag if flag else ''}, {iters:.0f} it.{saved}")
        lines.append(f"| {label(method)} | | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def goal_table(setups, results, candidates, scales, seeds) -> str:
    """Per candidate: cells within the tracking goal, quality flags, iterations against FairScale's."""
    lines = [
        "| estimator | cells with tracking error ≤ 10 % | mean tracking error | cells ✗ / ~ | iterations vs FairScale "
        "| cells missing the goal |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for method in candidates:
        within = total = bad = near = 0
        errs, ratios, missing = [], [], []
        for setup in setups:
            for s in scales:
                t = tracking_summary(results, setup.name, method, s, seeds)
                if t is not None:
                    total += 1
                    within += t[1] <= GOAL
                    errs.append(t[1])
                    if t[1] > GOAL:
                        missing.append(f"{setup.name} S={s} ({100 * t[1]:.0f} %)")
                flag = quality_flag(setup, results, method, s, seeds)
                if flag == "✗":
                    missing.append(f"{setup.name} S={s} ✗")
                bad += flag == "✗"
                near += flag == "~"
                recs = _records(results, setup.name, method, s, seeds)
                dflt = _records(results, setup.name, estimator.FAIRSCALE, s, seeds)
                if recs and dflt:
                    ratios.append(np.mean([r["iterations"] for r in recs]) / np.mean([r["iterations"] for r in dflt]))
        if not total:
            continue
        lo, hi = (100 * (min(ratios) - 1), 100 * (max(ratios) - 1)) if ratios else (0, 0)
        lines.append(
            f"| {label(method)} | {within} / {total} | {100 * np.mean(errs):.0f} % | {bad} / {near} | "
            f"{100 * (np.mean(ratios) - 1):+.0f} % ({lo:+.0f} … {hi:+.0f} %) | {', '.join(missing) or 'none'} |"
        )
    return "\n".join(lines)


def tracking_plot(setups, results, methods, scales, seed, path):
    """Online gain over τ against the reference at the run's own parameters, per setup (rows): its smallest and
    largest S that ran (columns; one column if ``scales`` has one S)."""
    plt = plots.pyplot()
    ncols = min(2, len(scales))
    fig, axes = plt.subplots(len(setups), ncols, figsize=(4.2 * ncols, 2.8 * len(setups)), squeeze=False)
    colours = ["0.45", "tab:blue", "tab:orange", "tab:green"]
    for row, setup in zip(axes, setups, strict=True):
        ran = [s for s in scales if any((setup.name, m, s, seed) in results for m in methods)]
        for ax, s in zip(row, [(ran or scales)[0], (ran or scales)[-1]][-ncols:], strict=True):
            if not ran:
                ax.text(0.5, 0.5, "not run", ha="center", va="center", transform=ax.transAxes, color="0.5")
            for method, c in zip(methods, colours, strict=False):
                r = results.get((setup.name, method, s, seed))
                if r is None:
                    continue
                ax.plot(r["logs"]["tau"], r["logs"]["gain"], color=c, lw=0.8, label=label(method))
                ref = r.get("reference")
                if ref is not None:
                    truth = estimator.gain(ref["sigma2"], ref["mu2"], s)
                    ax.plot(r["curve"]["tau"], truth, "o", color=c, ms=3.5, mfc="none", label=f"reference ({method})")
            ax.set_title(f"{setup.name}, S = {s}", fontsize=9)
            ax.set_xlabel("τ (base steps)", fontsize=8)
            ax.set_ylabel("gain", fontsize=8)
            ax.tick_params(labelsize=7)
    axes[0][0].legend(fontsize=6)
    fig.tight_layout()
    return plots.save(fig, path)


def write_report(
    path, setups, results, candidates, scales, seeds, plot_dir, command, wall_s, *, chosen=None, cached_under=None
):
    """The README section; ``cached_under``: where the cells are cached (``None``: not cached, a smoke run)."""
    chosen = (
        chosen
        or [m for m in candidates if m == estimator.PACKAGE_DEFAULT]
        or [c for c in candidates if c != estimator.FAIRSCALE][:1]
    )
    plot = tracking_plot(
        setups, results, [estimator.FAIRSCALE, *chosen], sorted(scales), seeds[0], plot_dir / "estimator_tracking.png"
    )
    cells = sum(1 for k in results)
    body = [
        "## Estimator: which default tracks the gain",
        "",
        f"Command: `{command}` ({len(seeds)} seeds, S ∈ {{{', '.join(map(str, scales))}}}; {cells} cells, "
        + (f"cached under `{cached_under}`" if cached_under else "not cached")
        + f"; this invocation took {wall_s:.0f} s).",
        "",
        report.kept_reading(path, SECTION),
        "",
        "### Tracking",
        "",
        "The gain applied over each window of T/5 in τ after the first 5 % (Δτ/Δiterations: what sets the "
        "iteration count) relative to the reference at the run's own parameters over the same window (the harmonic "
        "mean of its values at the checkpoints τ = kT/20, since iterations per unit of τ are 1/r), averaged over the "
        "seeds per window: mean (bias) / mean absolute (**the tracking error**) / worst window, and in brackets the "
        "mean absolute deviation of the last update's gain from the reference at each checkpoint, per seed (the "
        "per-update noise and the reference's own jumps included); in %. ✓: tracking error ≤ 10 %. Offline "
        "references: σ², μ² from fresh base batches at the checkpoint (256; 64 for the LM); their own noise (RMS, "
        "from two halves) in the first row of each task.",
        "",
        tracking_table(setups, results, candidates, scales, seeds),
        "",
        "### Summary",
        "",
        f"Over the {len(setups)} tasks × {len(scales)} scales. ✗: worse than S = 1 by more than two standard errors "
        "and the tolerance (1 point of accuracy, 10 % of the excess risk, 0.01 nats/byte), or a seed failed; ~: "
        "beyond two standard errors but within the tolerance.",
        "",
        goal_table(setups, results, candidates, scales, seeds),
        "",
        "### Quality and iterations",
        "",
        "Final metric (mean ± std over seeds, flags as above), mean iterations to τ = T and their change against "
        "the FairScale default at the same S.",
        "",
    ]
    for setup in setups:
        body += [f"**{setup.title}** ({setup.metric}, T = {setup.total_steps})", ""]
        body += [quality_table(setup, results, candidates, scales, seeds), ""]
    body += [
        "### Plot",
        "",
        f"`plots/{plot.name}`: online gain over τ (lines) and the reference at the same run's checkpoints (circles), "
        f"seed {seeds[0]}, at each task's smallest and largest S.",
        "",
        f"![tracking](plots/{plot.name})",
    ]
    report.write_section(path, SECTION, "\n".join(body))
    return path

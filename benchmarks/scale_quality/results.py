"""The study's tables and plots from its records (``scale_quality.run_grid``) and its analytic runs."""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from benchmarks.harness import plots

GOAL = {32: 0.02, 64: 0.05}  # final loss / S = 2's − 1 at most (one-sided) at S ≤ 32, and at S ≥ 64


def goal_for(scale: int) -> float:
    return GOAL[32] if scale <= 32 else GOAL[64]


def index(records) -> dict:
    """``{(task, method, S, mult): [records over seeds]}``."""
    out = defaultdict(list)
    for r in records:
        out[(r["task"], r["method"], r["scale"], r["lr_mult"])].append(r)
    return out


def relative(idx, task, method, scale, mult) -> tuple[float, float, int] | None:
    """``(final loss / S = 2's − 1, its standard error, seeds)`` over the seeds both cells hold."""
    cell, base = idx.get((task, method, scale, mult)), idx.get((task, method, 2, mult))
    if not cell or not base:
        return None
    b = {r["seed"]: r["final_loss"] for r in base}
    pairs = [(r["final_loss"], b[r["seed"]]) for r in cell if r["seed"] in b]
    if not pairs:
        return None
    x = np.array([p[0] for p in pairs])
    y = np.array([p[1] for p in pairs])
    rel = x.mean() / y.mean() - 1
    # delta method on the ratio of two means (independent runs of each seed)
    se = 0.0
    if len(pairs) > 1:
        vx, vy = x.var(ddof=1) / len(x), y.var(ddof=1) / len(y)
        se = float(np.sqrt(vx / y.mean() ** 2 + vy * x.mean() ** 2 / y.mean() ** 4))
    return float(rel), se, len(pairs)


def mean_of(idx, task, method, scale, mult, key) -> float | None:
    cell = idx.get((task, method, scale, mult))
    return None if not cell else float(np.mean([r[key] for r in cell]))


def _pct(v: tuple[float, float, int] | None, scale: int) -> str:
    if v is None:
        return "—"
    if scale == 2:
        return "(baseline)"
    rel, se, _ = v
    mark = " ✗ over" if rel - se > goal_for(scale) else ""  # one-sided: quality lost beyond its standard error
    return f"{100 * rel:+.1f} ± {100 * se:.1f}{mark}"


def task_table(idx, task, methods, scales, mults) -> str:
    """Rows: S × method; the final loss against S = 2's per learning rate, iterations and examples at 1×."""
    head = " | ".join(f"lr ×{m:g}: vs S = 2 (%)" for m in mults)
    lines = [
        f"| S | method | {head} | updates (×1) | examples (×1) vs `paper` | mean gain (×1) |",
        "|---:|---|" + "---:|" * (len(mults) + 3),
    ]
    for scale in scales:
        for method in methods:
            if (task.name, method, scale, 1.0) not in idx and not any(
                (task.name, method, scale, m) in idx for m in mults
            ):
                continue
            cells = " | ".join(_pct(relative(idx, task.name, method, scale, m), scale) for m in mults)
            it = mean_of(idx, task.name, method, scale, 1.0, "iterations")
            ex = mean_of(idx, task.name, method, scale, 1.0, "examples")
            ex0 = mean_of(idx, task.name, "paper", scale, 1.0, "examples")
            gain = mean_of(idx, task.name, method, scale, 1.0, "mean_gain")
            ratio = f"{ex / ex0:.2f}×" if ex and ex0 else "—"
            lines.append(
                f"| {scale} | `{method}` | {cells} | {'—' if it is None else f'{it:.0f}'} | {ratio} | "
                f"{'—' if gain is None else f'{gain:.1f}'} |"
            )
    base = [
        f"{mean_of(idx, task.name, 'paper', 2, m, 'final_loss'):.4f}"
        for m in mults
        if mean_of(idx, task.name, "paper", 2, m, "final_loss") is not None
    ]
    note = f"S = 2's final loss (`paper`), lr ×{', ×'.join(f'{m:g}' for m in mults)}: {', '.join(base)}."
    return "\n".join([*lines, "", note])


def summary_table(idx, tasks, methods, scales, mults) -> str:
    """Per task and method: the worst gap at S ≤ 32, at S = 64 and at S = 128 over the learning rates (the most
    positive: the promise is one-sided, no quality lost), whether it keeps the goal within its standard error, and
    the updates at S = 32 against the update clock's (`paper`)."""
    lines = [
        "| task | method | worst at S ≤ 32 (%) | worst at S = 64 (%) | worst at S = 128 (%) | "
        "goal (≤ +2 % to 32, ≤ +5 % beyond, within SE) | updates at S = 32 (× `paper`'s) |",
        "|---|---|---:|---:|---:|---|---:|",
    ]
    for task in tasks:
        for method in methods:
            worst, kept = {}, True
            groups = (
                ("le32", [s for s in scales if 2 < s <= 32], GOAL[32]),
                ("64", [64], GOAL[64]),
                ("128", [s for s in scales if s > 64], GOAL[64]),
            )
            for group, chosen, bound in groups:
                vals = [relative(idx, task.name, method, s, m) for s in chosen for m in mults]
                vals = [v for v in vals if v is not None]
                worst[group] = max(vals, key=lambda v: v[0]) if vals else None
                kept &= all(v[0] - v[1] <= bound for v in vals)
            if worst["le32"] is None:
                continue
            ratios = []
            for m in mults:
                ours = mean_of(idx, task.name, method, 32, m, "iterations")
                paper = mean_of(idx, task.name, "paper", 32, m, "iterations")
                if ours and paper:
                    ratios.append(ours / paper)
            fmt = lambda v: "—" if v is None else f"{100 * v[0]:+.1f} ± {100 * v[1]:.1f}"  # noqa: E731
            cost = f"{min(ratios):.2f}–{max(ratios):.2f}" if ratios else "—"
            lines.append(
                f"| {task.name} | `{method}` | {fmt(worst['le32'])} | {fmt(worst['64'])} | {fmt(worst['128'])} | "
                f"{'kept' if kept else '**lost**'} | {cost} |"
            )
    return "\n".join(lines)


def plot_sweep(idx, tasks, methods, scales, mults, path):
    """The final loss against S = 2's, per task, a line per method and learning rate."""
    plt = plots.pyplot()
    fig, axes = plt.subplots(1, len(tasks), figsize=(3.2 * len(tasks), 3.0), squeeze=False)
    styles = {"paper": "--", "tau": "-", "guarded": "-", "gain_before": ":", "no_momentum": "-."}
    for ax, task in zip(axes[0], tasks, strict=True):
        for method in methods:
            for j, m in enumerate(mults):
                pts = [(s, relative(idx, task.name, method, s, m)) for s in scales]
                pts = [(s, 100 * v[0]) for s, v in pts if v is not None]
                if pts:
                    ax.plot(
                        *zip(*pts, strict=True),
                        styles.get(method, "-"),
                        color=f"C{j}",
                        marker="o",
                        ms=3,
                        label=f"{method} ×{m:g}",
                    )
        ax.axhspan(-2, 2, color="0.9")
        ax.axhline(0, color="0.5", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_title(task.name, fontsize=9)
        ax.set_xlabel("S")
    axes[0][0].set_ylabel("final loss vs S = 2 (%)")
    axes[0][-1].legend(fontsize=6)
    fig.tight_layout()
    return plots.save(fig, path)

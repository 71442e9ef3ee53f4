"""The ramp study's tables, plots and README section, from the cells (``ramp.py``) and the proxy (``proxy.py``)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

import optax_adascale
from benchmarks.harness import plots, report, stats
from benchmarks.ramp.ramp import ARMS, EFFICIENCIES, K_MAX, K_MIN, LINEAR
from benchmarks.ramp.tasks import REPLICAS

DEFAULT = f"measured-{optax_adascale.BatchRamp(1, 2).efficiency:g}"  # the package's default efficiency
MEASURED = tuple(f"measured-{e:g}" for e in EFFICIENCIES)
FIXED_RAMPS = (*(f"linear-{f:g}" for f in LINEAR), "seesaw")
DESCRIPTIONS = {
    "fixed-min": f"`accumulation_steps={K_MIN}`: S = {REPLICAS * K_MIN} throughout (the baseline)",
    "fixed-max": f"`accumulation_steps={K_MAX}`: S = {REPLICAS * K_MAX} throughout",
    **{
        f"linear-{f:g}": f"MaxText's rule: k = 1 → 16 in unit steps, linear in examples, reaching 16 after {f:g}·T "
        "base batches"
        for f in LINEAR
    },
    "seesaw": "Seesaw-style: k doubles each time lr(τ) halves (1 → 16)",
    **{
        f"measured-{e:g}": f"`BatchRamp(1, 16, efficiency={e:g})`: S* = (B + 1)/{e:g} − B"
        + (", the critical batch" if e == 0.5 else "")
        + (" (**the package default**)" if f"measured-{e:g}" == DEFAULT else "")
        for e in EFFICIENCIES
    },
}


# --------------------------------------------------------------------------- reading the curves


def crossing(record: dict, target: float) -> tuple[float, float]:
    """``(updates, examples)`` at which the validation loss first reaches ``target`` (linear interpolation between
    evaluations); ``(nan, nan)`` if it never does."""
    c = record["curve"]
    loss, upd, ex = (np.asarray(c[k], np.float64) for k in ("val_loss", "updates", "examples"))
    hit = np.nonzero(loss <= target)[0]
    if not hit.size:
        return math.nan, math.nan
    j = int(hit[0])
    if j == 0:
        return 0.0, 0.0
    w = (loss[j - 1] - target) / (loss[j - 1] - loss[j])
    return float(upd[j - 1] + w * (upd[j] - upd[j - 1])), float(ex[j - 1] + w * (ex[j] - ex[j - 1]))


def loss_at_examples(record: dict, examples: float) -> float:
    """The validation loss after ``examples`` base batches (interpolated; the final one past the end)."""
    c = record["curve"]
    return float(np.interp(examples, c["examples"], c["val_loss"]))


def noise_growth(record: dict, total_steps: int) -> tuple[float, float]:
    """The controller's noise scale ``B`` (base batches), median over τ ∈ [5, 10] % and over τ ∈ [85, 90] % of T."""
    logs = record["logs"]
    tau, noise = np.asarray(logs["tau"]), np.asarray(logs["noise_scale"])

    def median(lo, hi):
        sel = (tau >= lo * total_steps) & (tau <= hi * total_steps) & np.isfinite(noise)
        return float(np.median(noise[sel])) if sel.any() else math.nan

    return median(0.05, 0.10), median(0.85, 0.90)


def rung_changes(record: dict) -> tuple[int, int]:
    """``(changes, of which down)`` of ``S`` between the logged updates (the logs keep ~300 of them)."""
    s = np.asarray(record["logs"]["scale"])
    s = s[np.isfinite(s)]
    steps = np.diff(s)
    return int(np.sum(steps != 0)), int(np.sum(steps < 0))


def clock_check(task, results, seeds) -> str:
    """Is the gain right? At equal τ (= T) the same loss at every S: fixed-max's final loss minus fixed-min's."""
    lo, hi = _recs(results, task, "fixed-min", seeds), _recs(results, task, "fixed-max", seeds)
    if lo is None or hi is None:
        return ""
    diff, se2 = stats.worse_by(False, [r["final"] for r in lo], [r["final"] for r in hi])
    return (
        f"The gain's clock: at τ = T, `fixed-max` (S = {REPLICAS * K_MAX}) ends {diff:+.4f} (2 SE {se2:.4f}) from "
        f"`fixed-min` (S = {REPLICAS * K_MIN}) in validation loss (0 if a step at S were worth exactly r base steps; "
        "negative: the large batch did better than its gain claimed)."
    )


def _recs(results, task, arm, seeds):
    recs = [results.get((task.name, arm, s)) for s in seeds]
    return None if any(r is None for r in recs) else recs


def summary(task, results, seeds) -> dict:
    """Per arm: updates and examples to the baseline's final loss (ratios to the baseline's), final loss, loss at
    equal examples, wall time per example; ``{arm: {...}}`` with per-seed lists."""
    base = _recs(results, task, "fixed-min", seeds)
    if base is None:
        return {}
    targets = [r["final"] for r in base]
    ramps = [a for a in (*FIXED_RAMPS, *MEASURED) if _recs(results, task, a, seeds)]
    equal = [min(results[(task.name, a, s)]["examples"] for a in ramps) for s in seeds] if ramps else None
    out = {}
    for arm in ARMS:
        recs = _recs(results, task, arm, seeds)
        if recs is None:
            continue
        hits = [crossing(r, t) for r, t in zip(recs, targets, strict=True)]
        out[arm] = {
            "updates_to": [h[0] for h in hits],
            "examples_to": [h[1] for h in hits],
            "updates_ratio": [h[0] / t[0] for h, t in zip(hits, (crossing(b, b["final"]) for b in base), strict=True)],
            "examples_ratio": [h[1] / t[1] for h, t in zip(hits, (crossing(b, b["final"]) for b in base), strict=True)],
            "final": [r["final"] for r in recs],
            "updates": [r["updates"] for r in recs],
            "examples": [r["examples"] for r in recs],
            "at_equal": [loss_at_examples(r, e) for r, e in zip(recs, equal, strict=True)] if equal else None,
            "equal_examples": equal,
            "us_per_example": [1e6 * r["run_s"] / (r["examples"] * task.batch_size) for r in recs],
            "changes": [rung_changes(r) for r in recs],
        }
    return out


def _fmt(values, digits=0, ratio=False) -> str:
    v = np.asarray(values, np.float64)
    if np.isnan(v).any():
        reached = int(np.sum(~np.isnan(v)))
        if reached == 0:
            return f"not reached (0/{len(v)})"
        mean = f"{np.nanmean(v):.2f}×" if ratio else f"{np.nanmean(v):.{digits}f}"
        return f"{mean} ({reached}/{len(v)})"
    m, s, _ = stats.mean_std(v)
    return f"{m:.2f}×" if ratio else f"{m:.{digits}f} ± {s:.{digits}f}"


def table(task, results, seeds) -> str:
    rows = summary(task, results, seeds)
    head = (
        "| arm | updates to baseline's loss | ÷ baseline | examples to it | ÷ baseline | final val. loss | "
        "updates | examples | loss at equal examples | µs / example | changes of S (down) |"
    )
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for arm, r in rows.items():
        equal = "—" if r["at_equal"] is None else stats.fmt(*stats.mean_std(r["at_equal"])[:2], 4)
        lines.append(
            f"| `{arm}` | {_fmt(r['updates_to'])} | {_fmt(r['updates_ratio'], ratio=True)} | "
            f"{_fmt(r['examples_to'])} | {_fmt(r['examples_ratio'], ratio=True)} | "
            f"{stats.fmt(*stats.mean_std(r['final'])[:2], 4)} | {stats.mean_std(r['updates'])[0]:.0f} | "
            f"{stats.mean_std(r['examples'])[0]:.0f} | {equal} | {stats.mean_std(r['us_per_example'])[0]:.0f} | "
            + " / ".join(f"{c} ({d})" for c, d in r["changes"])
            + " |"
        )
    return "\n".join(lines)


def goals(task, results, seeds, arm: str = DEFAULT) -> str:
    """The issue's two goals for a measured ramp (the package default unless named), met or missed, with numbers."""
    rows = summary(task, results, seeds)
    if arm not in rows:
        return "_(no measured cells)_"
    r = rows[arm]
    upd, ex = np.asarray(r["updates_ratio"]), np.asarray(r["examples_ratio"])
    reached = not np.isnan(upd).any()
    fewer = 1 - float(np.mean(upd)) if reached else math.nan
    more = float(np.mean(ex)) - 1 if reached else math.nan
    ok1 = reached and fewer >= 0.40 and more <= 0.10
    lines = [
        f"- **≥ 40 % fewer updates with ≤ 10 % more examples to the baseline's final loss: "
        f"{'met' if ok1 else 'missed'}**"
        + (
            f" ({100 * fewer:.0f} % fewer updates, {100 * more:+.0f} % examples; per seed "
            + ", ".join(f"{1 - u:.0%} / {e - 1:+.0%}" for u, e in zip(upd, ex, strict=True))
            + ")."
            if reached
            else f" (reached in {int(np.sum(~np.isnan(upd)))} of {len(upd)} seeds)."
        )
    ]
    worse = []
    for other in FIXED_RAMPS:
        pairs = [(results.get((task.name, arm, s)), results.get((task.name, other, s))) for s in seeds]
        if any(a is None or b is None for a, b in pairs):
            continue
        budget = [min(a["examples"], b["examples"]) for a, b in pairs]
        mine = [loss_at_examples(a, e) for (a, _), e in zip(pairs, budget, strict=True)]
        theirs = [loss_at_examples(b, e) for (_, b), e in zip(pairs, budget, strict=True)]
        diff, se2 = stats.worse_by(False, theirs, mine)
        worse.append((other, diff, se2, float(np.mean(budget))))
    ok2 = all(d <= s for _, d, s, _ in worse)
    lines.append(
        f"- **At equal examples no worse than any fixed ramp (within 2 SE): {'met' if ok2 else 'missed'}** "
        "(each pair compared after the examples of whichever of the two used fewer; measured minus "
        + ", ".join(f"`{a}` at {e:.0f}: {d:+.4f} (2 SE {s:.4f})" for a, d, s, e in worse)
        + ")."
    )
    return "\n".join(lines)


# --------------------------------------------------------------------------- plots

STYLES = {
    "fixed-min": ("k", "--"),
    "fixed-max": ("0.5", "--"),
    "linear-0.25": ("C1", ":"),
    "linear-0.5": ("C2", ":"),
    "linear-1": ("C4", ":"),
    "seesaw": ("C5", "-."),
    "measured-0.5": ("C3", "-"),
    "measured-0.6": ("C8", "-"),
    "measured-0.7": ("C6", "-"),
    "measured-0.9": ("C0", "-"),
}


def _mean_curve(results, task, arm, seeds, x: str):
    recs = _recs(results, task, arm, seeds)
    if recs is None:
        return None, None
    grid = np.linspace(0, min(r["curve"][x][-1] for r in recs), 60)
    return grid, np.mean([np.interp(grid, r["curve"][x], r["curve"]["val_loss"]) for r in recs], axis=0)


def make_plots(tasks, results, seeds, plot_dir: Path) -> list[Path]:
    plt = plots.pyplot()
    paths = []
    fig, axes = plt.subplots(2, len(tasks), figsize=(5.0 * len(tasks), 7.0), squeeze=False)
    for j, task in enumerate(tasks):
        base = _recs(results, task, "fixed-min", seeds)
        for i, x in enumerate(("examples", "updates")):
            ax = axes[i, j]
            for arm in ARMS:
                grid, loss = _mean_curve(results, task, arm, seeds, x)
                if grid is not None:
                    color, ls = STYLES[arm]
                    ax.plot(grid[1:], loss[1:], color=color, ls=ls, label=arm)
            if base:
                ax.axhline(np.mean([b["final"] for b in base]), color="k", lw=0.5)
                final = np.mean([b["final"] for b in base])
                ax.set_ylim(final - 0.15 * abs(final) - 0.05, final + 0.6 * abs(final) + 0.2)
            ax.set_xscale("log")
            ax.set_xlabel(f"{x} ({'base batches' if x == 'examples' else 'optimizer steps'})")
            ax.set_ylabel("val. loss")
            ax.set_title(task.title, fontsize=9)
            if i == 0 and j == 0:
                ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(plots.save(fig, plot_dir / "ramp_curves.png"))
    paths.append(picture(tasks, results, seeds[0], plot_dir / "ramp_controller.png"))
    return paths


def picture(tasks, results, seed: int, path: Path) -> Path:
    """``S_t``, the gain, ``B_noise`` and the effective learning rate against ``τ``: the measured ramp, one seed."""
    plt = plots.pyplot()
    fig, axes = plt.subplots(4, len(tasks), figsize=(4.6 * len(tasks), 8.4), sharex="col", squeeze=False)
    for j, task in enumerate(tasks):
        for arm, color in ((DEFAULT, "C0"), ("fixed-min", "k")):
            r = results.get((task.name, arm, seed))
            if r is None:
                continue
            logs = r["logs"]
            tau = np.asarray(logs["tau"])
            for i, key in enumerate(("scale", "gain", "noise_scale", "lr")):
                if key == "scale" and arm != DEFAULT:
                    continue
                axes[i, j].plot(tau, logs[key], color=color, lw=1.0, label=arm, drawstyle="steps-post")
        axes[0, j].set_title(task.title, fontsize=9)
        for i, label in enumerate(("S_t (base batches)", "gain r_t", "B_noise = σ̄²/μ̄²", "r_t·lr(⌊τ⌋)")):
            axes[i, j].set_ylabel(label)
            if i in (0, 2):
                axes[i, j].set_yscale("log")
        rungs = [REPLICAS * 2**i for i in range(int(math.log2(K_MAX)) + 1)]
        axes[0, j].set_yticks(rungs, [str(s) for s in rungs])
        axes[0, j].minorticks_off()
        axes[-1, j].set_xlabel("τ (base-batch steps)")
    axes[1, 0].legend(fontsize=7)
    fig.tight_layout()
    return plots.save(fig, path)


# --------------------------------------------------------------------------- the README section


def write_report(path, tasks, results, seeds, plot_paths, command, wall_s, *, proxy_text: str, cached_under) -> Path:
    total = sum(r["run_s"] + r["compile_s"] for r in results.values())
    lines = [
        "## The batch follows the noise",
        "",
        f"Command: `{command}` ({len(seeds)} seeds; cells "
        + (f"cached under `{cached_under}`" if cached_under else "not cached")
        + f"; the {len(results)} cells took {total / 60:.0f} min of wall time when they ran, compilation included).",
        "",
        "Arms (every one AdaScale, to τ ≥ T, on the same stream of micro-batches; two replicas as a vmap axis, "
        f"S = {REPLICAS}·k):",
        "",
        *(f"- `{a}`: {DESCRIPTIONS[a]}" for a in ARMS),
        "",
        report.kept_reading(path, "ramp"),
        "",
    ]
    for task in tasks:
        base = _recs(results, task, "fixed-min", seeds)
        growth = [noise_growth(r, task.total_steps) for r in base] if base else []
        model = task.config().get("model") or task.config().get("student", task.title)  # the teacher: its student
        lines += [
            f"### {task.title}",
            "",
            f"Base batch {task.batch_size} {'windows' if task.name.startswith('lm') else 'sequences'}, "
            f"T = {task.total_steps} base-batch steps, peak lr {task.learning_rate:g}; {model}. "
            + (
                "Noise scale of the baseline run (median over τ ∈ [5, 10] % → [85, 90] % of T, base batches): "
                + ", ".join(f"{a:.1f} → {b:.1f} ({b / a:.0f}×)" for a, b in growth)
                + "."
                if growth
                else ""
            ),
            "",
            table(task, results, seeds),
            "",
            clock_check(task, results, seeds),
            "",
            *(
                f"`{arm}`{' (default)' if arm == DEFAULT else ''}:\n\n" + goals(task, results, seeds, arm) + "\n"
                for arm in MEASURED
            ),
        ]
    lines += [
        "Updates and examples to the baseline's final loss: the first evaluation (40 per run, evenly spaced in τ) "
        "at which the validation loss is at or below the same seed's `fixed-min` final loss, interpolated "
        "linearly; `(m/3)`: reached in m seeds (mean over those). Loss at equal examples: each arm's validation "
        "loss after as many base batches as the ramp arm that used the fewest (per seed; an arm compared before it "
        "reached τ = T has not finished its schedule). µs / example: the "
        "compiled run's wall time over its examples, on this shared 2-core CPU (compilation excluded).",
        "",
        proxy_text,
        "",
        *(f"![{p.stem}]({report.relative(p, path)})" for p in plot_paths),
    ]
    return report.write_section(Path(path), "ramp", "\n".join(lines))

"""The diagnosis: which term makes the gain over- or under-credit, measured where the truth is known.

* **Momentum** (where the gain meets the buffer) and **curvature**: the noisy quadratic in closed form
  (``analytic.py``): every rule with the *true* gain, so no estimator noise; and the worth of one update measured
  directly: the number of small steps (S = 1, from the same state) that reach the loss the update reaches, against
  the ``r`` it is credited with.
* **Noise per τ**: the τ-clock rule with the big batch's noise raised to the small batch's per unit of τ: what is
  left of its gap once the only difference the paper's model leaves out (a step at ``r < S`` injects ``r/S`` of the
  small batch's noise per base step) is removed.
* **The estimator**: sampled runs of the quadratic with the true ``σ²`` and ``μ² = ‖Hx‖²`` beside the estimates:
  the bias at small ``n``, and the lag of the moving averages when ``S`` jumps from 2 to 32 mid-run.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from benchmarks.harness import plots
from benchmarks.scale_quality import analytic, engine

SCALES = (2, 4, 8, 16, 32, 64)
MULTS = (0.5, 1.0, 2.0)


def _quadratic_arrays(task):
    h, noise = (np.asarray(a, np.float64) for a in task.hessian)
    x0 = np.asarray(task.init(None), np.float64)
    return h, noise, x0


def _worth(rule, M, r, S, a, h, noise, batch, beta, max_steps):
    """Small steps (S = 1, gain 1) from the second moments ``M`` that reach the loss one update at gain ``r`` and
    scale ``S`` reaches (fractional: interpolated between the two steps that bracket it)."""
    A, b = analytic.transition(rule, r, a, h, beta)
    after = (
        np.einsum("dij,djk,dlk->dil", A, M, A) + np.einsum("di,dj->dij", b, b) * (noise / (batch * S))[:, None, None]
    )
    target = 0.5 * np.sum(h * after[:, 0, 0])
    A1, b1 = analytic.transition(rule, 1.0, a, h, beta)
    losses = [0.5 * np.sum(h * M[:, 0, 0])]
    m = M
    for _ in range(max_steps):
        m = np.einsum("dij,djk,dlk->dil", A1, m, A1) + np.einsum("di,dj->dij", b1, b1) * (noise / batch)[:, None, None]
        losses.append(0.5 * np.sum(h * m[:, 0, 0]))
        if losses[-1] <= target:
            k = len(losses) - 1
            lo, hi = losses[-2], losses[-1]
            return k - 1 + (lo - target) / max(lo - hi, 1e-30)
    return float("nan")  # the small steps never get there (they plateau above it: the update did more than any k)


def _cached(cache: Path | None, name: str, task, only_cached: bool, empty: dict, compute) -> dict:
    """A diagnosis table from ``cache/name`` while its task's configuration is unchanged, else ``compute()``d and
    cached (``empty`` where only cached tables may be read)."""
    path = None if cache is None else cache / name
    if path is not None and path.exists():
        data = json.loads(path.read_text())
        if data.get("config") == json.loads(json.dumps(task.config())):
            return data
    if only_cached:
        return empty
    data = {"config": task.config(), **compute()}
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data))
    return data


def analytic_tables(task, *, smoke: bool, cache: Path | None, only_cached: bool) -> dict:
    """The closed-form grid (rules × S × learning rate), the equal-noise check, and the worth of updates."""
    return _cached(cache, "analytic.json", task, only_cached, {"rows": []}, lambda: _analytic(task, smoke))


def _analytic(task, smoke: bool) -> dict:
    h, noise, x0 = _quadratic_arrays(task)
    B, T, lr, beta = task.batch_size, task.total_steps, task.learning_rate, task.momentum
    scales = (2, 4, 8) if smoke else SCALES
    rows = []
    for rule in analytic.RULES:
        for mult in MULTS[1:2] if smoke else MULTS:
            for S in scales:
                out = analytic.run(rule, S, mult * lr, h=h, noise=noise, x0=x0, batch_size=B, total=T, beta=beta)
                rows.append({"rule": rule, "mult": mult, "S": S, "loss": out["loss"], "iterations": out["iterations"]})
    equal = []
    for mult in MULTS[1:2] if smoke else MULTS:
        for S in scales:
            out = _equal_noise_run(S, mult * lr, h, noise, x0, B, T, beta)
            equal.append({"mult": mult, "S": S, "loss": out})
    worth = []
    for rule in ("paper", "tau"):
        for S in (8,) if smoke else (8, 32):
            worth.append({"rule": rule, "S": S, **_worth_profile(rule, S, lr, h, noise, x0, B, T, beta)})
    return {"rows": rows, "equal_noise": equal, "worth": worth}


def _equal_noise_run(S, lr, h, noise, x0, B, T, beta):
    """The τ-clock rule whose big batch injects the small batch's noise per unit of τ (noise × S/r)."""
    d = h.shape[0]
    M = np.zeros((d, 2, 2))
    M[:, 0, 0] = x0**2
    sigma2 = float(np.sum(noise)) / B
    tau = 0.0
    while tau < T:
        mu2 = float(np.sum(h**2 * M[:, 0, 0]))
        r = min(S, (sigma2 + mu2) / (sigma2 / S + mu2))
        A, b = analytic.transition("tau", r, lr * analytic.schedule(int(tau), T), h, beta)
        M = np.einsum("dij,djk,dlk->dil", A, M, A) + np.einsum("di,dj->dij", b, b) * (noise / (B * r))[:, None, None]
        tau += r
    return 0.5 * float(np.sum(h * M[:, 0, 0]))


def _worth_profile(rule, S, lr, h, noise, x0, B, T, beta, points=12):
    """The worth of updates along a run at scale ``S``: small steps equal to one update, over its credited ``r``."""
    d = h.shape[0]
    M = np.zeros((d, 2, 2))
    M[:, 0, 0] = x0**2
    sigma2 = float(np.sum(noise)) / B
    tau, it, log = 0.0, 0, []
    marks = set(np.linspace(0.05 * T, 0.95 * T, points).round().astype(int).tolist())
    while tau < T:
        mu2 = float(np.sum(h**2 * M[:, 0, 0]))
        r = min(S, (sigma2 + mu2) / (sigma2 / S + mu2))
        a = lr * analytic.schedule(int(tau), T)
        if any(tau <= m < tau + r for m in marks):
            w = _worth(rule, M, r, S, a, h, noise, B, beta, max_steps=int(4 * S) + 8)
            log.append({"tau": tau, "gain": r, "worth": w})
        A, b = analytic.transition(rule, r, a, h, beta)
        M = np.einsum("dij,djk,dlk->dil", A, M, A) + np.einsum("di,dj->dij", b, b) * (noise / (B * S))[:, None, None]
        tau += r
        it += 1
    return {"log": log}


def tracking_table(task, *, cache: Path | None, smoke: bool, only_cached: bool) -> dict:
    """The estimated against the true gain on the sampled quadratic: the bias by S, and after a jump of S."""
    empty: dict = {"bias": [], "switch": []}
    return _cached(cache, "tracking.json", task, only_cached, empty, lambda: _tracking(task, smoke))


def _tracking(task, smoke: bool) -> dict:
    seeds = [0] if smoke else list(range(4))
    bias = []
    for replicas in (2, 4) if smoke else (2, 4, 8, 32):
        for run in engine.run_tracking(task, "tau", replicas, 1, seeds):
            g, t = np.asarray(run["gain"]), np.asarray(run["true_gain"])
            bias.append(
                {
                    "S": replicas,
                    "seed": run["seed"],
                    "mean_ratio": float(np.mean(g / t)),
                    "median_abs_error": float(np.median(np.abs(g / t - 1))),
                }
            )
    switch = []
    for run in engine.run_tracking(task, "tau", 2, 4 if smoke else 16, seeds):
        g, t, s = (np.asarray(run[k]) for k in ("gain", "true_gain", "scale"))
        j = int(np.argmax(s > s[0]))
        switch.append(
            {
                "seed": run["seed"],
                "before": (g[max(0, j - 10) : j] / t[max(0, j - 10) : j]).tolist(),
                "after": (g[j : j + 20] / t[j : j + 20]).tolist(),
            }
        )
    return {"bias": bias, "switch": switch, "switch_scale": 2 * (4 if smoke else 16)}


def plot_analytic(data: dict, path):
    """The closed-form quadratic: final loss against S = 2's per rule (lr ×1), and the equal-noise τ-clock rule."""
    plt = plots.pyplot()
    fig, ax = plt.subplots(figsize=(4.8, 3.4))
    rows = [r for r in data["rows"] if r["mult"] == 1.0]
    for i, rule in enumerate(analytic.RULES):
        pts = sorted((r["S"], r["loss"]) for r in rows if r["rule"] == rule)
        if pts and pts[0][0] == 2:
            base = pts[0][1]
            ax.plot(
                [p[0] for p in pts],
                [100 * (min(p[1] / base, 3.0) - 1) for p in pts],
                marker="o",
                ms=3,
                color=f"C{i}",
                label=rule,
            )
    eq = sorted((r["S"], r["loss"]) for r in data.get("equal_noise", []) if r["mult"] == 1.0)
    if eq:
        ax.plot(
            [p[0] for p in eq],
            [100 * (p[1] / eq[0][1] - 1) for p in eq],
            "k--",
            marker="s",
            ms=3,
            label="tau, noise per τ equalised",
        )
    ax.axhspan(-2, 2, color="0.9")
    ax.set_xscale("log", base=2)
    ax.set_ylim(-60, 200)
    ax.set_xlabel("S")
    ax.set_ylabel("expected final loss vs S = 2 (%)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return plots.save(fig, path)


def report_lines(analytic_data: dict, tracking: dict, plot_links) -> list[str]:
    """The diagnosis section of the report."""
    out = ["### Diagnosis", ""]
    rows = analytic_data.get("rows", [])
    if rows:
        mults = sorted({r["mult"] for r in rows})
        scales = sorted({r["S"] for r in rows})
        out += [
            "**Momentum and curvature, in closed form** (the quadratic task, expected loss with the *true* gain: no "
            "sampling, no estimator). Final loss against the same rule's S = 2, %:",
            "",
            "| rule | lr | " + " | ".join(f"S = {s}" for s in scales[1:]) + " |",
            "|---|---:|" + "---:|" * (len(scales) - 1),
        ]
        for rule in analytic.RULES:
            for m in mults:
                by = {r["S"]: r["loss"] for r in rows if r["rule"] == rule and r["mult"] == m}
                if 2 not in by:
                    continue
                cells = []
                for s in scales[1:]:
                    v = by.get(s)
                    cells.append(
                        "—" if v is None else ("diverged" if not np.isfinite(v) else f"{100 * (v / by[2] - 1):+.1f}")
                    )
                out.append(f"| `{rule}` | ×{m:g} | " + " | ".join(cells) + " |")
        eq = analytic_data.get("equal_noise", [])
        if eq:
            out += [
                "",
                "The `tau` rule once its big batch injects the small batch's noise per unit of τ (the noise of "
                "each update × S/r), %:",
                "",
                "| lr | " + " | ".join(f"S = {s}" for s in scales[1:]) + " |",
                "|---:|" + "---:|" * (len(scales) - 1),
            ]
            for m in mults:
                by = {r["S"]: r["loss"] for r in eq if r["mult"] == m}
                if 2 in by:
                    out.append(
                        f"| ×{m:g} | "
                        + " | ".join(f"{100 * (by[s] / by[2] - 1):+.1f}" if s in by else "—" for s in scales[1:])
                        + " |"
                    )
        worth = analytic_data.get("worth", [])
        if worth:
            out += [
                "",
                "**The worth of one update, measured**: from the same expected state, the number of small "
                "steps (S = 1) that reach the loss one update reaches, divided by the r it is credited with (1: "
                "honest; below 1: over-credited; above: under-credited; `rose`: the update raised the loss; "
                "`>`: no number of small steps gets there), lr ×1:",
                "",
            ]
            for w in worth:
                cells = []
                for p in w["log"]:
                    v = p["worth"]
                    cells.append(
                        f"τ {p['tau']:.0f}: "
                        + (
                            "rose"
                            if np.isfinite(v) and v < 0
                            else (">" if not np.isfinite(v) else f"{v / p['gain']:.2f}")
                        )
                    )
                out.append(f"- `{w['rule']}` at S = {w['S']}: " + ", ".join(cells))
        out += [""] + [f"![closed form]({link})" for link in plot_links] + [""]
    if tracking.get("bias"):
        out += [
            "**The estimator** (the sampled quadratic, `tau`, true σ² = tr Σ/B and μ² = ‖Hx‖² at each update's "
            "point): the estimated gain over the true one, mean over the run and median |error|, per S:",
            "",
            "| S | mean est./true | median abs. error |",
            "|---:|---:|---:|",
        ]
        for s in sorted({b["S"] for b in tracking["bias"]}):
            rs = [b for b in tracking["bias"] if b["S"] == s]
            out.append(
                f"| {s} | {np.mean([b['mean_ratio'] for b in rs]):.3f} | "
                f"{100 * np.mean([b['median_abs_error'] for b in rs]):.1f} % |"
            )
        if tracking.get("switch"):
            before = np.mean([np.mean(np.abs(np.asarray(s["before"]) - 1)) for s in tracking["switch"]])
            after5 = np.mean([np.mean(np.asarray(s["after"][:5])) for s in tracking["switch"]])
            after20 = np.mean([np.mean(np.asarray(s["after"])) for s in tracking["switch"]])
            top = tracking.get("switch_scale", 32)
            out += [
                "",
                f"S jumps from 2 to {top} at τ = T/2 (a `BatchRamp` whose policy is that switch): the "
                f"estimated over the true gain is {after5:.3f} over the first 5 updates after it and "
                f"{after20:.3f} over the first 20 (mean |error| over the 10 before it: {100 * before:.1f} %).",
                "",
            ]
    return out

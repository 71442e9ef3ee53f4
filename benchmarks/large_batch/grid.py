"""The cells, the S = 1 sweep and the table shared by this study and the Adam study's fair comparison.

A fixed-rule method is a label with ``(family, rule, stretched)``, e.g. ``"LAMB+": ("lamb", "sqrtW", True)``.
Cells are cached under the label and the peak learning rate (``"LAMB+@0.01"``), so a new tuned rate
re-runs its cells instead of reading stale ones.
"""

from __future__ import annotations

import functools
import math
import re

import numpy as np

from benchmarks.harness import stats
from benchmarks.large_batch import engine


def cell_name(problem, key: str, scale: int, seed: int) -> str:
    """``"LAMB+@0.01"`` → ``mnist1d_LAMBplus_lr0.01_S4_seed0``."""
    label, _, lr = key.partition("@")
    tag = re.sub(r"[^A-Za-z0-9.-]+", "_", label.replace("+", "plus")).strip("_")
    return f"{problem.name}_{tag}_lr{lr}_S{scale}_seed{seed}"


class FixedCells:
    """Fixed-rule cells of one problem, cached, with a progress line per cell that ran."""

    def __init__(self, problem: engine.Problem, cache, *, num_evals: int, log=None):
        self.problem, self.cache, self.num_evals = problem, cache, num_evals
        self.log = log or functools.partial(print, flush=True)

    def run(self, label, family, rule, scale, seed, num_iterations, peak, *, only_cached=False):
        key = f"{label}@{peak:g}"
        record = self.cache.get(self.problem, key, scale, seed)
        if record is None and not only_cached:
            record = engine.run_cell(
                self.problem, family, rule, scale, seed, num_iterations, peak, num_evals=self.num_evals
            )
            record["method"], record["label"] = key, label
            self.cache.put(record, self.problem)
            self.log(
                f"  {self.problem.name:10s} {label:6s} S={scale:<3d} seed={seed} lr={peak:<7g} "
                f"iters={record['iterations']:5d}  {self.problem.metric}={record['final']['metric']:.4g}  "
                f"train loss={record['final']['train_loss']:.4g}  ({record['wall_s']:.1f} s)"
            )
        return record

    def tune(self, label, family, rates, *, only_cached=False):
        """The S = 1 sweep (seed 0, ``N = T``; every rule is the identity at S = 1): ``(best rate, rows)``."""
        rows = []
        for lr in rates:
            r = self.run(label, family, "id", 1, 0, self.problem.total_steps, lr, only_cached=only_cached)
            if r is not None:
                rows.append((lr, r))
        if not rows:
            return None, rows

        def score(item):
            m = item[1]["final"]["metric"]
            if not math.isfinite(m) or failed(self.problem, item[1]):
                return -math.inf
            return m if self.problem.higher_is_better else -m

        return max(rows, key=score)[0], rows


def failed(problem, record) -> bool:
    """A run that did not train: final training loss non-finite or no better than uniform guessing."""
    loss = record["final"]["train_loss"]
    return not math.isfinite(loss) or loss > 0.98 * problem.chance_loss


def _finals(recs):
    return [r["final"]["metric"] for r in recs]


def paired(problem, base_recs, recs) -> tuple[float, float, int]:
    """``(mean of per-seed differences, two standard errors, seeds)`` over the seeds both ran, signed so that
    positive means *better* than base."""
    base = {r["seed"]: r["final"]["metric"] for r in base_recs}
    sign = 1.0 if problem.higher_is_better else -1.0
    d = [sign * (r["final"]["metric"] - base[r["seed"]]) for r in recs if r["seed"] in base]
    m, s, n = stats.mean_std(d)
    return m, 2.0 * s / math.sqrt(n), n


def flag(problem, base_recs, recs) -> str:
    """``✗``: worse than its S = 1 by more than 2 SE (unpaired) and the tolerance, or a seed failed; ``~``: beyond
    2 SE but within the tolerance."""
    values = _finals(recs)
    if any(failed(problem, r) for r in recs) or not np.all(np.isfinite(values)):
        n = sum(failed(problem, r) for r in recs)
        return f" ✗ ({n}/{len(recs)} failed)"
    diff, se2 = stats.worse_by(problem.higher_is_better, _finals(base_recs), values)
    tolerance = problem.tolerance * (abs(np.mean(_finals(base_recs))) if problem.metric == "excess risk" else 1.0)
    if diff > max(se2, tolerance):
        return " ✗"
    if diff > se2 and diff > 0:
        return " ~"
    return ""


def number_format(problem):
    """How a task's metric prints: 2 decimals for accuracy, 4 for a loss in nats, 3 significant digits else."""
    if problem.higher_is_better:
        return lambda v: f"{v:.2f}"
    if "nats" in problem.metric:
        return lambda v: f"{v:.4f}"
    return lambda v: f"{v:.3g}"


def table(problem, rows) -> str:
    """A markdown table. ``rows``: ``(S, label, recs, S = 1 recs of its optimizer, AdaScale's recs at S)``."""
    fmt = number_format(problem)
    lines = [
        f"| S | method | {problem.metric} | Δ vs its S = 1 | vs AdaScale, same S (paired, + = better) | "
        "iterations | examples ÷ S=1 | per seed |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    T = problem.total_steps
    every = sorted({rec["seed"] for row in rows if row[2] for rec in row[2]})
    for scale, label, recs, base, adascale in rows:
        if recs is None:
            lines.append(f"| {scale} | {label} | — | — | — | — | — | — |")
            continue
        metric = _finals(recs)
        delta = vs_as = mark = ""
        if base is not None and scale > 1:
            mark = flag(problem, base, recs)
            diff, se2 = stats.worse_by(problem.higher_is_better, _finals(base), metric)
            delta = f"{_signed(fmt, -diff if problem.higher_is_better else diff)} (2 SE {fmt(se2)})"
        if adascale is not None and adascale is not recs:
            m, se2, n = paired(problem, adascale, recs)
            vs_as = f"{_signed(fmt, m)} (2 SE {fmt(se2)})" + ("" if n == len(recs) else f" ({n} seeds)")
        iters = stats.mean_std([r["iterations"] for r in recs])[0]
        m, s, _ = stats.mean_std(metric)
        value = "diverged" if not math.isfinite(m) else f"{fmt(m)} ± {fmt(s)}"
        seeds = [r["seed"] for r in recs]
        value += "" if seeds == every else f" (seeds {', '.join(map(str, seeds))})"
        lines.append(
            f"| {scale} | {label} | {value}{mark} | {delta} | {vs_as} | {iters:.0f} | "
            f"{iters * scale / T:.2f} | " + " / ".join(fmt(v) for v in metric) + " |"
        )
    return "\n".join(lines)


def _signed(fmt, value):
    return ("+" if value >= 0 else "-") + fmt(abs(value))


class SplitCache:
    """A study's own cells and the fixed-rule cells (``cell_name``: methods with an ``@``) as one cache."""

    def __init__(self, own_cache, fixed_cache):
        self._own, self._fixed = own_cache, fixed_cache

    def _pick(self, method):
        return self._fixed if "@" in method else self._own

    def get(self, task, method, scale, seed):
        return self._pick(method).get(task, method, scale, seed)

    def put(self, record, task):
        self._pick(record["method"]).put(record, task)

"""The guard in the statistics' own pass (0.5.0) against 0.4.0's on the scale study's deciding cells.

0.5.0 takes the guard's statistics on a sample of each leaf in the statistics' reduction, and the curvature measured in
one update caps the next; 0.4.0 read every element in a pass of its own. Re-run: the cells that decided 0.4.0's default
(LM-SGD at S = 32, every rate, 3 seeds; quadratic, teacher and MNIST-1D at S = 32 and 64), each with its S = 2 baseline
re-run too, into ``cells_0.5/``; 0.4.0's committed cells (``cells/``, method ``guarded``) beside.

    python -m benchmarks.scale_quality --tasks quadratic teacher mnist1d --methods guarded --scales 2 32 64 \\
        --cache benchmarks/scale_quality/cells_0.5 --no-report --no-diagnosis
    python -m benchmarks.scale_quality --tasks lm_sgd --methods guarded --scales 2 32 \\
        --cache benchmarks/scale_quality/cells_0.5 --no-report --no-diagnosis
    python -m benchmarks.scale_quality.lag        # this table, into README.md's lag section

The columns: the final loss at S relative to S = 2's with the same method, rate and seeds (mean ± SE: the one-sided
goal is ≤ +2 % at S ≤ 32 and ≤ +5 % beyond, within SE), the updates the run took (0.5.0 / 0.4.0), and how often
the guard held the applied gain below 0.99 of the estimated gain (``metrics()["estimated_gain"]``) and by how much
(applied / estimated over those updates).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from benchmarks.scale_quality import results

HERE = Path(__file__).resolve().parent
CELLS = {"0.4.0": HERE / "cells", "0.5.0": HERE / "cells_0.5"}
DECIDING = {"lm_sgd": (32,), "quadratic": (32, 64), "teacher": (32, 64), "mnist1d": (32, 64)}
MULTS = (0.5, 1.0, 2.0)


def _records(root: Path, task: str) -> list[dict]:
    out = []
    for path in sorted((root / task).glob("guarded_S*.json")):
        out += json.loads(path.read_text())
    return out


def _held(root: Path, task: str, scale: int, mult: float) -> str:
    """How often the stability guard held the applied gain below 0.99 of the estimated one (share of the updates,
    mean over seeds), and by how much where it did (applied / estimated, mean over those updates and seeds)."""
    runs = [
        r for r in _records(root, task) if r["scale"] == scale and abs(r["lr_mult"] - mult) < 1e-9 and "held_share" in r
    ]
    if not runs:
        return "—"
    share = sum(r["held_share"] for r in runs) / len(runs)
    ratios = [r["held_ratio"] for r in runs if r["held_share"] > 0]
    return f"{100 * share:.0f} %" + (f", {sum(ratios) / len(ratios):.2f}" if ratios else "")


def table() -> str:
    lines = [
        "| task | S | rate | 0.4.0 (own pass) | 0.5.0 (sampled, next update) | updates 0.5.0 / 0.4.0 "
        "| 0.5.0: updates held, applied / estimated |",
        "|---|---|---|---|---|---|---|",
    ]
    for task, scales in DECIDING.items():
        idx = {v: results.index(_records(root, task)) for v, root in CELLS.items()}
        for scale in scales:
            for mult in MULTS:
                cells = []
                for v in CELLS:
                    rel = results.relative(idx[v], task, "guarded", scale, mult)
                    cells.append("—" if rel is None else f"{100 * rel[0]:+.1f} ± {100 * rel[1]:.1f} ({rel[2]} seeds)")
                its = [results.mean_of(idx[v], task, "guarded", scale, mult, "iterations") for v in CELLS]
                ratio = "—" if None in its else f"{its[1]:.0f} / {its[0]:.0f} = {its[1] / its[0]:.2f}×"
                held = _held(root=CELLS["0.5.0"], task=task, scale=scale, mult=mult)
                lines.append(f"| {task} | {scale} | ×{mult:g} | {cells[0]} | {cells[1]} | {ratio} | {held} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    text = table()
    readme = HERE / "README.md"
    body = readme.read_text()
    start, end = "<!-- lag:start -->", "<!-- lag:end -->"
    section = f"{start}\n{text}\n{end}"
    if start in body:
        body = body[: body.index(start)] + section + body[body.index(end) + len(end) :]
    else:
        body = body.rstrip("\n") + "\n\n## The guard's statistics in the reduction (0.5.0)\n\n" + section + "\n"
    if "--print" in (argv or sys.argv[1:]):
        print(text)
    else:
        readme.write_text(body)
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Plot helpers: a headless pyplot, saving, seed-mean curves and τ at the logged iterations."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: Path, dpi: int = 110) -> Path:
    """Write ``fig`` to ``path`` (its folder made if needed) and close it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return path


def mean_curve(results: dict, task: str, method: str, scale: int, seeds, key: str = "metric"):
    """``(τ, value)`` at the evaluation checkpoints, means over the seeds present; ``(None, None)`` if none."""
    recs = [results[(task, method, scale, s)] for s in seeds if (task, method, scale, s) in results]
    if not recs:
        return None, None
    n = min(len(r["curve"]["tau"]) for r in recs)
    tau = np.mean([r["curve"]["tau"][:n] for r in recs], axis=0)
    return tau, np.mean([r["curve"][key][:n] for r in recs], axis=0)


def log_tau(record: dict) -> np.ndarray:
    """τ before each logged iteration, interpolated from the checkpoints (τ is monotone in the iteration).

    ``logs["it"]`` holds 0-based iteration indices and ``curve["it"]`` iterations done, so iteration
    ``i`` starts at ``τ(i)``: the τ at which its gain was measured and its step size ``lr(⌊τ⌋)`` chosen.
    """
    curve = record["curve"]
    return np.interp(record["logs"]["it"], curve["it"], curve["tau"])

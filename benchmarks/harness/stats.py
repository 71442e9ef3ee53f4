"""Summaries over seeds and the "worse than S = 1" test the quality studies share."""

from __future__ import annotations

import math

import numpy as np


def mean_std(values) -> tuple[float, float, int]:
    """``(mean, sample std (0 for one value), count)``."""
    arr = np.asarray(values, np.float64)
    return float(np.mean(arr)), (float(np.std(arr, ddof=1)) if len(arr) > 1 else 0.0), len(arr)


def worse_by(higher_is_better: bool, base_values, values) -> tuple[float, float]:
    """``(how much worse than the base, two standard errors of the difference)``; positive is worse."""
    m0, s0, n0 = mean_std(base_values)
    m, s, n = mean_std(values)
    diff = (m0 - m) if higher_is_better else (m - m0)
    return diff, 2.0 * math.sqrt(s0**2 / n0 + s**2 / n)


def fmt(mean: float, std: float, digits: int) -> str:
    """``"mean ± std"`` with ``digits`` decimals, or ``"diverged"``."""
    return "diverged" if not math.isfinite(mean) else f"{mean:.{digits}f} ± {std:.{digits}f}"


def thin(n: int, points: int) -> np.ndarray:
    """About ``points`` sorted indices out of ``range(n)``, denser at the start (log-spaced, then linear)."""
    if n <= points:
        return np.arange(n)
    idx = np.concatenate([np.geomspace(1, n, points // 2).astype(int) - 1, np.linspace(0, n - 1, points // 2)])
    return np.unique(idx.astype(int))

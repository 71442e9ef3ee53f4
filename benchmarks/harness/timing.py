"""Ratios of alternating timed blocks (A B C A B C ...) against the baseline block of the same round."""

from __future__ import annotations

import numpy as np


def ratios(times: dict[str, list[float]], base: str) -> dict[str, dict[str, float]]:
    """``{variant: {"median", "min", "max"}}`` of its per-round time over ``base``'s in the same round."""
    b = np.asarray(times[base], np.float64)
    out = {}
    for name, t in times.items():
        r = np.asarray(t, np.float64) / b
        out[name] = {"median": float(np.median(r)), "min": float(np.min(r)), "max": float(np.max(r))}
    return out


def fmt_ratio(r: dict[str, float]) -> str:
    """``"median (min–max)"``."""
    return f"{r['median']:.3f} ({r['min']:.2f}–{r['max']:.2f})"

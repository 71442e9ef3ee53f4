"""The noisy quadratic in closed form: the expected loss of every rule, with the *true* gain, no sampling.

On ``L(x) = ½ xᵀHx`` with ``H = diag(h)`` and base-batch gradient noise ``N(0, Σ/B)``, ``Σ = diag(c)``, momentum SGD
is linear in ``(x, m)``: per coordinate the second moments ``E[z zᵀ]`` of ``z = (x, m)`` evolve exactly by
``M ← A M Aᵀ + b bᵀ c/(B·S)`` for an update at scale ``S``. The gain uses the true ``σ² = tr Σ/B`` and
``μ² = E‖Hx‖² = Σ h² E[x²]``, so what is left of a gap between scales is the *model*: where the gain is applied
(the momentum's clock), and the curvature and noise the paper's progress model leaves out. Estimator noise (small
``n``, the moving averages' lag) is what separates these numbers from the sampled runs of ``scale_quality.py``.

Rules (the step is ``−r·lr(⌊τ⌋)·d``, ``τ ← τ + r``):

* ``paper``: ``m ← βm + g``, ``d = m`` (FairScale; the momentum decays per update);
* ``gain_before``: ``m ← βm + r·lr·g``, the step is ``m`` (each gradient enters at its own gain);
* ``tau``: ``m ← β^r m + (1 − β^r)/(1 − β)·g``, ``d = m`` (the τ clock, ``optax_adascale.trace``);
* ``no_momentum``: ``d = g/(1 − β)`` (plain SGD at the same effective step).
"""

from __future__ import annotations

import numpy as np

RULES = ("paper", "gain_before", "tau", "no_momentum")


def schedule(t: int, total: int, warmup_fraction: float = 0.05) -> float:
    """``optax.warmup_cosine_decay_schedule(0, 1, warmup, total, 0)`` at integer ``t``."""
    w = max(1, round(warmup_fraction * total))
    if t < w:
        return t / w
    return 0.5 * (1 + np.cos(np.pi * min((t - w) / (total - w), 1.0)))


def transition(rule: str, r: float, a: float, h: np.ndarray, beta: float) -> tuple[np.ndarray, np.ndarray]:
    """``(A, b)`` per coordinate: ``z' = A z + b ξ`` for ``z = (x, m)``, a step at gain ``r`` and rate ``a``."""
    d = h.shape[0]
    A, b = np.zeros((d, 2, 2)), np.zeros((d, 2))
    if rule == "paper":
        A[:, 1, 0], A[:, 1, 1], b[:, 1] = h, beta, 1.0
        A[:, 0, 0], A[:, 0, 1], b[:, 0] = 1 - r * a * h, -r * a * beta, -r * a
    elif rule == "gain_before":
        A[:, 1, 0], A[:, 1, 1], b[:, 1] = r * a * h, beta, r * a
        A[:, 0, 0], A[:, 0, 1], b[:, 0] = 1 - r * a * h, -beta, -r * a
    elif rule == "tau":
        keep = beta**r
        w = (1 - keep) / (1 - beta)
        A[:, 1, 0], A[:, 1, 1], b[:, 1] = w * h, keep, w
        A[:, 0, 0], A[:, 0, 1], b[:, 0] = 1 - r * a * w * h, -r * a * keep, -r * a * w
    elif rule == "no_momentum":
        s = r * a / (1 - beta)
        A[:, 0, 0], b[:, 0] = 1 - s * h, -s
    else:
        raise ValueError(f"unknown rule {rule!r}, expected one of {RULES}")
    return A, b


def run(
    rule: str,
    scale: int,
    lr: float,
    *,
    h,
    noise,
    x0,
    batch_size: int,
    total: int,
    beta: float = 0.9,
    log_every: int = 0,
) -> dict:
    """The expected loss at ``τ ≥ T`` of one rule at scale ``S`` (true gain), and a log of the run."""
    d = h.shape[0]
    M = np.zeros((d, 2, 2))
    M[:, 0, 0] = x0**2
    sigma2 = float(np.sum(noise)) / batch_size
    tau, it, log = 0.0, 0, []
    while tau < total and it < 10 * total:
        mu2 = float(np.sum(h**2 * M[:, 0, 0]))
        r = 1.0 if scale == 1 else min(scale, (sigma2 + mu2) / (sigma2 / scale + mu2))
        a = lr * schedule(int(tau), total)
        A, b = transition(rule, r, a, h, beta)
        if log_every and it % log_every == 0:
            log.append(
                {"tau": tau, "gain": r, "loss": 0.5 * float(np.sum(h * M[:, 0, 0])), "sigma2": sigma2, "mu2": mu2}
            )
        M = (
            np.einsum("dij,djk,dlk->dil", A, M, A)
            + np.einsum("di,dj->dij", b, b) * (noise / (batch_size * scale))[:, None, None]
        )
        tau += r
        it += 1
        if not np.all(np.isfinite(M)):
            return {"loss": float("inf"), "iterations": it, "log": log}
    return {
        "loss": 0.5 * float(np.sum(h * M[:, 0, 0])),
        "iterations": it,
        "log": log,
        "per_coordinate": (0.5 * h * M[:, 0, 0]).tolist(),
    }

"""Shared test fixtures: a tiny MLP and its synthetic data (not a test module)."""

import functools
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

DIM, CLASSES = 6, 3


def init_mlp():
    """A 6 → 16 → 3 tanh MLP with fixed weights."""
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "hidden": {"w": jax.random.normal(k1, (DIM, 16)) * 0.5, "b": jnp.zeros(16)},
        "out": {"w": jax.random.normal(k2, (16, CLASSES)) * 0.5, "b": jnp.zeros(CLASSES)},
    }


def mlp_loss(params, x, y):
    h = jnp.tanh(x @ params["hidden"]["w"] + params["hidden"]["b"])
    logits = h @ params["out"]["w"] + params["out"]["b"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


@functools.cache
def synthetic_batches(steps: int, n: int, rows: int, dim: int = DIM, classes: int = CLASSES):
    """``(steps, n, rows, dim)`` inputs and ``(steps, n, rows)`` labels: update t, sample i."""
    kx, ky = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (steps, n, rows, dim))
    y = jax.random.randint(ky, (steps, n, rows), 0, classes)
    return np.asarray(x), np.asarray(y)


EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run_example(name: str, *args: str, timeout: float = 300) -> str:
    """Run ``examples/<name>`` in a fresh CPU-only interpreter; assert it succeeds; return its stdout."""
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    return result.stdout

"""The scale-quality study's tasks: a noisy quadratic with a known Hessian, a teacher–student classifier with sampled
labels, a byte-level LM (SGD and AdamW) and the MNIST-1D CNN.

Each task draws ``n`` base batches at a time (``sample(key, n)``, leading axis ``n``), evaluates a loss that does
not depend on the batch size (a population loss in closed form, an exact expectation over the teacher's labels, or
held-out data) and names its optimizer. Nothing is downloaded: text and MNIST-1D come from ``examples/datasets.py``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks.ramp import tasks as ramp_tasks

Array = jax.Array


@dataclasses.dataclass(frozen=True, eq=False)
class Task:
    """A task; hashed by identity (compiled runs are cached per task object).

    Attributes:
      name, title: short and long names.
      optimizer: ``"sgd"`` (momentum ``momentum``) or ``"adamw"``.
      batch_size: ``B``, examples per base batch.
      total_steps: ``T``, base-batch steps (τ) per run.
      learning_rate: the peak of the warm-up + cosine schedule, the best at S = 2 (``--tune``).
      init, loss, sample, evaluate: ``key -> params``; ``(params, batch) -> loss``; ``(key, n) -> n base batches``;
        ``params -> loss`` (the quality measure: population or held-out).
      hessian: the quadratic's Hessian diagonal and noise covariance diagonal (per base batch), or ``None``.
    """

    name: str
    title: str
    optimizer: str
    batch_size: int
    total_steps: int
    learning_rate: float
    init: Callable[[Array], Any]
    loss: Callable[[Any, Any], Array]
    sample: Callable[[Array, int], Any]
    evaluate: Callable[[Any], Array]
    momentum: float = 0.9
    weight_decay: float = 0.0
    warmup_fraction: float = 0.05
    hessian: tuple[Array, Array] | None = None
    info: dict = dataclasses.field(default_factory=dict)

    def schedule(self, peak: float | Array) -> optax.Schedule:
        """``lr(τ)``: linear warm-up from 0 over 5 % of ``T``, cosine decay to 0 at ``T``."""
        T = self.total_steps
        base = optax.warmup_cosine_decay_schedule(0.0, 1.0, max(1, round(self.warmup_fraction * T)), T, 0.0)
        return lambda t: peak * base(t)

    def config(self) -> dict:
        return {
            "optimizer": self.optimizer,
            "batch_size": self.batch_size,
            "total_steps": self.total_steps,
            "learning_rate": self.learning_rate,
            "momentum": self.momentum,
            "weight_decay": self.weight_decay,
            "warmup_fraction": self.warmup_fraction,
            "schedule": "warmup_cosine_decay(0 → lr over warmup, → 0 at T)",
            **self.info,
        }


def quadratic(*, smoke: bool = False) -> Task:
    r"""A noisy quadratic with a known Hessian: ``L(x) = ½ xᵀHx``, ``H = diag(h)``, ``h`` log-spaced over two decades.

    A base batch's gradient is ``Hx + ξ`` with ``ξ ~ N(0, Σ/B)``, ``Σ = diag(h)`` (the gradient noise of a
    well-specified model near its optimum has the Hessian's shape: Fisher = Hessian). Everything the gain models is
    known in closed form: ``σ² = tr Σ / B``, ``μ² = ‖Hx‖²``, the curvature along any direction ``d`` is
    ``dᵀHd/‖d‖²``. Evaluated exactly: ``L(x)`` (its minimum is 0).
    """
    dim, B, T = (16, 4, 80) if smoke else (256, 4, 1000)
    h = jnp.asarray(np.logspace(0.0, -2.0, dim), jnp.float32)
    noise = h
    x0 = jnp.asarray(np.random.default_rng(0).normal(size=dim), jnp.float32)

    def loss(x, xi):
        return 0.5 * jnp.sum(h * x * x) + jnp.dot(xi, x)

    def sample(key, n):
        return jax.random.normal(key, (n, dim), jnp.float32) * jnp.sqrt(noise / B)

    return Task(
        name="quadratic",
        title="noisy quadratic, known Hessian (SGD, momentum 0.9)",
        optimizer="sgd",
        batch_size=B,
        total_steps=T,
        learning_rate=0.03,
        init=lambda key: x0,
        loss=loss,
        sample=sample,
        evaluate=lambda x: 0.5 * jnp.sum(h * x * x),
        hessian=(h, noise),
        info={"dim": dim, "h": "logspace(0, -2, dim)", "noise": "Σ = H per example", "x0_seed": 0},
    )


def teacher_student(*, smoke: bool = False) -> Task:
    """A student MLP learns a fixed teacher MLP whose labels are *sampled* from its softmax, fresh every call.

    Every batch is new data, so no generalisation gap separates batch sizes; the loss is the exact expectation over
    the teacher's labels (cross-entropy against its probabilities) on 8,192 fixed inputs.
    """
    d, hidden, classes, teacher_hidden, temp = (16, 32, 8, 16, 12.0) if smoke else (64, 256, 32, 128, 12.0)
    B, T = (8, 80) if smoke else (16, 1500)
    k1, k2, k3 = jax.random.split(jax.random.key(7), 3)
    w1 = jax.random.normal(k1, (d, teacher_hidden)) * 2 / math.sqrt(d)
    w2 = jax.random.normal(k2, (teacher_hidden, classes)) * temp / math.sqrt(teacher_hidden)

    def teacher(x):
        return jnp.tanh(x @ w1) @ w2

    x_eval = jax.random.normal(k3, (1024 if smoke else 8192, d))
    p_eval = jax.nn.softmax(teacher(x_eval))

    def init(key):
        a, b = jax.random.split(key)
        return {
            "w1": jax.random.normal(a, (d, hidden)) * math.sqrt(2 / d),
            "b1": jnp.zeros(hidden),
            "w2": jax.random.normal(b, (hidden, classes)) * math.sqrt(1 / hidden),
            "b2": jnp.zeros(classes),
        }

    def apply(p, x):
        return jax.nn.relu(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]

    def loss(p, batch):
        x, y = batch
        return optax.softmax_cross_entropy_with_integer_labels(apply(p, x), y).mean()

    def sample(key, n):
        kx, ky = jax.random.split(key)
        x = jax.random.normal(kx, (n, B, d))
        return x, jax.random.categorical(ky, teacher(x))

    return Task(
        name="teacher",
        title="teacher–student classifier, sampled labels (SGD, momentum 0.9)",
        optimizer="sgd",
        batch_size=B,
        total_steps=T,
        learning_rate=0.01,
        init=init,
        loss=loss,
        sample=sample,
        evaluate=lambda p: optax.softmax_cross_entropy(apply(p, x_eval), p_eval).mean(),
        info={
            "student": f"MLP {d}-{hidden}-{classes} ReLU",
            "teacher": f"MLP {d}-{teacher_hidden}-{classes} tanh, logit scale {temp}, seed 7",
            "eval_inputs": int(x_eval.shape[0]),
        },
    )


def _from_ramp(task: ramp_tasks.Task, optimizer_title: str, *, lr: float, weight_decay: float) -> Task:
    """A ``benchmarks/ramp`` task (its model, data and held-out split) drawing ``n`` base batches at a time."""
    data = jax.tree.map(jnp.asarray, task.data)
    B = task.batch_size
    if task.name.startswith("lm"):

        def sample(key, n):
            return data["train"][jax.random.randint(key, (n, B), 0, data["train"].shape[0])]

    else:

        def sample(key, n):
            idx = jax.random.randint(key, (n, B), 0, data["x"].shape[0])
            return data["x"][idx], data["y"][idx]

    return Task(
        name=task.name,
        title=f"{task.title.split(',')[0]}, {optimizer_title}",
        optimizer=task.optimizer,
        batch_size=B,
        total_steps=task.total_steps,
        learning_rate=lr,
        init=task.init,
        loss=task.loss,
        sample=sample,
        evaluate=lambda p: task.evaluate(p, data),
        weight_decay=weight_decay,
        info={"from": f"benchmarks/ramp's {task.name} builder", **task.info},
    )


# The LMs and the CNN at sizes the CPU grid affords (S up to 64, three learning rates, two seeds): the ramp study's
# models shrunk (d = 32, one layer, 32-byte context; 8 channels), T = 1000 base steps. Peak rates: the best at
# S = 2 of ×{¼, ½, 1, 2, 4} around the ramp study's (seeds 0, 1; the README's "Learning rates").
LM_MODEL, LM_BATCH_TOTAL = (32, 1, 2, 32, 256), (4, 1000)
CNN_SIZES = (8, 16, 1000, 10_000)
TUNE_CENTERS = {"lm_sgd": 0.03, "lm_adamw": 3e-3, "mnist1d": 0.03}  # the ramp study's rates, the sweep's centre
LEARNING_RATES = {"lm_sgd": 0.06, "lm_adamw": 3e-3, "mnist1d": 0.06}  # the sweep's best (README, "Learning rates")


def make_tasks(*, smoke: bool = False, learning_rates: dict | None = None) -> dict[str, Task]:
    """All tasks by name (``learning_rates`` replaces peak rates, for the sweep that chose them)."""
    rates = {**LEARNING_RATES, **(learning_rates or {})}

    def lm(optimizer):
        return ramp_tasks._lm(
            optimizer, smoke=smoke, model=None if smoke else LM_MODEL, batch_total=None if smoke else LM_BATCH_TOTAL
        )

    cnn = ramp_tasks._mnist1d(
        smoke=smoke, cache_dir=Path(__file__).parent / ".cache", sizes=None if smoke else CNN_SIZES
    )
    return {
        "quadratic": quadratic(smoke=smoke),
        "teacher": teacher_student(smoke=smoke),
        "lm_sgd": _from_ramp(lm("sgd"), "SGD (momentum 0.9)", lr=rates["lm_sgd"], weight_decay=0.0),
        "lm_adamw": _from_ramp(lm("adamw"), "AdamW", lr=rates["lm_adamw"], weight_decay=0.1),
        "mnist1d": _from_ramp(cnn, "SGD (momentum 0.9)", lr=rates["mnist1d"], weight_decay=0.0),
    }

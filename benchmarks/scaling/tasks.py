"""The three tasks of the scaling study: data, model, loss, evaluation, closed-form moments.

Everything a training run touches is a pure ``jax.numpy`` function, so a whole
run compiles into one XLA program. Data sets are small enough to live on the
device as constants; mini-batches are drawn with replacement (i.i.d. batches,
as AdaScale's analysis assumes).

* ``mnist1d``: MNIST-1D (Greydanus, 2020), ``examples/datasets.py``'s ``mnist1d``
  (generated locally, never downloaded), 8,000 training / 2,000 validation
  sequences of length 40; an MLP 40-128-128-10.
* ``digits``: scikit-learn's bundled 8×8 digits, 1,437 / 360; an MLP 64-64-10.
* ``regression``: streaming linear regression with Gaussian inputs, where the
  gradient's mean and variance — hence AdaScale's true gain — are known in
  closed form (:func:`regression_moments`).
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

from examples import datasets

Array = jax.Array


@dataclasses.dataclass(frozen=True, eq=False)
class Task:
    """A benchmark task. Hashed by identity, so compiled runs can be cached per task object.

    Attributes:
      name: short name used in file names.
      title: human-readable name.
      batch_size: ``B``, the base batch (per replica).
      total_steps: ``T``, the base-batch step budget.
      learning_rate: ``lr(0)`` of the base schedule, tuned once at ``S = 1``.
      momentum: heavy-ball momentum (PyTorch convention) for every method.
      decay: ``"step"`` (×0.1 at 50 % and 75 % of ``T``) or ``"exponential"``
        (×0.01 over ``T``).
      metric: name of the validation metric.
      higher_is_better: direction of the metric.
      tolerance: the smallest difference in the metric that counts as worse
        (absolute for accuracy, relative for the regression's excess risk).
      init: ``key -> params``.
      loss: ``(params, batch) -> scalar`` mean loss of one batch.
      sample: ``(key, n) -> batch`` with leading axes ``(n, B)``: one base
        batch per replica (``n = S``), or ``n`` fresh batches for the offline
        gain estimate.
      evaluate: ``params -> {"metric", "train_loss", "val_loss"}``.
      moments: for the regression, ``params -> (σ², μ²)`` of one base-batch
        gradient in closed form; ``None`` otherwise.
      info: extra configuration recorded in the cache (sizes, seeds).
    """

    name: str
    title: str
    batch_size: int
    total_steps: int
    learning_rate: float
    momentum: float
    decay: str
    metric: str
    higher_is_better: bool
    tolerance: float
    init: Callable[[Array], Any]
    loss: Callable[[Any, Any], Array]
    sample: Callable[[Array, int], Any]
    evaluate: Callable[[Any], dict[str, Array]]
    moments: Callable[[Any], tuple[Array, Array]] | None
    info: dict = dataclasses.field(default_factory=dict)

    def schedule(self) -> optax.Schedule:
        """The base schedule ``lr(t)`` of the base-batch step ``t`` (no warm-up)."""
        T = self.total_steps
        if self.decay == "step":
            return optax.piecewise_constant_schedule(self.learning_rate, {T // 2: 0.1, (3 * T) // 4: 0.1})
        if self.decay == "exponential":
            return optax.exponential_decay(self.learning_rate, transition_steps=T, decay_rate=0.01)
        raise ValueError(f"unknown decay={self.decay!r}")

    def config(self) -> dict:
        """Everything that determines a run's result (stored with cached cells)."""
        return {
            "batch_size": self.batch_size,
            "total_steps": self.total_steps,
            "learning_rate": self.learning_rate,
            "momentum": self.momentum,
            "decay": self.decay,
            **self.info,
        }


# --------------------------------------------------------------------------- MLP classification


def _mlp_init(sizes: tuple[int, ...]) -> Callable[[Array], list[tuple[Array, Array]]]:
    def init(key):
        params = []
        keys = jax.random.split(key, len(sizes) - 1)
        for i, (k, fan_in, fan_out) in enumerate(zip(keys, sizes[:-1], sizes[1:], strict=True)):
            gain = 2.0 if i < len(sizes) - 2 else 1.0  # He for ReLU layers, LeCun for the logits
            w = jax.random.normal(k, (fan_in, fan_out), jnp.float32) * math.sqrt(gain / fan_in)
            params.append((w, jnp.zeros((fan_out,), jnp.float32)))
        return params

    return init


def _mlp_apply(params, x):
    for w, b in params[:-1]:
        x = jax.nn.relu(x @ w + b)
    w, b = params[-1]
    return x @ w + b


def _cross_entropy(params, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(_mlp_apply(params, x), y).mean()


def _classification_task(
    name, title, x_train, y_train, x_val, y_val, hidden, *, batch_size, total_steps, learning_rate, info
) -> Task:
    x_train, x_val = jnp.asarray(x_train, jnp.float32), jnp.asarray(x_val, jnp.float32)
    y_train, y_val = jnp.asarray(y_train, jnp.int32), jnp.asarray(y_val, jnp.int32)
    n_train = x_train.shape[0]
    sizes = (x_train.shape[1], *hidden, int(max(y_train.max(), y_val.max())) + 1)

    def loss(params, batch):
        x, y = batch
        return _cross_entropy(params, x, y)

    def sample(key, num_replicas):
        idx = jax.random.randint(key, (num_replicas, batch_size), 0, n_train)
        return x_train[idx], y_train[idx]

    def evaluate(params):
        logits = _mlp_apply(params, x_val)
        accuracy = 100.0 * jnp.mean(jnp.argmax(logits, -1) == y_val)
        val_loss = optax.softmax_cross_entropy_with_integer_labels(logits, y_val).mean()
        return {"metric": accuracy, "train_loss": _cross_entropy(params, x_train, y_train), "val_loss": val_loss}

    return Task(
        name=name,
        title=title,
        batch_size=batch_size,
        total_steps=total_steps,
        learning_rate=learning_rate,
        momentum=0.9,
        decay="step",
        metric="val. accuracy (%)",
        higher_is_better=True,
        tolerance=1.0,
        init=_mlp_init(sizes),
        loss=loss,
        sample=sample,
        evaluate=evaluate,
        moments=None,
        info={"sizes": list(sizes), "n_train": int(n_train), "n_val": int(x_val.shape[0]), **info},
    )


def mnist1d_task(*, smoke: bool = False, cache_dir: Path | None = None) -> Task:
    """MNIST-1D, MLP 40-128-128-10, step decay, base batch 32."""
    num_samples = 1_000 if smoke else 10_000
    data = datasets.mnist1d(num_samples, cache_dir)
    x, y, x_val, y_val = (data[k] for k in ("x", "y", "x_test", "y_test"))
    return _classification_task(
        "mnist1d",
        "MNIST-1D MLP",
        x,
        y,
        x_val,
        y_val,
        hidden=(32,) if smoke else (128, 128),
        batch_size=32,
        total_steps=64 if smoke else 3072,
        learning_rate=0.05,
        info={"num_samples": num_samples},
    )


def digits_task(*, smoke: bool = False) -> Task:
    """scikit-learn digits (8×8), MLP 64-64-10, step decay, base batch 16."""
    data = datasets.digits(val_fraction=0.2, seed=0)
    return _classification_task(
        "digits",
        "digits MLP",
        data["x"],
        data["y"],
        data["x_test"],
        data["y_test"],
        hidden=(16,) if smoke else (64,),
        batch_size=16,
        total_steps=64 if smoke else 1536,
        learning_rate=0.1,
        info={"split_seed": 0},
    )


# --------------------------------------------------------------------------- streaming linear regression


def regression_moments(w: Array, w_star: Array, eigs: Array, noise_std: float, batch_size: int) -> tuple[Array, Array]:
    r"""Closed-form ``(σ², μ²)`` of one base-batch gradient of the regression.

    Model: ``x ~ N(0, Σ)``, ``Σ = diag(λ)``, ``y = x·w* + ε``, ``ε ~ N(0, s²)``,
    loss ``½(x·w − y)²``. With ``e = w − w*`` the per-example gradient is
    ``g = x(xᵀe − ε)``, so

    * ``E[g] = Σe`` and ``μ² = ‖Σe‖²``;
    * by Isserlis' theorem ``E[x xᵀ e eᵀ x xᵀ] = 2Σe eᵀΣ + (eᵀΣe)Σ``, so
      ``Cov[g] = Σe eᵀΣ + (eᵀΣe + s²)Σ`` and
      ``tr Cov[g] = ‖Σe‖² + (eᵀΣe + s²)·tr Σ``;
    * a base batch averages ``B`` independent examples: ``σ² = tr Cov[g] / B``.

    The true gain at scale ``S`` is then ``(σ² + μ²)/(σ²/S + μ²)``.
    """
    e = w - w_star
    sigma_e = eigs * e
    mu2 = jnp.sum(sigma_e**2)
    quad = jnp.sum(eigs * e**2)
    sigma2 = (mu2 + (quad + noise_std**2) * jnp.sum(eigs)) / batch_size
    return sigma2, mu2


def regression_task(*, smoke: bool = False) -> Task:
    """Streaming linear regression, d = 32, eigenvalues 1 … 0.01, noise s = 0.5, base batch 8, exponential decay."""
    dim, noise_std, batch_size = (8 if smoke else 32), 0.5, 8
    eigs = jnp.asarray(np.logspace(0.0, -2.0, dim), jnp.float32)
    w_star = jax.random.normal(jax.random.key(1234), (dim,), jnp.float32)

    def loss(w, batch):
        x, y = batch
        return 0.5 * jnp.mean((x @ w - y) ** 2)

    def sample(key, num_replicas):
        kx, ke = jax.random.split(key)
        x = jax.random.normal(kx, (num_replicas, batch_size, dim), jnp.float32) * jnp.sqrt(eigs)
        y = x @ w_star + noise_std * jax.random.normal(ke, (num_replicas, batch_size), jnp.float32)
        return x, y

    def evaluate(w):
        e = w - w_star
        excess = 0.5 * jnp.sum(eigs * e**2)
        population = excess + 0.5 * noise_std**2
        return {"metric": excess, "train_loss": population, "val_loss": population}

    return Task(
        name="regression",
        title="noisy linear regression",
        batch_size=batch_size,
        total_steps=64 if smoke else 2048,
        learning_rate=0.05,
        momentum=0.9,
        decay="exponential",
        metric="excess risk",
        higher_is_better=False,
        tolerance=0.10,
        init=lambda key: jnp.zeros((dim,), jnp.float32),
        loss=loss,
        sample=sample,
        evaluate=evaluate,
        moments=lambda w: regression_moments(w, w_star, eigs, noise_std, batch_size),
        info={"dim": dim, "noise_std": noise_std, "eigs": "logspace(0, -2, dim)", "w_star_seed": 1234},
    )


def make_tasks(*, smoke: bool = False, cache_dir: Path | None = None) -> dict[str, Task]:
    """All tasks by name."""
    return {
        "mnist1d": mnist1d_task(smoke=smoke, cache_dir=cache_dir),
        "digits": digits_task(smoke=smoke),
        "regression": regression_task(smoke=smoke),
    }

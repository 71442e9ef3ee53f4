"""The study's five setups and an opt-in sixth, each a :class:`Setup`: what a run needs, whatever its origin.

* ``mnist1d``, ``digits``, ``regression``: ``benchmarks.scaling``'s tasks unchanged (momentum SGD, step or
  exponential decay; the regression's gain in closed form).
* ``digits32``: the issue's GSPMD digits setup, an MLP 64-64-10 on scikit-learn's digits at base batch 32,
  ``T = 1500``, linear warm-up (5 %) + cosine decay tuned at ``S = 1``, momentum SGD. The GSPMD drop-in
  (``optax_adascale.value_and_grad(data_axes=...)``) gives the statistics of ``S`` vmap replicas exactly
  (``tests/core/test_vmap_replicas_on_a_mesh.py``), so it is simulated with vmap replicas like the others.
* ``lm``: ``benchmarks.adam``'s byte-level transformer LM with the AdamW direction, shrunk to its ``smoke``
  model (d = 32, 1 layer, 2 heads, 16-byte context) so that the grid fits the CPU budget; base batch 8
  windows, ``T = 1500``, warm-up + cosine tuned at ``S = 1``; validation on 1,024 held-out windows.
* ``lm_full`` (opt-in: ``--tasks lm_full``): the same LM at ``benchmarks.adam``'s own size (d = 96, 2 layers,
  4 heads, 64-byte context, ~254k parameters), ``T = 2000`` and that study's peak rate; validation on 512 windows.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks.adam import tasks as adam_tasks
from benchmarks.scaling import tasks as scaling_tasks
from examples import datasets

Array = jax.Array

# Peak learning rates of the two new setups, chosen by `python -m benchmarks.estimator --tune` (S = 1, seed 0;
# README "Setup"). The scaling tasks keep benchmarks.scaling's.
LEARNING_RATES = {"digits32": 0.1, "lm": 3e-3}


@dataclasses.dataclass(frozen=True, eq=False)
class Setup:
    """One task as the study runs it. Hashed by identity (compiled runs are cached per setup).

    Attributes:
      name, title: short and long names.
      batch_size: ``B``, the base batch per replica.
      total_steps: ``T``, the base-batch budget (train until ``τ ≥ T``).
      schedule: ``lr(t)`` of the base-batch step.
      inner: ``() -> optax.GradientTransformation``, the learning-rate-free direction.
      init, loss, sample, evaluate: ``key -> params``; ``(params, batch) -> loss``; ``(key, n) -> n base
        batches``; ``params -> {"metric", "train_loss", "val_loss"}``.
      moments: ``params -> (σ², μ²)`` in closed form, or ``None`` (then the offline estimate is the reference).
      metric, higher_is_better, tolerance: the quality measure and its practical tolerance (absolute, or
        relative for the regression's excess risk).
      info: what else determines a run (stored with cached cells).
    """

    name: str
    title: str
    batch_size: int
    total_steps: int
    learning_rate: float
    schedule: Callable[[Array], Array]
    inner: Callable[[], optax.GradientTransformation]
    init: Callable[[Array], Any]
    loss: Callable[[Any, Any], Array]
    sample: Callable[[Array, int], Any]
    evaluate: Callable[[Any], dict]
    moments: Callable[[Any], tuple[Array, Array]] | None
    metric: str
    higher_is_better: bool
    tolerance: float
    relative_tolerance: bool = False
    info: dict = dataclasses.field(default_factory=dict)

    def config(self) -> dict:
        return {"batch_size": self.batch_size, "total_steps": self.total_steps, "lr": self.learning_rate, **self.info}


def _from_scaling(task: scaling_tasks.Task) -> Setup:
    return Setup(
        name=task.name,
        title=task.title,
        batch_size=task.batch_size,
        total_steps=task.total_steps,
        learning_rate=task.learning_rate,
        schedule=task.schedule(),
        inner=lambda: optax.trace(decay=task.momentum),
        init=task.init,
        loss=task.loss,
        sample=task.sample,
        evaluate=task.evaluate,
        moments=task.moments,
        metric=task.metric,
        higher_is_better=task.higher_is_better,
        tolerance=task.tolerance,
        relative_tolerance=not task.higher_is_better,
        info={**task.config(), "inner": f"trace({task.momentum})"},
    )


def _warmup_cosine(lr: float, T: int) -> optax.Schedule:
    """Linear warm-up from 0 over 5 % of ``T``, cosine decay to 0 at ``T``."""
    return optax.warmup_cosine_decay_schedule(0.0, lr, max(1, round(0.05 * T)), T, 0.0)


def digits32(*, smoke: bool = False, learning_rate: float | None = None) -> Setup:
    """The issue's GSPMD digits setup (simulated with vmap replicas, which give the same statistics)."""
    lr = LEARNING_RATES["digits32"] if learning_rate is None else learning_rate
    T = 48 if smoke else 1500
    base = scaling_tasks.digits_task(smoke=smoke)
    data = datasets.digits(val_fraction=0.2, seed=0)
    x = jnp.asarray(data["x"], jnp.float32)
    y = jnp.asarray(data["y"], jnp.int32)
    B = 32

    def sample(key, n):
        idx = jax.random.randint(key, (n, B), 0, x.shape[0])
        return x[idx], y[idx]

    return Setup(
        name="digits32",
        title="digits MLP, warm-up + cosine, B = 32 (the GSPMD setup)",
        batch_size=B,
        total_steps=T,
        learning_rate=lr,
        schedule=_warmup_cosine(lr, T),
        inner=lambda: optax.trace(decay=0.9),
        init=base.init,
        loss=base.loss,
        sample=sample,
        evaluate=base.evaluate,
        moments=None,
        metric=base.metric,
        higher_is_better=True,
        tolerance=1.0,
        info={"sizes": base.info["sizes"], "schedule": "warmup 5 % + cosine to 0", "inner": "trace(0.9)"},
    )


def lm(*, smoke: bool = False, learning_rate: float | None = None, full: bool = False) -> Setup:
    """``benchmarks.adam``'s byte LM with the AdamW direction, at its smoke size or (``full``) its own."""
    # Not full: the smoke model (d = 32, 1 layer, 2 heads, ctx 16), the one the CPU budget allows for the grid.
    task = adam_tasks.lm_task(smoke=smoke or not full)
    tuned = adam_tasks.LEARNING_RATES if full else LEARNING_RATES  # full: benchmarks.adam's tuned peak rate
    lr = tuned["lm"] if learning_rate is None else learning_rate
    if smoke:
        T, B, n_val = 48, 4, 64
    else:
        T, B, n_val = (task.total_steps, task.batch_size, 512) if full else (1500, 8, 1024)
    text, _ = datasets.stdlib_source()
    arr = np.frombuffer(text, np.uint8)
    w = task.data["train"].shape[1]
    split = int(0.95 * len(arr))
    val_all = arr[split:][: (len(arr) - split) // w * w].reshape(-1, w)
    val = jnp.asarray(val_all[np.linspace(0, len(val_all) - 1, n_val).astype(int)])
    train = jnp.asarray(task.data["train"])
    train_eval = train[np.linspace(0, train.shape[0] - 1, n_val).astype(int)]

    def sample(key, n):
        return train[jax.random.randint(key, (n, B), 0, train.shape[0])]

    def evaluate(params):
        v = task.loss(params, val)
        return {"metric": v, "val_loss": v, "train_loss": task.loss(params, train_eval)}

    def inner():
        return optax.chain(
            optax.scale_by_adam(b1=task.b1, b2=task.b2, eps=task.eps),
            optax.add_decayed_weights(task.weight_decay, task.decay_mask),
        )

    return Setup(
        name="lm_full" if full else "lm",
        title=f"byte-level transformer LM (stdlib source){', full size' if full else ''}, AdamW direction",
        batch_size=B,
        total_steps=T,
        learning_rate=lr,
        schedule=_warmup_cosine(lr, T),
        inner=inner,
        init=task.init,
        loss=task.loss,
        sample=sample,
        evaluate=evaluate,
        moments=None,
        metric="val. loss (nats/byte)",
        higher_is_better=False,
        tolerance=0.01,
        info={
            "model": task.info["model"],
            "val_windows": n_val,
            "inner": f"scale_by_adam({task.b1}, {task.b2}, {task.eps}) + decayed weights {task.weight_decay}",
            "chance": math.log(256),
        },
    )


def make_setups(*, smoke: bool = False) -> dict[str, Setup]:
    scaling = scaling_tasks.make_tasks(smoke=smoke)
    setups = {k: _from_scaling(t) for k, t in scaling.items()}
    setups["digits32"] = digits32(smoke=smoke)
    setups["lm"] = lm(smoke=smoke)
    setups["lm_full"] = lm(smoke=smoke, full=True)
    return setups


OPT_IN = ("lm_full",)  # not in the default grid: an hour and more of CPU per scale

"""The two tasks of the Adam study: a byte-level transformer LM and an MNIST-1D CNN.

* ``lm``: a byte-level pre-LayerNorm decoder (plain JAX, layers under ``lax.scan``) on
  ``examples/datasets.py``'s ``stdlib_source`` (the standard library's top-level ``*.py`` files; the
  last 5 % held out), cut into fixed windows; metric: validation loss in nats/byte;
* ``mnist1d``: ``examples/datasets.py``'s ``mnist1d`` (generated locally), a small 1-D CNN; metric:
  validation accuracy (and loss).
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
from jax import lax

from examples import datasets


@dataclasses.dataclass(frozen=True, eq=False)
class Task:
    """A benchmark task. Hashed by identity, so compiled runs are cached per task object.

    ``data`` (a dict of numpy arrays) is passed to the compiled run as an
    argument; ``sample(data, key, n)`` returns ``n`` base batches with leading
    axes ``(n, B)``; ``evaluate(params, data)`` returns ``{"metric",
    "val_loss", "train_loss"}``.
    """

    name: str
    title: str
    batch_size: int
    total_steps: int
    learning_rate: float
    weight_decay: float
    b1: float
    b2: float
    eps: float
    warmup_fraction: float
    metric: str
    higher_is_better: bool
    tolerance: float
    init: Callable[[jax.Array], Any]
    loss: Callable[[Any, Any], jax.Array]
    sample: Callable[[Any, jax.Array, int], Any]
    evaluate: Callable[[Any, Any], dict]
    decay_mask: Callable[[Any], Any]
    data: dict
    chance_loss: float = float("inf")
    info: dict = dataclasses.field(default_factory=dict)

    def schedule(self) -> optax.Schedule:
        """``lr(t)`` of the base-batch step: linear warm-up from 0, cosine decay to lr/10 at T."""
        T = self.total_steps
        return optax.warmup_cosine_decay_schedule(
            0.0, self.learning_rate, max(1, round(self.warmup_fraction * T)), T, 0.1 * self.learning_rate
        )

    def config(self) -> dict:
        """Everything that determines a run's result (stored with cached cells)."""
        return {
            "batch_size": self.batch_size,
            "total_steps": self.total_steps,
            "learning_rate": self.learning_rate,
            "weight_decay": self.weight_decay,
            "b1": self.b1,
            "b2": self.b2,
            "eps": self.eps,
            "warmup_fraction": self.warmup_fraction,
            "schedule": "warmup_cosine_decay(0 → lr over warmup, → lr/10 at T)",
            **self.info,
        }

    def num_params(self) -> int:
        return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(jax.eval_shape(self.init, jax.random.key(0))))


def _dense_init(key, shape, std):
    return jax.random.normal(key, shape, jnp.float32) * std


# ---- byte-level transformer LM on the standard library's source


def _layer_norm(x, g, b):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) * lax.rsqrt(var + 1e-5) * g + b


def lm_task(*, smoke: bool = False) -> Task:
    """Byte-level pre-LN decoder on the stdlib's source; base batch B windows of ``ctx`` bytes."""
    if smoke:
        d, layers, heads, ctx, B, T, n_val, n_tr = 32, 1, 2, 16, 4, 48, 64, 32
    else:
        d, layers, heads, ctx, B, T, n_val, n_tr = 96, 2, 4, 64, 8, 2000, 512, 256
    text, corpus = datasets.stdlib_source()
    arr = np.frombuffer(text, np.uint8)
    split = int(0.95 * len(arr))
    w = ctx + 1
    train = arr[: split // w * w].reshape(-1, w)  # fixed, non-overlapping windows
    val_all = arr[split:][: (len(arr) - split) // w * w].reshape(-1, w)
    val = val_all[np.linspace(0, len(val_all) - 1, min(n_val, len(val_all))).astype(int)]
    train_eval = train[np.linspace(0, len(train) - 1, n_tr).astype(int)]
    data = {"train": train, "val": val, "train_eval": train_eval}
    hd = d // heads

    def init(key):
        k = jax.random.split(key, 6)
        out_std = 0.02 / math.sqrt(2 * layers)
        return {
            "embed": _dense_init(k[0], (256, d), 0.02),
            "pos": _dense_init(k[1], (ctx, d), 0.02),
            "ln1_g": jnp.ones((layers, d)),
            "ln1_b": jnp.zeros((layers, d)),
            "w_qkv": _dense_init(k[2], (layers, d, 3 * d), 0.02),
            "w_o": _dense_init(k[3], (layers, d, d), out_std),
            "ln2_g": jnp.ones((layers, d)),
            "ln2_b": jnp.zeros((layers, d)),
            "w_in": _dense_init(k[4], (layers, d, 4 * d), 0.02),
            "b_in": jnp.zeros((layers, 4 * d)),
            "w_out": _dense_init(k[5], (layers, 4 * d, d), out_std),
            "b_out": jnp.zeros((layers, d)),
            "lnf_g": jnp.ones((d,)),
            "lnf_b": jnp.zeros((d,)),
        }

    causal = jnp.tril(jnp.ones((ctx, ctx), bool))

    def block(h, p):
        n, L, _ = h.shape
        x = _layer_norm(h, p["ln1_g"], p["ln1_b"])
        q, k, v = jnp.split((x @ p["w_qkv"]).reshape(n, L, 3 * heads, hd), 3, axis=2)
        att = jnp.einsum("nqhd,nkhd->nhqk", q, k) / math.sqrt(hd)
        att = jax.nn.softmax(jnp.where(causal, att, -1e9), axis=-1)
        h = h + jnp.einsum("nhqk,nkhd->nqhd", att, v).reshape(n, L, d) @ p["w_o"]
        x = _layer_norm(h, p["ln2_g"], p["ln2_b"])
        h = h + jax.nn.gelu(x @ p["w_in"] + p["b_in"]) @ p["w_out"] + p["b_out"]
        return h, None

    stacked = ("ln1_g", "ln1_b", "w_qkv", "w_o", "ln2_g", "ln2_b", "w_in", "b_in", "w_out", "b_out")

    def nll(params, windows):
        tokens = windows.astype(jnp.int32)
        x, y = tokens[:, :-1], tokens[:, 1:]
        h = params["embed"][x] + params["pos"]
        h, _ = lax.scan(block, h, {k: params[k] for k in stacked})
        logits = _layer_norm(h, params["lnf_g"], params["lnf_b"]) @ params["embed"].T
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def sample(data, key, n):
        idx = jax.random.randint(key, (n, B), 0, data["train"].shape[0])
        return data["train"][idx]

    def evaluate(params, data):
        val = nll(params, data["val"])
        return {"metric": val, "val_loss": val, "train_loss": nll(params, data["train_eval"])}

    def decay_mask(params):
        return {k: k in ("embed", "w_qkv", "w_o", "w_in", "w_out") for k in params}

    return Task(
        name="lm",
        title="byte-level transformer LM (stdlib source)",
        batch_size=B,
        total_steps=T,
        learning_rate=3e-3,
        weight_decay=0.1,
        b1=0.9,
        b2=0.99,
        eps=1e-8,
        warmup_fraction=0.05,
        metric="val. loss (nats/byte)",
        higher_is_better=False,
        tolerance=0.01,
        init=init,
        loss=nll,
        sample=sample,
        evaluate=evaluate,
        decay_mask=decay_mask,
        data=data,
        chance_loss=math.log(256),
        info={
            "model": f"pre-LN decoder, d={d}, layers={layers}, heads={heads}, ctx={ctx}, tied embedding",
            "train_windows": int(train.shape[0]),
            "val_windows": int(val.shape[0]),
            "train_eval_windows": int(train_eval.shape[0]),
            **corpus,
        },
    )


# ---- MNIST-1D 1-D CNN


def mnist1d_task(*, smoke: bool = False, cache_dir: Path | None = None) -> Task:
    """MNIST-1D (8,000 / 2,000), CNN conv5(32)-conv5/2(32)-conv3/2(32)-dense(10), base batch 32."""
    num_samples = 1_000 if smoke else 10_000
    ch, B, T = (8, 16, 48) if smoke else (32, 32, 3000)
    arrays = datasets.mnist1d(num_samples, cache_dir)
    data = {
        "x": arrays["x"][..., None],
        "y": arrays["y"],
        "x_val": arrays["x_test"][..., None],
        "y_val": arrays["y_test"],
    }
    length = data["x"].shape[1]
    convs = ((5, 1, ch, 1), (5, ch, ch, 2), (3, ch, ch, 2))  # (width, in, out, stride)
    flat = math.ceil(math.ceil(length / 2) / 2) * ch

    def init(key):
        keys = jax.random.split(key, len(convs) + 1)
        params = {}
        for i, (k, (w, cin, cout, _)) in enumerate(zip(keys, convs, strict=False)):
            params[f"conv{i}"] = {
                "w": _dense_init(k, (w, cin, cout), math.sqrt(2.0 / (w * cin))),
                "b": jnp.zeros((cout,)),
            }
        params["dense"] = {"w": _dense_init(keys[-1], (flat, 10), math.sqrt(1.0 / flat)), "b": jnp.zeros((10,))}
        return params

    def conv(x, w, stride):
        """A "SAME" 1-D convolution as one matmul over stacked shifted slices (im2col): fast under vmap on CPU."""
        width, length = w.shape[0], x.shape[1]
        pad = max((-(-length // stride) - 1) * stride + width - length, 0)  # XLA's "SAME"
        x = jnp.pad(x, ((0, 0), (pad // 2, pad - pad // 2), (0, 0)))
        patches = jnp.concatenate([x[:, j : j + length : stride] for j in range(width)], axis=-1)
        return patches @ w.reshape(-1, w.shape[-1])

    def apply(params, x):
        for i, (_, _, _, stride) in enumerate(convs):
            p = params[f"conv{i}"]
            x = jax.nn.relu(conv(x, p["w"], stride) + p["b"])
        return x.reshape(x.shape[0], -1) @ params["dense"]["w"] + params["dense"]["b"]

    def ce(params, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(apply(params, x), y).mean()

    def loss(params, batch):
        return ce(params, *batch)

    def sample(data, key, n):
        idx = jax.random.randint(key, (n, B), 0, data["x"].shape[0])
        return data["x"][idx], data["y"][idx]

    def evaluate(params, data):
        logits = apply(params, data["x_val"])
        acc = 100.0 * jnp.mean(jnp.argmax(logits, -1) == data["y_val"])
        val = optax.softmax_cross_entropy_with_integer_labels(logits, data["y_val"]).mean()
        return {"metric": acc, "val_loss": val, "train_loss": ce(params, data["x"], data["y"])}

    def decay_mask(params):
        return jax.tree.map_with_path(lambda path, _: path[-1].key == "w", params)

    return Task(
        name="mnist1d",
        title="MNIST-1D CNN",
        batch_size=B,
        total_steps=T,
        learning_rate=3e-3,
        weight_decay=0.1,
        b1=0.9,
        b2=0.99,
        eps=1e-8,
        warmup_fraction=0.05,
        metric="val. accuracy (%)",
        higher_is_better=True,
        tolerance=1.0,
        init=init,
        loss=loss,
        sample=sample,
        evaluate=evaluate,
        decay_mask=decay_mask,
        data=data,
        chance_loss=math.log(10),
        info={
            "model": f"1-D CNN conv5({ch})-conv5/2({ch})-conv3/2({ch})-dense(10)",
            "num_samples": num_samples,
            "n_train": int(data["x"].shape[0]),
            "n_val": int(data["x_val"].shape[0]),
        },
    )


# learning rates chosen by `--tune` (S = 1, seed 0); see the report's setup section
LEARNING_RATES = {"lm": 3e-3, "mnist1d": 1e-2}


def make_tasks(*, smoke: bool = False, cache_dir: Path | None = None) -> dict[str, Task]:
    tasks = {"lm": lm_task(smoke=smoke), "mnist1d": mnist1d_task(smoke=smoke, cache_dir=cache_dir)}
    return {k: dataclasses.replace(t, learning_rate=LEARNING_RATES[k]) for k, t in tasks.items()}

"""The ramp study's tasks: a byte-level LM trained with AdamW and with SGD, and an MNIST-1D CNN with SGD.

Each base batch is small (four 64-byte windows; 8 MNIST-1D sequences), so that the measured noise scale starts
near one base batch and grows as the loss falls, as it does in language-model pre-training. Data come from
``examples/datasets.py`` (nothing downloaded). ``sample(data, key)`` draws one micro-batch per replica
(``(R, B, ...)``); every arm of a seed sees the same stream of micro-batches, call by call.
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

REPLICAS = 2  # a vmap axis: S = REPLICAS × k


@dataclasses.dataclass(frozen=True, eq=False)
class Task:
    """A task; hashed by identity (compiled runs are cached per task object)."""

    name: str
    title: str
    optimizer: str  # "sgd" or "adamw"
    batch_size: int  # examples per micro-batch per replica: the base batch
    total_steps: int  # T, base-batch steps (τ) per run
    learning_rate: float
    weight_decay: float
    init: Callable[[jax.Array], Any]
    loss: Callable[[Any, Any], jax.Array]
    sample: Callable[[Any, jax.Array], Any]
    evaluate: Callable[[Any, Any], jax.Array]  # validation loss
    data: dict
    warmup_fraction: float = 0.05
    info: dict = dataclasses.field(default_factory=dict)
    clock: str = "tau"  # the momentum's clock (optax_adascale's clock=): "tau" since 0.4, "update" before

    def schedule(self) -> optax.Schedule:
        """``lr(τ)``: linear warm-up from 0, cosine decay to 0 at ``T`` (so a Seesaw ramp reaches ``S_max``)."""
        T = self.total_steps
        return optax.warmup_cosine_decay_schedule(0.0, self.learning_rate, max(1, round(self.warmup_fraction * T)), T)

    def config(self) -> dict:
        return {
            "optimizer": self.optimizer,
            "batch_size": self.batch_size,
            "total_steps": self.total_steps,
            "learning_rate": self.learning_rate,
            "weight_decay": self.weight_decay,
            "warmup_fraction": self.warmup_fraction,
            "replicas": REPLICAS,
            "schedule": "warmup_cosine_decay(0 → lr over warmup, → 0 at T)",
            "clock": self.clock,
            **self.info,
        }


def _normal(key, shape, std):
    return jax.random.normal(key, shape, jnp.float32) * std


def _layer_norm(x, g, b):
    mu = x.mean(-1, keepdims=True)
    return (x - mu) * lax.rsqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5) * g + b


def _lm(optimizer: str, *, smoke: bool, model: tuple | None = None, batch_total: tuple | None = None) -> Task:
    """Byte-level pre-LN decoder on the standard library's source; base batch ``B`` windows of ``ctx`` bytes.

    ``model = (d, layers, heads, ctx, validation windows)`` and ``batch_total = (B, T)`` replace the study's sizes
    (``benchmarks/scale_quality`` runs a smaller model).
    """
    d, layers, heads, ctx, n_val = model or ((16, 1, 2, 16, 16) if smoke else (64, 2, 4, 64, 256))
    B, T = batch_total or ((2, 40) if smoke else (4, 2000))
    text, corpus = datasets.stdlib_source()
    arr = np.frombuffer(text, np.uint8)
    split = int(0.95 * len(arr))
    w = ctx + 1
    train = arr[: split // w * w].reshape(-1, w)
    val_all = arr[split:][: (len(arr) - split) // w * w].reshape(-1, w)
    val = val_all[np.linspace(0, len(val_all) - 1, min(n_val, len(val_all))).astype(int)]
    hd = d // heads
    stacked = ("ln1_g", "ln1_b", "w_qkv", "w_o", "ln2_g", "ln2_b", "w_in", "w_out")

    def init(key):
        k = jax.random.split(key, 6)
        out = 0.02 / math.sqrt(2 * layers)
        return {
            "embed": _normal(k[0], (256, d), 0.02),
            "pos": _normal(k[1], (ctx, d), 0.02),
            "ln1_g": jnp.ones((layers, d)),
            "ln1_b": jnp.zeros((layers, d)),
            "w_qkv": _normal(k[2], (layers, d, 3 * d), 0.02),
            "w_o": _normal(k[3], (layers, d, d), out),
            "ln2_g": jnp.ones((layers, d)),
            "ln2_b": jnp.zeros((layers, d)),
            "w_in": _normal(k[4], (layers, d, 4 * d), 0.02),
            "w_out": _normal(k[5], (layers, 4 * d, d), out),
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
        return h + jax.nn.gelu(x @ p["w_in"]) @ p["w_out"], None

    def loss(params, windows):
        tokens = windows.astype(jnp.int32)
        h = params["embed"][tokens[:, :-1]] + params["pos"]
        h, _ = lax.scan(block, h, {k: params[k] for k in stacked})
        logits = _layer_norm(h, params["lnf_g"], params["lnf_b"]) @ params["embed"].T
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    def sample(data, key):
        return data["train"][jax.random.randint(key, (REPLICAS, B), 0, data["train"].shape[0])]

    lr = {"adamw": 3e-3, "sgd": 0.03}[optimizer]
    return Task(
        name=f"lm_{optimizer}",
        title=f"byte-level LM, {'AdamW' if optimizer == 'adamw' else 'SGD (momentum 0.9)'}",
        optimizer=optimizer,
        batch_size=B,
        total_steps=T,
        learning_rate=lr,
        weight_decay=0.1 if optimizer == "adamw" else 0.0,
        init=init,
        loss=loss,
        sample=sample,
        evaluate=lambda params, data: loss(params, data["val"]),
        data={"train": train, "val": val},
        info={
            "model": f"pre-LN decoder d={d}, layers={layers}, heads={heads}, ctx={ctx}, tied embedding",
            "base_batch": f"{B} windows of {ctx} bytes",
            "val_windows": int(val.shape[0]),
            **corpus,
        },
    )


def _mnist1d(*, smoke: bool, cache_dir: Path | None, sizes: tuple | None = None) -> Task:
    """MNIST-1D (8,000 / 2,000 generated locally), conv5(16)-conv5/2(16)-conv3/2(16)-dense(10), SGD.

    ``sizes = (channels, B, T, examples)`` replaces the study's (``benchmarks/scale_quality`` runs smaller ones).
    """
    ch, B, T, n = sizes or ((4, 4, 40, 1_000) if smoke else (16, 16, 4000, 10_000))
    arrays = datasets.mnist1d(n, cache_dir)
    data = {
        "x": arrays["x"][..., None],
        "y": arrays["y"],
        "x_val": arrays["x_test"][..., None],
        "y_val": arrays["y_test"],
    }
    length = data["x"].shape[1]
    convs = ((5, 1, ch, 1), (5, ch, ch, 2), (3, ch, ch, 2))
    flat = math.ceil(math.ceil(length / 2) / 2) * ch

    def init(key):
        keys = jax.random.split(key, len(convs) + 1)
        params = {
            f"conv{i}": {"w": _normal(k, (w, cin, cout), math.sqrt(2.0 / (w * cin))), "b": jnp.zeros((cout,))}
            for i, (k, (w, cin, cout, _)) in enumerate(zip(keys, convs, strict=False))
        }
        params["dense"] = {"w": _normal(keys[-1], (flat, 10), math.sqrt(1.0 / flat)), "b": jnp.zeros((10,))}
        return params

    def conv(x, w, stride):  # "SAME" 1-D convolution as one matmul over shifted slices (fast under vmap on CPU)
        width, n_in = w.shape[0], x.shape[1]
        pad = max((-(-n_in // stride) - 1) * stride + width - n_in, 0)
        x = jnp.pad(x, ((0, 0), (pad // 2, pad - pad // 2), (0, 0)))
        patches = jnp.concatenate([x[:, j : j + n_in : stride] for j in range(width)], axis=-1)
        return patches @ w.reshape(-1, w.shape[-1])

    def apply(params, x):
        for i, (_, _, _, stride) in enumerate(convs):
            x = jax.nn.relu(conv(x, params[f"conv{i}"]["w"], stride) + params[f"conv{i}"]["b"])
        return x.reshape(x.shape[0], -1) @ params["dense"]["w"] + params["dense"]["b"]

    def loss(params, batch):
        x, y = batch
        return optax.softmax_cross_entropy_with_integer_labels(apply(params, x), y).mean()

    def sample(data, key):
        idx = jax.random.randint(key, (REPLICAS, B), 0, data["x"].shape[0])
        return data["x"][idx], data["y"][idx]

    return Task(
        name="mnist1d",
        title="MNIST-1D CNN, SGD (momentum 0.9)",
        optimizer="sgd",
        batch_size=B,
        total_steps=T,
        learning_rate=0.03,
        weight_decay=0.0,
        init=init,
        loss=loss,
        sample=sample,
        evaluate=lambda params, data: loss(params, (data["x_val"], data["y_val"])),
        data=data,
        info={"model": f"1-D CNN conv5({ch})-conv5/2({ch})-conv3/2({ch})-dense(10)", "num_samples": n},
    )


def _teacher(*, smoke: bool) -> Task:
    """``benchmarks/scale_quality``'s teacher–student classifier (labels sampled from the teacher, fresh examples
    every call, the loss an exact expectation over the teacher's labels), SGD with momentum 0.9."""
    from benchmarks.scale_quality.tasks import teacher_student  # the scale study's own task, one definition

    t = teacher_student(smoke=smoke)
    return Task(
        name="teacher",
        title="teacher–student classifier, SGD (momentum 0.9)",
        optimizer="sgd",
        batch_size=t.batch_size,
        total_steps=t.total_steps,
        learning_rate=t.learning_rate,
        weight_decay=0.0,
        init=t.init,
        loss=t.loss,
        sample=lambda data, key: t.sample(key, REPLICAS),
        evaluate=lambda params, data: t.evaluate(params),
        data={},
        info={k: v for k, v in t.info.items()},
    )


def make_tasks(*, smoke: bool = False, cache_dir: Path | None = None) -> dict[str, Task]:
    return {
        "lm_adamw": _lm("adamw", smoke=smoke),
        "lm_sgd": _lm("sgd", smoke=smoke),
        "mnist1d": _mnist1d(smoke=smoke, cache_dir=cache_dir),
        "teacher": _teacher(smoke=smoke),
    }

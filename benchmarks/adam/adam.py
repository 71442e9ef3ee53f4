"""AdaScale with Adam: which gain rule keeps the S = 1 quality of AdamW at S times the batch?

Two tasks where Adam is the natural optimizer, each with one base batch ``B``,
one base-batch budget ``T`` and one warm-up + cosine schedule tuned once at
``S = 1`` (``--tune``):

* ``lm``: a byte-level pre-LayerNorm decoder (plain JAX, layers under
  ``lax.scan``) on the Python standard library's own top-level ``*.py`` files
  (``sysconfig.get_paths()["stdlib"]``, sorted, concatenated; the last 5 % held
  out), cut into fixed windows; metric: validation loss in nats/byte;
* ``mnist1d``: MNIST-1D generated locally (``make_dataset``, never the
  downloader), a small 1-D CNN; metric: validation accuracy (and loss).

At each ``S`` (``S`` replicas of batch ``B``, a ``jax.vmap`` axis) the
candidates train from the same initialisation on the same stream of batches:

* ``adamw``: ``optax.adamw(lr)`` at ``S = 1``, the baseline (AdaScale at
  ``S = 1`` is the identity, so every AdaScale candidate equals it there);
* ``AS-a``: ``adascale(chain(scale_by_adam, add_decayed_weights), lr)``: the
  raw-gradient gain ``r`` times ``lr(⌊τ⌋)`` on the Adam direction;
* ``AS-b``: the same with ``gain_exponent=0.5`` (step ``r^½·lr``, τ advances by ``r``);
* ``AS-c``: ``AS-a`` with ``precondition=adam_preconditioner(b2, eps)``: the gain
  from Adam-preconditioned gradients (``v̂`` of the previous update);
* ``AS-c'``: ``AS-c`` with ``gain_exponent=0.5`` (AdaptDL's AdamScale);
* ``sqrt``: ``optax.adamw(scaling_rules.square_root(lr, S))`` for ``⌈T/S⌉`` iterations;
* ``LSW``: ``optax.adamw(scaling_rules.linear_warmup(lr, S, T))`` for ``⌈T/S⌉`` iterations.

AdaScale candidates train until ``τ ≥ T``. A whole run is one jitted program: a
``lax.scan`` over evaluation checkpoints, each a ``lax.while_loop`` of steps;
the data sets are arguments of that program, not constants in it. Each cell
(task, method, S, seed, lr) is cached as JSON under ``benchmarks/.cache/adam/``,
so an interrupted grid resumes where it stopped; ``--smoke`` runs a tiny grid
uncached (with ``--cache DIR`` it caches there).

Usage::

    python benchmarks/adam.py --tune                  # the S = 1 learning-rate sweep (1 seed)
    python benchmarks/adam.py --no-report             # the grid (resumable), no report
    python benchmarks/adam.py --report                # tables and plots from the cache only
    python benchmarks/adam.py                         # the grid, then the report
    python benchmarks/adam.py --smoke --cache /tmp/a --results /tmp/a/RESULTS.md   # < 60 s

Outputs: the "adam" section of ``benchmarks/RESULTS.md`` (``--results``) and
``benchmarks/plots/adam_*.png`` (next to the results file's ``plots/`` with ``--results``).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import sysconfig  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

import report  # noqa: E402

import optax_adascale  # noqa: E402
from optax_adascale import scaling_rules  # noqa: E402

AXIS = "replicas"
BASELINE = "adamw"
ADASCALE = {  # name -> (gain_exponent, preconditioned statistics)
    "AS-a": (1.0, False),
    "AS-b": (0.5, False),
    "AS-c": (1.0, True),
    "AS-c'": (0.5, True),
}
FIXED = ("sqrt", "LSW")
METHODS = (*ADASCALE, *FIXED)
SCALES = (1, 4, 16)
NUM_EVALS = 12  # evaluation checkpoints per run (plus the initial one)
LOG_POINTS = 300  # per-iteration logs are thinned to about this many points in the cache
TUNE_RATES = {"lm": (1e-3, 3e-3, 1e-2), "mnist1d": (1e-3, 3e-3, 1e-2, 3e-2)}  # 3e-2: 1e-2 was the edge

HERE = Path(__file__).resolve().parent

DESCRIPTIONS = {
    BASELINE: "`optax.adamw(lr)`, S = 1, T iterations",
    "AS-a": "`adascale(chain(scale_by_adam, add_decayed_weights), lr)`: r·lr(⌊τ⌋), raw-gradient gain",
    "AS-b": "AS-a with `gain_exponent=0.5`: r^½·lr(⌊τ⌋), τ += r",
    "AS-c": "AS-a with `precondition=adam_preconditioner(b2, eps)`: gain of Adam-preconditioned gradients",
    "AS-c'": "AS-c with `gain_exponent=0.5` (AdaptDL's AdamScale)",
    "sqrt": "`optax.adamw(scaling_rules.square_root(lr, S))`, ⌈T/S⌉ iterations",
    "LSW": "`optax.adamw(scaling_rules.linear_warmup(lr, S, T))`, ⌈T/S⌉ iterations",
}


# --------------------------------------------------------------------------- tasks


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


def stdlib_corpus() -> tuple[bytes, dict]:
    """The sorted top-level ``*.py`` files of the standard library, concatenated, and a description."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    text = b"".join(f.read_bytes() for f in files)
    info = {
        "corpus": f"{root}/*.py",
        "files": len(files),
        "bytes": len(text),
        "sha256": hashlib.sha256(text).hexdigest()[:16],
        "python": sys.version.split()[0],
    }
    return text, info


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
    text, corpus = stdlib_corpus()
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


def mnist1d_arrays(num_samples: int, cache_dir: Path | None):
    """MNIST-1D generated locally with ``make_dataset`` (never its downloader), cached as ``.npz``."""
    path = None if cache_dir is None else cache_dir / f"mnist1d_{num_samples}.npz"
    if path is not None and path.exists():
        with np.load(path) as data:
            return data["x"], data["y"], data["x_test"], data["y_test"]
    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()
    args.num_samples = num_samples
    data = make_dataset(args)
    arrays = tuple(np.asarray(data[k]) for k in ("x", "y", "x_test", "y_test"))
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez(path, **dict(zip(("x", "y", "x_test", "y_test"), arrays, strict=True)))
    return arrays


def mnist1d_task(*, smoke: bool = False, cache_dir: Path | None = None) -> Task:
    """MNIST-1D (8,000 / 2,000), CNN conv5(32)-conv5/2(32)-conv3/2(32)-dense(10), base batch 32."""
    num_samples = 1_000 if smoke else 10_000
    ch, B, T = (8, 16, 48) if smoke else (32, 32, 3000)
    x, y, x_val, y_val = mnist1d_arrays(num_samples, cache_dir)
    data = {
        "x": np.asarray(x, np.float32)[..., None],
        "y": np.asarray(y, np.int32),
        "x_val": np.asarray(x_val, np.float32)[..., None],
        "y_val": np.asarray(y_val, np.int32),
    }
    length = data["x"].shape[1]
    convs = ((5, 1, ch, 1), (5, ch, ch, 2), (3, ch, ch, 2))  # (width, in, out, stride)
    flat = math.ceil(math.ceil(length / 2) / 2) * ch

    def init(key):
        keys = jax.random.split(key, len(convs) + 1)
        params = {}
        for i, (k, (w, cin, cout, _)) in enumerate(zip(keys, convs, strict=False)):
            params[f"conv{i}"] = {"w": _dense_init(k, (w, cin, cout), math.sqrt(2.0 / (w * cin))),
                                  "b": jnp.zeros((cout,))}
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


# --------------------------------------------------------------------------- optimizers


def program_of(method: str) -> str:
    """The compiled program a method runs in: each AdaScale candidate its own, the fixed rules one shared."""
    return method if method in ADASCALE else "fixed"


def build_optimizer(task: Task, program: str, scale: int, use_sqrt=None):
    """``(tx, lr_fn)``; ``lr_fn`` is ``None`` for AdaScale.

    ``"fixed"`` is ``optax.adamw`` on the square-root rule where the (traced)
    ``use_sqrt`` flag is set and on LSW elsewhere; at ``S = 1`` both are the
    base schedule (the ``adamw`` baseline).
    """
    base = task.schedule()
    adam = dict(b1=task.b1, b2=task.b2, eps=task.eps)
    if program in ADASCALE:
        exponent, preconditioned = ADASCALE[program]
        inner = optax.chain(optax.scale_by_adam(**adam), optax.add_decayed_weights(task.weight_decay, task.decay_mask))
        precondition = optax_adascale.adam_preconditioner(b2=task.b2, eps=task.eps) if preconditioned else None
        tx = optax_adascale.adascale(inner, base, axis_name=AXIS, gain_exponent=exponent, precondition=precondition)
        return tx, None
    if program != "fixed":
        raise ValueError(f"unknown program={program!r}")
    sqrt = scaling_rules.square_root(base, scale)
    lsw = scaling_rules.linear_warmup(base, scale, task.total_steps)
    lr = lambda count: jnp.where(use_sqrt, sqrt(count), lsw(count))  # noqa: E731
    return optax.adamw(lr, weight_decay=task.weight_decay, mask=task.decay_mask, **adam), lr


def num_iterations_for(task: Task, method: str, scale: int) -> int:
    if method in ADASCALE:
        return task.total_steps  # an upper bound (gain ≥ 1); the stop is τ ≥ T
    return math.ceil(task.total_steps / scale)


@functools.cache
def compiled_run(task: Task, program: str, scale: int, num_evals: int):
    """A jitted run ``(params, opt_state, key, targets, use_sqrt, data) -> (params, it, evals, logs)``.

    ``targets`` are int32 progress marks (``⌊τ⌋`` for AdaScale, iterations for
    the fixed rules); after reaching each the run evaluates. Batches come from
    ``fold_in(key, iteration)``: every method sees the same stream.
    """
    log_size = task.total_steps

    def run(params, opt_state, key, targets, use_sqrt, data):
        tx, lr_fn = build_optimizer(task, program, scale, use_sqrt)
        is_as = program in ADASCALE

        def replica_step(params, opt_state, batch):
            loss, grads = jax.value_and_grad(task.loss)(params, batch)
            if not is_as:
                grads = lax.pmean(grads, AXIS)  # plain data-parallel AdamW; AdaScale reduces inside
            updates, opt_state = tx.update(grads, opt_state, params)
            return lax.pmean(loss, AXIS), updates, opt_state

        step = jax.vmap(replica_step, in_axes=(None, None, 0), out_axes=None, axis_name=AXIS)

        def progress(opt_state, it):
            return optax_adascale.get_adascale_state(opt_state).tau_whole if is_as else it

        def body(carry):
            params, opt_state, it, logs = carry
            batch = task.sample(data, jax.random.fold_in(key, it), scale)
            loss, updates, opt_state = step(params, opt_state, batch)
            params = optax.apply_updates(params, updates)
            if is_as:
                m = optax_adascale.metrics(opt_state)
                new = {"lr": m["learning_rate"], "gain": m["gain"], "noise_scale": m["noise_scale"], "loss": loss}
            else:
                nan = jnp.float32(jnp.nan)
                new = {"lr": lr_fn(it), "gain": nan, "noise_scale": nan, "loss": loss}
            logs = {k: logs[k].at[it].set(jnp.asarray(v, jnp.float32)) for k, v in new.items()}
            return params, opt_state, it + 1, logs

        def segment(carry, target):
            carry = lax.while_loop(lambda c: (progress(c[1], c[2]) < target) & (c[2] < log_size), body, carry)
            params, opt_state, it, _ = carry
            if is_as:
                tau = optax_adascale.scale_invariant_steps(opt_state)
                skipped = optax_adascale.metrics(opt_state)["skipped_steps"]
            else:
                tau, skipped = it.astype(jnp.float32) * scale, jnp.int32(0)
            record = {"tau": tau, "it": it, "skipped": skipped, **task.evaluate(params, data)}
            return carry, record

        logs = {k: jnp.full((log_size,), jnp.nan, jnp.float32) for k in ("lr", "gain", "noise_scale", "loss")}
        carry = (params, opt_state, jnp.int32(0), logs)
        (params, opt_state, it, logs), evals = lax.scan(segment, carry, targets)
        return params, it, evals, logs

    return jax.jit(run)


# --------------------------------------------------------------------------- one cell


def _thin(n, points=LOG_POINTS):
    """About ``points`` indices out of ``n``, denser at the start (log-spaced, then linear)."""
    if n <= points:
        return np.arange(n)
    idx = np.concatenate([np.geomspace(1, n, points // 2).astype(int) - 1, np.linspace(0, n - 1, points // 2)])
    return np.unique(idx.astype(int))


def run_cell(task: Task, method: str, scale: int, seed: int, *, num_evals: int = NUM_EVALS) -> dict:
    """Train one cell and return a JSON-able record."""
    start = time.perf_counter()
    k_init, k_data = jax.random.split(jax.random.key(seed))
    params = task.init(k_init)
    program = program_of(method)
    tx, _ = build_optimizer(task, program, scale, True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt_state = tx.init(params)
    n = num_iterations_for(task, method, scale)
    T = task.total_steps
    if program in ADASCALE:
        targets = [round(k * T / num_evals) for k in range(1, num_evals + 1)]
    else:
        targets = [math.ceil(k * n / num_evals) for k in range(1, num_evals + 1)]
    first = jax.jit(task.evaluate)(params, task.data)
    fn = compiled_run(task, program, scale, num_evals)
    t0 = time.perf_counter()
    _, it, ev, logs = fn(params, opt_state, k_data, np.asarray(targets, np.int32), method == "sqrt", task.data)
    it = int(it)
    ev, logs = jax.device_get((ev, logs))
    run_s = time.perf_counter() - t0
    evals = [{"tau": 0.0, "it": 0, "skipped": 0, **{k: float(v) for k, v in first.items()}}]
    evals += [{k: float(ev[k][j]) for k in ev} for j in range(num_evals)]
    keep = _thin(it)
    last = evals[-1]
    return {
        "task": task.name,
        "method": method,
        "scale": scale,
        "seed": seed,
        "config": task.config(),
        "iterations": it,
        "tau": last["tau"],
        "skipped": int(last["skipped"]),
        "final": {k: last[k] for k in ("metric", "val_loss", "train_loss")},
        "curve": {k: [e[k] for e in evals] for k in evals[0]},
        "logs": {"it": [int(i) for i in keep], **{k: [float(v) for v in np.asarray(logs[k])[keep]] for k in logs}},
        "wall_s": time.perf_counter() - start,
        "run_s": run_s,  # the compiled run alone (includes compilation on its first call in a process)
    }


# --------------------------------------------------------------------------- the grid


class Cache:
    """One JSON file per cell; a ``None`` directory caches nothing."""

    def __init__(self, directory: Path | None):
        self.directory = directory

    def path(self, task: Task, method: str, scale: int, seed: int) -> Path:
        tag = method.replace("'", "p")
        return self.directory / f"{task.name}_{tag}_S{scale}_seed{seed}_lr{task.learning_rate:g}.json"

    def get(self, task, method, scale, seed):
        if self.directory is None:
            return None
        path = self.path(task, method, scale, seed)
        if not path.exists():
            return None
        record = json.loads(path.read_text())
        return record if record.get("config") == json.loads(json.dumps(task.config())) else None

    def put(self, record, task):
        if self.directory is None:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.path(task, record["method"], record["scale"], record["seed"])
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        tmp.replace(path)


def cells(scales, seeds, methods=METHODS):
    """``(method, S, seed)`` of the grid: the baseline at ``S = 1``, every candidate at each ``S > 1``."""
    out = []
    for seed in seeds:  # seed-major: a partial grid already compares every candidate
        out += [(BASELINE, 1, seed)] if 1 in scales else []
        out += [(m, s, seed) for s in scales if s > 1 for m in methods]
    return out


def run_grid(tasks, scales, seeds, cache, *, num_evals, methods=METHODS, only_cached=False, log=None):
    """All cells (cached ones loaded; with ``only_cached`` nothing runs); ``{(task, method, S, seed): record}``."""
    log = log or functools.partial(print, flush=True)
    results = {}
    for task in tasks:
        for method, scale, seed in cells(scales, seeds, methods):
            record = cache.get(task, method, scale, seed)
            if record is None and not only_cached:
                record = run_cell(task, method, scale, seed, num_evals=num_evals)
                cache.put(record, task)
                log(
                    f"  {task.name:8s} {method:6s} S={scale:<3d} seed={seed}  iters={record['iterations']:5d}  "
                    f"τ={record['tau']:.0f}  {task.metric}={record['final']['metric']:.4f}  "
                    f"val loss={record['final']['val_loss']:.4f}  {record['wall_s']:.0f} s"
                )
            if record is not None:
                results[(task.name, method, scale, seed)] = record
    return results


# --------------------------------------------------------------------------- tables


def _stats(values):
    arr = np.asarray(values, np.float64)
    return float(np.mean(arr)), (float(np.std(arr, ddof=1)) if len(arr) > 1 else 0.0), len(arr)


def worse_by(task: Task, base_values, values) -> tuple[float, float]:
    """``(how much worse than S = 1, two standard errors of the difference)``; positive is worse."""
    m0, s0, n0 = _stats(base_values)
    m, s, n = _stats(values)
    diff = (m0 - m) if task.higher_is_better else (m - m0)
    return diff, 2.0 * math.sqrt(s0**2 / n0 + s**2 / n)


def failed(task: Task, record) -> bool:
    """A run that did not train: final training loss non-finite or no better than uniform guessing (ln K)."""
    loss = record["final"]["train_loss"]
    return not math.isfinite(loss) or loss > 0.98 * task.chance_loss


def flag(task: Task, base_values, values, num_failed=0) -> str:
    """``✗``: worse than S = 1 by more than 2 SE of the difference *and* the task's tolerance, or a seed failed;
    ``~``: beyond 2 SE but within the tolerance."""
    if num_failed or not np.all(np.isfinite(values)):
        return " ✗"
    diff, se2 = worse_by(task, base_values, values)
    if diff > max(se2, task.tolerance):
        return " ✗"
    if diff > se2 and diff > 0:
        return " ~"
    return ""


def _fmt(mean, std, digits):
    return "diverged" if not math.isfinite(mean) else f"{mean:.{digits}f} ± {std:.{digits}f}"


def _recs(results, task, method, scale, seeds):
    recs = [results.get((task.name, method, scale, seed)) for seed in seeds]
    return None if any(r is None for r in recs) else recs


def table(task: Task, results, scales, seeds) -> str:
    digits = 2 if task.higher_is_better else 4
    show_val = task.metric != "val. loss (nats/byte)"  # the LM's metric is its validation loss
    head = f"| S | method | {task.metric} | Δ vs S = 1 |" + (" val. loss |" if show_val else "")
    head += " train loss | iterations | mean gain | examples ÷ S=1 | per seed |"
    lines = [head, "|---:|---|---:|---:|" + ("---:|" if show_val else "") + "---:|---:|---:|---:|---:|"]
    base = _recs(results, task, BASELINE, 1, seeds)
    base_metric = [r["final"]["metric"] for r in base] if base else None
    T = task.total_steps
    rows = [(1, BASELINE)] + [(s, m) for s in scales if s > 1 for m in METHODS]
    for scale, method in rows:
        recs = _recs(results, task, method, scale, seeds)
        if recs is None:
            lines.append(f"| {scale} | {method} | — | — |" + (" — |" if show_val else "") + " — | — | — | — | — |")
            continue
        metric = [r["final"]["metric"] for r in recs]
        mark = delta = ""
        num_failed = sum(failed(task, r) for r in recs)
        if base_metric is not None and scale > 1:
            mark = flag(task, base_metric, metric, num_failed)
            if num_failed:
                mark += f" ({num_failed}/{len(recs)} failed)"
            diff, se2 = worse_by(task, base_metric, metric)
            signed = -diff if task.higher_is_better else diff
            delta = f"{signed:+.{digits}f} (2 SE {se2:.{digits}f})"
        iters = _stats([r["iterations"] for r in recs])[0]
        gain = _stats([r["tau"] / r["iterations"] for r in recs])[0] if method in ADASCALE else float("nan")
        row = f"| {scale} | {method} | {_fmt(*_stats(metric)[:2], digits)}{mark} | {delta} |"
        if show_val:
            row += f" {_fmt(*_stats([r['final']['val_loss'] for r in recs])[:2], 4)} |"
        row += (
            f" {_fmt(*_stats([r['final']['train_loss'] for r in recs])[:2], 4)} | {iters:.0f} | "
            f"{'' if math.isnan(gain) else f'{gain:.2f}'} | {iters * scale / T:.2f} | "
            + " / ".join(f"{v:.{max(digits - 1, 1)}f}" for v in metric)
            + " |"
        )
        lines.append(row)
    return "\n".join(lines)


def tune_table(tasks, cache, rates) -> str:
    lines = ["| task | lr (peak) | metric (seed 0, S = 1) | val. loss | train loss |", "|---|---:|---:|---:|---:|"]
    for task in tasks:
        for lr in rates[task.name]:
            r = cache.get(dataclasses.replace(task, learning_rate=lr), BASELINE, 1, 0)
            if r is None:
                continue
            bold = "**" if lr == task.learning_rate else ""
            f = r["final"]
            lines.append(
                f"| {task.name} | {bold}{lr:g}{bold} | {f['metric']:.4f} | {f['val_loss']:.4f} | "
                f"{f['train_loss']:.4f} |"
            )
    return "\n".join(lines) if len(lines) > 2 else "_(no `--tune` cells in the cache)_"


# --------------------------------------------------------------------------- plots


STYLES = {
    "AS-a": ("C0", "-"),
    "AS-b": ("C1", "-"),
    "AS-c": ("C2", "-"),
    "AS-c'": ("C3", "-"),
    "sqrt": ("C4", ":"),
    "LSW": ("C5", ":"),
    BASELINE: ("k", "--"),
}


def _mean_curve(results, task, method, scale, seeds, key="metric"):
    recs = [results[(task.name, method, scale, s)] for s in seeds if (task.name, method, scale, s) in results]
    if not recs:
        return None, None
    tau = np.mean([r["curve"]["tau"] for r in recs], axis=0)
    return tau, np.mean([r["curve"][key] for r in recs], axis=0)


def _log_tau(record):
    """τ at each logged iteration, interpolated from the checkpoints (τ is monotone in the iteration)."""
    return np.interp(np.asarray(record["logs"]["it"]) + 1, record["curve"]["it"], record["curve"]["tau"])


def make_plots(tasks, results, scales, seeds, plot_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plot_dir.mkdir(parents=True, exist_ok=True)
    big = [s for s in scales if s > 1]
    paths = []

    # τ-aligned validation curves: one row per S > 1 (the largest last), S = 1 dashed.
    fig, axes = plt.subplots(len(big), len(tasks), figsize=(5.2 * len(tasks), 3.6 * len(big)), squeeze=False)
    for i, s in enumerate(big):
        for j, task in enumerate(tasks):
            ax = axes[i, j]
            for method in (BASELINE, *METHODS):
                tau, val = _mean_curve(results, task, method, 1 if method == BASELINE else s, seeds)
                if tau is None:
                    continue
                color, ls = STYLES[method]
                label = "S=1 (adamw)" if method == BASELINE else method
                ax.plot(tau[1:], val[1:], color=color, ls=ls, marker="." if method != BASELINE else None, label=label)
            ax.set_title(f"{task.title}, S={s}", fontsize=9)
            ax.set_xlabel("τ (base-batch steps)")
            ax.set_ylabel(task.metric)
            if task.higher_is_better:
                lo = min(50.0, ax.get_ylim()[1] - 1)
                ax.set_ylim(bottom=max(ax.get_ylim()[0], lo))
            else:
                ax.set_yscale("log")
            ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(_save(fig, plot_dir / "adam_curves.png", plt))

    # Gain trajectories (seed 0) of the AdaScale candidates at every S > 1.
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.2 * len(tasks), 3.8), squeeze=False)
    for j, task in enumerate(tasks):
        ax = axes[0, j]
        for s, ls in zip(big, ("--", "-", "-."), strict=False):
            for method in ADASCALE:
                r = results.get((task.name, method, s, seeds[0]))
                if r is not None:
                    ax.plot(_log_tau(r), r["logs"]["gain"], color=STYLES[method][0], ls=ls, lw=1,
                            label=f"{method}, S={s}")
            ax.axhline(s, color="grey", lw=0.5)
        ax.set_xlabel("τ (base-batch steps)")
        ax.set_ylabel("gain r_t")
        ax.set_yscale("log")
        ax.set_title(f"{task.title}: gain (seed {seeds[0]})", fontsize=9)
        ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    paths.append(_save(fig, plot_dir / "adam_gain.png", plt))

    # Step size actually taken vs τ at the largest S, S = 1 dashed.
    s = big[-1] if big else 1
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.2 * len(tasks), 3.6), squeeze=False)
    for j, task in enumerate(tasks):
        ax = axes[0, j]
        for method in (BASELINE, *METHODS):
            r = results.get((task.name, method, 1 if method == BASELINE else s, seeds[0]))
            if r is None:
                continue
            color, ls = STYLES[method]
            ax.plot(_log_tau(r), r["logs"]["lr"], color=color, ls=ls, lw=1, label=method)
        ax.set_xlabel("τ (base-batch steps)")
        ax.set_ylabel("step size (lr × gain factor)")
        ax.set_yscale("log")
        ax.set_title(f"{task.title}: step size, S={s} (seed {seeds[0]})", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(_save(fig, plot_dir / "adam_lr.png", plt))
    return paths


def _save(fig, path, plt):
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


PLOT_CAPTIONS = {
    "adam_curves.png": "validation metric vs τ (base-batch steps; S·t for the fixed rules) for every candidate "
    "at S = 4 (top) and the largest S (bottom), means over seeds; S = 1 AdamW dashed.",
    "adam_gain.png": "gain r_t vs τ of the four AdaScale candidates (seed 0); dashed S = 4, solid S = 16, "
    "grey lines at r = S.",
    "adam_lr.png": "step size actually taken (r^p·lr(⌊τ⌋) for AdaScale, the rule's lr for sqrt/LSW) vs τ at the "
    "largest S (seed 0), S = 1 dashed.",
}


# --------------------------------------------------------------------------- report


def write_report(path: Path, tasks, results, scales, seeds, plot_paths, command, wall_s, cache, *, smoke=False):
    """Write the "adam" section of ``path`` (RESULTS.md); its hand-written reading is kept."""
    rel = lambda p: os.path.relpath(p, path.parent)  # noqa: E731
    reading = report.kept_reading(path, "adam")
    run_s = sum(r["wall_s"] for r in results.values())
    out = [
        "## Adam",
        "",
        "Does AdaScale carry over to Adam(W)? Which gain rule keeps the S = 1 quality when the batch is S× larger, "
        "with a warm-up + cosine schedule tuned once at S = 1?",
        "",
        f"Command: `{command}` ({len(seeds)} seed{'s' if len(seeds) > 1 else ''}, "
        f"S ∈ {{{', '.join(map(str, scales))}}}; "
        + ("smoke mode: tiny models and budgets" if smoke else "cells cached under `benchmarks/.cache/adam/`")
        + f"; the {len(results)} cells took {run_s / 60:.0f} min of wall time when they ran, compilation included, "
        f"this invocation {wall_s:.0f} s).",
        "",
        reading,
        "",
        "### Setup",
        "",
        "S replicas are a `jax.vmap` axis, each with the base batch B drawn i.i.d. with replacement; a whole run is "
        "one jitted program (`lax.scan` over evaluation checkpoints of `lax.while_loop` steps). For each seed every "
        "method starts from the same initialisation and, at a given S, sees the same stream of batches. The "
        "schedule is `optax.warmup_cosine_decay_schedule(0, lr, 5 % of T, T, lr/10)` of the base-batch step, tuned "
        "once at S = 1 (`--tune`, one seed) and never per S; weight decay is decoupled (AdamW), on the weight "
        "matrices (and the LM's tied embedding) only.",
        "",
        "| task | model | params | B | T (base steps) | peak lr | weight decay | β₁, β₂, ε |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for t in tasks:
        unit = "windows" if t.name == "lm" else "examples"
        out.append(
            f"| {t.name} | {t.info['model']} | {t.num_params():,} | {t.batch_size} {unit} | {t.total_steps} | "
            f"{t.learning_rate:g} | {t.weight_decay:g} | {t.b1}, {t.b2}, {t.eps:g} |"
        )
    lm = next((t for t in tasks if t.name == "lm"), None)
    if lm is not None:
        c = lm.config()
        out += [
            "",
            f"LM data: {c['files']} files `{c['corpus']}` (Python {c['python']}), {c['bytes']:,} bytes (sha256 "
            f"{c['sha256']}…); the first 95 % cut into {c['train_windows']:,} fixed windows of ctx+1 bytes for "
            f"training, the last 5 % into windows of which {c['val_windows']} evenly spaced ones are the validation "
            f"set ({c['train_eval_windows']} training windows for the training loss).",
        ]
    out += ["", "Methods:", ""]
    out += [f"- **{m}**: {DESCRIPTIONS[m]}" for m in (BASELINE, *METHODS)]
    out += [
        "",
        "Columns: mean ± std over seeds at the end (τ = T); Δ: difference of the means from S = 1 (positive = higher) "
        "with two standard errors of that difference; mean gain: τ/iterations; examples ÷ S=1: iterations·S/T. "
        "✗: worse than S = 1 by more than 2 SE of the difference *and* by the practical tolerance "
        + ", ".join(f"{t.tolerance:g} ({t.metric})" for t in tasks)
        + ", or a seed failed (final training loss non-finite or within 2 % of uniform guessing, ln K); "
        "~: beyond 2 SE but within the tolerance. Per seed: the final metric of seeds 0, 1, 2.",
    ]
    for t in tasks:
        out += ["", f"### {t.title}", "", table(t, results, scales, seeds)]
    out += ["", "### Learning-rate sweep at S = 1 (`--tune`)", "", tune_table(tasks, cache, TUNE_RATES)]
    out += ["", "### Plots", ""]
    for p in plot_paths:
        out += [f"- `{rel(p)}`: {PLOT_CAPTIONS.get(Path(p).name, '')}", "", f"  ![{Path(p).stem}]({rel(p)})", ""]
    return report.write_section(path, "adam", "\n".join(out))


# --------------------------------------------------------------------------- tuning


def tune(tasks, cache, rates, log=None):
    """The S = 1 learning-rate sweep, one seed (AdaScale at S = 1 is AdamW on ``lr(t)``)."""
    log = log or functools.partial(print, flush=True)
    for task in tasks:
        for lr in rates[task.name]:
            t = dataclasses.replace(task, learning_rate=lr)
            record = cache.get(t, BASELINE, 1, 0)
            if record is None:
                record = run_cell(t, BASELINE, 1, 0)
                cache.put(record, t)
            f = record["final"]
            log(f"{task.name:8s} lr={lr:<7g} {task.metric}={f['metric']:.4f}  val loss={f['val_loss']:.4f}  "
                f"train loss={f['train_loss']:.4f}  ({record['wall_s']:.0f} s)")


# --------------------------------------------------------------------------- CLI


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny models and grid (< 60 s on CPU)")
    parser.add_argument("--cache", type=Path, default=None,
                        help="cell cache directory (default benchmarks/.cache/adam; none in smoke mode unless given)")
    parser.add_argument("--results", type=Path, default=None,
                        help="RESULTS.md to write (default benchmarks/RESULTS.md); the plots go to plots/ next to it")
    parser.add_argument("--tasks", nargs="+", default=None, choices=("lm", "mnist1d"))
    parser.add_argument("--scales", nargs="+", type=int, default=None)
    parser.add_argument("--methods", nargs="+", default=None, choices=METHODS)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--tune", action="store_true", help="S = 1 learning-rate sweep (1 seed)")
    parser.add_argument("--no-report", action="store_true", help="run cells only")
    parser.add_argument("--report", action="store_true", help="report from cached cells only; run nothing")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    results_path = args.results or HERE / "RESULTS.md"
    if args.smoke:
        # Compilation dominates a smoke run: ask XLA for less work (the legacy CPU emitters compile ~2× faster).
        # XLA reads XLA_FLAGS when the backend starts, which nothing above has done yet.
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_use_fusion_emitters=false").strip()
        jax.config.update("jax_disable_most_optimizations", True)
        cache_dir, scales, seeds, num_evals = args.cache, (1, 4), [0], 3
    else:
        cache_dir = args.cache or HERE / ".cache" / "adam"
        scales, seeds, num_evals = SCALES, list(range(args.seeds)), NUM_EVALS
    scales = tuple(args.scales) if args.scales else scales
    cache = Cache(cache_dir)
    all_tasks = make_tasks(smoke=args.smoke, cache_dir=cache_dir)
    tasks = [all_tasks[n] for n in (args.tasks or all_tasks)]
    methods = tuple(args.methods) if args.methods else METHODS

    if args.tune:
        tune(tasks, cache, {k: (v[:1] if args.smoke else v) for k, v in TUNE_RATES.items()})
        return 0
    results = run_grid(tasks, scales, seeds, cache, num_evals=num_evals, methods=methods, only_cached=args.report)
    if args.no_report:
        return 0
    plot_paths = make_plots(tasks, results, scales, seeds, results_path.parent / "plots")
    argv = argv if argv is not None else sys.argv[1:]
    command = ("python benchmarks/adam.py " + " ".join(argv)).strip()
    path = write_report(results_path, tasks, results, scales, seeds, plot_paths, command,
                        time.perf_counter() - start, cache, smoke=args.smoke)
    print(f"wrote {path} and {len(plot_paths)} plots in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

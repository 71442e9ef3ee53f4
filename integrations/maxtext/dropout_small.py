"""Issue 45's question on a cheap pure-JAX model: AdaScale-AdamW at S = 8 through the drop-in (a Flax NNX MLP with
``nnx.Dropout(0.1)``, 8 CPU devices), on its τ clock and on the update clock, against ``optax.adamw`` at S = 1 over
the same base-batch steps T (cosine schedule in base steps, 2 seeds); the held-out loss in eval mode.

    python integrations/maxtext/dropout_small.py T BASE LR [FIXED]    # e.g. 200 4 3e-3; FIXED=32: one fixed batch

Fresh rows every step (a softmax teacher with sampled labels), or with ``FIXED`` one fixed set of that many rows
(the S = 8 batch is then the whole set, as MaxText's ``dataset_type=synthetic`` is: one batch of random tokens,
repeated; S = 1 takes base batches of it in turn, and the loss is read on those rows). ``IMPL=unsafe_rbg`` for
MaxText's dropout keys.
"""

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import optax_adascale  # noqa: E402

D, H, C = 16, 64, 8
IMPL = os.environ.get("IMPL", "threefry2x32")


class Net(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(D, H, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)
        self.l2 = nnx.Linear(H, C, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.drop(jax.nn.relu(self.l1(x))))


def data(seed: int, rows: int):
    rng = np.random.default_rng(seed)
    teacher = np.random.default_rng(123).normal(size=(D, C))
    x = rng.normal(size=(rows, D)).astype(np.float32)
    logits = 2 * x @ teacher
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    y = np.array([rng.choice(C, p=row) for row in p]).astype(np.int32)
    return x, y


def parts(seed: int):
    model = Net(nnx.Rngs(params=seed, dropout=jax.random.key(seed + 1, impl=IMPL)))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params, rest, x, y):
        m = nnx.merge(graphdef, params, rest, copy=True)
        value = optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()
        return value, nnx.state(m, nnx.Not(nnx.Param))

    def eval_loss(params, rest, x, y):
        m = nnx.merge(graphdef, params, rest, copy=True)
        m.eval()
        return optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()

    return loss, eval_loss, params, rest


def run(mode: str, steps: int, base: int, scale: int, seed: int, lr: float, fixed: int | None):
    """``mode``: ``plain`` (optax.adamw, S = 1), ``tau`` or ``update`` (AdaScale-AdamW's clock, S = ``scale``)."""
    loss, eval_loss, params, rest = parts(seed)
    x_eval, y_eval = data(10_000 + seed, 4096)
    if fixed:
        x_fix, y_fix = x_eval, y_eval = data(seed + 500, fixed)
    schedule = optax.cosine_decay_schedule(lr, steps)
    gains: list[float] = []
    if mode == "plain":
        tx = optax.adamw(schedule, weight_decay=0.0)

        @jax.jit
        def step(params, rest, state, x, y):
            (_, rest), g = jax.value_and_grad(loss, has_aux=True)(params, rest, x, y)
            u, state = tx.update(g, state, params)
            return optax.apply_updates(params, u), rest, state

        state = tx.init(params)
        for t in range(steps):
            i = (t * base) % fixed if fixed else 0
            x, y = (x_fix[i : i + base], y_fix[i : i + base]) if fixed else data(seed * 100_000 + t, base)
            params, rest, state = step(params, rest, state, x, y)
        return float(jax.jit(eval_loss)(params, rest, x_eval, y_eval)), steps, gains
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    tx = optax_adascale.adascale_adamw(schedule, weight_decay=0.0, scale=scale, clock=mode)
    grad_fn = optax_adascale.value_and_grad(loss, has_aux=True, state_argnum=1, data_axes="data")

    @jax.jit
    def ada_step(params, rest, state, x, y):
        (_, rest), g, stats = grad_fn(params, rest, x, y)
        u, state = tx.update(g, state, params, microbatch_stats=stats)
        return optax.apply_updates(params, u), rest, state

    state, t = tx.init(params), 0
    with jax.set_mesh(mesh):
        while not optax_adascale.done(state, steps):
            x, y = (x_fix, y_fix) if fixed else data(seed * 100_000 + 7_000_000 + t, base * scale)
            x, y = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, y))
            params, rest, state = ada_step(params, rest, state, x, y)
            gains.append(float(optax_adascale.metrics(state)["gain"]))
            t += 1
    return float(jax.jit(eval_loss)(params, rest, x_eval, y_eval)), t, gains


if __name__ == "__main__":
    T, BASE, LR = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    FIXED = int(sys.argv[4]) if len(sys.argv) > 4 else None
    for seed in (0, 1):
        for mode in ("plain", "tau", "update"):
            value, updates, g = run(mode, T, BASE, 8, seed, LR, FIXED)
            ends = f"{np.round(g[:3], 2)}..{np.round(g[-3:], 2)}" if g else "-"
            print(f"seed {seed} {mode:6s} loss {value:.4f} updates {updates} gains {ends}", flush=True)

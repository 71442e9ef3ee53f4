"""AdaScale SGD on a tensor-parallel Flax NNX transformer: data parallel over "data", Megatron over "model".

A small byte-level transformer language model learns the Python standard library's own
source (the ``*.py`` files directly under ``sysconfig.get_paths()["stdlib"]``, sorted and
concatenated; the last 5 % of the bytes are held out for validation). Nothing is
downloaded and the corpus is the same on every run of the same Python version.

The parameters carry sharding annotations, Megatron-style, for a ``(data, model)`` mesh:
attention's query/key/value and the MLP's first layer are column-parallel
(``nnx.with_partitioning(init, (None, "model"))``: heads and hidden units split over
``"model"``), attention's output projection and the MLP's second layer are row-parallel
(``("model", None)``), the tied byte embedding is vocabulary-parallel, and the position
embedding, the layer norms and the row-parallel biases are replicated. The program prints
which leaves are split and checks that the optimizer's momentum of a split weight is
itself split.

The learning-rate schedule is the user's: linear warm-up then cosine decay over ``T``
base-batch steps, SGD with momentum 0.9 and the averaged gradient clipped to norm 1,
written once for the base batch of 8 sequences of 64 bytes. It is never retuned. We
train twice, each until AdaScale's scale-invariant clock ``τ`` reaches ``T``
(``optax_adascale.done(opt_state, T)``):

* ``S = 1``: mesh ``(data=1, model=2)``, ``axis_name=None``; AdaScale is exactly SGD with
  momentum on ``lr(t)`` and takes ``T`` iterations.
* ``S = 4``: mesh ``(data=4, model=2)``: 4 data replicas of the base batch each, every
  replica's model split over 2 devices.

A full run (T = 2000) printed, on 8 virtual CPU devices::

      S  batch iterations     tau mean gain val loss wall (s)
    ---------------------------------------------------------
      1      8       2000  2000.0      1.00   1.6905     84.0
      4     32        865  2001.4      2.31   1.6076    127.0

The same schedule, 2.3× fewer iterations at 4× the batch, and no worse validation loss.

The recipe: a **partial-manual** ``jax.shard_map`` in which only ``"data"`` is manual.
Each replica differentiates its own copy of the parameters (``jax.lax.pcast(params,
"data", to="varying")``) and hands the local gradient to ``tx.update``, whose one
all-reduce over ``"data"`` averages it and carries AdaScale's statistics. The ``"model"``
axis stays automatic: the partitioner splits the matmuls, the gradients and the momentum
from the parameters' own shardings (placed with ``jax.device_put(params,
NamedSharding(mesh, spec))``, ``spec`` from ``nnx.get_partition_spec``). No psum over
``"model"`` is written by hand, and none is needed in the optimizer::

    mesh = jax.sharding.Mesh(np.array(devices).reshape(4, 2), ("data", "model"))  # Auto axes
    graphdef, params = nnx.split(model, nnx.Param)
    params = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), nnx.get_partition_spec(params)))
    tx = optax_adascale.adascale_sgd(schedule, momentum=0.9, axis_name="data")
    opt_state = tx.init(params)                         # the momentum is split like its weight

    def step(params, opt_state, batch):                 # one data replica, model axis automatic
        p = jax.lax.pcast(params, "data", to="varying")
        grads = jax.grad(loss_fn)(p, batch)            # loss_fn: nnx.merge(graphdef, p)(batch) ...
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P("data")),
                                 out_specs=(P(), P()), axis_names={"data"}))

Clipping goes inside AdaScale, where it sees the averaged gradient (this program's ``tx``):
``optax_adascale.adascale(optax.chain(optax_adascale.clip_by_global_norm(1.0),
optax.trace(0.9)), schedule, axis_name="data")``. At ``S = 1`` the same ``step`` is jitted
without ``shard_map`` or ``pcast``, with ``axis_name=None``. The 8 devices are 8
accelerators when there are that many, else 8 virtual CPU devices.

Run::

    python examples/sharded_lm.py            # full run, about 4 min on 2 CPU cores
    python examples/sharded_lm.py --smoke    # tiny model, T = 40, about 20 s

Reference: Johnson, Agrawal, Gu, Guestrin, "AdaScale SGD: A User-Friendly Algorithm for
Distributed Training", ICML 2020, https://arxiv.org/abs/2007.05105.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_adascale

import datasets

DATA, MODEL = "data", "model"  # mesh axes: data parallel (AdaScale's axis), tensor parallel
MODEL_SHARDS = 2
NUM_DEVICES = 8  # the S = 4 mesh: (data=4, model=2)
VOCAB = 256  # bytes


@dataclasses.dataclass(frozen=True)
class Config:
    budget: int  # T: base-batch steps; train until τ ≥ T
    lr: float  # the schedule's peak learning rate, for the base batch
    warmup: int  # linear warm-up, base-batch steps
    base_batch: int  # sequences per replica per iteration: the batch the schedule was written for
    seq_len: int  # bytes per sequence (predicted positions)
    width: int
    heads: int
    layers: int
    val_sequences: int  # validation windows (contiguous, from the held-out tail)
    clip: float | None = None  # clip the averaged gradient's global norm (inside AdaScale's inner)


FULL = Config(
    budget=2000, lr=1.0, warmup=100, base_batch=8, seq_len=64, width=128, heads=4, layers=2, val_sequences=512, clip=1.0
)
SMOKE = Config(
    budget=40, lr=1.0, warmup=5, base_batch=8, seq_len=64, width=64, heads=2, layers=1, val_sequences=64, clip=1.0
)


# --------------------------------------------------------------------------- data


# --------------------------------------------------------------------------- model


def make_model(cfg: Config, seed: int):
    """A pre-LayerNorm byte transformer with Megatron-style sharding annotations (not yet placed)."""
    from flax import nnx

    normal = nnx.initializers.normal
    shard = nnx.with_partitioning
    column = {
        "kernel_init": shard(nnx.initializers.lecun_normal(), (None, MODEL)),
        "bias_init": shard(nnx.initializers.zeros_init(), (MODEL,)),
    }
    residual_std = 0.02 / math.sqrt(2 * cfg.layers)  # GPT-2's scaled init of the residual projections
    row = {
        "kernel_init": shard(normal(residual_std), (MODEL, None)),
        "bias_init": nnx.initializers.zeros_init(),
    }  # replicated: added after the row-parallel sum

    class Attention(nnx.Module):
        def __init__(self, rngs):
            self.q, self.k, self.v = (nnx.Linear(cfg.width, cfg.width, **column, rngs=rngs) for _ in range(3))
            self.out = nnx.Linear(cfg.width, cfg.width, **row, rngs=rngs)

        def __call__(self, x):
            b, n, d = x.shape
            heads = lambda t: t.reshape(b, n, cfg.heads, d // cfg.heads)  # the "model" split falls on heads
            y = jax.nn.dot_product_attention(heads(self.q(x)), heads(self.k(x)), heads(self.v(x)), is_causal=True)
            return self.out(y.reshape(b, n, d))

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(cfg.width, 4 * cfg.width, **column, rngs=rngs)
            self.down = nnx.Linear(4 * cfg.width, cfg.width, **row, rngs=rngs)

        def __call__(self, x):
            return self.down(nnx.gelu(self.up(x)))

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.ln1, self.ln2 = nnx.LayerNorm(cfg.width, rngs=rngs), nnx.LayerNorm(cfg.width, rngs=rngs)
            self.attn, self.mlp = Attention(rngs), MLP(rngs)

        def __call__(self, x):
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))

    class ByteLM(nnx.Module):
        def __init__(self, rngs):
            # Vocabulary-parallel and tied: the logits come out split over "model" too.
            self.embed = nnx.Embed(VOCAB, cfg.width, embedding_init=shard(normal(1.0), (MODEL, None)), rngs=rngs)
            self.pos = nnx.Param(normal(1.0)(rngs.params(), (cfg.seq_len, cfg.width)))  # replicated
            self.blocks = nnx.List([Block(rngs) for _ in range(cfg.layers)])
            self.ln_f = nnx.LayerNorm(cfg.width, rngs=rngs)

        def __call__(self, tokens):
            x = self.embed(tokens) + self.pos[: tokens.shape[1]]
            for block in self.blocks:
                x = block(x)
            return self.embed.attend(self.ln_f(x)) / math.sqrt(cfg.width)

    # Annotate only; we place the parameters ourselves, once per mesh.
    with nnx.use_eager_sharding(False):
        return ByteLM(nnx.Rngs(seed))


def make_schedule(cfg: Config) -> optax.Schedule:
    """The user's schedule for the base batch: linear warm-up, cosine decay to 1 % at ``T``."""
    return optax.warmup_cosine_decay_schedule(cfg.lr / 10, cfg.lr, cfg.warmup, cfg.budget, end_value=cfg.lr / 100)


def make_optimizer(cfg: Config, axis_name: str | None) -> optax.GradientTransformation:
    """AdaScale SGD, momentum 0.9, on the schedule; clipping goes inside (it must see the averaged gradient)."""
    if cfg.clip is None:
        return optax_adascale.adascale_sgd(make_schedule(cfg), momentum=0.9, axis_name=axis_name)
    inner = optax.chain(optax_adascale.clip_by_global_norm(cfg.clip), optax.trace(0.9))
    return optax_adascale.adascale(inner, make_schedule(cfg), axis_name=axis_name)


# --------------------------------------------------------------------------- placement and reporting


def leaf_name(path) -> str:
    keys = [getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in path]
    return "/".join(str(k) for k in keys if k != "value")


def is_split(x) -> bool:
    return any(MODEL in (a if isinstance(a, tuple) else (a,)) for a in x.sharding.spec)


def place(params, mesh):
    """Each parameter onto ``mesh`` with its annotated spec (the mesh's "data" axis replicates it)."""
    from flax import nnx

    specs = nnx.get_partition_spec(params)
    return jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))


def print_shardings(params) -> None:
    """Every leaf of block 0 and outside the blocks: its shape, spec and per-device shape."""
    leaves = jax.tree_util.tree_leaves_with_path(params)
    split = sum(int(is_split(x)) for _, x in leaves)
    print(f"Parameter shardings ({split} of {len(leaves)} leaves split over {MODEL!r}; blocks 1+ like block 0):")
    for path, x in leaves:
        name = leaf_name(path)
        if name.startswith("blocks/") and not name.startswith("blocks/0/"):
            continue
        shard = x.sharding.shard_shape(x.shape)
        mark = f"split over {MODEL!r}" if is_split(x) else "replicated"
        print(f"  {name:<24} {str(x.shape):<11} {str(x.sharding.spec):<20} per device {str(shard):<12} {mark}")


def check_momentum_is_split(params, opt_state) -> int:
    """Assert that the momentum of every split weight is split like the weight; returns how many were checked."""
    momentum = optax.tree.get(opt_state, "trace")  # optax.trace's state, inside AdaScale's
    checked = 0
    for (path, p), m in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(momentum), strict=True):
        if is_split(p):
            assert m.sharding.spec == p.sharding.spec, (leaf_name(path), m.sharding.spec, p.sharding.spec)
            checked += 1
    assert checked > 0
    return checked


# --------------------------------------------------------------------------- training


def train(cfg: Config, corpus: tuple[np.ndarray, np.ndarray], *, scale: int, devices: list, seed: int) -> dict:
    """Train at ``scale`` data replicas until ``τ ≥ T``; return the table row."""
    from flax import nnx
    from tqdm import tqdm

    train_bytes, val_bytes = corpus
    mesh = jax.sharding.Mesh(np.array(devices[: scale * MODEL_SHARDS]).reshape(scale, MODEL_SHARDS), (DATA, MODEL))
    graphdef, params = nnx.split(make_model(cfg, seed), nnx.Param)  # the same initial weights at every S
    params = place(params, mesh)
    if scale == 1:
        print_shardings(params)
    axis_name = None if scale == 1 else DATA
    tx = make_optimizer(cfg, axis_name)
    opt_state = tx.init(params)
    check_momentum_is_split(params, opt_state)

    def loss_fn(params, windows):
        logits = nnx.merge(graphdef, params)(windows[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, windows[:, 1:]).mean()  # nats per byte

    def step(params, opt_state, windows):
        # One data replica. Under shard_map, differentiate a copy marked varying over "data":
        # per-replica gradients, which tx.update averages in its one all-reduce.
        p = params if axis_name is None else jax.lax.pcast(params, DATA, to="varying")
        loss, grads = jax.value_and_grad(loss_fn)(p, windows)
        updates, opt_state = tx.update(grads, opt_state, params)
        if axis_name is not None:
            loss = jax.lax.pmean(loss, DATA)
        return optax.apply_updates(params, updates), opt_state, loss

    # At S = 1 the step is jitted as is (the partitioner handles "model"). A partial-manual shard_map over a
    # size-1 "data" axis would not do: with JAX 0.10 any collective over it, even a plain pmean, fails
    # to compile ("Cross-partition allreduce must be in (partial) manual partitioning mode").
    if axis_name is not None:
        # Partial-manual: "data" is manual (in_specs/out_specs name only it); "model" is left to
        # the partitioner, which follows the shardings the parameters already have.
        step = jax.shard_map(
            step, mesh=mesh, in_specs=(P(), P(), P(DATA)), out_specs=(P(), P(), P()), axis_names={DATA}
        )
    step = jax.jit(step, donate_argnums=(0, 1))
    evaluate = jax.jit(loss_fn)
    batch_sharding = NamedSharding(mesh, P(DATA))
    val = jax.device_put(
        datasets.validation_windows(val_bytes, cfg.val_sequences, cfg.seq_len), NamedSharding(mesh, P())
    )

    rng = np.random.default_rng(seed + 1)
    draw = lambda: jax.device_put(
        datasets.sample_windows(train_bytes, scale * cfg.base_batch, cfg.seq_len, rng), batch_sharding
    )  # replica i: rows i·B … (i+1)·B − 1
    start = time.perf_counter()
    step = step.lower(params, opt_state, draw()).compile()
    compile_seconds = time.perf_counter() - start

    iterations, tau = 0, 0.0
    start = time.perf_counter()
    with tqdm(
        total=cfg.budget, desc=f"S={scale} τ", unit="base step", leave=False, mininterval=0.5, disable=None
    ) as bar:
        while not optax_adascale.done(opt_state, cfg.budget):  # τ ≥ T
            params, opt_state, loss = step(params, opt_state, draw())
            iterations += 1
            new_tau = float(optax_adascale.scale_invariant_steps(opt_state))
            bar.update(min(new_tau, cfg.budget) - min(tau, cfg.budget))
            tau = new_tau
            if iterations % 10 == 0:
                gain = float(optax_adascale.metrics(opt_state)["gain"])
                bar.set_postfix(gain=f"{gain:.2f}", loss=f"{float(loss):.3f}")
    seconds = time.perf_counter() - start
    checked = check_momentum_is_split(params, opt_state)  # still split after training
    val_loss = float(evaluate(params, val))
    print(
        f"S={scale}: {iterations} iterations to τ={tau:.1f}, validation loss {val_loss:.4f} nats/byte "
        f"({seconds:.1f} s + {compile_seconds:.1f} s compile; momentum of {checked} split leaves is split)"
    )
    return {
        "S": scale,
        "batch": scale * cfg.base_batch,
        "iterations": iterations,
        "tau": tau,
        "mean_gain": tau / iterations,
        "val_loss": val_loss,
        "seconds": seconds,
    }


def print_table(rows: list[dict[str, Any]]) -> None:
    header = f"{'S':>3} {'batch':>6} {'iterations':>10} {'tau':>7} {'mean gain':>9} {'val loss':>8} {'wall (s)':>8}"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['S']:>3} {r['batch']:>6} {r['iterations']:>10} {r['tau']:>7.1f} {r['mean_gain']:>9.2f} "
            f"{r['val_loss']:>8.4f} {r['seconds']:>8.1f}"
        )


def select_devices() -> list:
    """8 accelerators if there are that many, else 8 virtual CPU devices."""
    jax.config.update("jax_num_cpu_devices", NUM_DEVICES)  # before JAX initialises its CPU backend
    devices = jax.devices()
    if len(devices) < NUM_DEVICES:
        devices = jax.devices("cpu")
    return devices[:NUM_DEVICES]


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget", type=int, default=None, help="T: base-batch steps (default 500, smoke 30)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="tiny model and budget (about 30 s)")
    args = parser.parse_args(argv)
    cfg = SMOKE if args.smoke else FULL
    if args.budget is not None:
        cfg = dataclasses.replace(cfg, budget=args.budget)

    devices = select_devices()
    train_bytes, val_bytes, corpus = datasets.byte_corpus()
    print(
        f"Corpus: {corpus['files']} files {corpus['corpus']}: {len(train_bytes):,} train / "
        f"{len(val_bytes):,} validation bytes. "
        f"Byte transformer: {cfg.layers} layers, width {cfg.width}, {cfg.heads} heads, context {cfg.seq_len}. "
        f"SGD momentum 0.9{f', clip {cfg.clip}' if cfg.clip else ''}, warm-up {cfg.warmup} + cosine, peak lr {cfg.lr}, "
        f"written for batch {cfg.base_batch} sequences; "
        f"T = {cfg.budget}. Mesh (data, model) on {len(devices)} {devices[0].platform.upper()} devices."
    )
    rows = [train(cfg, (train_bytes, val_bytes), scale=s, devices=devices, seed=args.seed) for s in (1, 4)]
    print()
    print_table(rows)
    return rows


if __name__ == "__main__":
    main()

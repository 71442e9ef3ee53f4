"""A MaxText-shaped trainer with AdaScale: one ``jax.jit`` step over the global batch, FSDP × TP parameters.

A small byte-level Flax NNX transformer learns the Python standard library's own source
(``examples/datasets.py``'s ``stdlib_source()``: the ``*.py`` files directly under the
stdlib directory, read from disk, nothing downloaded; the last 5 % of the bytes are held
out). The trainer is written the way MaxText, Levanter or Flax's lm1b write theirs: the
loss is a function of the **global** batch, the train step is **one** ``jax.jit`` with
``in_shardings``/``out_shardings``, and the SPMD partitioner places everything. No
``shard_map``, ``pmap``, ``vmap`` or reshaping of the batch in the user's code.

* Mesh: ``jax.make_mesh((data, model), ("data", "model"))``, JAX's default **Explicit** axes.
  The model is written the Explicit way, as MaxText and Flax's lm1b write theirs: the TP
  matmuls name their output's sharding (``nnx.Linear(...)(x, out_sharding=P("data", None,
  "model"))`` for the column-parallel ones, ``P("data")`` after the row-parallel ones and the
  logits), the embedding gather names it (``.at[tokens].get(out_sharding=P("data"))``), the
  FSDP-split position table is gathered with ``jax.sharding.reshard``. ``value_and_grad`` drops
  the data axes from those shardings when it evaluates the loss one data shard at a time.
* Parameters FSDP × TP (``nnx.with_partitioning``): attention's query/key/value and the
  MLP's first layer are ``("data", "model")`` (column-parallel over ``"model"``, their
  input dimension split over ``"data"``), the output projections ``("model", "data")``,
  the tied byte embedding ``("model", "data")``, the position embedding ``(None, "data")``;
  biases and layer norms are replicated. The optimizer state is sharded like the
  parameters through ``out_shardings`` built the documented way::

      specs = optax_adascale.state_partition_specs(jax.eval_shape(tx.init, params), "data", param_specs, tx=tx)

* Gradient accumulation: ``optax_adascale.value_and_grad(loss_fn, data_axes="data",
  num_microbatches=k)`` splits each data shard's rows into ``k`` micro-batches, accumulates
  them locally and reduces once per step. Its ``stats`` go to
  ``tx.update(grads, opt_state, params, microbatch_stats=stats)``. AdaScale's scale is the
  number of gradient samples, ``S = data shards × k``.

The schedule is the user's, written once for the base batch of 8 sequences of 64 bytes
(linear warm-up then cosine decay over ``T`` base-batch steps) and never retuned. We
train twice to the same scale-invariant clock (``optax_adascale.done(opt_state, T)``):

* ``S = 1``: mesh ``(data=1, model=2)``, ``k = 1``, batch 8: exactly AdamW (or SGD with
  momentum) on the schedule, ``T`` iterations;
* ``S = 8``: mesh ``(data=4, model=2)``, ``k = 2``, batch 64 (``--data``, ``--microbatches``).

The optimizer is ``optax_adascale.adascale_adamw`` (``--optimizer adamw``, the default) or
``optax_adascale.adascale_sgd`` with momentum 0.9 (``--optimizer sgd``). The diff of the
train step from the same step with plain ``optax.adamw`` is in ``docs/gspmd.md``; the
region between the ``[diff]`` markers below is what it shows.

A full run (T = 600) on 8 virtual CPU devices (2 shared CPU cores; wall times include
compilation and depend on the load). The model written the Explicit way on Explicit axes prints the
same losses, iterations and gains as the earlier Auto-axes version, to every printed digit.
``python examples/gspmd_lm.py`` printed::

    Initial validation loss: 5.7315 nats/byte (log 256 = 5.5452)
      S  mesh  k batch iterations     tau mean gain train loss val loss wall (s)
    ----------------------------------------------------------------------------
      1   1x2  1     8        600   600.0      1.00     2.3957   2.6028     49.9
      8   4x2  2    64        291   601.1      2.07     2.1725   2.4229     68.5

and ``python examples/gspmd_lm.py --optimizer sgd``::

    Initial validation loss: 5.7315 nats/byte (log 256 = 5.5452)
      S  mesh  k batch iterations     tau mean gain train loss val loss wall (s)
    ----------------------------------------------------------------------------
      1   1x2  1     8        600   600.0      1.00     2.3687   2.5900     47.2
      8   4x2  2    64        292   600.8      2.06     2.2601   2.5181     56.6

The same schedule reaches the same τ in about half the iterations at 8× the batch, with a
lower loss; the gain is about 2 rather than 8 because at this batch size the gradient's signal
dominates its noise (the gain is ``S`` only where noise dominates).

The 8 devices are 8 accelerators when there are that many, else 8 virtual CPU devices.

Run::

    python examples/gspmd_lm.py                      # adamw, S = 1 and S = 8
    python examples/gspmd_lm.py --optimizer sgd
    python examples/gspmd_lm.py --smoke              # tiny model, T = 30, for CI

Reference: Johnson, Agrawal, Gu, Guestrin, "AdaScale SGD: A User-Friendly Algorithm for
Distributed Training", ICML 2020, https://arxiv.org/abs/2007.05105.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import time
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding, reshard
from jax.sharding import PartitionSpec as P

import optax_adascale

import datasets

DATA, MODEL = "data", "model"  # mesh axes: the batch (and FSDP) axis, the tensor-parallel axis
MODEL_SHARDS = 2
ROWS, SPLIT = P(DATA), P(DATA, None, MODEL)  # activations (batch, position, feature): whole, or TP-split features
NUM_DEVICES = 8
VOCAB = 256  # bytes


@dataclasses.dataclass(frozen=True)
class Config:
    budget: int  # T: base-batch steps; train until τ ≥ T
    warmup: int  # linear warm-up, base-batch steps
    base_batch: int  # sequences per gradient sample: the batch the schedule was written for
    seq_len: int  # bytes per sequence (predicted positions)
    width: int
    heads: int
    layers: int
    val_sequences: int  # validation windows (contiguous, from the held-out tail)


FULL = Config(budget=600, warmup=50, base_batch=8, seq_len=64, width=64, heads=4, layers=2, val_sequences=256)
SMOKE = Config(budget=30, warmup=5, base_batch=8, seq_len=32, width=32, heads=2, layers=1, val_sequences=32)
PEAK_LR = {"adamw": 3e-3, "sgd": 0.5}  # for the base batch; never retuned


# --------------------------------------------------------------------------- data


# --------------------------------------------------------------------------- model


def make_model(cfg: Config, seed: int):
    """A pre-LayerNorm byte transformer with FSDP × TP sharding annotations (not yet placed)."""
    from flax import nnx

    normal, shard = nnx.initializers.normal, nnx.with_partitioning
    column = {
        "kernel_init": shard(nnx.initializers.lecun_normal(), (DATA, MODEL)),
        "bias_init": shard(nnx.initializers.zeros_init(), (MODEL,)),
    }
    residual_std = 0.02 / math.sqrt(2 * cfg.layers)  # GPT-2's scaled init of the residual projections
    row = {
        "kernel_init": shard(normal(residual_std), (MODEL, DATA)),
        "bias_init": nnx.initializers.zeros_init(),
    }  # the row-parallel bias is replicated: added after the sum over "model"

    class Attention(nnx.Module):
        def __init__(self, rngs):
            self.q, self.k, self.v = (nnx.Linear(cfg.width, cfg.width, **column, rngs=rngs) for _ in range(3))
            self.out = nnx.Linear(cfg.width, cfg.width, **row, rngs=rngs)

        def __call__(self, x):
            b, n, d = x.shape
            heads = lambda t: t.reshape(b, n, cfg.heads, d // cfg.heads)  # the "model" split falls on heads
            q, k, v = (heads(f(x, out_sharding=SPLIT)) for f in (self.q, self.k, self.v))
            y = jax.nn.dot_product_attention(q, k, v, is_causal=True)
            return self.out(y.reshape(b, n, d), out_sharding=ROWS)

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(cfg.width, 4 * cfg.width, **column, rngs=rngs)
            self.down = nnx.Linear(4 * cfg.width, cfg.width, **row, rngs=rngs)

        def __call__(self, x):
            return self.down(nnx.gelu(self.up(x, out_sharding=SPLIT)), out_sharding=ROWS)

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.ln1, self.ln2 = nnx.LayerNorm(cfg.width, rngs=rngs), nnx.LayerNorm(cfg.width, rngs=rngs)
            self.attn, self.mlp = Attention(rngs), MLP(rngs)

        def __call__(self, x):
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))

    class ByteLM(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(VOCAB, cfg.width, embedding_init=shard(normal(1.0), (MODEL, DATA)), rngs=rngs)
            self.pos = nnx.Param(normal(1.0)(rngs.params(), (cfg.seq_len, cfg.width)), sharding=(None, DATA))
            self.blocks = nnx.List([Block(rngs) for _ in range(cfg.layers)])
            self.ln_f = nnx.LayerNorm(cfg.width, rngs=rngs)

        def __call__(self, tokens):
            x = self.embed.embedding[...].at[tokens].get(out_sharding=ROWS)  # gathered rows split like the batch
            x = x + reshard(self.pos[: tokens.shape[1]], P())  # the FSDP-split table gathered whole
            for block in self.blocks:
                x = block(x)
            return self.embed.attend(self.ln_f(x), out_sharding=ROWS) / math.sqrt(cfg.width)

    with nnx.use_eager_sharding(False):  # annotate only; placed once per mesh below
        return ByteLM(nnx.Rngs(seed))


def make_schedule(cfg: Config, peak: float) -> optax.Schedule:
    """The user's schedule for the base batch: linear warm-up, cosine decay to 1 % at ``T``."""
    return optax.warmup_cosine_decay_schedule(peak / 10, peak, cfg.warmup, cfg.budget, end_value=peak / 100)


# [diff] docs/gspmd.md "The diff from a plain optax step" shows this region against plain optax.
def make_optimizer(name, schedule):
    if name == "adamw":
        return optax_adascale.adascale_adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1)
    return optax_adascale.adascale_sgd(schedule, momentum=0.9)


def make_train_step(tx, loss_fn, num_microbatches, param_shardings, state_shardings, batch_sharding):
    grad_fn = optax_adascale.value_and_grad(loss_fn, data_axes="data", num_microbatches=num_microbatches)

    @functools.partial(
        jax.jit,
        in_shardings=(param_shardings, state_shardings, batch_sharding),
        out_shardings=(param_shardings, state_shardings, None),
        donate_argnums=(0, 1),
    )
    def train_step(params, opt_state, batch):
        loss, grads, stats = grad_fn(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params, microbatch_stats=stats)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step


# [end diff]


# --------------------------------------------------------------------------- placement and reporting


def leaf_name(path) -> str:
    keys = [getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in path]
    return "/".join(str(k) for k in keys if k != "value")


def print_shardings(params) -> None:
    """Every leaf outside blocks 1+: its shape, spec and per-device shape."""
    print("Parameter shardings (blocks 1+ like block 0):")
    for path, x in jax.tree_util.tree_leaves_with_path(params):
        name = leaf_name(path)
        if not (name.startswith("blocks/") and not name.startswith("blocks/0/")):
            shard = x.sharding.shard_shape(x.shape)
            print(f"  {name:<24} {str(x.shape):<11} {str(x.sharding.spec):<24} per device {shard}")


def check_state_is_sharded(opt_state, state_shardings) -> int:
    """Every optimizer-state leaf has its ``out_shardings`` sharding; returns how many leaves are split."""
    split = 0
    for leaf, sharding in zip(jax.tree.leaves(opt_state), jax.tree.leaves(state_shardings), strict=True):
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim), (leaf.shape, leaf.sharding, sharding)
        split += any(sharding.spec)
    assert split > 0, "the momentum should be split like the parameters"
    return split


# --------------------------------------------------------------------------- training


def train(cfg: Config, corpus, *, optimizer: str, data: int, k: int, devices: list, seed: int) -> dict:
    """Train with ``data`` shards × ``k`` micro-batches (``S = data · k``) until ``τ ≥ T``; return the table row."""
    from flax import nnx
    from tqdm import tqdm

    train_bytes, val_bytes = corpus
    scale = data * k
    mesh = jax.make_mesh((data, MODEL_SHARDS), (DATA, MODEL), devices=devices[: data * MODEL_SHARDS])  # Explicit
    graphdef, params = nnx.split(make_model(cfg, seed), nnx.Param)  # the same initial weights at every S
    param_specs = nnx.get_partition_spec(params)
    param_shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs)
    params = jax.device_put(params, param_shardings)
    if data > 1:
        print_shardings(params)

    tx = make_optimizer(optimizer, make_schedule(cfg, PEAK_LR[optimizer]))
    state_specs = optax_adascale.state_partition_specs(jax.eval_shape(tx.init, params), DATA, param_specs, tx=tx)
    state_shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), state_specs)
    opt_state = jax.jit(tx.init, out_shardings=state_shardings)(params)

    def loss_fn(params, windows):
        logits = nnx.merge(graphdef, params)(windows[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, windows[:, 1:]).mean()  # nats per byte

    batch_sharding = NamedSharding(mesh, P(DATA))
    train_step = make_train_step(tx, loss_fn, k, param_shardings, state_shardings, batch_sharding)
    evaluate = jax.jit(loss_fn)
    rng = np.random.default_rng(seed + 1)
    draw = lambda: jax.device_put(
        datasets.sample_windows(train_bytes, scale * cfg.base_batch, cfg.seq_len, rng), batch_sharding
    )

    iterations, tau, losses = 0, 0.0, []
    with jax.set_mesh(mesh):
        val = jax.device_put(datasets.validation_windows(val_bytes, cfg.val_sequences, cfg.seq_len), batch_sharding)
        initial_val = float(evaluate(params, val))
        start = time.perf_counter()
        with tqdm(
            total=cfg.budget, desc=f"S={scale} τ", unit="base step", leave=False, mininterval=0.5, disable=None
        ) as bar:
            while not optax_adascale.done(opt_state, cfg.budget):  # τ ≥ T
                params, opt_state, loss = train_step(params, opt_state, draw())
                losses.append(loss)
                iterations += 1
                new_tau = float(optax_adascale.scale_invariant_steps(opt_state))
                bar.update(min(new_tau, cfg.budget) - min(tau, cfg.budget))
                tau = new_tau
                if iterations % 10 == 0:
                    gain = float(optax_adascale.metrics(opt_state)["gain"])
                    bar.set_postfix(gain=f"{gain:.2f}", loss=f"{float(loss):.3f}")
        seconds = time.perf_counter() - start
        val_loss = float(evaluate(params, val))
    checked = check_state_is_sharded(opt_state, state_shardings)
    train_loss = float(np.mean(jax.device_get(losses[-10:])))
    print(
        f"S={scale} (data {data} × k {k}): {iterations} iterations to τ={tau:.1f}, validation loss "
        f"{initial_val:.4f} → {val_loss:.4f} nats/byte in {seconds:.1f} s "
        f"({checked} optimizer-state leaves split)"
    )
    return {
        "S": scale,
        "mesh": f"{data}x{MODEL_SHARDS}",
        "k": k,
        "batch": scale * cfg.base_batch,
        "iterations": iterations,
        "tau": tau,
        "mean_gain": tau / iterations,
        "initial_val": initial_val,
        "train_loss": train_loss,
        "val_loss": val_loss,
        "seconds": seconds,
    }


def print_table(rows: list[dict[str, Any]]) -> None:
    header = (
        f"{'S':>3} {'mesh':>5} {'k':>2} {'batch':>5} {'iterations':>10} {'tau':>7} {'mean gain':>9} "
        f"{'train loss':>10} {'val loss':>8} {'wall (s)':>8}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['S']:>3} {r['mesh']:>5} {r['k']:>2} {r['batch']:>5} {r['iterations']:>10} {r['tau']:>7.1f} "
            f"{r['mean_gain']:>9.2f} {r['train_loss']:>10.4f} {r['val_loss']:>8.4f} {r['seconds']:>8.1f}"
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
    parser.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    parser.add_argument("--data", type=int, default=4, choices=[1, 2, 4], help="data shards of the large run")
    parser.add_argument("--microbatches", type=int, default=2, help="k: micro-batches per shard of the large run")
    parser.add_argument("--budget", type=int, default=None, help=f"T (default {FULL.budget}, smoke {SMOKE.budget})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="tiny model and budget, for CI")
    args = parser.parse_args(argv)
    if args.microbatches < 1:
        parser.error(f"--microbatches must be >= 1, got {args.microbatches}")
    if args.data * args.microbatches < 2:
        parser.error("the large run needs S = data × microbatches >= 2")
    cfg = SMOKE if args.smoke else FULL
    if args.budget is not None:
        cfg = dataclasses.replace(cfg, budget=args.budget)

    devices = select_devices()
    train_bytes, val_bytes, corpus = datasets.byte_corpus()
    print(
        f"Corpus: {corpus['files']} files {corpus['corpus']}: {len(train_bytes):,} train / "
        f"{len(val_bytes):,} validation bytes. Byte transformer: {cfg.layers} layers, width {cfg.width}, "
        f"{cfg.heads} heads, context {cfg.seq_len}. adascale_{args.optimizer}, peak lr {PEAK_LR[args.optimizer]}, "
        f"warm-up {cfg.warmup} + cosine, written for batch {cfg.base_batch}; T = {cfg.budget}. "
        f"{len(devices)} {devices[0].platform.upper()} devices."
    )
    runs = [(1, 1), (args.data, args.microbatches)]
    rows = [
        train(cfg, (train_bytes, val_bytes), optimizer=args.optimizer, data=d, k=k, devices=devices, seed=args.seed)
        for d, k in runs
    ]
    print()
    print(f"Initial validation loss: {rows[0]['initial_val']:.4f} nats/byte (log 256 = {math.log(256):.4f})")
    print_table(rows)
    return rows


if __name__ == "__main__":
    main()

"""A Flax Linen seq2seq LSTM that learns addition, ported to AdaScale through the drop-in.

The task of Flax's ``examples/seq2seq`` (two-digit numbers here, so that a CPU learns it in minutes): the encoder
reads ``"17+58"`` one character at a time (``nn.RNN`` over an ``nn.LSTMCell``), the decoder, started from the
encoder's last state, writes ``"=75 "`` (a space marks the end; teacher forcing in training, greedy decoding for
the held-out accuracy). Linen's ``TrainState``, ``optax.adam``, one ``jax.jit`` step. The port
changes the lines marked ``# AdaScale``:

* ``flax.training.train_state.TrainState`` -> ``optax_adascale.flax.TrainState`` (Flax's own treats every keyword of
  ``apply_gradients`` as a field: ``microbatch_stats=`` would fail there);
* ``optax.adam(lr)`` -> ``optax_adascale.adascale_adamw(schedule, weight_decay=0.0)`` (optax's ``adam`` is AdamW
  without decay; the alias's default decay is 1e-4), the schedule written for the base batch;
* ``jax.value_and_grad(loss_fn, has_aux=True)`` -> ``optax_adascale.value_and_grad(loss_fn, data_axes="data",
  has_aux=True, num_microbatches=k, param_specs=...)`` on a mesh of 8 devices (Auto axes, as Flax writes its steps:
  the parameters replicated, ``param_specs`` says so); ``state.apply_gradients(grads=grads,
  microbatch_stats=stats)``;
* the loop stops at ``optax_adascale.done(state.opt_state, T)``: ``T`` base-batch steps, never ``range(T // S)``.

The recurrent layers need nothing: their zero state (``initialize_carry``) starts unsharded and the drop-in lays it
out as the loop returns it. ``--mesh pmap`` runs the same port per replica (``jax.pmap``, ``axis_name="data"`` on the
optimizer), the way a Flax user without a mesh writes it; it follows the drop-in's trajectory to float32 rounding
(``tests/test_examples.py``). After a quarter of ``T``, ``optax_adascale.done`` says what a larger S buys when the
batch is well above the gradient noise scale. On this task it is, for a long while: measured (T = 3000, seed 0, LSTM
128), the noise scale read 0.5 base batches a quarter of the way in (S = 8: r = 1.43 an update, 18 % of S) and 43
to 100 by the end; S = 1 took 3000 updates to 99.4 % of held-out answers exact, S = 8 1541 updates (mean gain 1.95)
to 99.9 %, S = 32 1288 updates (2.34) to 100.0 %.

Run::

    python examples/flax_seq2seq.py                  # S = 1, 8, 32, T = 3000 base steps of 64 examples
    python examples/flax_seq2seq.py --smoke          # CI: T = 60, S = 1 and 8, the drop-in and pmap
    python examples/flax_seq2seq.py --mesh pmap      # the same port per replica
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import optax_adascale  # noqa: E402  # AdaScale
from optax_adascale.flax import TrainState  # noqa: E402  # AdaScale

CHARS = "0123456789+= "  # digits, the two signs, padding
VOCAB, EQUALS = len(CHARS), CHARS.index("=")
MAX_INPUT, MAX_OUTPUT = 5, 4  # "99+99", "=198"
BASE_BATCH, DEVICES = 64, 8


def encode(text: str, length: int) -> np.ndarray:
    return np.array([CHARS.index(c) for c in text.ljust(length)], np.int32)


def sample(rng: np.random.Generator, count: int) -> dict[str, np.ndarray]:
    """``count`` random additions of two numbers below 100: the question, and the answer after ``=``."""
    a, b = rng.integers(0, 100, count), rng.integers(0, 100, count)
    questions = np.stack([encode(f"{x}+{y}", MAX_INPUT) for x, y in zip(a, b, strict=True)])
    answers = np.stack([encode(f"={x + y}", MAX_OUTPUT) for x, y in zip(a, b, strict=True)])
    return {"question": questions, "answer": answers}


def make_model(hidden: int):
    from flax import linen as nn

    class Seq2Seq(nn.Module):
        """An LSTM encoder and decoder over one-hot characters, the decoder started from the encoder's state."""

        @nn.compact
        def __call__(self, question, decoder_inputs):
            carry, _ = nn.RNN(nn.LSTMCell(hidden), return_carry=True, name="encoder")(jax.nn.one_hot(question, VOCAB))
            out = nn.RNN(nn.LSTMCell(hidden), name="decoder")(
                jax.nn.one_hot(decoder_inputs, VOCAB), initial_carry=carry
            )
            return nn.Dense(VOCAB, name="logits")(out)

    return Seq2Seq()


def loss_fn(params, model, batch):
    """Teacher forcing: the decoder reads the answer shifted by one (``=`` first) and predicts each next character,
    the padding after a short answer too (it marks the end)."""
    answer = batch["answer"]
    logits = model.apply({"params": params}, batch["question"], answer[:, :-1])
    targets = answer[:, 1:]
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
    correct = jnp.all(jnp.argmax(logits, -1) == targets, axis=-1)
    return loss, jnp.mean(correct)


def greedy_accuracy(params, model, batch) -> float:
    """Held-out answers decoded greedily, one character at a time from ``=``: the share written exactly."""
    question, answer = batch["question"], batch["answer"]
    decoded = jnp.full((question.shape[0], 1), EQUALS, jnp.int32)
    for _ in range(MAX_OUTPUT - 1):
        logits = model.apply({"params": params}, question, decoded)
        decoded = jnp.concatenate([decoded, jnp.argmax(logits[:, -1:], -1).astype(jnp.int32)], axis=1)
    return float(jnp.mean(jnp.all(decoded[:, 1:] == answer[:, 1:], axis=-1)))


def make_step(model, scale: int, mesh_kind: str, params):
    """The train step: Flax's as written at S = 1, the drop-in over the global batch (``gspmd``) or a per-replica
    ``jax.pmap`` (``pmap``) at S > 1."""
    if scale == 1:

        @jax.jit
        def step(state, batch):
            (loss, acc), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, model, batch)
            return state.apply_gradients(grads=grads), loss

        return step
    k = scale // DEVICES  # micro-batches per data shard: S = 8 shards × k
    if mesh_kind == "pmap":

        def replica(state, batch):
            grad_fn = optax_adascale.value_and_grad(lambda p, b: loss_fn(p, model, b), has_aux=True, num_microbatches=k)
            (loss, _), grads, stats = grad_fn(state.params, batch)
            return state.apply_gradients(grads=grads, microbatch_stats=stats), jax.lax.pmean(loss, "data")

        return jax.pmap(replica, axis_name="data")
    specs = jax.tree.map(lambda _: P(), params)  # AdaScale: Flax's parameters are replicated on the mesh
    grad_fn = optax_adascale.value_and_grad(  # AdaScale
        lambda p, b: loss_fn(p, model, b), data_axes="data", has_aux=True, num_microbatches=k, param_specs=specs
    )

    @jax.jit
    def step(state, batch):
        (loss, _), grads, stats = grad_fn(state.params, batch)  # AdaScale
        return state.apply_gradients(grads=grads, microbatch_stats=stats), loss  # AdaScale

    return step


def make_tx(lr: float, budget: int, scale: int, mesh_kind: str):
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, budget // 20, budget)  # written for the base batch
    if scale == 1:
        return optax.adam(schedule)
    axis = "data" if mesh_kind == "pmap" else None
    return optax_adascale.adascale_adamw(schedule, weight_decay=0.0, axis_name=axis)  # AdaScale


def train(scale: int, budget: int, lr: float, seed: int, mesh_kind: str, hidden: int, progress: bool) -> dict:
    """Train until ``τ ≥ budget`` base-batch steps; return the run's row and its per-update losses."""
    from tqdm import tqdm

    model = make_model(hidden)
    rng = np.random.default_rng(seed)
    held_out = sample(np.random.default_rng(10_000 + seed), 1024)
    example = sample(rng, 2)
    params = model.init(jax.random.key(seed), example["question"], example["answer"][:, :-1])["params"]
    tx = make_tx(lr, budget, scale, mesh_kind)
    state = TrainState.create(apply_fn=model.apply, params=params, tx=tx)  # AdaScale: optax_adascale.flax's
    step = make_step(model, scale, mesh_kind, params)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:DEVICES]), ("data",))  # AdaScale: 8 data shards (Auto axes)
    replicas = scale > 1 and mesh_kind == "pmap"
    if replicas:
        state = jax.tree.map(lambda x: jnp.stack([x] * DEVICES), state)  # a copy per replica
    iterations, losses, start = 0, [], time.perf_counter()
    bar = tqdm(total=budget, desc=f"S={scale}", unit="τ", file=sys.stderr, disable=not progress)
    tau = 0.0

    def opt_state():  # under pmap each replica holds the same state: read the first copy
        return jax.tree.map(lambda x: x[0], state.opt_state) if replicas else state.opt_state

    while not (tau >= budget if scale == 1 else optax_adascale.done(opt_state(), budget)):  # AdaScale
        batch = sample(rng, BASE_BATCH * scale)
        if replicas:
            batch = jax.tree.map(lambda x: x.reshape(DEVICES, -1, *x.shape[1:]), batch)
            state, loss = step(state, batch)
        elif scale > 1:
            with jax.set_mesh(mesh):
                state, loss = step(state, jax.device_put(batch, NamedSharding(mesh, P("data"))))
        else:
            state, loss = step(state, batch)
        iterations += 1
        new_tau = float(iterations) if scale == 1 else float(optax_adascale.scale_invariant_steps(opt_state()))
        losses.append(float(np.mean(loss)))
        bar.update(min(new_tau, budget) - min(tau, budget))
        tau = new_tau
    bar.close()
    if replicas:
        state = jax.tree.map(lambda x: x[0], state)
    m = optax_adascale.metrics(state.opt_state) if scale > 1 else None
    return {
        "S": scale,
        "iterations": iterations,
        "tau": tau,
        "mean_gain": tau / iterations,
        "noise_scale": float(m["noise_scale"]) if m else float("nan"),
        "train_loss": float(np.mean(losses[-10:])),
        "accuracy": 100 * greedy_accuracy(state.params, model, held_out),
        "seconds": time.perf_counter() - start,
        "losses": losses,
    }


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget", type=int, default=None, help="T in base-batch steps (default 3000; smoke 60)")
    parser.add_argument("--lr", type=float, default=3e-3, help="the schedule's peak, for the base batch of 64")
    parser.add_argument("--scales", type=int, nargs="+", default=None, help="S values (1 or multiples of 8)")
    parser.add_argument(
        "--mesh", choices=("gspmd", "pmap"), nargs="+", default=None, help="the drop-in and/or jax.pmap (default gspmd)"
    )
    parser.add_argument("--json", help="write the rows, with each update's loss, here")
    parser.add_argument("--hidden", type=int, default=None, help="the LSTMs' width (default 128; smoke 16)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--smoke", action="store_true", help="CI: T = 60, S = 1 and 8, both meshes, width 16")
    args = parser.parse_args(argv)
    budget = args.budget or (60 if args.smoke else 3000)
    meshes = args.mesh or (["gspmd", "pmap"] if args.smoke else ["gspmd"])
    scales = args.scales or ([1, 8] if args.smoke else [1, 8, 32])
    hidden = args.hidden or (16 if args.smoke else 128)
    print(
        f"seq2seq addition (LSTM {hidden}) on {len(jax.devices())} {jax.devices()[0].platform.upper()} device(s), "
        f"T = {budget} base-batch steps of {BASE_BATCH}; S > 1 through AdaScale's "
        + " and ".join(
            {"gspmd": "drop-in (gspmd: jit over the global batch)", "pmap": "per-replica update (jax.pmap)"}[m]
            for m in meshes
        )
    )
    runs = [(s, m) for s in scales for m in (meshes if s > 1 else ["-"])]
    rows = [{"mesh": m, **train(s, budget, args.lr, args.seed, m, hidden, not args.no_progress)} for s, m in runs]
    header = (
        f"{'S':>4} {'mesh':>6} {'iterations':>10} {'tau':>8} {'mean gain':>9} {'noise scale':>11} {'loss':>8} "
        f"{'held-out':>9}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['S']:>4} {r['mesh']:>6} {r['iterations']:>10} {r['tau']:>8.1f} {r['mean_gain']:>9.2f} "
            f"{r['noise_scale']:>11.3g} {r['train_loss']:>8.4f} {r['accuracy']:>8.1f}%"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f)
    return rows


if __name__ == "__main__":
    main()

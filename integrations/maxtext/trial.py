"""One MaxText 0.2.5 run of a tiny decoder on CPU, unmodified or with AdaScale (the patched ``train_step``).

The loop is ``train.py``'s own pieces (``train.initialize``, ``train_utils.setup_train_loop``,
``jit_train_and_eval_step``, ``train.train_step``) without checkpoints and evals, fed byte-level text read
from this Python's standard library (held-out windows for the loss), so that a gradient sample is a real one.
It writes one JSON record: losses, gains, τ, step times and (``--check``) our gradient against MaxText's own
``jax.value_and_grad`` of the same loss at every step.

    python trial.py --mode adascale --steps 120 --out r.json -- shard_mode=explicit ici_fsdp_parallelism=8

``--mode maxtext``: MaxText's AdamW for ``--steps`` iterations. ``--mode adascale``: AdaScale-AdamW with the
same schedule until τ ≥ ``--steps``. ``--unequal``: every row padded after a random length (weight 0 past it),
so the data shards hold unequal real-token counts. ``--eval-at N``: also the held-out loss at iteration N.
``--prng threefry2x32``: dropout keys of that implementation instead of MaxText's hard-coded ``unsafe_rbg``.
``--closure``: the drop-in called on a lambda closing over NNX's ``rest`` (no ``state_argnum``), as issue 33's
reviewer called it, instead of the patch's ``state_argnum=2``.

The batch ramp (issue 34): ``--stream`` feeds one stream of training windows, in order, through MaxText's own data
loader (``data_loader.load_next_batch(rampup_manager=...)``, as ``train_loop`` calls it), so MaxText's
``enable_rampup_batch_size`` slices it as it does (``--mode maxtext`` with its overrides). ``--ramp K`` (with
``--mode adascale``): ``per_device_batch_size`` is the fixed micro-batch, ``accumulation_steps=BatchRamp(1, K)``,
one call per global micro-batch, the loop stops on ``adascale_maxtext.done`` (the patched ``train_loop``'s
condition). ``--ramp-linear G``: MaxText's linear rule over ``G`` examples through ``BatchRamp(policy=...)``. The
held-out windows are then ``--eval-rows`` rows whatever the batch, and the record holds the compiles of the train
step (JAX's compile events and the jit's cache). ``--train-loop``: MaxText's own patched ``train.train_loop`` instead
of this loop, fed the same stream.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import sysconfig
import time
from pathlib import Path

os.environ.setdefault("DECOUPLE_GCLOUD", "TRUE")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
sys.path.insert(0, str(Path(__file__).resolve().parent))  # adascale_maxtext, imported by the patched train.py

import jax  # noqa: E402
import numpy as np  # noqa: E402

TINY = [
    "hardware=cpu",
    "skip_jax_distributed_system=true",
    "dataset_type=synthetic",
    "base_emb_dim=64",
    "base_num_query_heads=2",
    "base_num_kv_heads=2",
    "base_mlp_dim=128",
    "base_num_decoder_layers=2",
    "head_dim=32",
    "vocab_size=256",
    "max_target_length=64",
    "per_device_batch_size=2",
    "enable_checkpointing=false",
    "learning_rate=3e-3",
]


def corpus() -> np.ndarray:
    """This Python's standard library sources, as bytes (a fixed, offline text)."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:200]
    return np.frombuffer(b"".join(f.read_bytes() for f in files), dtype=np.uint8)


def make_batch(text: np.ndarray, rows: int, length: int, seed: int, unequal: bool, held_out: bool) -> dict:
    rng = np.random.default_rng(seed)
    split = int(0.9 * len(text))
    lo, hi = (split, len(text)) if held_out else (0, split)
    starts = rng.integers(lo, hi - length - 1, rows)
    tokens = np.stack([text[s : s + length + 1] for s in starts]).astype(np.int32)
    seg = np.ones((rows, length), np.int32)
    if unequal:  # real tokens then padding: weight 0 past a random length per row
        lengths = rng.integers(length // 8, length + 1, rows)
        seg = (np.arange(length)[None, :] < lengths[:, None]).astype(np.int32)
    pos = np.broadcast_to(np.arange(length, dtype=np.int32), (rows, length))
    return {
        "inputs": tokens[:, :-1] * seg,
        "inputs_position": pos,
        "inputs_segmentation": seg,
        "targets": tokens[:, 1:] * seg,
        "targets_position": pos,
        "targets_segmentation": seg,
    }


def as_batch(tokens: np.ndarray) -> dict:
    """MaxText's batch of whole windows (``length + 1`` tokens each, no padding)."""
    rows, length = tokens.shape[0], tokens.shape[1] - 1
    seg = np.ones((rows, length), np.int32)
    pos = np.broadcast_to(np.arange(length, dtype=np.int32), (rows, length))
    return {
        "inputs": tokens[:, :-1],
        "inputs_position": pos,
        "inputs_segmentation": seg,
        "targets": tokens[:, 1:],
        "targets_position": pos,
        "targets_segmentation": seg,
    }


class WindowStream:
    """MaxText's data iterator over one stream of training windows: batch ``b`` is windows ``[b·R, (b+1)·R)`` of a
    fixed permutation of the training split's non-overlapping windows (``R`` the rows MaxText loads per call), so
    every run reads the same windows in the same order, whatever its batch. ``drawn`` counts the rows handed out."""

    def __init__(self, text: np.ndarray, rows: int, length: int, seed: int = 0):
        split = int(0.9 * len(text))
        n = split // (length + 1)
        self.windows = text[: n * (length + 1)].reshape(n, length + 1).astype(np.int32)
        self.order = np.random.default_rng(seed).permutation(n)
        self.rows, self.drawn = rows, 0

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        idx = self.order[np.arange(self.drawn, self.drawn + self.rows) % len(self.order)]
        self.drawn += self.rows
        return as_batch(self.windows[idx])


def maxtext_linear_rule(k: int, samples: float, rows_per_call: int):
    """MaxText's ``enable_rampup_batch_size`` rule as a ``BatchRamp`` policy: ``1 + (K − 1)·min(rows seen / G, 1)``
    micro-batches, floored to the ladder ``1, …, K`` (MaxText adds one increment per ``G/(K − 1)`` rows)."""
    import jax.numpy as jnp

    return lambda i: 1 + (k - 1) * jnp.minimum(i.microbatches_seen * rows_per_call / samples, 1.0)


CHECKS: list[dict] = []


def checked(value_and_grad, closure: bool):
    """``optax_adascale.value_and_grad`` as the patched ``train_step`` calls it, recording at every step our gradient
    against MaxText's own (float32 runs): ``k = 1`` ``jax.value_and_grad`` of ``diff_wrapper`` on the global batch;
    ``k > 1`` MaxText's accumulation (``gradient_accumulation_loss_and_grad``: micro-batch ``j`` is rows ``j, j + k,
    …``, NNX's ``rest`` threaded from one micro-batch to the next, ``Σ_j ∇xent_sum_j / W``; with
    ``use_tunix_gradient_accumulation`` the mean of the micro-batches' mean-loss gradients), and the same sum over
    the drop-in's micro-batches (the ``j``-th contiguous block of every data shard's rows). Also whether the
    returned ``rest`` (RNG counters) is MaxText's after the step."""
    import jax.numpy as jnp

    def make(loss, argnums=0, **kw):
        own = getattr(loss, "__wrapped__", loss)  # MaxText's diff_wrapper (per_token's k / W undone)
        k = kw.get("num_microbatches", 1)

        def fn(curr, custom, rest, config, data):
            if closure:  # issue 33's reviewer: rest closed over, no state_argnum
                kw_ = {key: v for key, v in kw.items() if key != "state_argnum"}
                lam = lambda p, c, cfg, d: loss(p, c, rest, cfg, d)  # noqa: E731
                out = value_and_grad(lam, argnums=argnums, **kw_)(curr, custom, config, data)
            else:
                out = value_and_grad(loss, argnums=argnums, **kw)(curr, custom, rest, config, data)
            step = jax.value_and_grad(lambda p, r, d: own(p[0], p[1], r, config, d), has_aux=True)
            rows = data["inputs"].shape[0]
            mesh = jax.sharding.get_abstract_mesh()
            n = int(np.prod([mesh.shape[a] for a in kw["data_axes"]]))
            refs, rests = {}, {}
            split = {  # micro-batch j's rows, by reshapes (an Explicit mesh types them; a gather it refuses)
                "maxtext": lambda x, j: jnp.swapaxes(x.reshape((rows // k, k) + x.shape[1:]), 0, 1)[j],
                "blocks": lambda x, j: x.reshape((n, k, rows // (n * k), *x.shape[1:]))[:, j].reshape(-1, *x.shape[1:]),
            }
            for name in ("maxtext", "blocks") if k > 1 else ("maxtext",):
                total, r = None, rest
                for j in range(k):
                    part = jax.tree.map(lambda x, j=j, f=split[name]: f(x, j), data) if k > 1 else data
                    (_, (_, r)), g = step((curr, custom), r, part)
                    total = g if total is None else jax.tree.map(jnp.add, total, g)
                if k > 1:  # MaxText's divisor: W (its loss is xent_sum), or k (tunix: per-micro-batch means)
                    w = jnp.sum(data["targets_segmentation"] != 0).astype(jnp.float32)
                    w = k if getattr(config, "use_tunix_gradient_accumulation", False) else w
                    total = jax.tree.map(lambda x, w=w: x / w, total)
                refs[name], rests[name] = total, r
            norm = lambda t: jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(t)))  # noqa: E731
            diff = lambda a, b: norm(jax.tree.map(lambda x, y: x.astype(jnp.float32) - y.astype(jnp.float32), a, b))  # noqa: E731
            ints = lambda t: [x for x in jax.tree.leaves(t) if not jnp.issubdtype(x.dtype, jnp.floating)]  # noqa: E731
            new_rest = out[0][1][1]
            same_rest = jnp.all(
                jnp.stack(
                    [
                        jnp.all(jax.random.key_data(a) == jax.random.key_data(b))
                        if jnp.issubdtype(a.dtype, jax.dtypes.prng_key)
                        else jnp.all(a == b)
                        for a, b in zip(ints(new_rest), ints(rests["maxtext"]), strict=True)
                    ]
                )
            )
            errs = {name: diff(out[1], ref) / norm(ref) for name, ref in refs.items()}
            jax.debug.callback(
                lambda e, r, g: CHECKS.append(
                    {
                        "grad_rel_error": float(e["maxtext"]),
                        "grad_norm": float(g),
                        "rest_equal": bool(r),
                        **({"grad_rel_error_blocks": float(e["blocks"])} if "blocks" in e else {}),
                    }
                ),
                errs,
                same_rest,
                norm(refs["maxtext"]),
            )
            return out

        return fn

    return make


def model_creation_utils_from_config_with_lora() -> None:
    """MaxText 0.2.5's pre-training never adds LoRA adapters (its ``train_step`` trains ``nnx.LoRAParam`` when
    ``lora.enable_lora``; only its SFT trainer adds them, eagerly, with ``lora_utils.apply_lora_to_model``, which
    reads ``.sharding`` of concrete arrays and so fails inside the pre-training setup's ``jit``/``eval_shape``).
    This is that function without its eager resharding of the adapters (their ``sharding`` metadata, ``P()``,
    replicated, places them), applied to every model ``from_config`` builds."""
    import qwix
    from flax import nnx
    from maxtext.utils import lora_utils, model_creation_utils

    from_config = model_creation_utils.from_config

    def with_lora(config, devices=None, mesh=None, **kw):
        model = from_config(config, devices, mesh, **kw)
        decoder = getattr(model, "decoder", model)
        tokens, positions = lora_utils._prepare_dummy_inputs(mesh)  # noqa: SLF001
        model = qwix.apply_lora_to_model(
            model,
            lora_utils._build_lora_provider(config),
            decoder_input_tokens=tokens,  # noqa: SLF001
            decoder_positions=positions,
            rngs=getattr(decoder, "rngs", None),
        )
        for _, node in nnx.iter_graph(model):
            if hasattr(node, "__dict__") and "qwix_rngs" in node.__dict__:
                del node.qwix_rngs
            if isinstance(node, nnx.LoRAParam):
                node.set_metadata(sharding=jax.sharding.PartitionSpec(), out_sharding=None, sharding_names=None)
        return model

    model_creation_utils.from_config = with_lora


def run_train_loop(args, config, recorder) -> int:
    """MaxText's own ``train.train_loop``, patched, fed the window stream: the patched loop's stop on ``done``, the
    compiles of its train step (JAX's events: its ahead-of-time compile included), the run's end."""
    import adascale_maxtext
    from flax import nnx
    from flax.core.spmd import logical_axis_rules
    from maxtext.trainers.pre_train import train
    from maxtext.utils import train_utils

    import optax_adascale

    text, length = corpus(), config.max_target_length
    found: dict = {}
    fed: list[int] = []
    setup = train_utils.setup_train_loop

    def setup_with_stream(*a, **kw):
        out = setup(*a, **kw)
        loader = out[7]
        loader.data_iterator = found["stream"] = WindowStream(text, config.global_batch_size_to_load, length)
        load = loader.load_next_batch

        def load_and_count(*a, **kw):  # the rows each call of the train step gets (MaxText's ramp slices them)
            batch = load(*a, **kw)
            fed.append(int(batch["inputs"].shape[0]))
            return batch

        loader.load_next_batch = load_and_count
        found["graphdef"], _ = nnx.split(out[10])
        found["mesh"], found["sharding"] = out[4], out[7].input_data_shardings
        return out

    compiles: list[str] = []

    def on_event(event: str, duration: float, **kw) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(str(kw.get("fun_name", "")))

    train_utils.setup_train_loop = setup_with_stream
    jax.monitoring.register_event_duration_secs_listener(on_event)
    state = train.train_loop(config, recorder)
    jax.monitoring.unregister_event_duration_listener(on_event)
    mesh, graphdef = found["mesh"], found["graphdef"]

    @jax.jit
    def held_out_loss(state, batch):
        model = nnx.merge(graphdef, state).model
        aux = train.loss_fn(model, config, batch, None, None, is_train=False)[1]
        return aux["xent_sum"] / aux["total_weights"]

    rows = args.eval_rows or config.global_batch_size_to_load
    with jax.set_mesh(mesh), logical_axis_rules(config.logical_axis_rules):
        held_out = [
            jax.device_put(make_batch(text, rows, length, 10_000 + i, False, True), found["sharding"]) for i in range(4)
        ]
        loss = float(np.mean([float(held_out_loss(state, b)) for b in held_out]))
    calls = int(np.asarray(nnx.merge(graphdef, state).optimizer.step.get_value()))
    record = {
        "mode": args.mode,
        "train_loop": True,
        "overrides": args.overrides,
        "T": args.steps,
        "calls": calls,
        "rows_drawn": found["stream"].drawn,
        "examples": sum(fed[:calls]),
        "eval": {"end": loss},
        "train_step_compiles": sum("train_step" in c for c in compiles),
        "compile_names": compiles,
    }
    if args.mode == "adascale":
        m = optax_adascale.metrics(state)
        record.update(
            updates=int(optax_adascale.get_adascale_state(state).count),
            tau_end=float(m["scale_invariant_steps"]),
            scale_end=float(m["scale"]),
            microbatches_seen=int(m.get("microbatches_seen", calls)),  # no ramp: one micro-batch set per call
        )
        adascale_maxtext.ON = False  # the helper's state ends with the run
    else:
        record["updates"] = calls  # MaxText: one update per call
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record))
    print(
        f"train_loop ({args.mode}): {calls} calls, held-out loss {loss:.3f}, "
        f"train-step compiles {record['train_step_compiles']}"
    )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("maxtext", "adascale"), required=True)
    parser.add_argument("--steps", type=int, required=True, help="T: MaxText's steps (AdaScale: until τ ≥ T)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--check", action="store_true", help="our gradient against MaxText's own, every step")
    parser.add_argument("--unequal", action="store_true", help="padded rows: unequal real tokens per shard")
    parser.add_argument("--eval-at", type=int, default=None, help="also the held-out loss at this iteration")
    parser.add_argument("--prng", default=None, help="jax_default_prng_impl (MaxText: unsafe_rbg)")
    parser.add_argument("--lora", action="store_true", help="MaxText's LoRA adapters (lora.* overrides) applied")
    parser.add_argument("--closure", action="store_true", help="the drop-in on a lambda closing over rest")
    parser.add_argument("--stream", action="store_true", help="one window stream through MaxText's data loader")
    parser.add_argument("--ramp", type=int, default=None, help="AdaScale: BatchRamp(1, K) across calls (K)")
    parser.add_argument("--ramp-linear", type=float, default=None, help="the ramp: MaxText's rule over G examples")
    parser.add_argument("--eval-rows", type=int, default=None, help="held-out rows per batch (default: the batch's)")
    parser.add_argument("--train-loop", action="store_true", help="MaxText's own (patched) train_loop, --stream fed")
    parser.add_argument(
        "--synthetic-rows",
        type=int,
        default=None,
        help="MaxText's synthetic batch of N rows (dataset_type=synthetic: one fixed batch of random tokens), fed "
        "in turn as the run's batches of its own rows; the loss is then read on those N rows",
    )
    parser.add_argument("--clock", default=None, help="adascale_adamw's clock: tau or update (default: the library's)")
    parser.add_argument("overrides", nargs="*", help="MaxText key=value overrides")
    args = parser.parse_args()

    import adascale_maxtext
    import maxtext
    from flax import nnx
    from flax.core.spmd import logical_axis_rules
    from maxtext.trainers.pre_train import train
    from maxtext.utils import sharding, train_utils

    import optax_adascale

    if args.lora:  # LoRA adapters as MaxText's SFT trainer adds them (lora_utils.apply_lora_to_model, qwix)
        model_creation_utils_from_config_with_lora()
    base = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
    argv = [sys.argv[0], base, "run_name=trial", f"base_output_directory={args.out.parent / 'maxtext_out'}"]
    config, recorder = train.initialize(argv + TINY + [f"steps={args.steps}"] + args.overrides)
    if args.mode == "adascale":
        ramp = None
        if args.ramp is not None:  # the batch follows the noise (or MaxText's linear rule) through one compiled step
            ramp = optax_adascale.BatchRamp(1, args.ramp)
            if args.ramp_linear is not None:
                policy = maxtext_linear_rule(args.ramp, args.ramp_linear, config.global_batch_size_to_train_on)
                ramp = optax_adascale.BatchRamp(
                    1, args.ramp, ladder=tuple(range(1, args.ramp + 1)), patience=1, policy=policy
                )
        adascale_maxtext.CLOCK = args.clock
        adascale_maxtext.use_adascale(ramp)
        if args.check or args.closure:
            optax_adascale.value_and_grad = checked(optax_adascale.value_and_grad, args.closure)
    if args.prng:
        jax.config.update("jax_default_prng_impl", args.prng)  # after train.initialize, which sets unsafe_rbg
    if args.train_loop:
        return run_train_loop(args, config, recorder)
    (_, _, state_mesh_shardings, _, mesh, _, _, data_loader, rampup_manager, _, state) = train_utils.setup_train_loop(
        config, recorder
    )
    graphdef, state = nnx.split(state)
    params_shardings, state_mesh_shardings = sharding.maybe_update_params_sharding_with_opt(
        config, state_mesh_shardings
    )
    p_train_step, _ = train_utils.jit_train_and_eval_step(
        config, graphdef, mesh, state, state_mesh_shardings, train.train_step, train.eval_step, None, params_shardings
    )

    @jax.jit
    def held_out_loss(state, batch):  # nats per real token (the loss is xent_sum alone with accumulation)
        model = nnx.merge(graphdef, state).model
        aux = train.loss_fn(model, config, batch, None, None, is_train=False)[1]
        return aux["xent_sum"] / aux["total_weights"]

    text = corpus()
    rows, length = config.global_batch_size_to_load, config.max_target_length
    put = lambda b: jax.device_put(b, data_loader.input_data_shardings)  # noqa: E731
    eval_rows = args.eval_rows or rows  # the ramps: the same held-out windows whatever the batch
    held_out = [put(make_batch(text, eval_rows, length, 10_000 + i, args.unequal, True)) for i in range(4)]
    stream = None
    if args.synthetic_rows:  # MaxText's SyntheticDataIterator's tokens (its key, its shape at N rows), cycled
        import jax.numpy as jnp

        shape = (args.synthetic_rows, length + 1)
        tokens = np.asarray(jax.random.randint(jax.random.PRNGKey(0), shape, 0, config.vocab_size, jnp.int32))
        held_out = [put(as_batch(tokens[i : i + rows])) for i in range(0, args.synthetic_rows, rows)]  # all N rows
        stream = WindowStream(text, rows, length)
        stream.windows, stream.order = tokens, np.arange(args.synthetic_rows)
    elif args.stream:  # MaxText's loader reads the stream: one global (micro-)batch per call, sliced by its own ramp
        stream = data_loader.data_iterator = WindowStream(text, rows, length)
    record = {
        "mode": args.mode,
        "overrides": args.overrides,
        "unequal": args.unequal,
        "T": args.steps,
        "mesh": dict(mesh.shape),
        "axis_types": [str(t) for t in mesh.axis_types],
        "iterations": 0,
        "loss": [],
        "lm_loss": [],
        "gain": [],
        "grad_sqr": [],
        "grad_var": [],
        "tau": [],
        "step_s": [],
        "eval": {},
        "rows": [],
        "updates_log": [],
    }
    compiles, in_step = [], [False]  # the train step's XLA compilations, from JAX's compile events

    def on_event(event: str, duration: float, **kw) -> None:
        if event == "/jax/core/compile/backend_compile_duration" and in_step[0]:
            compiles.append(str(kw.get("fun_name", "")))

    jax.monitoring.register_event_duration_secs_listener(on_event)

    def evaluate(state) -> float:
        with jax.set_mesh(mesh), logical_axis_rules(config.logical_axis_rules):
            return float(np.mean([float(held_out_loss(state, b)) for b in held_out]))

    it = 0
    while it < args.steps and not adascale_maxtext.done(state, config):  # the patched train_loop's condition
        if args.eval_at is not None and it == args.eval_at:
            record["eval"][f"it={it}"] = evaluate(state)
        if args.synthetic_rows:
            host_batch = next(stream)
            batch = put(host_batch)
        elif stream is not None:
            batch = data_loader.load_next_batch(rampup_manager=rampup_manager)  # train_loop's own line
            host_batch = {"targets_segmentation": np.asarray(batch["targets_segmentation"])}
        else:
            host_batch = make_batch(text, rows, length, it, args.unequal, False)
            batch = put(host_batch)
        record["rows"].append(int(batch["inputs"].shape[0]))
        t0 = time.perf_counter()
        in_step[0] = True
        with jax.set_mesh(mesh), logical_axis_rules(config.logical_axis_rules):
            state, metrics = p_train_step(state, batch)
        jax.block_until_ready(state)
        in_step[0] = False
        record["step_s"].append(time.perf_counter() - t0)
        record["loss"].append(float(metrics["scalar"]["learning/loss"]))
        record["lm_loss"].append(float(metrics["scalar"]["learning/lm_loss"]))
        if args.mode == "adascale":
            m = optax_adascale.metrics(state)
            record["gain"].append(float(m["gain"]))
            record["grad_sqr"].append(float(m["grad_sqr"]))
            record["grad_var"].append(float(m["grad_var"]))
            record["tau"].append(float(m["scale_invariant_steps"]))
            if args.ramp is not None:
                seen = int(optax_adascale.batch_plan(state)["microbatches_seen"])
                assert seen == it + 1, f"the loader fed {it + 1} micro-batches, the optimizer saw {seen}"
                if int(optax_adascale.get_adascale_state(state).micro_step) == 0:  # this call applied an update
                    keys = ("scale_invariant_steps", "scale", "gain", "noise_scale", "learning_rate")
                    record["updates_log"].append([it + 1, *(float(m[k]) for k in keys)])
        it += 1
    jax.monitoring.unregister_event_duration_listener(on_event)
    record["iterations"] = it
    record["examples"] = int(sum(record["rows"]))
    record["rows_drawn"] = stream.drawn if stream is not None else record["examples"]
    record["train_step_compiles"] = len(compiles)
    record["train_step_cache_size"] = p_train_step._cache_size()  # noqa: SLF001 - the jit's compiled programs
    if args.mode == "adascale":
        s = optax_adascale.get_adascale_state(state)
        record["updates"] = int(s.count)
        m = optax_adascale.metrics(state)
        record["scale_end"], record["next_scale"] = float(m["scale"]), float(m.get("next_scale", m["scale"]))
        record["tau_end"] = float(m["scale_invariant_steps"])
        if s.acc_grads is not None:  # where MaxText's state shardings put the accumulated gradients: like the params?
            value = lambda x: getattr(x, "value", x)  # noqa: E731
            acc = [value(x).sharding.spec for x in jax.tree.leaves(s.acc_grads)]
            params = [
                value(x).sharding.spec for x in jax.tree.leaves(nnx.state(nnx.merge(graphdef, state).model, nnx.Param))
            ]
            record["acc_grads_like_params"] = acc == params
            record["acc_grads_specs"] = sorted({str(a) for a in acc})
            record["ramp_scalar_specs"] = sorted({str(value(x).sharding.spec) for x in jax.tree.leaves(s.ramp)})
    else:
        record["updates"] = it
        record["scale_end"] = record["next_scale"] = float(record["rows"][-1])
    record["eval"]["end"] = evaluate(state)
    record["checks"] = CHECKS
    record["total_weights_logged"] = float(metrics["scalar"]["learning/total_weights"])
    record["total_weights_true"] = float(np.sum(host_batch["targets_segmentation"]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record))
    print(
        f"{args.mode}: {it} iterations, held-out loss {record['eval']['end']:.3f}"
        + (f", final gain {record['gain'][-1]:.2f}, τ {record['tau'][-1]:.0f}" if record["gain"] else "")
        + (f", step-1 gradient error {record['checks'][0]['grad_rel_error']:.1e}" if record["checks"] else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

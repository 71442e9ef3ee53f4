"""The accelerator suite: what AdaScale costs per step on one GPU, against SGD run side by side.

Six cases, each a function; one JSON file with every result (``--out``) and a "gpu" section of
``benchmarks/gpu/README.md`` made from it (``--report``):

  update    update only: flat f32 parameters (67M and 268M, leaves of 4096 x 4096), momentum 0.9,
            donated buffers, a fixed gradient with precomputed ``MicrobatchStats(k=8)`` (no axis).
            sgd       optax.sgd(lr, momentum=0.9) (the baseline: ratio 1)
            floor     sgd + the ‖ḡ‖² reduction in the same program, its result returned
            adascale  adascale_sgd(lr, momentum=0.9), exact (current-step) gain
            delayed   adascale_sgd(lr, momentum=0.9, delayed_gain=True)
            copy      a jitted ``x * s`` (s = 1.0 at run time) in place over donated arrays of the same
                      leaves: the copy bandwidth
            Bandwidth model: SGD moves 5 words per parameter (read g, read m, write m, read p,
            write p); every update variant is charged those 5 words, so an extra pass shows as a
            lower achieved bandwidth. The copy moves 2 words per element (read, write).
  lm        a GPT-like decoder (plain JAX, bf16 compute, f32 master weights; d_model 768, 12 layers,
            12 heads, seq 512, vocab 32000 by default); one step = 8 micro-batches of 16 x 512
            tokens, ``value_and_grad(loss, num_microbatches=8)`` + ``tx.update(..., microbatch_stats=)``.
            sgd (the same lax.scan accumulation without the norms, SGD update), adascale, delayed.
  lm_vmap   the same LM and global tokens with 8 replicas as a ``jax.vmap(axis_name="data")`` axis
            on one device (16 x 512 tokens each, one gradient per replica, layers rematerialised):
            sgd (+ pmean), floor (the local squared norm rides in the pmean), adascale.
  cnn       a ResNet-18-like CNN (plain JAX, bf16 convolutions, batch-statistics normalisation),
            CIFAR-shaped random inputs, batch 256 in 8 micro-batches: sgd, adascale, delayed.
  peer      FairScale 0.4.13 ``AdaScale(torch.optim.SGD(...), num_gradients_to_accumulate=8)``
            against torch SGD with 8-step gradient accumulation, on the LM shape in torch (CUDA when
            available), alternating in one process; skipped when torch/fairscale do not import.
  profile   the AdaScale update inside the compiled LM step (its entry computation without the
            micro-batch loop, where the forward and backward passes run): fusions by bytes (result
            plus operand sizes read off the HLO text), tagged with the package's scopes
            (adascale/reduce, statistics, learning_rate, inner, scale_updates, state), against the same
            for the SGD step. With ``--profile DIR`` the lm case also writes a ``jax.profiler`` trace
            of three adascale steps; its kernels carry the fusion names of this table.

Method: each variant is compiled once and warmed up (block_until_ready); a block runs ``steps``
steps and blocks until done (``steps`` is chosen once per case so that a baseline block lasts about
``--block-s``); one round times every variant once, in order (A B C A B C ...); a block's ratio is
its time over the baseline block of the same round. We report the median ratio with its min-max
over ``--rounds`` rounds; absolute milliseconds are recorded too, the ratios are the headline.
The torch peer runs first, before JAX initialises the GPU, so that JAX's preallocation leaves it
room; its memory is released before the JAX cases start.

    python -m benchmarks.gpu --out benchmarks/gpu/gpu_h200.json      # the suite (2 min on an H200 without the peer)
    python -m benchmarks.gpu --smoke --out /tmp/gpu_smoke.json   # tiny shapes on a CPU: about a minute
    python -m benchmarks.gpu --smoke --no-peer --variants adascale --rounds 2   # the test's subset
    python -m benchmarks.gpu --profile /tmp/trace --cases lm profile   # + a jax.profiler trace
    python -m benchmarks.gpu --report benchmarks/gpu/gpu_h200.json         # -> README.md "gpu" section

Files: ``gpu.py`` (this: timing, the cases, the command line), ``models.py`` (the LM and the CNN in JAX,
the LM in torch), ``results.py`` (the README section from the JSON file).

torch and fairscale are optional (not package dependencies): ``pip install torch`` and then
``pip install --no-build-isolation fairscale==0.4.13`` (its sdist needs the installed torch).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import statistics
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from benchmarks.gpu.models import TorchGPT, cnn_init, lm_init, make_cnn_loss, make_lm_loss
from benchmarks.gpu.results import _p, write_report
from benchmarks.harness import report
from benchmarks.harness.timing import fmt_ratio as _r  # "median (min–max)"
from benchmarks.harness.timing import ratios

CASES = ("update", "lm", "lm_vmap", "cnn", "peer", "profile")
AXIS = "data"
SHARED: dict = {}  # compiled HLO texts handed from the lm case to the profile case
K_MICRO = 8
LR = 1e-3
MOMENTUM = 0.9

# Model sizes: the real suite, and the --smoke shapes (seconds on 2 CPU cores).
LM_FULL = dict(d_model=768, layers=12, heads=12, vocab=32000, seq=512, micro_batch=16)
LM_SMOKE = dict(d_model=64, layers=2, heads=4, vocab=256, seq=32, micro_batch=4)
CNN_FULL = dict(widths=(64, 128, 256, 512), blocks=2, image=32, batch=256, classes=10)
CNN_SMOKE = dict(widths=(8, 16), blocks=1, image=16, batch=32, classes=10)
UPDATE_FULL = dict(params=(2**26, 2**28), leaf=(4096, 4096))  # 67.1M, 268.4M
UPDATE_SMOKE = dict(params=(2**16, 2**18), leaf=(128, 128))
BYTES_MODEL = {
    "sgd_words_per_param": 5,
    "sgd_words": "read g, read m, write m, read p, write p",
    "copy_words_per_element": 2,
    "copy_words": "read x, write x * 1.0 (in place, donated; 1.0 given at run time)",
    "word_bytes": 4,
    "note": "every update variant is charged SGD's 5 words/param: extra passes show as lower achieved bandwidth",
}


# --------------------------------------------------------------------------- timing


def time_alternating(
    runners: dict[str, Callable[[int], None]], base: str, rounds: int, block_s: float, max_steps: int = 256
) -> dict:
    """Alternating blocks A B C A B C ...: median ratio to ``base`` per round, min-max, absolute ms.

    ``runners[name](steps)`` runs ``steps`` steps of one variant and blocks until they are done.
    Every runner must already be compiled and warmed up.
    """
    t0 = time.perf_counter()
    runners[base](1)
    one = time.perf_counter() - t0
    steps = int(min(max_steps, max(1, math.ceil(block_s / max(one, 1e-9)))))
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(rounds):
        for name, run in runners.items():
            t0 = time.perf_counter()
            run(steps)
            times[name].append((time.perf_counter() - t0) / steps)
    return {
        "baseline": base,
        "rounds": rounds,
        "steps_per_block": steps,
        "ratios": ratios(times, base),
        "median_ms": {name: 1e3 * statistics.median(t) for name, t in times.items()},
        "min_ms": {name: 1e3 * min(t) for name, t in times.items()},
    }


def jax_runner(jax, exe, carry: tuple, consts: tuple) -> Callable[[int], None]:
    """``exe(*carry, *consts) -> (*carry, aux)``; the carry (donated buffers) flows from call to call."""
    box = [tuple(carry)]

    def run(steps: int) -> None:
        c, out = box[0], None
        for _ in range(steps):
            out = exe(*c, *consts)
            c = tuple(out[: len(c)])
        jax.block_until_ready(out)
        box[0] = c

    return run


def select(args, variants: dict, base: str) -> dict:
    """The variants ``--variants`` asks for; the baseline (and the copy) always."""
    keep = args.variants
    return {k: v for k, v in variants.items() if keep is None or k in (base, "copy") or k in keep}


def compile_variants(jax, fns: dict, carry: dict, consts: tuple, donate: tuple[int, ...], warmup: int = 2):
    """Compile each variant once, warm it up; return runners, compile seconds and the executables.

    On a CPU the variants are compiled concurrently (XLA compiles outside the GIL; the seconds
    recorded are then each compilation's wall time beside the others). On an accelerator they are
    compiled in turn: XLA's GEMM autotuning runs on the device, its results are cached in the
    process, so the variants get the same kernels for the same model instead of racing to measure.
    """
    lowered = {name: jax.jit(fn, donate_argnums=donate).lower(*carry[name], *consts) for name, fn in fns.items()}

    def timed(lo):
        t0 = time.perf_counter()
        exe = lo.compile()
        return exe, time.perf_counter() - t0

    workers = max(1, min(len(lowered), os.cpu_count() or 1)) if jax.default_backend() == "cpu" else 1
    with ThreadPoolExecutor(max_workers=workers) as pool:
        done = {name: pool.submit(timed, lo) for name, lo in lowered.items()}
        compiled = {name: f.result() for name, f in done.items()}
    runners, compile_s, exes = {}, {}, {}
    for name, (exe, seconds) in compiled.items():
        compile_s[name], exes[name] = seconds, exe
        run = jax_runner(jax, exe, carry[name], consts)
        run(warmup)
        runners[name] = run
    return runners, compile_s, exes


# --------------------------------------------------------------------------- case 1: update only


def case_update(jax, args) -> dict:
    import jax.numpy as jnp
    import optax

    import optax_adascale

    sizes = UPDATE_SMOKE if args.smoke else UPDATE_FULL
    rows = []
    for target in sizes["params"]:
        leaf = sizes["leaf"]
        n_leaves = max(1, round(target / (leaf[0] * leaf[1])))
        rows.append(_update_row(jax, jnp, optax, optax_adascale, args, leaf, n_leaves))
    return {"bytes_model": BYTES_MODEL, "rows": rows}


def _update_row(jax, jnp, optax, optax_adascale, args, leaf, n_leaves) -> dict:
    n_params = n_leaves * leaf[0] * leaf[1]
    keys = jax.random.split(jax.random.key(0), n_leaves)
    # Built on the device: no host copy of a gigabyte of random numbers.
    make = jax.jit(lambda k: jax.random.normal(k, leaf, jnp.float32) * 1e-3)
    grads = [make(k) for k in keys]
    # a = mean micro-batch ‖g_j‖² (per leaf) > ‖ḡ‖²: a realistic variance, no floor.
    sq_norms = [jnp.sum(g * g) * 3.0 for g in grads]
    sgd = optax.sgd(LR, momentum=MOMENTUM)
    txs = select(
        args,
        {
            "sgd": sgd,
            "floor": sgd,
            "adascale": optax_adascale.adascale_sgd(LR, momentum=MOMENTUM),
            "delayed": optax_adascale.adascale_sgd(LR, momentum=MOMENTUM, delayed_gain=True),
            "update_clock": optax_adascale.adascale_sgd(LR, momentum=MOMENTUM, clock="update"),
        },
        "sgd",
    )

    def make_step(name, tx):
        def step(params, state, g, sq):
            aux = jnp.zeros([], jnp.float32)
            if name in ("adascale", "delayed"):
                stats = optax_adascale.MicrobatchStats(sq, K_MICRO)
                updates, state = tx.update(g, state, params, microbatch_stats=stats)
            else:
                updates, state = tx.update(g, state, params)
                if name == "floor":
                    aux = sum(jnp.sum(x * x) for x in g)
            return optax.apply_updates(params, updates), state, aux

        return step

    fns = {name: make_step(name, tx) for name, tx in txs.items()}
    carry = {}
    for name, tx in txs.items():
        params = [jnp.ones(leaf, jnp.float32) for _ in range(n_leaves)]  # a fresh buffer per variant (donated)
        carry[name] = (params, tx.init(params))
    runners, compile_s, _ = compile_variants(jax, fns, carry, (grads, sq_norms), donate=(0, 1))

    # The copy: x * s in place (donated, as the updates are), s = 1.0 given at run time so that XLA
    # cannot fold the multiply away; read x, write x: 2 words per element.
    copy_fn = lambda xs, scale: ([x * scale for x in xs], jnp.zeros([], jnp.float32))  # noqa: E731
    copy_src = [jnp.copy(g) for g in grads]
    copy_exe = jax.jit(copy_fn, donate_argnums=0).lower(copy_src, jnp.float32(1.0)).compile()
    run_copy = jax_runner(jax, copy_exe, (copy_src,), (jnp.float32(1.0),))
    run_copy(2)
    runners["copy"] = run_copy
    timing = time_alternating(runners, "sgd", args.rounds, args.block_s)
    word = BYTES_MODEL["word_bytes"]
    sgd_bytes = BYTES_MODEL["sgd_words_per_param"] * word * n_params
    copy_bytes = BYTES_MODEL["copy_words_per_element"] * word * n_params
    gbps = {name: sgd_bytes / (ms * 1e-3) / 1e9 for name, ms in timing["median_ms"].items() if name != "copy"}
    gbps["copy"] = copy_bytes / (timing["median_ms"]["copy"] * 1e-3) / 1e9
    return {
        "params": n_params,
        "leaves": n_leaves,
        "leaf_shape": list(leaf),
        "num_microbatches": K_MICRO,
        **timing,
        "bytes_per_update": sgd_bytes,
        "copy_bytes": copy_bytes,
        "achieved_GBps": gbps,
        "fraction_of_copy_bandwidth": {name: v / gbps["copy"] for name, v in gbps.items()},
        "compile_s": compile_s,
    }


# --------------------------------------------------------------------------- case 2: the LM


def _count(jax, tree) -> int:
    return int(sum(x.size for x in jax.tree.leaves(tree)))


def _scan_mean_grad(jax, jnp, loss_fn, k: int, unroll):
    """The SGD baseline's accumulation: the same ``lax.scan`` over ``k`` micro-batches, no norms."""
    grad_fn = jax.value_and_grad(loss_fn)

    def fn(params, *batch):
        micro = [x.reshape((k, x.shape[0] // k) + x.shape[1:]) for x in batch]

        def body(acc, mb):
            value, g = grad_fn(params, *mb)
            return jax.tree.map(lambda a, b: a + b, acc, g), value

        acc, values = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, params), micro, unroll=unroll)
        return jnp.mean(values), jax.tree.map(lambda a: a / k, acc)

    return fn


def microbatch_steps(jax, loss_fn, unroll, names) -> tuple[dict, dict]:
    """Step functions ``(params, state, *batch) -> (params, state, loss)`` of sgd / adascale / delayed."""
    import optax

    import optax_adascale

    all_txs = {
        "sgd": optax.sgd(LR, momentum=MOMENTUM),
        "adascale": optax_adascale.adascale_sgd(LR, momentum=MOMENTUM),
        "delayed": optax_adascale.adascale_sgd(LR, momentum=MOMENTUM, delayed_gain=True),
    }
    txs = {name: tx for name, tx in all_txs.items() if name in names}
    sgd_grad = _scan_mean_grad(jax, jax.numpy, loss_fn, K_MICRO, unroll)
    micro_grad = optax_adascale.value_and_grad(loss_fn, num_microbatches=K_MICRO, unroll=unroll)

    def make_step(name, tx):
        def step(params, state, *xs):
            if name == "sgd":
                loss, grads = sgd_grad(params, *xs)
                updates, state = tx.update(grads, state, params)
            else:
                loss, grads, stats = micro_grad(params, *xs)
                updates, state = tx.update(grads, state, params, microbatch_stats=stats)
            return optax.apply_updates(params, updates), state, loss

        return step

    return {name: make_step(name, tx) for name, tx in txs.items()}, txs


def microbatch_case(jax, args, loss_fn, params0, batch: tuple, unroll, meta: dict) -> dict:
    """sgd / adascale / delayed on ``k`` micro-batches in one step; shared by the LM and the CNN."""
    names = select(args, dict.fromkeys(("sgd", "adascale", "delayed")), "sgd")
    fns, txs = microbatch_steps(jax, loss_fn, unroll, names)
    carry = {name: (jax.tree.map(jax.numpy.copy, params0), tx.init(params0)) for name, tx in txs.items()}
    runners, compile_s, exes = compile_variants(jax, fns, carry, batch, donate=(0, 1))
    timing = time_alternating(runners, "sgd", args.rounds, args.block_s)
    return {
        **meta,
        "params": _count(jax, params0),
        "num_microbatches": K_MICRO,
        **timing,
        "compile_s": compile_s,
        "_exes": exes,
        "_txs": txs,
    }


def case_lm(jax, args) -> dict:
    import jax.numpy as jnp

    cfg = _lm_cfg(args)
    params0 = lm_init(jax, jnp, cfg)
    B = K_MICRO * cfg["micro_batch"]
    tokens = jax.random.randint(jax.random.key(1), (B, cfg["seq"] + 1), 0, cfg["vocab"])
    batch = (tokens[:, :-1], tokens[:, 1:])
    loss_fn = make_lm_loss(jax, jnp, cfg, remat=False)
    meta = {"config": cfg, "tokens_per_step": B * cfg["seq"], "compute_dtype": "bfloat16", "master_dtype": "float32"}
    meta["leaves"] = len(jax.tree.leaves(params0))
    row = microbatch_case(jax, args, loss_fn, params0, batch, unroll=1, meta=meta)
    exes, txs = row.pop("_exes"), row.pop("_txs")
    SHARED["lm_hlo"] = {name: exe.as_text() for name, exe in exes.items()}  # the profile case reads these
    if args.profile and "adascale" in exes:
        carry = (jax.tree.map(jnp.copy, params0), txs["adascale"].init(params0))
        try:
            row["trace_dir"] = str(trace_steps(jax, exes["adascale"], carry, batch, args.profile))
        except Exception as err:  # noqa: BLE001 - a profiler that fails (no CUPTI) must not lose the timings
            traceback.print_exc()
            row["trace_error"] = f"{type(err).__name__}: {err}"
    return row


def trace_steps(jax, exe, carry, consts, out_dir: Path, steps: int = 3) -> Path:
    """A ``jax.profiler`` trace of ``steps`` warm steps of the compiled ``exe`` (the timed program)."""
    params, state = carry
    params, state, loss = exe(params, state, *consts)
    jax.block_until_ready(loss)
    out_dir.mkdir(parents=True, exist_ok=True)
    with jax.profiler.trace(str(out_dir)):
        for _ in range(steps):
            params, state, loss = exe(params, state, *consts)
        jax.block_until_ready((params, state, loss))
    return out_dir


def case_lm_vmap(jax, args) -> dict:
    import jax.numpy as jnp
    import optax

    import optax_adascale

    cfg = _lm_cfg(args)
    R = K_MICRO  # replicas; the global tokens equal the micro-batch case's
    params0 = lm_init(jax, jnp, cfg)
    per_replica = cfg["micro_batch"]
    tokens = jax.random.randint(jax.random.key(1), (R, per_replica, cfg["seq"] + 1), 0, cfg["vocab"])
    batch = (tokens[..., :-1], tokens[..., 1:])
    loss_fn = make_lm_loss(jax, jnp, cfg, remat=True)
    sgd = optax.sgd(LR, momentum=MOMENTUM)
    txs = select(
        args,
        {
            "sgd": sgd,
            "floor": sgd,
            "adascale": optax_adascale.adascale_sgd(LR, momentum=MOMENTUM, axis_name=AXIS),
        },
        "sgd",
    )

    def make_step(name, tx):
        def replica(params, state, x, y):
            loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
            aux = jnp.zeros([], jnp.float32)
            if name == "sgd":
                grads = jax.lax.pmean(grads, AXIS)
            elif name == "floor":
                sq = sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads))
                grads, aux = jax.lax.pmean((grads, sq), AXIS)
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state, jax.lax.pmean(loss, AXIS) + aux

        return jax.vmap(replica, in_axes=(None, None, 0, 0), out_axes=(None, None, None), axis_name=AXIS)

    fns = {name: make_step(name, tx) for name, tx in txs.items()}
    carry = {name: (jax.tree.map(jnp.copy, params0), tx.init(params0)) for name, tx in txs.items()}
    runners, compile_s, _ = compile_variants(jax, fns, carry, batch, donate=(0, 1))
    timing = time_alternating(runners, "sgd", args.rounds, args.block_s)
    return {
        "config": cfg,
        "replicas": R,
        "per_replica_batch": per_replica,
        "tokens_per_step": R * per_replica * cfg["seq"],
        "remat": "per layer (jax.checkpoint)",
        "params": _count(jax, params0),
        **timing,
        "compile_s": compile_s,
    }


def _lm_cfg(args) -> dict:
    cfg = dict(LM_SMOKE if args.smoke else LM_FULL)
    if args.vocab:
        cfg["vocab"] = args.vocab
    return cfg


# --------------------------------------------------------------------------- case 3: the CNN


def case_cnn(jax, args) -> dict:
    import jax.numpy as jnp

    cfg = dict(CNN_SMOKE if args.smoke else CNN_FULL)
    params0 = cnn_init(jax, jnp, cfg)
    kx, ky = jax.random.split(jax.random.key(2))
    x = jax.random.normal(kx, (cfg["batch"], cfg["image"], cfg["image"], 3), jnp.float32)
    y = jax.random.randint(ky, (cfg["batch"],), 0, cfg["classes"])
    meta = {
        "config": {**cfg, "widths": list(cfg["widths"])},
        "micro_batch": cfg["batch"] // K_MICRO,
        "compute_dtype": "bfloat16",
    }
    row = microbatch_case(jax, args, make_cnn_loss(jax, jnp), params0, (x, y), unroll=1, meta=meta)
    row.pop("_exes"), row.pop("_txs")
    return row


# --------------------------------------------------------------------------- case 4: the FairScale peer


def case_peer(args) -> dict:
    """FairScale AdaScale(SGD) vs torch SGD, both with 8-step gradient accumulation, alternating blocks."""
    try:
        import fairscale
        import torch
        from fairscale.optim import AdaScale
    except Exception as err:  # noqa: BLE001 - any import failure means: no peer here
        return {"skipped": "torch/fairscale not installed", "import_error": f"{type(err).__name__}: {err}"}

    cfg = _lm_cfg(args)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        # Intra-op threads spin-wait: on a shared 2-core host 2 threads ran this 60x slower than 1.
        torch.set_num_threads(args.torch_threads)
    torch.manual_seed(0)
    models = {name: TorchGPT(torch, cfg).to(device) for name in ("sgd", "adascale")}
    models["adascale"].load_state_dict(models["sgd"].state_dict())
    optims = {
        "sgd": torch.optim.SGD(models["sgd"].parameters(), lr=LR, momentum=MOMENTUM),
        "adascale": AdaScale(
            torch.optim.SGD(models["adascale"].parameters(), lr=LR, momentum=MOMENTUM),
            num_gradients_to_accumulate=K_MICRO,
        ),
    }
    mb = cfg["micro_batch"]
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg["vocab"], (K_MICRO * mb, cfg["seq"] + 1), generator=g).to(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def make_run(name):
        model, opt = models[name], optims[name]

        def run(steps: int) -> None:
            for _ in range(steps):
                for j in range(K_MICRO):  # the loss scaled by 1/k: FairScale's default is_scaled_loss=True
                    x, y = tokens[j * mb : (j + 1) * mb, :-1], tokens[j * mb : (j + 1) * mb, 1:]
                    with torch.autocast(device.type, dtype=torch.bfloat16):
                        logits = model(x)
                    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
                    (loss / K_MICRO).backward()
                opt.step()
                opt.zero_grad()  # set_to_none (the default) for both: FairScale passes no argument
            sync()

        return run

    runners = {name: make_run(name) for name in models}
    for run in runners.values():
        run(2)
    timing = time_alternating(runners, "sgd", args.rounds, args.block_s)
    out = {
        "torch": torch.__version__,
        "fairscale": fairscale.__version__,
        "device": (
            torch.cuda.get_device_name()
            if device.type == "cuda"
            else f"cpu, {torch.get_num_threads()} intra-op thread(s)"
        ),
        "config": cfg,
        "params": sum(p.numel() for p in models["sgd"].parameters()),
        "tokens_per_step": K_MICRO * mb * cfg["seq"],
        "gain_after": float(optims["adascale"].gain()),
        **timing,
    }
    runners.clear(), models.clear(), optims.clear()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()  # leave the GPU to JAX
    return out


# --------------------------------------------------------------------------- case 5: HLO top costs


SCOPES = (
    "adascale/reduce",
    "adascale/statistics",
    "adascale/learning_rate",
    "adascale/inner",
    "adascale/scale_updates",
    "adascale/state",
)


def hlo_costs(text: str, skip: tuple[str, ...] = ()) -> list[dict]:
    """``_hlo.instruction_bytes`` of the entry computation, each tagged with the package scope it runs in."""
    from benchmarks import hlo as _hlo

    rows = []
    for r in _hlo.instruction_bytes(text, skip):
        scope = next((s for s in SCOPES if s in r["op_name"]), "")
        path = r.pop("op_name")
        rows.append(
            {
                **r,
                "result": _short_type(r["result"]),
                "scope": scope or (f"other: {_short_path(path)}" if path else "other (no op_name)"),
            }
        )
    return rows


def _short_type(t: str) -> str:
    from benchmarks import hlo as _hlo

    arrays = [f"{dt}[{','.join(map(str, dims))}]" for dt, dims in _hlo.arrays(t)]
    return (
        arrays[0]
        if len(arrays) == 1
        else f"({len(arrays)} arrays) " + ", ".join(arrays[:2]) + (", ..." if len(arrays) > 2 else "")
    )


def _short_path(path: str) -> str:
    parts = [p for p in path.split("/") if not p.startswith("jit(")]
    return "/".join(parts[-2:]) or "?"


def case_profile(jax, args) -> dict:
    """Top costs of the AdaScale update inside the LM step: the step's entry computation minus its loop.

    In the LM step the forward and backward passes run inside the ``lax.scan`` over micro-batches
    (a ``while`` instruction); what the entry computation does besides is the update (with the
    final ``1/k`` of the accumulated gradient). Fusion names are those of the compiled program, so
    they can be found in a ``--profile`` trace of the same step. The per-micro-batch squared norms
    run inside the loop and are not in this table.
    """
    import jax.numpy as jnp

    cfg = _lm_cfg(args)
    texts = dict(SHARED.get("lm_hlo", {}))
    missing = [name for name in ("sgd", "adascale") if name not in texts]
    params = lm_init(jax, jnp, cfg)
    if missing:  # the lm case did not run here (or without these variants): compile, do not run
        fns, txs = microbatch_steps(jax, make_lm_loss(jax, jnp, cfg, remat=False), 1, missing)
        B = K_MICRO * cfg["micro_batch"]
        x = jnp.zeros((B, cfg["seq"]), jnp.int32)
        for name in missing:
            lowered = jax.jit(fns[name], donate_argnums=(0, 1)).lower(params, txs[name].init(params), x, x)
            texts[name] = lowered.compile().as_text()
    out = {
        "config": cfg,
        "params": _count(jax, params),
        "program": "the LM step (lm case), entry computation without the micro-batch loop",
        "programs": {},
    }
    for name in ("sgd", "adascale"):
        rows = sorted(hlo_costs(texts[name], skip=("while",)), key=lambda r: -r["bytes"])
        by_scope: dict[str, int] = {}
        for r in rows:
            by_scope[r["scope"]] = by_scope.get(r["scope"], 0) + r["bytes"]
        out["programs"][name] = {
            "total_bytes": sum(r["bytes"] for r in rows),
            "instructions": len(rows),
            "bytes_by_scope": by_scope,
            "top": rows[: args.top],
        }
    param_bytes = 4 * out["params"]
    out["total_bytes_in_param_words"] = {n: p["total_bytes"] / param_bytes for n, p in out["programs"].items()}
    return out


def print_top_costs(prof: dict) -> None:
    words = prof["total_bytes_in_param_words"]
    print(
        f"  top costs of the update in the LM step ({_p(prof['params'])} params); total bytes / "
        f"(4 x params): sgd {words['sgd']:.2f}, adascale {words['adascale']:.2f}",
        flush=True,
    )
    print(f"  {'MB':>9s}  {'instruction':28s} {'kind':8s} {'result':22s} scope", flush=True)
    for r in prof["programs"]["adascale"]["top"]:
        print(
            f"  {r['bytes'] / 1e6:9.2f}  {r['name'][:28]:28s} {r['kind'] or r['op']:8s} {r['result'][:22]:22s} "
            f"{r['scope']}",
            flush=True,
        )


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, few rounds (seconds on a CPU)")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    parser.add_argument("--no-peer", action="store_true", help="skip the torch/FairScale case")
    parser.add_argument(
        "--variants",
        nargs="+",
        default=None,
        help="time only these variants (each case keeps its baseline), e.g. adascale",
    )
    parser.add_argument("--rounds", type=int, default=None, help="alternating rounds (default 15; smoke 3)")
    parser.add_argument(
        "--block-s", type=float, default=None, help="seconds a baseline block should last (default 0.2; smoke 0.01)"
    )
    parser.add_argument("--vocab", type=int, default=None, help="the LM's vocabulary (default 32000; smoke 256)")
    parser.add_argument("--torch-threads", type=int, default=1, help="torch intra-op threads when it runs on a CPU")
    parser.add_argument("--top", type=int, default=8, help="fusions listed in the top-costs table")
    parser.add_argument("--profile", type=Path, default=None, help="write a jax.profiler trace of the LM step here")
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("gpu.json"))
    parser.add_argument("--report", type=Path, help="write the results' 'gpu' section from this JSON file")
    parser.add_argument("--results", type=Path, default=Path(__file__).with_name("README.md"))
    args = parser.parse_args(argv)
    if args.report:
        print(f"wrote {write_report(args.report, args.results)}")
        return 0
    args.rounds = args.rounds or (3 if args.smoke else 15)
    args.block_s = args.block_s or (0.01 if args.smoke else 0.2)
    if args.no_peer and "peer" in args.cases:
        args.cases.remove("peer")
    command = report.command_line("gpu", argv)
    results, errors, wall = {}, {}, {}

    def run(name, fn, *fn_args):
        print(f"[{name}]", flush=True)
        t0 = time.perf_counter()
        try:
            results[name] = fn(*fn_args)
        except Exception as err:  # noqa: BLE001 - record, go on with the other cases, exit non-zero
            traceback.print_exc()
            results[name] = {"error": f"{type(err).__name__}: {err}"}
            errors[name] = results[name]["error"]
        wall[name] = time.perf_counter() - t0
        print_case(name, results[name])
        print(f"  ({wall[name]:.1f} s)", flush=True)

    if "peer" in args.cases:  # first: before JAX takes the GPU
        run("peer", case_peer, args)
    import jax

    device = jax.devices()[0]
    print(f"JAX {jax.__version__}, {device.device_kind} ({device.platform}), {os.cpu_count()} host cores", flush=True)
    if device.platform == "cpu" and not args.smoke:
        print("warning: no accelerator; the full shapes on a CPU take a long time (use --smoke)", flush=True)
    cases = {"update": case_update, "lm": case_lm, "lm_vmap": case_lm_vmap, "cnn": case_cnn, "profile": case_profile}
    for name in args.cases:
        if name in cases:
            run(name, cases[name], jax, args)
    meta = {
        "command": command,
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "device_kind": device.device_kind,
        "device": f"{device.device_kind} ({device.platform})",
        "host": f"{platform.machine()}, {os.cpu_count()} cores",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "smoke": args.smoke,
        "concurrent_compile": jax.default_backend() == "cpu",
        "variants": args.variants,
        "rounds": args.rounds,
        "block_s": args.block_s,
        "learning_rate": LR,
        "momentum": MOMENTUM,
        "num_microbatches": K_MICRO,
        "wall_s": wall,
        "errors": errors,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "cases": results}, indent=2, default=_json_default))
    print(f"wrote {args.out} ({sum(wall.values()):.1f} s)", flush=True)
    return 1 if errors else 0


def _json_default(x):
    if isinstance(x, np.generic):
        return x.item()
    return str(x)


def print_case(name: str, res: dict) -> None:
    if "error" in res or "skipped" in res:
        print(f"  {res.get('error') or res['skipped']}", flush=True)
        return
    if name == "profile":
        print_top_costs(res)
        return
    for row in res.get("rows", [res]):
        base = row["baseline"]
        parts = [f"{base} {row['median_ms'][base]:.2f} ms"]
        parts += [f"{v} {_r(r)}" for v, r in row["ratios"].items() if v != base]
        print(f"  {_p(row['params'])} params | " + " | ".join(parts), flush=True)
        if "achieved_GBps" in row:
            gb = row["achieved_GBps"]
            print(
                "    GB/s (5 words/param; copy 2 words/elem): " + ", ".join(f"{v} {x:.1f}" for v, x in gb.items()),
                flush=True,
            )

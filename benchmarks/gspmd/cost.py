"""The GSPMD drop-in against the user's own step: collectives, memory, the compiled step's cost, compile and wall time.

On 8 CPU devices as ``(data 4, model 2)``, Explicit axes (``jax.make_mesh``'s default), one training step
of each model over the global batch is compiled as a user writes it (``jax.jit(step, donate_argnums=(0,
1))``, and again with ``out_shardings``), three ways:

  drop-in    ``optax_adascale.value_and_grad(loss, data_axes="data", num_microbatches=k)`` + ``adascale_sgd``
  same-opt   ``jax.value_and_grad(loss)`` + the same ``adascale_sgd``, fed the statistics of n samples computed
             from the gradient (the optimizer's whole estimator compiled, so the difference is the drop-in's)
  sgd        ``jax.value_and_grad(loss)`` + ``optax.sgd(momentum=0.9)``

With ``k`` micro-batches the user's step is the user's own accumulation (``user_value_and_grad``: a scan of
``jax.value_and_grad`` over the same micro-batches, as MaxText's gradient accumulation).

Reported per model × layout × k: gradient-sized bytes moved by collectives (``benchmarks.hlo``), extra
scalar all-reduces, the collectives inside the micro-batch loop, memory per device
(``compiled.memory_analysis()``: arguments + outputs + temporaries − donated aliases), compile time
(lower + compile, median of alternated rounds) and CPU wall time per step (alternated timed blocks, median
of the per-round ratios), and the compiled step's cost (``step_cost``: ``compiled.cost_analysis()`` flops and bytes
accessed per device, every loop unrolled). Gates: bytes ≤ SGD's, ≤ 2 extra scalar all-reduces, memory ≤ 1.05 ×
SGD's + 4 KiB, compile ≤ 1.3 × same-opt's, flops and bytes accessed ≤ 1.02 × same-opt's. Wall time is reported, not
gated: XLA:CPU's kernel choice (its YNNPACK fusions) decides it on this hardware, not the program. One documented
allowance on memory: with k > 1, an FSDP leaf the loss uses at more than one place (the LM's tied embedding) is
gathered once before the micro-batch loop and its partial gradient accumulates at full size, so its full size is
added (``Model.hoisted_bytes``).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import inspect  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import optax_adascale  # noqa: E402
from benchmarks import hlo  # noqa: E402
from benchmarks.gspmd import models  # noqa: E402

VARIANTS = ("drop-in", "same-opt", "sgd")


def _spec_tree(tree: Any) -> Any:
    return jax.tree.map(lambda a: a.sharding, tree)


def user_value_and_grad(loss, k: int, shards: int = 4, auto: bool = False, unroll: int | bool = 1):
    """The user's own step: ``jax.value_and_grad`` of the loss; with ``k > 1`` the user's own accumulation (as
    MaxText's ``gradient_accumulation_steps``): a ``lax.scan`` over the k micro-batches (micro-batch ``j``: the
    ``j``-th block of every data shard's rows, as the drop-in's), gradients summed and divided by k."""
    grad_fn = jax.value_and_grad(loss)
    if k == 1:
        return grad_fn

    def split(x):
        rest = (None,) * (x.ndim - 1)
        shape = (shards, k, x.shape[0] // (shards * k)) + x.shape[1:]
        if auto:
            y = jax.lax.with_sharding_constraint(x.reshape(shape), P("data", None, None, *rest))
        else:
            y = x.reshape(shape, out_sharding=P("data", None, None, *rest))
        return jnp.moveaxis(y, 1, 0)

    def join(m):
        spec = P("data", *(None,) * (m.ndim - 2))
        shape = (m.shape[0] * m.shape[1],) + m.shape[2:]
        return jax.lax.with_sharding_constraint(m.reshape(shape), spec) if auto else m.reshape(shape, out_sharding=spec)

    def fn(params, *batch):
        def body(acc, micro):
            value, grads = grad_fn(params, *[join(m) for m in micro])
            return jax.tree.map(lambda a, g: a + g, acc, grads), value

        zeros = jax.tree.map(jnp.zeros_like, params)
        acc, values = jax.lax.scan(body, zeros, [split(x) for x in batch], unroll=unroll)
        return jnp.mean(values), jax.tree.map(lambda a: a / k, acc)

    return fn


def make_step(
    variant: str,
    model: models.Model,
    k: int,
    shards: int = 4,
    unroll: int | bool = 1,
    adascale_clock: str | None = None,
):
    """``(params, opt_state, *batch) -> (params, opt_state, loss)`` and its optimizer; ``unroll``: the micro-batch
    loop's (the drop-in's and the user's own accumulation). ``adascale_clock``: ``None`` (``adascale_sgd`` as a user
    gets it: the guarded τ clock, the budget's) or ``"update"`` (optax.sgd's arithmetic)."""
    loss = model.loss
    if variant == "sgd":
        tx = optax.sgd(0.1, momentum=0.9)
    else:
        tx = optax_adascale.adascale_sgd(0.1, momentum=0.9, clock=adascale_clock)
    # param_specs (0.4) keeps an Auto mesh's layout; an older optax_adascale (a "before" run) has no such keyword
    takes_specs = "param_specs" in inspect.signature(optax_adascale.value_and_grad).parameters
    specs = {"param_specs": model.specs} if model.auto and takes_specs else {}
    if unroll is True or unroll != 1:  # (True == 1, and True unrolls)
        specs["unroll"] = unroll
    grad_fn = optax_adascale.value_and_grad(loss, data_axes="data", num_microbatches=k, **specs)
    users = user_value_and_grad(loss, k, shards, model.auto, unroll)
    n = shards * k

    def step(params, opt_state, *batch):
        if variant == "drop-in":
            value, grads, stats = grad_fn(params, *batch)
            updates, opt_state = tx.update(grads, opt_state, params, microbatch_stats=stats)
        elif variant == "same-opt":
            value, grads = users(params, *batch)
            sq = jax.tree.map(lambda g: jnp.sum(jnp.square(g.astype(jnp.float32))), grads)
            stats = optax_adascale.MicrobatchStats(sq, n, mean_sq_norms=sq)
            updates, opt_state = tx.update(grads, opt_state, params, microbatch_stats=stats)
        else:
            value, grads = users(params, *batch)
            updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return step, tx


def init_state(tx, params):
    """``tx.init(params)`` under jit, its parameter-shaped buffers (the momentum) laid out as the parameters are, as
    a trainer lays its state out (MaxText: from the parameters' logical axes). On an Auto mesh ``jax.jit(tx.init)``
    alone lets the compiler choose, and it replicates the momentum of a split weight: a layout no FSDP user keeps,
    whose step then gathers the new momentum. The scalars are replicated."""
    shardings = jax.tree.map(lambda x: x.sharding, params)
    mesh = jax.tree.leaves(shardings)[0].mesh
    out = optax.tree_utils.tree_map_params(
        tx,
        lambda _, sh: sh,
        jax.eval_shape(tx.init, params),
        shardings,
        transform_non_params=lambda _: NamedSharding(mesh, P()),
    )
    return jax.jit(tx.init, out_shardings=out)(params)


def _memory(compiled) -> int:
    m = compiled.memory_analysis()
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def measure(
    model: models.Model,
    k: int,
    *,
    mesh,
    rounds: int = 3,
    time_steps: int = 0,
    clock: str = "wall",
    adascale_clock: str | None = None,
) -> dict[str, Any]:
    """Compile the three variants (alternately, ``rounds`` times) and read their facts; time ``time_steps``.
    ``adascale_clock``: AdaScale's clock in the drop-in and same-opt variants (:func:`make_step`)."""
    shards = mesh.shape["data"]
    with jax.set_mesh(mesh):
        params, batch = model.place(mesh)
        out: dict[str, Any] = {v: {"compile_s": []} for v in VARIANTS}
        compiled: dict[str, Any] = {}
        states = {}
        for r in range(rounds):
            for v in VARIANTS:
                step, tx = make_step(v, model, k, shards, adascale_clock=adascale_clock)
                state = init_state(tx, params)
                states[v] = state
                jitted = jax.jit(step, donate_argnums=(0, 1))
                t0 = time.perf_counter()
                c = jitted.lower(params, state, *batch).compile()
                out[v]["compile_s"].append(time.perf_counter() - t0)
                if r == 0:
                    compiled[v] = (c, step, state)
        data_of = {d.id: i for i, row in enumerate(np.asarray(mesh.devices).reshape(shards, -1)) for d in row}
        for v in VARIANTS:
            c = compiled[v][0]
            text = c.as_text()
            out[v].update(
                memory=_memory(c),
                gradient_bytes=hlo.executed_collective_bytes(text)["large_bytes"],
                scalar_all_reduces=hlo.collective_bytes(text)["small_all_reduces"],
                data_reductions_in_loops=hlo.data_reductions_in_loops(text, data_of),
                host_callbacks=hlo.count_host_callbacks(text),
                compile=statistics.median(out[v]["compile_s"]),
            )
            # with out_shardings: the params and state come back as they went in
            p_sh, s_sh = _spec_tree(params), _spec_tree(compiled[v][2])
            jitted = jax.jit(
                compiled[v][1], donate_argnums=(0, 1), out_shardings=(p_sh, s_sh, NamedSharding(mesh, P()))
            )
            c2 = jitted.lower(params, compiled[v][2], *batch).compile()
            out[v]["memory_out_shardings"] = _memory(c2)
        out["allowance"] = model.hoisted_bytes(k)
        if time_steps:
            out["wall"] = _time(model, k, params, batch, time_steps, shards, clock=CLOCKS[clock])
    return out


def _time(model, k, params, batch, steps: int, shards: int = 4, rounds: int = 7, clock=time.perf_counter):
    """Alternated timed blocks of ``steps`` steps (drop-in, same-opt); the median of the per-round ratios. ``clock``:
    the wall clock, or the process's CPU time (``time.process_time``) on a host shared with other work."""
    runners = {}
    for v in ("drop-in", "same-opt"):
        step, tx = make_step(v, model, k, shards)
        f = jax.jit(step)
        state = init_state(tx, params)
        jax.block_until_ready(f(params, state, *batch))
        runners[v] = (f, state)
    times: dict[str, list[float]] = {v: [] for v in runners}
    for _ in range(rounds):
        for v, (f, state) in runners.items():
            p, s = params, state
            t0 = clock()
            for _ in range(steps):
                p, s, _ = f(p, s, *batch)
            jax.block_until_ready(p)
            times[v].append(clock() - t0)
    ratios = np.asarray(times["drop-in"]) / np.asarray(times["same-opt"])
    return {"median": float(np.median(ratios)), "min": float(ratios.min()), "max": float(ratios.max())}


def _flops_bytes(compiled) -> tuple[float, float]:
    """``compiled.cost_analysis()``'s ``flops`` and ``bytes accessed`` (a list of one dict on some JAX versions)."""
    a = compiled.cost_analysis()
    a = a[0] if isinstance(a, (list, tuple)) else a
    return float(a.get("flops", 0.0)), float(a.get("bytes accessed", 0.0))


STEP_COST_TOLERANCE = 1.02


def step_cost(model: models.Model, k: int, *, mesh, adascale_clock: str | None = None) -> dict[str, Any]:
    """The compiled step's cost of each variant: ``compiled.cost_analysis()`` flops and bytes accessed per device,
    with every loop unrolled. XLA's cost analysis counts a ``while`` body once, whatever its trip count, so a
    scanned model's layers and the micro-batch loop would be counted once while the optimizer's passes over the
    parameters count in full: ``model`` must be built with ``unroll=True`` (``models.build``), and the micro-batch
    loops (the drop-in's ``unroll=``, the user's own accumulation's) are unrolled here."""
    shards = mesh.shape["data"]
    out: dict[str, Any] = {}
    with jax.set_mesh(mesh):
        params, batch = model.place(mesh)
        for v in VARIANTS:
            step, tx = make_step(v, model, k, shards, unroll=True, adascale_clock=adascale_clock)
            state = init_state(tx, params)
            compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, *batch).compile()
            flops, bytes_accessed = _flops_bytes(compiled)
            # 0: every loop of the program counted as often as it runs. (XLA:CPU's scatter expander, with the tests'
            # legacy emitters, turns a scatter-add into a loop of its own: the same in every variant, not counted.)
            loops = [line for line in compiled.as_text().splitlines() if " while(" in line and "scatter" not in line]
            out[v] = {"flops": flops, "bytes_accessed": bytes_accessed, "loops": len(loops)}
        # each device's per-copy gradient, the partial before the data axes' reduction (whole along a dimension
        # split over "data", as FSDP's partial is): the per-copy ‖g_i‖² reads it once per micro-batch (the
        # statistic's own floor)
        out["gradient_elements"] = sum(_partial_elements(x, mesh) for x in jax.tree.leaves(params))
        out["microbatches"] = k
    return out


def _partial_elements(x: Any, mesh: Any) -> int:
    """Elements of one device's unreduced partial gradient of ``x``: split over every mesh axis but ``data``."""
    split = 1
    for entry in x.sharding.spec:
        for axis in (entry,) if isinstance(entry, str) else tuple(entry or ()):
            if axis != "data":
                split *= mesh.shape[axis]
    return x.size // split


def step_cost_gates(cost: dict[str, Any]) -> dict[str, bool]:
    """The drop-in's step within 2 % of the user's own step's flops and bytes accessed plus the statistic's own floor
    (``same-opt``: the user's ``jax.value_and_grad`` on the same shardings and the same optimizer, so that the
    difference is the drop-in's): one pass over each device's per-copy gradient per micro-batch for ``‖g_i‖²`` (4
    bytes and 2 flops an element; under FSDP the partial before the reduce-scatter, whole along the data-split
    dimension), which the user's own step gets free."""
    ours, same = cost["drop-in"], cost["same-opt"]
    passes = cost.get("gradient_elements", 0) * cost.get("microbatches", 1)
    floor = {"flops": 2 * passes, "bytes_accessed": 4 * passes}
    return {m: ours[m] <= STEP_COST_TOLERANCE * (same[m] + floor[m]) for m in ("flops", "bytes_accessed")}


def gates(row: dict[str, Any]) -> dict[str, bool]:
    """The issue's gates for one row (compile and wall against same-opt, the rest against SGD)."""
    ours, same, sgd = row["drop-in"], row["same-opt"], row["sgd"]
    slack = 4096 + row.get("allowance", 0)
    out = {
        "gradient_bytes": ours["gradient_bytes"] <= sgd["gradient_bytes"],
        "scalar_all_reduces": ours["scalar_all_reduces"] - sgd["scalar_all_reduces"] <= 2,
        "memory": ours["memory"] <= 1.05 * sgd["memory"] + slack,
        "memory_out_shardings": ours["memory_out_shardings"] <= 1.05 * sgd["memory_out_shardings"] + slack,
        "compile": ours["compile"] <= 1.3 * same["compile"],
        "host_callbacks": ours["host_callbacks"] == 0,
    }
    if "step_cost" in row:  # the compiled step's flops and bytes accessed (XLA:CPU's wall time is not a gate)
        out.update({f"step_{m}": ok for m, ok in step_cost_gates(row["step_cost"]).items()})
    return out

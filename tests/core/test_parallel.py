"""One mechanism, every way JAX runs data parallelism: the same samples give the same training.

Each update averages the same n = 8 micro-batches of 4 rows, collected as 8 replicas
(vmap, pmap, shard_map, GSPMD), as 8 accumulated calls, as 8 micro-batches within one
step, or as mixtures (4 replicas × 2 calls, 4 replicas × 2 micro-batches, a 2 × 4 mesh
with a tuple axis name). All must agree with the vmap run over 20 updates.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import DIM, make_tx, synthetic_batches
from helpers import init_mlp as init_params
from helpers import mlp_loss as loss_fn
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_adascale
from benchmarks import hlo as _hlo

N, ROWS, STEPS = 8, 4, 20
SCHEDULE = optax.exponential_decay(0.3, transition_steps=10, decay_rate=0.5)


def data():
    """(STEPS, N, ROWS, ...) micro-batches: update t, sample i."""
    return synthetic_batches(STEPS, N, ROWS)


def plain_step(tx):
    """One step on this replica's gradient; the transformation does the reduction."""

    def step(params, state, x, y):
        grads = jax.grad(loss_fn)(params, x, y)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step


def record(params, state, log):
    m = optax_adascale.metrics(state)
    log.append((float(m["gain"]), float(m["scale_invariant_steps"])))


def train(step, tx, put=lambda a: a):
    """Run ``step`` over the 20 updates (one call each) from fresh params; log gain and τ."""
    params, log = init_params(), []
    state = tx.init(params)
    for x, y in zip(*data()):
        params, state = step(params, state, put(x), put(y))
        record(params, state, log)
    return params, log


def vmapped(tx):
    return jax.jit(jax.vmap(plain_step(tx), in_axes=(None, None, 0, 0), out_axes=(None, None), axis_name="i"))


def run_vmap(**tx_kw):
    tx = make_tx(SCHEDULE, axis_name="i", **tx_kw)
    return train(vmapped(tx), tx)


def run_pmap(**tx_kw):
    tx = make_tx(SCHEDULE, axis_name="i", **tx_kw)
    return train(jax.pmap(plain_step(tx), axis_name="i", in_axes=(None, None, 0, 0), out_axes=(None, None)), tx)


def shard_map_run(mesh, axis, tx, *, pcast=True, check_vma=True, micro=1, state=None):
    """Replicas on ``mesh`` over ``axis``; each replica gets ``micro`` consecutive micro-batches per call."""
    params, log = init_params(), []
    state = tx.init(params) if state is None else state
    specs = optax_adascale.state_partition_specs(state, axis)

    def step(params, state, x, y):
        p = jax.lax.pcast(params, axis, to="varying") if pcast else params
        if micro == 1:
            grads = jax.grad(loss_fn)(p, x[0], y[0])
            updates, state = tx.update(grads, state, params)
        else:
            grad_fn = optax_adascale.value_and_grad(loss_fn, num_microbatches=micro)
            _, grads, stats = grad_fn(p, x.reshape(-1, DIM), y.reshape(-1))
            updates, state = tx.update(grads, state, params, microbatch_stats=stats)
        return optax.apply_updates(params, updates), state

    step = jax.jit(
        jax.shard_map(
            step, mesh=mesh, in_specs=(P(), specs, P(axis), P(axis)), out_specs=(P(), specs), check_vma=check_vma
        )
    )
    return params, state, step, log


def run_shard_map(pcast=True, check_vma=True, **tx_kw):
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("i",))
    tx = make_tx(SCHEDULE, axis_name="i", **tx_kw)
    params, state, step, log = shard_map_run(mesh, "i", tx, pcast=pcast, check_vma=check_vma)
    for x, y in zip(*data()):
        params, state = step(params, state, x, y)
        record(params, state, log)
    return params, log


def run_shard_map_explicit_mesh(**tx_kw):
    mesh = jax.make_mesh((N,), ("i",))
    params, state, step, log = shard_map_run(mesh, "i", make_tx(SCHEDULE, axis_name="i", **tx_kw))
    sharding = NamedSharding(mesh, P("i"))
    for x, y in zip(*data()):
        params, state = step(params, state, jax.device_put(x, sharding), jax.device_put(y, sharding))
        record(params, state, log)
    return params, log


def run_shard_map_2d_mesh(**tx_kw):
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("hosts", "devices"))
    axis = ("hosts", "devices")
    params, state, step, log = shard_map_run(mesh, axis, make_tx(SCHEDULE, axis_name=axis, **tx_kw))
    for x, y in zip(*data()):
        params, state = step(params, state, x, y)
        record(params, state, log)
    return params, log


def run_gspmd(**tx_kw):
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("i",))  # Auto axes
    tx = make_tx(SCHEDULE, axis_name="i", **tx_kw)
    return train(vmapped(tx), tx, put=lambda a: jax.device_put(a, NamedSharding(mesh, P("i"))))


def run_accumulation(**tx_kw):
    tx = make_tx(SCHEDULE, accumulation_steps=N, **tx_kw)
    params, log = init_params(), []
    state = tx.init(params)

    step = jax.jit(plain_step(tx))

    for xs, ys in zip(*data()):
        for x, y in zip(xs, ys):
            params, state = step(params, state, x, y)
        record(params, state, log)
    return params, log


def run_within_step(**tx_kw):
    tx = make_tx(SCHEDULE, **tx_kw)
    params, log = init_params(), []
    state = tx.init(params)
    grad_fn = optax_adascale.value_and_grad(loss_fn, num_microbatches=N)

    @jax.jit
    def step(params, state, x, y):
        _, grads, stats = grad_fn(params, x.reshape(-1, DIM), y.reshape(-1))
        updates, state = tx.update(grads, state, params, microbatch_stats=stats)
        return optax.apply_updates(params, updates), state

    for x, y in zip(*data()):
        params, state = step(params, state, x, y)
        record(params, state, log)
    return params, log


def run_shard_map_times_accumulation(**tx_kw):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("i",))
    tx = make_tx(SCHEDULE, axis_name="i", accumulation_steps=2, **tx_kw)
    state = optax_adascale.replicate_buffers(tx.init(init_params()), 4)
    params, state, step, log = shard_map_run(mesh, "i", tx, state=state)
    for x, y in zip(*data()):
        for call in range(2):  # replica r gets micro-batch 2r + call
            params, state = step(params, state, x[call::2], y[call::2])
        record(params, state, log)
    return params, log


def run_vmap_times_accumulation(**tx_kw):
    tx = make_tx(SCHEDULE, axis_name="i", accumulation_steps=2, **tx_kw)
    params, log = init_params(), []
    state = optax_adascale.replicate_buffers(tx.init(params), 4)
    axes = optax_adascale.state_axes(state)

    step = jax.jit(jax.vmap(plain_step(tx), in_axes=(None, axes, 0, 0), out_axes=(None, axes), axis_name="i"))
    for x, y in zip(*data()):
        for call in range(2):
            params, state = step(params, state, x[call::2], y[call::2])
        record(params, state, log)
    return params, log


def run_shard_map_times_microbatches(**tx_kw):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("i",))
    params, state, step, log = shard_map_run(mesh, "i", make_tx(SCHEDULE, axis_name="i", **tx_kw), micro=2)
    for x, y in zip(*data()):
        params, state = step(params, state, x, y)  # replica r gets micro-batches 2r, 2r + 1
        record(params, state, log)
    return params, log


PATHS = {
    "pmap": run_pmap,
    "shard_map": run_shard_map,
    "shard_map explicit mesh": run_shard_map_explicit_mesh,
    "shard_map check_vma=False without pcast": functools.partial(run_shard_map, pcast=False, check_vma=False),
    "shard_map 2x4 mesh, tuple axis": run_shard_map_2d_mesh,
    "gspmd (jit + sharded vmap axis)": run_gspmd,
    "accumulation_steps=8": run_accumulation,
    "within-step 8 microbatches": run_within_step,
    "shard_map 4 x accumulation 2": run_shard_map_times_accumulation,
    "vmap 4 x accumulation 2": run_vmap_times_accumulation,
    "shard_map 4 x 2 microbatches": run_shard_map_times_microbatches,
}


@functools.cache
def reference():
    return run_vmap()


SLOW_PATHS = {"pmap"}  # > 10 s on a 2-core CPU (8 pmap devices)


@pytest.mark.parametrize(
    "path",
    [pytest.param(run, id=name, marks=[pytest.mark.slow] if name in SLOW_PATHS else []) for name, run in PATHS.items()],
)
def test_every_parallel_path_matches_vmap(path):
    ref_params, ref_log = reference()
    params, log = path()
    np.testing.assert_allclose(np.array(log), np.array(ref_log), rtol=1e-5)
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    gains = np.array(ref_log)[:, 0]
    assert 1.0 < gains.min() and gains.max() <= N  # the comparison is not degenerate


DELAYED_PATHS = (
    "pmap",
    "shard_map",
    "accumulation_steps=8",
    "within-step 8 microbatches",
    "shard_map 4 x accumulation 2",
    "shard_map 4 x 2 microbatches",
)


@functools.cache
def delayed_reference():
    return run_vmap(delayed_gain=True)


@pytest.mark.parametrize("path", DELAYED_PATHS)
def test_every_parallel_path_matches_vmap_with_delayed_gain(path):
    ref_params, ref_log = delayed_reference()
    params, log = PATHS[path](delayed_gain=True)
    np.testing.assert_allclose(np.array(log), np.array(ref_log), rtol=1e-5)
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert np.array(ref_log)[0, 0] == 1.0  # the first update used gain 1


def test_reference_gain_changes_over_training():
    gains = np.array(reference()[1])[:, 0]
    assert gains.max() - gains.min() > 0.1


def sgd_pmean_step(axis):
    tx = optax.sgd(0.1, momentum=0.9)

    def step(params, state, x, y):
        grads = jax.lax.pmean(jax.grad(loss_fn)(jax.lax.pcast(params, axis, to="varying"), x[0], y[0]), axis)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return tx, step


def test_one_all_reduce_like_sgd_with_pmean():
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("i",))
    params, state, step, _ = shard_map_run(mesh, "i", make_tx(SCHEDULE, axis_name="i"))
    x, y = data()
    ours = _hlo.compiled_text(step, params, state, x[0], y[0])

    tx, base = sgd_pmean_step("i")
    base = jax.jit(jax.shard_map(base, mesh=mesh, in_specs=(P(), P(), P("i"), P("i")), out_specs=(P(), P())))
    baseline = _hlo.compiled_text(base, params, tx.init(params), x[0], y[0])

    assert _hlo.count(ours, "all-reduce") == _hlo.count(baseline, "all-reduce") == 1
    assert _hlo.count_collectives(ours) == _hlo.count_collectives(baseline)
    assert _hlo.count_host_callbacks(ours) == 0


def test_accumulation_only_calls_execute_no_all_reduce():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("i",))
    tx = make_tx(SCHEDULE, axis_name="i", accumulation_steps=2)
    state = optax_adascale.replicate_buffers(tx.init(init_params()), 4)
    params, state, step, _ = shard_map_run(mesh, "i", tx, state=state)
    x, y = data()
    text = _hlo.compiled_text(step, params, state, x[0][::2], y[0][::2])
    assert _hlo.count(text, "all-reduce") == 1  # the reduction exists...
    assert _hlo.count_unconditional(text, "all-reduce") == 0  # ...only inside the k-th call's branch
    assert _hlo.count_host_callbacks(text) == 0


def test_donated_step_copies_no_gradient_sized_buffer():
    # The skip's select on the momentum (Adam's μ and ν) must not force XLA to copy the donated state before the
    # in-place update (it would be an extra pass over every buffer).
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("i",))
    params = {"w": jnp.ones((64, 64)), "b": jnp.zeros(64)}
    x = jnp.ones((N, 4, 64))
    loss = lambda p, xb: jnp.sum(jnp.tanh(xb @ p["w"] + p["b"]) ** 2)
    texts = {}
    optimizers = {
        "adascale": make_tx(SCHEDULE, axis_name="i"),
        "adascale_adamw": optax_adascale.adascale_adamw(1e-3, axis_name="i"),  # selects where it writes
        "adascale-adam-chain": optax_adascale.adascale(  # optax's Adam: run in a lax.cond
            optax.chain(optax.scale_by_adam(), optax.add_decayed_weights(1e-4)), 1e-3, axis_name="i"
        ),
        "sgd": optax.sgd(0.1, momentum=0.9),
        "adamw": optax.adamw(1e-3),
    }
    for name, tx in optimizers.items():

        def step(p, s, xb, tx=tx, name=name):
            g = jax.grad(loss)(jax.lax.pcast(p, "i", to="varying"), xb[0])
            if not name.startswith("adascale"):
                g = jax.lax.pmean(g, "i")
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        f = jax.jit(
            jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P("i")), out_specs=(P(), P())), donate_argnums=(0, 1)
        )
        texts[name] = _hlo.compiled_text(f, params, tx.init(params), x)
    assert {name: _hlo.count_large_copies(text) for name, text in texts.items()} == dict.fromkeys(texts, 0)


def test_donated_accumulation_step_copies_no_buffer():
    # The accumulation buffers are updated in place: the cond neither passes them through (which
    # copies them on every accumulating call) nor races the in-place write against its reads.
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("i",))
    tx = make_tx(SCHEDULE, axis_name="i", accumulation_steps=4)
    params = init_params()
    state = optax_adascale.replicate_buffers(tx.init(params), N)
    specs = optax_adascale.state_partition_specs(state, "i")

    def step(p, s, x, y):
        grads = jax.grad(loss_fn)(jax.lax.pcast(p, "i", to="varying"), x[0], y[0])
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s

    f = jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P("i"), P("i")), out_specs=(P(), specs)),
        donate_argnums=(0, 1),
    )
    x, y = data()
    text = _hlo.compiled_text(f, params, state, x[0], y[0])
    assert _hlo.count_large_copies(text, min_elements=DIM * 16) == 0

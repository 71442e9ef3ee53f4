"""``shard_optimizer_state=n`` (ZeRO-1/2, FairScale's ``AdaScale(OSS)``): the same numbers as the replicated update.

The truth is replicated AdaScale on the same samples. With the state sharded, each
replica reduce-scatters the gradients, updates its ``1/n`` row with ``1/n`` of the
inner state, and all-gathers the update: gains, τ and parameters must equal the
replicated run's to float32 rounding, for leaves whose sizes ``n`` does not divide,
16-bit parameters, accumulation, micro-batches and parameter groups.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import DIM, make_tx, synthetic_batches
from helpers import init_mlp as init_params
from helpers import mlp_loss as loss_fn
from jax.sharding import PartitionSpec as P

import optax_adascale
from benchmarks import hlo as _hlo

N, ROWS, STEPS = 8, 4, 20
SCHEDULE = optax.exponential_decay(0.3, transition_steps=10, decay_rate=0.5)
MESH = jax.sharding.Mesh(np.array(jax.devices()), ("data",))


def zero_tx(zero, **kw):
    """:func:`helpers.make_tx` over ``data``, with the state sharded over the N replicas if ``zero``."""
    return make_tx(SCHEDULE, weight_decay=1e-3, axis_name="data", shard_optimizer_state=N if zero else None, **kw)


def record(state, log):
    m = optax_adascale.metrics(state)
    log.append((float(m["gain"]), float(m["scale_invariant_steps"])))


def shard_map_run(zero, *, accumulation=1, micro=1, labels=None, dtype=jnp.float32, mesh=MESH):
    n = mesh.size
    tx = zero_tx(zero, accumulation_steps=accumulation, param_labels=labels)
    if zero:
        tx = make_tx(
            SCHEDULE,
            weight_decay=1e-3,
            axis_name="data",
            shard_optimizer_state=n,
            accumulation_steps=accumulation,
            param_labels=labels,
        )
    params = jax.tree.map(lambda p: p.astype(dtype), init_params())
    state = tx.init(params)
    if accumulation > 1:
        state = optax_adascale.replicate_buffers(state, n)
    specs = optax_adascale.state_partition_specs(state, "data")
    grad_fn = optax_adascale.value_and_grad(loss_fn, num_microbatches=micro)

    def step(params, state, x, y):
        p = jax.lax.pcast(params, "data", to="varying")
        if micro == 1:
            updates, state = tx.update(jax.grad(loss_fn)(p, x[0], y[0]), state, params)
        else:
            _, grads, stats = grad_fn(p, x.reshape(-1, DIM), y.reshape(-1))
            updates, state = tx.update(grads, state, params, microbatch_stats=stats)
        return optax.apply_updates(params, updates), state

    step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P("data"), P("data")), out_specs=(P(), specs)))
    log = []
    xs, ys = synthetic_batches(STEPS, n * accumulation * micro, ROWS)
    for x, y in zip(xs, ys, strict=True):
        if accumulation == 1:
            params, state = step(params, state, x, y)
        else:
            for call in range(accumulation):
                params, state = step(params, state, x[call::accumulation], y[call::accumulation])
        record(state, log)
    return params, state, np.array(log)


_REPLICATED = {}


def replicated(case="plain", **kw):
    """The replicated run of a case, computed once."""
    if case not in _REPLICATED:
        _REPLICATED[case] = shard_map_run(False, **kw)
    return _REPLICATED[case]


def assert_same(a, b, rtol=1e-5, atol=1e-6):
    params_a, _, log_a = a
    params_b, _, log_b = b
    np.testing.assert_allclose(log_a, log_b, rtol=rtol)
    for x, y in zip(jax.tree.leaves(params_a), jax.tree.leaves(params_b), strict=True):
        np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=rtol, atol=atol)
    assert log_b[:, 0].min() > 1.0


CASES = {
    "plain": {},
    "accumulation2": {"accumulation": 2},
    "micro2": {"micro": 2},
    "labels": {"labels": {"hidden": {"w": "w", "b": "b"}, "out": {"w": "w", "b": "b"}}},
}


SLOW_CASES = {"plain", "accumulation2", "micro2"}  # > 10 s each on a 2-core CPU; "labels" stays in the fast loop


@pytest.mark.parametrize("case", [pytest.param(c, marks=[pytest.mark.slow] if c in SLOW_CASES else []) for c in CASES])
def test_sharded_state_under_shard_map_matches_the_replicated_update(case):
    kw = CASES[case]
    assert_same(shard_map_run(True, **kw), replicated(case, **kw))


@pytest.mark.slow  # > 10 s on a 2-core CPU
def test_sharded_state_with_bfloat16_params_matches_the_replicated_update():
    a = shard_map_run(True, dtype=jnp.bfloat16)
    b = replicated("bfloat16", dtype=jnp.bfloat16)
    np.testing.assert_allclose(a[2], b[2], rtol=1e-5)
    for x, y in zip(jax.tree.leaves(a[0]), jax.tree.leaves(b[0]), strict=True):
        assert x.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=1e-2, atol=1e-2)


def test_sharded_state_under_pmap_matches_the_replicated_update():
    tx = zero_tx(True)
    params = init_params()
    state = tx.init(params)
    axes = optax_adascale.state_axes(state)

    def step(params, state, x, y):
        updates, state = tx.update(jax.grad(loss_fn)(params, x, y), state, params)
        return optax.apply_updates(params, updates), state

    step = jax.pmap(step, axis_name="data", in_axes=(None, axes, 0, 0), out_axes=(None, axes))
    log = []
    for x, y in zip(*synthetic_batches(STEPS, N, ROWS), strict=True):
        params, state = step(params, state, x, y)
        record(state, log)
    assert_same((params, state, np.array(log)), replicated())


def test_leaf_sizes_are_not_all_divisible_by_the_replicas():
    sizes = [leaf.size for leaf in jax.tree.leaves(init_params())]
    assert any(size % N for size in sizes)
    rows = optax_adascale.get_adascale_state(zero_tx(True).init(init_params())).inner_state.rows
    momentum = optax.tree.get(rows, "trace")  # the τ clock's TraceState: its 5 scalars are not rows
    assert [t.shape for t in jax.tree.leaves(momentum)] == [(N, -(-s // N)) for s in sizes]
    assert [t.shape for t in jax.tree.leaves(rows) if t.ndim != 2] == [()] * 5


# --------------------------------------------------------------------------- FairScale's AdaScale(OSS) golden


def test_fairscale_oss_golden_gain():
    """tests/optim/test_oss_adascale.py::test_sequential: 2 ranks, a bias-free 2→3→4→5→6 linear chain
    with weights ``arange/mean``, loss ``out.sum()``, one-hot inputs swapped between the ranks on step 2,
    two steps of ``AdaScale(OSS(SGD, lr=0.1))``. Expected gain 1.0335265132125744, mean weight 52.92657661437988."""
    shapes = [(3, 2), (4, 3), (5, 4), (6, 5)]
    params = [jnp.arange(o * i, dtype=jnp.float32).reshape(o, i) / np.mean(range(o * i)) for o, i in shapes]

    def loss(ws, x):
        for w in ws:
            x = w @ x
        return jnp.sum(x)

    tx = optax_adascale.adascale_sgd(0.1, axis_name="data", shard_optimizer_state=2, estimator="fairscale")
    state = tx.init(params)
    specs = optax_adascale.state_partition_specs(state, "data")
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))

    def step(ws, state, x):
        updates, state = tx.update(jax.grad(loss)(jax.lax.pcast(ws, "data", to="varying"), x[0]), state, ws)
        return optax.apply_updates(ws, updates), state

    step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P("data")), out_specs=(P(), specs)))
    for x in (jnp.array([[1.0, 0.0], [0.0, 1.0]]), jnp.array([[0.0, 1.0], [1.0, 0.0]])):
        params, state = step(params, state, x)
    np.testing.assert_allclose(float(optax_adascale.metrics(state)["gain"]), 1.0335265132125744, rtol=1e-5)
    np.testing.assert_allclose(np.mean([float(w.mean()) for w in params]), 52.92657661437988, rtol=1e-5)


# --------------------------------------------------------------------------- skip, HLO and memory


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_non_finite_replica_zeroes_the_update_on_every_replica(bad):
    tx = zero_tx(True)
    params = init_params()
    state = tx.init(params)
    axes = optax_adascale.state_axes(state)
    step = jax.pmap(tx.update, axis_name="data", in_axes=(0, axes, None), out_axes=(0, axes))
    grads = jax.tree.map(lambda p: jnp.ones((N,) + p.shape, p.dtype), params)
    _, state = step(grads, state, params)
    poisoned = jax.tree.map(lambda g: g.at[5].multiply(1.5), grads)
    poisoned["out"]["w"] = poisoned["out"]["w"].at[3, 0, 0].set(bad)
    updates, new_state = step(poisoned, state, params)
    assert all(bool(jnp.all(u == 0)) for u in jax.tree.leaves(updates))
    assert np.all(np.asarray(new_state.skipped_steps) == 1)
    same = new_state._replace(skipped_steps=state.skipped_steps, skip_streak=state.skip_streak)
    jax.tree.map(np.testing.assert_array_equal, same, state)


# An all-reduce of the τ clock guard's own (0.4.0 summed its three dot products over the ZeRO rows in one, after the
# update): the guard's probe now rides the statistics' psum.
GUARD_SUMS = re.compile(r"= f32\[3\]\{0\} all-reduce\(")


def compiled(zero: bool, params):
    tx = zero_tx(zero)
    state = tx.init(params)
    specs = optax_adascale.state_partition_specs(state, "data")
    x = jnp.ones((N, ROWS, DIM))
    y = jnp.zeros((N, ROWS), jnp.int32)

    def step(params, state, x, y):
        updates, state = tx.update(
            jax.grad(loss_fn)(jax.lax.pcast(params, "data", to="varying"), x[0], y[0]), state, params
        )
        return optax.apply_updates(params, updates), state

    f = jax.jit(
        jax.shard_map(step, mesh=MESH, in_specs=(P(), specs, P("data"), P("data")), out_specs=(P(), specs)),
        donate_argnums=(0, 1),
    )
    return f.lower(params, state, x, y).compile(), state


def test_reduce_scatter_and_all_gather_replace_the_gradient_all_reduce():
    params = init_params()
    text = compiled(True, params)[0].as_text()
    counts = _hlo.count_collectives(text)
    assert counts["reduce-scatter"] >= 1 and counts["all-gather"] >= 1
    traffic = _hlo.collective_bytes(text, min_elements=2)
    replicated_traffic = _hlo.collective_bytes(compiled(False, params)[0].as_text(), min_elements=2)
    # One scalar-sized psum of the statistics, the default τ clock guard's probe (six dot products per leaf on a
    # sample of each row) riding in it: optax.sgd + pmean's one gradient reduction (here a reduce-scatter and an
    # all-gather) and that psum, nothing else.
    assert counts["all-reduce"] == 1 and not GUARD_SUMS.findall(text)  # (its size: the bytes below)
    grad_bytes = sum(4 * leaf.size for leaf in jax.tree.leaves(params))
    padded = sum(4 * N * -(-leaf.size // N) for leaf in jax.tree.leaves(params))
    # reduce-scatter results (1/n each) + all-gather results (the padded whole): one all-reduce's bytes,
    # plus the statistics (a and b, one float32 each) and the guard's probe (six float32 per leaf).
    probe = 6 * 4 * len(jax.tree.leaves(params))
    assert traffic["large_bytes"] + traffic["small_bytes"] == padded // N + padded + 2 * 4 + probe
    assert replicated_traffic["large_bytes"] == grad_bytes
    assert _hlo.count_host_callbacks(text) == 0


def test_per_device_state_is_a_row_of_the_replicated_state():
    params = init_params()
    _, state = compiled(True, params)
    _, rep = compiled(False, params)
    per_device = lambda s: sum(  # noqa: E731
        x.nbytes // (N if x.ndim == 2 and x.shape[0] == N else 1) for x in jax.tree.leaves(s)
    )
    inner_rep = sum(x.nbytes for x in jax.tree.leaves(rep.inner_state))
    inner_zero = per_device(state.inner_state)
    padding = sum(4 * (-(-leaf.size // N) - leaf.size / N) for leaf in jax.tree.leaves(params))
    # The default τ clock's TraceState holds 5 float32 scalars besides the momentum (slope, reach, noise, curvature,
    # limit): O(1) state, replicated whole on every device, not split into rows.
    replicated = [x for x in jax.tree.leaves(state.inner_state) if x.ndim == 0]
    assert len(replicated) == 5 and all(x.dtype == jnp.float32 for x in replicated)
    scalars_bytes = 5 * 4
    assert inner_zero <= (inner_rep - scalars_bytes) / N + scalars_bytes + padding + 1e-9
    scalars = per_device(state._replace(inner_state=None))
    assert scalars == sum(x.nbytes for x in jax.tree.leaves(rep._replace(inner_state=None))) <= 128


# --------------------------------------------------------------------------- errors and inner on a shard


def test_a_replica_count_other_than_shard_optimizer_state_is_an_error():
    tx = optax_adascale.adascale_sgd(0.1, axis_name="data", shard_optimizer_state=4)
    params = init_params()
    step = jax.vmap(tx.update, in_axes=(0, None, None), axis_name="data")
    grads = jax.tree.map(lambda p: jnp.ones((N,) + p.shape), params)
    with pytest.raises(ValueError, match=r"shard_optimizer_state=4 but the data axes 'data' have 8 replicas"):
        step(grads, tx.init(params), params)


@pytest.mark.parametrize(
    "inner,match",
    [
        (optax.chain(optax.clip_by_global_norm(1.0), optax.trace(0.9)), r"optax_adascale\.clip_by_global_norm"),
        (
            optax.chain(
                optax.add_decayed_weights(1e-2, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)), optax.trace(0.9)
            ),
            r"masks and labels must be given as trees",
        ),
    ],
    ids=["optax.clip_by_global_norm", "mask from shapes"],
)
def test_an_inner_that_is_not_elementwise_is_rejected_at_init(inner, match):
    tx = optax_adascale.adascale(inner, 0.1, axis_name="data", shard_optimizer_state=N)
    with pytest.raises(ValueError, match=match):
        tx.init(init_params())


def test_the_shard_aware_clip_equals_optax_clip_on_the_replicated_update():
    def run(zero):
        clip = optax_adascale.clip_by_global_norm(0.05) if zero else optax.clip_by_global_norm(0.05)
        tx = optax_adascale.adascale(
            optax.chain(clip, optax.trace(0.9)), 0.1, axis_name="data", shard_optimizer_state=N if zero else None
        )
        params = init_params()
        state = tx.init(params)
        axes = optax_adascale.state_axes(state)
        step = jax.jit(jax.vmap(tx.update, in_axes=(0, axes, None), out_axes=(None, axes), axis_name="data"))
        x, y = synthetic_batches(STEPS, N, ROWS)
        grads = jax.vmap(jax.grad(loss_fn), in_axes=(None, 0, 0))(params, x[0], y[0])
        return step(grads, state, params)[0]

    a, b = run(True), run(False)
    jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-8), a, b)
    assert float(optax.tree.norm(b)) < 0.05 * 0.1 * 8 + 1e-6  # the clip was active


# --------------------------------------------------------------------------- composes


def test_inject_hyperparams_and_a_state_transfer_onto_four_replicas():
    # shard_optimizer_state goes through adascale_sgd's **options, which inject_hyperparams passes on as they are.
    inject = optax.inject_hyperparams(optax_adascale.adascale_sgd, static_args=("axis_name", "accumulation_steps"))
    tx = inject(learning_rate=0.1, momentum=0.9, axis_name="data", shard_optimizer_state=N)
    params = init_params()
    state = tx.init(params)
    axes = optax_adascale.state_axes(state)
    step = jax.jit(jax.vmap(tx.update, in_axes=(0, axes, None), out_axes=(None, axes), axis_name="data"))
    x, y = synthetic_batches(STEPS, N, ROWS)
    for t in range(3):
        updates, state = step(jax.vmap(jax.grad(loss_fn), in_axes=(None, 0, 0))(params, x[t], y[t]), state, params)
        params = optax.apply_updates(params, updates)
    momentum = optax.tree.get(state, "trace")

    tx4 = inject(learning_rate=0.1, momentum=0.9, axis_name="data", shard_optimizer_state=4)
    moved = optax_adascale.transfer_state(state, tx4.init(params))
    rows4 = optax.tree.get(moved, "trace")
    for leaf, r8, r4 in zip(jax.tree.leaves(params), jax.tree.leaves(momentum), jax.tree.leaves(rows4), strict=True):
        assert r4.shape == (4, -(-leaf.size // 4))
        np.testing.assert_array_equal(np.ravel(r4)[: leaf.size], np.ravel(r8)[: leaf.size])
    assert float(optax_adascale.metrics(moved)["gain"]) == float(optax_adascale.metrics(state)["gain"])


# --------------------------------------------------------------------------- FSDP (ZeRO-3) under shard_map


def fsdp_run(dtype=jnp.float32, probes_to_update=True):
    """Parameters in ZeRO rows, gathered for the forward pass; the probes carry the local squared norms."""
    tx = zero_tx(True)
    params = jax.tree.map(lambda p: p.astype(dtype), init_params())
    shapes = jax.eval_shape(lambda: params)
    state = tx.init(params)
    rows = optax_adascale.fsdp_shard(params, N)
    specs = optax_adascale.state_partition_specs(state, "data")
    row_specs = jax.tree.map(lambda _: P("data"), rows)

    def step(rows, state, x, y):
        def loss_of(rows, probes):
            return loss_fn(optax_adascale.fsdp_gather(rows, probes, shapes, "data"), x[0], y[0])

        probes = optax_adascale.fsdp_probes(rows, "data")
        grads, stats = jax.grad(loss_of, argnums=(0, 1))(rows, probes)
        if probes_to_update:
            updates, state = tx.update(grads, state, rows, microbatch_stats=stats)
        else:  # the mistake: the probes' statistics forgotten
            updates, state = tx.update(grads, state, rows)
        return optax.apply_updates(rows, updates), state

    step = jax.jit(
        jax.shard_map(step, mesh=MESH, in_specs=(row_specs, specs, P("data"), P("data")), out_specs=(row_specs, specs))
    )
    log = []
    for x, y in zip(*synthetic_batches(STEPS, N, ROWS), strict=True):
        rows, state = step(rows, state, x, y)
        record(state, log)
    return optax_adascale.fsdp_unshard(rows, shapes), state, np.array(log), step, (rows, state)


def test_fsdp_matches_the_replicated_update():
    params, state, log, _, _ = fsdp_run()
    assert_same((params, state, log), replicated())


def test_fsdp_moves_one_all_gather_and_one_reduce_scatter_of_the_params_and_no_gradient_all_reduce():
    _, _, _, step, (rows, state) = fsdp_run()
    x, y = synthetic_batches(STEPS, N, ROWS)
    text = _hlo.compiled_text(step, rows, state, x[0], y[0])
    counts = _hlo.count_collectives(text)
    assert counts["all-gather"] >= 1 and counts["reduce-scatter"] >= 1
    # One scalar-sized psum of the statistics, the τ clock guard's probe riding in it.
    assert counts["all-reduce"] == 1 and not GUARD_SUMS.findall(text)
    probe = 6 * len(jax.tree.leaves(rows))  # the statistics (2 floats) and the probe: scalar-sized
    assert _hlo.collective_bytes(text, min_elements=2 + probe + 1)["small_all_reduces"] == 1


def test_fsdp_statistics_without_sharded_state_are_an_error():
    tx = optax_adascale.adascale_sgd(0.1, axis_name="data")
    params = init_params()
    stats = lambda g: optax_adascale.MicrobatchStats(jax.tree.map(jnp.sum, g), 1, fsdp=True)  # noqa: E731
    with pytest.raises(ValueError, match="needs the ZeRO layout: adascale\\(..., shard_optimizer_state=n\\)"):
        jax.vmap(lambda g: tx.update(g, tx.init(params), params, microbatch_stats=stats(g)), axis_name="data")(
            jax.tree.map(lambda p: jnp.ones((N,) + p.shape), params)
        )


def test_fsdp_rows_updated_without_the_probes_statistics_are_an_error():
    # Issue 16, bug 3: trained silently with gain 8.0 instead of 2.7.
    with pytest.raises(ValueError, match="the parameters vary over the data axes .*fsdp_probes"):
        fsdp_run(probes_to_update=False)

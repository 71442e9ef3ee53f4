"""noise_scale_monitor: the noise scale for any optimizer, against closed forms and between its paths."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import optax_adascale
from benchmarks import hlo as _hlo
from optax_adascale.core._norms import leaf_sq_norm
from optax_adascale.tools import _noise

# --------------------------------------------------------------------------- closed form


def test_matches_closed_form_noise_scale_on_noisy_quadratic():
    # Per-example gradient H(w − w*) + ξ, ξ ~ N(0, diag(s²)): B_simple = tr(Σ)/|G|² examples.
    d, n, m, steps, tokens = 16, 8, 4, 600, 128
    h = jnp.linspace(0.5, 2.0, d)
    g_true = h * (jnp.linspace(-1.0, 1.0, d) - 0.3)  # H(w − w*) at the fixed w
    s = jnp.linspace(0.5, 1.5, d)
    expected_examples = float(jnp.sum(s**2) / jnp.sum(g_true**2))

    estimator = optax_adascale.Estimator(smoothing=0.999)  # a long memory: the formula is under test
    tx = optax_adascale.noise_scale_monitor(batch_size=n * m, tokens_per_example=tokens, estimator=estimator)
    state = tx.init(jnp.zeros(d))

    def body(state, key):
        xi = jax.random.normal(key, (n, m, d)) * s
        samples = g_true + xi.mean(axis=1)  # each sample: the mean gradient of m examples
        stats = optax_adascale.MicrobatchStats(jnp.mean(jnp.sum(samples**2, axis=1)), n)
        _, state = tx.update(samples.mean(axis=0), state, microbatch_stats=stats)
        return state, None

    state, _ = jax.jit(lambda st: jax.lax.scan(body, st, jax.random.split(jax.random.key(0), steps)))(state)
    got = _noise.metrics(state)
    assert float(got["noise_scale_examples"]) == pytest.approx(expected_examples, rel=0.05)
    assert float(got["noise_scale"]) == pytest.approx(expected_examples / m, rel=0.05)
    assert float(got["noise_scale_tokens"]) == pytest.approx(expected_examples * tokens, rel=0.05)
    assert float(got["grad_var"]) == pytest.approx(float(jnp.sum(s**2)) / m, rel=0.05)  # per sample
    assert float(got["grad_sqr"]) == pytest.approx(float(jnp.sum(g_true**2)), rel=0.05)


def test_one_update_matches_hand_computed_moments():
    # Samples [3, 0], [1, 2], [2, 1]: ḡ = [2, 1], a = (9 + 5 + 5)/3, b = 5.
    samples = jnp.array([[3.0, 0.0], [1.0, 2.0], [2.0, 1.0]])
    a, b, n = 19.0 / 3.0, 5.0, 3
    var = n / (n - 1) * (a - b)
    sqr = b - var / n
    tx = optax_adascale.noise_scale_monitor(batch_size=12, tokens_per_example=10)
    stats = optax_adascale.MicrobatchStats(jnp.mean(jnp.sum(samples**2, axis=1)), n)
    updates, state = tx.update(samples.mean(0), tx.init(jnp.zeros(2)), microbatch_stats=stats)
    got = _noise.metrics(state)
    np.testing.assert_allclose(updates, samples.mean(0))
    np.testing.assert_allclose(got["grad_var"], var, rtol=1e-6)
    np.testing.assert_allclose(got["grad_sqr"], sqr, rtol=1e-6)
    np.testing.assert_allclose(got["noise_scale"], var / sqr, rtol=1e-6)
    np.testing.assert_allclose(got["noise_scale_examples"], 4 * var / sqr, rtol=1e-6)
    np.testing.assert_allclose(got["noise_scale_tokens"], 40 * var / sqr, rtol=1e-6)


def test_equals_adascale_statistics_on_the_same_stream():
    # The same estimator as AdaScale's (S = n), memory (a fraction of τ) included: σ̄², μ̄² agree update by update.
    key = jax.random.key(3)
    params = {"w": jnp.zeros((3, 2)), "b": jnp.zeros(2)}
    estimator = optax_adascale.Estimator(eps=1e-30)
    mon = optax_adascale.noise_scale_monitor(estimator=estimator)
    ada = optax_adascale.adascale(optax.identity(), 0.1, estimator=estimator)
    ms, as_ = mon.init(params), ada.init(params)
    mon_step = jax.jit(lambda g, s, st: mon.update(g, s, params, microbatch_stats=st)[1])
    ada_step = jax.jit(lambda g, s, st: ada.update(g, s, params, microbatch_stats=st)[1])
    for t in range(6):
        k = jax.random.fold_in(key, t)
        samples = jax.tree.map(lambda p: jax.random.normal(k, (4,) + p.shape) + 1.0, params)  # noqa: B023
        grads = jax.tree.map(lambda x: x.mean(0), samples)
        stats = optax_adascale.MicrobatchStats(jax.tree.map(lambda x: jnp.mean(jax.vmap(leaf_sq_norm)(x)), samples), 4)
        ms = mon_step(grads, ms, stats)
        as_ = ada_step(grads, as_, stats)
        mine, theirs = _noise.metrics(ms), optax_adascale.metrics(as_)
        for key_ in ("grad_var", "grad_sqr", "noise_scale"):
            np.testing.assert_allclose(mine[key_], theirs[key_], rtol=1e-6)


# --------------------------------------------------------------------------- the per-replica paths


def _loss(params, x):
    return jnp.mean((x @ params["w"] + params["b"] - 1.0) ** 2)


def _data():
    params = {"w": jnp.full((4, 3), 0.1, jnp.float32), "b": jnp.zeros(3, jnp.float32)}
    xs = jax.random.normal(jax.random.key(1), (3, 32, 4))  # 3 updates of 32 rows
    return params, xs


def _reduced_run(tx, params, xs, k, loss=_loss):
    fn = optax_adascale.value_and_grad(loss, num_microbatches=k)

    @jax.jit
    def step(state, x):
        _, grads, stats = fn(params, x)
        return tx.update(grads, state, params, microbatch_stats=stats)[1]

    state = tx.init(params)
    for x in xs:
        state = step(state, x)
    return state


@pytest.mark.parametrize("own_pmean", [False, True], ids=["monitor_reduces", "user_pmean_first"])
def test_vmap_replicas_equal_the_reduced_path(own_pmean):
    # With axis_name the monitor averages the replicas' gradients itself (0.2 took them as given and, fed
    # per-replica gradients, read the noise scale 3.4x low); a pmean before it is harmless.
    params, xs = _data()
    ref = _reduced_run(optax_adascale.noise_scale_monitor(batch_size=32), params, xs, 8)
    tx = optax_adascale.noise_scale_monitor(axis_name="data", batch_size=32)
    fn = optax_adascale.value_and_grad(_loss, num_microbatches=2)

    def step(state, x):  # x: this replica's 8 rows
        _, grads, stats = fn(params, x)
        if own_pmean:
            grads = jax.lax.pmean(grads, "data")
        return tx.update(grads, state, params, microbatch_stats=stats)

    vstep = jax.jit(jax.vmap(step, in_axes=(None, 0), out_axes=(0, None), axis_name="data"))
    state = tx.init(params)
    for x in xs:
        passed, state = vstep(state, x.reshape(4, 8, 4))
    for key, value in _noise.metrics(ref).items():
        np.testing.assert_allclose(_noise.metrics(state)[key], value, rtol=1e-5, err_msg=key)
    _, mean, _ = fn(params, xs[-1])  # what the monitor hands on: the averaged gradient, on every replica
    jax.tree.map(
        lambda got, want: np.testing.assert_allclose(got, np.broadcast_to(want, got.shape), rtol=1e-5), passed, mean
    )


def _shard_map_step(tx, params, fn, mesh, axis="data", own_pmean=True):
    def step(state, x):
        p = jax.lax.pcast(params, axis, to="varying")
        _, grads, stats = fn(p, x)
        if own_pmean:
            grads = jax.lax.pmean(grads, axis)
        return tx.update(grads, state, params, microbatch_stats=stats)

    return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(axis)), out_specs=(P(), P())))


@pytest.mark.parametrize("own_pmean", [False, True], ids=["monitor_reduces", "user_pmean_first"])
def test_shard_map_replicas_equal_the_reduced_path(own_pmean):
    params, xs = _data()
    ref = _reduced_run(optax_adascale.noise_scale_monitor(batch_size=32), params, xs, 8)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("data",))
    tx = optax_adascale.noise_scale_monitor(axis_name="data", batch_size=32)
    fn = optax_adascale.value_and_grad(_loss, num_microbatches=2)
    step = _shard_map_step(tx, params, fn, mesh, own_pmean=own_pmean)
    state = tx.init(params)
    for x in xs:
        _, state = step(state, x)
    for key, value in _noise.metrics(ref).items():
        np.testing.assert_allclose(_noise.metrics(state)[key], value, rtol=1e-5, err_msg=key)


def test_adds_only_a_scalar_collective_to_the_users_step():
    # The user's pmap-style step (pmean of the gradients, then adamw) with and without the monitor.
    params = {"w": jnp.zeros((64, 32)), "b": jnp.zeros(32)}
    x = jax.random.normal(jax.random.key(2), (64, 64))
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    fn = optax_adascale.value_and_grad(lambda p, x: jnp.mean((x @ p["w"] + p["b"]) ** 2), num_microbatches=1)
    texts = {}
    for name, tx in [
        ("adamw", optax.adamw(1e-3)),
        ("monitor", optax.chain(optax_adascale.noise_scale_monitor(axis_name="data"), optax.adamw(1e-3))),
    ]:
        step = _shard_map_step(tx, params, fn, mesh)
        texts[name] = _hlo.compiled_text(step, tx.init(params), x)
    base, mon = _hlo.collective_bytes(texts["adamw"]), _hlo.collective_bytes(texts["monitor"])
    assert base["large_bytes"] > 0  # the gradient all-reduce is seen
    assert mon["large_bytes"] == base["large_bytes"]
    assert mon["small_all_reduces"] - base["small_all_reduces"] <= 1
    assert _hlo.count_host_callbacks(texts["monitor"]) == 0


# --------------------------------------------------------------------------- with an optimizer


def test_chained_with_adamw_leaves_its_updates_bit_identical():
    params, xs = _data()
    fn = optax_adascale.value_and_grad(_loss, num_microbatches=4)
    plain = optax.adamw(1e-2, weight_decay=1e-2)
    chained = optax.chain(optax_adascale.noise_scale_monitor(batch_size=32), optax.adamw(1e-2, weight_decay=1e-2))

    @jax.jit
    def step_plain(params, state, x):
        _, grads, _ = fn(params, x)
        updates, state = plain.update(grads, state, params)
        return optax.apply_updates(params, updates), state, updates

    @jax.jit
    def step_chained(params, state, x):
        _, grads, stats = fn(params, x)
        updates, state = chained.update(grads, state, params, microbatch_stats=stats)
        return optax.apply_updates(params, updates), state, updates

    p1, s1 = params, plain.init(params)
    p2, s2 = params, chained.init(params)
    for x in xs:
        p1, s1, u1 = step_plain(p1, s1, x)
        p2, s2, u2 = step_chained(p2, s2, x)
        jax.tree.map(np.testing.assert_array_equal, u1, u2)
    jax.tree.map(np.testing.assert_array_equal, s1, s2[1])
    assert np.isfinite(_noise.metrics(s2)["noise_scale"])


def test_jit_compiles_once_and_keeps_state_types():
    params, xs = _data()
    fn = optax_adascale.value_and_grad(_loss, num_microbatches=4)
    tx = optax.chain(optax_adascale.noise_scale_monitor(batch_size=32, tokens_per_example=8), optax.sgd(0.1))
    traces = []

    @jax.jit
    def step(params, state, x):
        traces.append(1)
        _, grads, stats = fn(params, x)
        updates, state = tx.update(grads, state, params, microbatch_stats=stats)
        return optax.apply_updates(params, updates), state

    state0 = tx.init(params)
    state = state0
    for x in xs:
        params, state = step(params, state, x)
    assert len(traces) == 1
    assert jax.tree.map(lambda a: (a.shape, a.dtype), state) == jax.tree.map(lambda a: (a.shape, a.dtype), state0)


# --------------------------------------------------------------------------- one sample, bad input, readers


def test_one_sample_warns_passes_through_and_reads_not_measured():
    tx = optax.chain(optax_adascale.noise_scale_monitor(batch_size=8), optax.sgd(1.0))
    params = jnp.zeros(2)
    stats = optax_adascale.MicrobatchStats(jnp.float32(2.0), 1)
    with pytest.warns(UserWarning, match="n = 1 gradient sample"):
        updates, state = tx.update(jnp.ones(2), tx.init(params), params, microbatch_stats=stats)
    np.testing.assert_array_equal(updates, -jnp.ones(2))
    got = _noise.metrics(state)
    assert np.isnan(float(got["noise_scale"])) and np.isnan(float(got["noise_scale_examples"]))
    assert not bool(got["noise_scale_measured"])
    assert int(_noise.get_noise_state(state).count) == 0


def test_noise_scales_are_not_measured_before_the_first_update_and_nan_without_sizes():
    tx = optax_adascale.noise_scale_monitor()
    state = tx.init(jnp.zeros(2))
    got = _noise.metrics(state)
    assert np.isnan(float(got["noise_scale"])) and not bool(got["noise_scale_measured"])
    stats = optax_adascale.MicrobatchStats(jnp.float32(3.0), 2)
    _, state = tx.update(jnp.ones(2), state, microbatch_stats=stats)
    got = _noise.metrics(state)
    assert float(got["noise_scale"]) == pytest.approx(2.0) and bool(got["noise_scale_measured"])
    assert np.isnan(got["noise_scale_examples"]) and np.isnan(got["noise_scale_tokens"])


def test_non_finite_statistics_are_left_out():
    tx = optax_adascale.noise_scale_monitor()
    stats = optax_adascale.MicrobatchStats(jnp.float32(3.0), 2)
    _, state = tx.update(jnp.ones(2), tx.init(jnp.zeros(2)), microbatch_stats=stats)
    bad = optax_adascale.MicrobatchStats(jnp.float32(jnp.inf), 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, after = tx.update(jnp.ones(2), state, microbatch_stats=bad)
    jax.tree.map(np.testing.assert_array_equal, after, state)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(batch_size=0), ValueError, "batch_size"),
        (dict(batch_size=8.0), TypeError, "batch_size"),
        (dict(tokens_per_example=-1), ValueError, "tokens_per_example"),
        (dict(smoothing=1.0), ValueError, "smoothing"),
    ],
)
def test_bad_arguments_raise(kwargs, error, match):
    with pytest.raises(error, match=match):
        optax_adascale.noise_scale_monitor(**kwargs)


def test_batch_size_not_a_multiple_of_the_samples_raises():
    tx = optax_adascale.noise_scale_monitor(batch_size=30)
    with pytest.raises(ValueError, match=r"batch_size=30 .* n=4"):
        tx.update(jnp.ones(2), tx.init(jnp.zeros(2)), microbatch_stats=optax_adascale.MicrobatchStats(1.0, 4))


def test_missing_statistics_raise():
    tx = optax.chain(optax_adascale.noise_scale_monitor(), optax.adamw(1e-3))
    with pytest.raises(TypeError, match="microbatch_stats=stats"):
        tx.update(jnp.ones(2), tx.init(jnp.zeros(2)), jnp.zeros(2))


def test_statistics_shaped_unlike_the_gradients_raise():
    tx = optax_adascale.noise_scale_monitor()
    stats = optax_adascale.MicrobatchStats({"a": 1.0, "b": 1.0}, 2)
    with pytest.raises(ValueError, match="structure of the gradients"):
        tx.update({"a": jnp.ones(2)}, tx.init(None), microbatch_stats=stats)


def test_reader_finds_the_state_in_nested_and_restored_states():
    inner = optax.chain(optax_adascale.noise_scale_monitor(), optax.adamw(1e-3))
    tx = optax.multi_transform({"a": inner, "b": optax.set_to_zero()}, {"x": "a", "y": "b"})
    params = {"x": jnp.zeros(2), "y": jnp.zeros(1)}
    state = tx.init(params)
    assert isinstance(_noise.get_noise_state(state), optax_adascale.NoiseScaleState)
    restored = jax.tree.map(np.asarray, {"opt": {"0": _noise.get_noise_state(state)._asdict()}})
    assert int(_noise.get_noise_state(restored).count) == 0
    with pytest.raises(ValueError, match="NoiseScaleState"):
        _noise.metrics(optax.adamw(1e-3).init(params))


def test_tensor_parallel_replicas_equal_the_reduced_path():
    # w split over a model axis: each device's squared norms are partial; the monitor sums them.
    _, xs = _data()
    params = {"w": jnp.full((4, 4), 0.1, jnp.float32), "b": jnp.full(4, 0.3, jnp.float32)}
    ref = _reduced_run(optax_adascale.noise_scale_monitor(batch_size=32), params, xs, 8, _tp_loss)
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    tx = optax_adascale.noise_scale_monitor(axis_name="data", batch_size=32)
    fn = optax_adascale.value_and_grad(_tp_loss, num_microbatches=2)
    specs = {"w": P(None, "model"), "b": P()}

    def step(state, params, x):
        _, grads, stats = fn(jax.lax.pcast(params, "data", to="varying"), x)
        return tx.update(jax.lax.pmean(grads, "data"), state, params, microbatch_stats=stats)[1]

    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P("data")), out_specs=P()))
    state = tx.init(params)
    for x in xs:
        state = f(state, params, x)
    for key, value in _noise.metrics(ref).items():
        np.testing.assert_allclose(_noise.metrics(state)[key], value, rtol=1e-5, err_msg=key)


def _tp_loss(params, x):
    """A loss whose w columns may be split over "model" (inside shard_map) or whole (outside)."""
    h = x @ params["w"]
    try:
        total = jax.lax.psum(jnp.sum((h - 1.0) ** 2, axis=-1), "model")
    except NameError:  # outside shard_map: w is whole
        total = jnp.sum((h - 1.0) ** 2, axis=-1)
    return jnp.mean(total) + jnp.sum(params["b"] ** 2)


def test_under_gspmd_adds_no_gradient_sized_collective():
    # axis_name=None, jit over FSDP-sharded gradients: ‖ḡ‖² is a partial sum per device plus a scalar all-reduce.
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    shard = jax.sharding.NamedSharding(mesh, P("data"))
    params = {"w": jax.device_put(jnp.zeros((64, 32)), shard), "b": jax.device_put(jnp.zeros(64), shard)}
    stats = optax_adascale.MicrobatchStats({"w": jnp.float32(1.0), "b": jnp.float32(1.0)}, 8)
    texts = {}
    for name, tx in [
        ("adamw", optax.adamw(1e-3)),
        ("monitor", optax.chain(optax_adascale.noise_scale_monitor(), optax.adamw(1e-3))),
    ]:

        def step(grads, state, stats, tx=tx):
            return tx.update(grads, state, params, microbatch_stats=stats)

        texts[name] = _hlo.compiled_text(jax.jit(step), params, jax.jit(tx.init)(params), stats)
    base, mon = _hlo.collective_bytes(texts["adamw"]), _hlo.collective_bytes(texts["monitor"])
    assert mon["large_bytes"] == base["large_bytes"] == 0
    assert mon["small_all_reduces"] - base["small_all_reduces"] == 1

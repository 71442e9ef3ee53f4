"""The bugs of issue 16's review, one behaviour per test (the lead redistributes them by concern).

Each test failed on the code before its fix; the docstring or comment says against what truth it checks.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_adascale

PARAMS = jnp.zeros(3)


def vmap_update(tx, grads, state, params):
    """``tx.update`` with the replicas as a vmap axis ``"i"`` (one gradient row per replica)."""
    return jax.vmap(tx.update, in_axes=(0, None, None), out_axes=(None, None), axis_name="i")(grads, state, params)


# --------------------------------------------------------------------------- bug 4: a long horizon


def test_a_horizon_beyond_float32_resolution_averages_the_samples():
    # H = 1e9: θ = exp(−r/H) rounds to 1.0 in float32. As H → ∞, 1 − θ_t → r_{t−1}/H, so the debiased
    # average tends to the mean of the samples weighted by the previous gain; computed by hand from
    # each step's a and b.
    rng = np.random.default_rng(0)
    grads = rng.normal(size=(6, 2, 3)).astype(np.float32) + np.float32(0.5)
    tx = optax_adascale.adascale(optax.identity(), 0.1, axis_name="i", horizon=1e9)
    state = tx.init(PARAMS)
    var_sum = sqr_sum = total = 0.0
    for g in grads:
        weight = float(state.gain)  # r_{t−1}: 1 before the first update
        _, state = vmap_update(tx, jnp.asarray(g), state, PARAMS)
        a = np.mean(np.sum(g.astype(np.float64) ** 2, axis=1))
        b = np.sum(np.mean(g.astype(np.float64), axis=0) ** 2)
        var = max(2 / (2 - 1) * (a - b), 1e-6)
        var_sum += weight * var
        sqr_sum += weight * max(b - var / 2, 0.0)
        total += weight
        v, m = var_sum / total, sqr_sum / total
        expected = min(max((v + m) / (v / 2 + m), 1.0), 2.0)
        assert float(optax_adascale.metrics(state)["gain"]) == pytest.approx(expected, rel=1e-4)
    assert float(optax_adascale.metrics(state)["gain"]) > 1.05  # not the stuck gain of 1


def test_a_horizon_beyond_float32_resolution_reports_a_finite_noise_scale():
    rng = np.random.default_rng(1)
    tx = optax_adascale.adascale(optax.identity(), 0.1, axis_name="i", horizon=1e9)
    state = tx.init(PARAMS)
    for _ in range(3):
        _, state = vmap_update(tx, jnp.asarray(rng.normal(size=(2, 3)), jnp.float32) + 1.0, state, PARAMS)
    m = optax_adascale.metrics(state)
    assert np.isfinite(float(m["grad_var"])) and float(m["grad_var"]) > 0
    assert 0 < float(m["noise_scale"]) < np.inf


def test_noise_scale_of_a_non_finite_state_is_nan_not_zero():
    state = optax_adascale.adascale_sgd(0.1, accumulation_steps=2).init(PARAMS)
    state = state._replace(grad_var=jnp.float32(np.nan), grad_sqr=jnp.float32(np.nan))
    assert np.isnan(float(optax_adascale.metrics(state)["noise_scale"]))


def test_non_finite_moving_averages_skip_the_update():
    # A state whose averages are NaN (e.g. restored from a broken run) must not produce updates.
    tx = optax_adascale.adascale(optax.identity(), 0.1, axis_name="i")
    state = tx.init(PARAMS)._replace(grad_var=jnp.float32(np.nan), ema_weight=jnp.float32(0.5))
    updates, new_state = vmap_update(tx, jnp.eye(2, 3), state, PARAMS)
    np.testing.assert_array_equal(np.asarray(updates), 0.0)
    assert int(new_state.skipped_steps) == 1 and int(new_state.count) == 0


# --------------------------------------------------------------------------- bug 5: horizon's shape


@pytest.mark.parametrize(
    "horizon", [(2.0, None), (1, 2, 3), (2.0,), ()], ids=["none_inside", "triple", "single", "empty"]
)
def test_a_horizon_tuple_that_is_not_a_pair_of_numbers_is_rejected_at_construction(horizon):
    with pytest.raises((ValueError, TypeError), match=r"horizon.*got horizon="):
        optax_adascale.adascale(optax.identity(), 0.1, axis_name="i", horizon=horizon)


# --------------------------------------------------------------------------- bug 6: pmap without the right axis


@pytest.mark.parametrize("axis_name", [None, "data"])
def test_pmap_over_an_axis_the_optimizer_does_not_name_says_to_set_axis_name(axis_name):
    tx = optax_adascale.adascale_sgd(0.1, axis_name=axis_name)
    step = jax.pmap(lambda g, s: tx.update(g, s, PARAMS), axis_name="batch", in_axes=(0, None))
    with pytest.raises(ValueError, match=r"axis_name=.*'batch'") as err:
        step(jnp.ones((2, 3)), tx.init(PARAMS))
    assert f"axis_name={axis_name!r}" in str(err.value)


# --------------------------------------------------------------------------- bug 8: smaller ones


def test_a_constant_learning_rate_of_zero_warns_naming_learning_rate():
    with pytest.warns(UserWarning, match=r"learning_rate=0"):
        optax_adascale.adascale_sgd(0.0, axis_name="i")


def test_a_learning_rate_schedule_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optax_adascale.adascale_sgd(optax.constant_schedule(0.0), axis_name="i")
        optax_adascale.adascale_sgd(0.1, axis_name="i")


def test_the_single_replica_warning_points_at_the_users_call_through_the_flax_train_state():
    from optax_adascale.flax import TrainState

    params = {"w": PARAMS}
    state = TrainState.create(apply_fn=None, params=params, tx=optax_adascale.adascale_sgd(0.1, axis_name="i"))

    def step(state, grads):
        return state.apply_gradients(grads=grads)  # the user's call

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax.vmap(step, in_axes=(None, 0), out_axes=None, axis_name="i")(state, {"w": jnp.ones((1, 3))})
    found = [w for w in caught if "single replica" in str(w.message)]
    assert found and found[0].filename == __file__


def test_the_single_replica_warning_points_at_the_users_call_of_update():
    tx = optax_adascale.adascale_sgd(0.1, axis_name="i")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        vmap_update(tx, jnp.ones((1, 3)), tx.init(PARAMS), PARAMS)
    found = [w for w in caught if "single replica" in str(w.message)]
    assert found and found[0].filename == __file__


def test_a_state_from_an_inner_of_another_structure_is_a_value_error_naming_transfer_state():
    tx = optax_adascale.adascale(optax.trace(0.9), 0.1, accumulation_steps=2)
    other = optax_adascale.adascale(optax.identity(), 0.1, accumulation_steps=2).init(PARAMS)
    with pytest.raises(ValueError, match=r"opt_state does not match this transformation.*transfer_state"):
        tx.update(jnp.ones(3), other, PARAMS)


def test_a_state_that_is_not_adascales_is_a_value_error_naming_transfer_state():
    tx = optax_adascale.adascale_sgd(0.1, accumulation_steps=2)
    with pytest.raises(ValueError, match=r"opt_state does not match this transformation.*transfer_state"):
        tx.update(jnp.ones(3), optax.sgd(0.1).init(PARAMS), PARAMS)


@pytest.mark.parametrize("labelled_source", [True, False], ids=["labelled_to_plain", "plain_to_labelled"])
def test_transfer_state_between_labelled_and_unlabelled_names_param_labels(labelled_source):
    params = {"a": jnp.zeros(2), "b": jnp.zeros(3)}
    labelled = optax_adascale.adascale_sgd(0.1, accumulation_steps=2, param_labels={"a": "x", "b": "y"})
    plain = optax_adascale.adascale_sgd(0.1, accumulation_steps=2)
    source, target = (labelled, plain) if labelled_source else (plain, labelled)
    with pytest.raises(ValueError, match=r"param_labels"):
        optax_adascale.transfer_state(source.init(params), target.init(params))


# --------------------------------------------------------------------------- bug 2: ZeRO's check of inner

ZERO_N = 8
ZERO_PARAMS = {"w": jnp.full((8, 8), 0.5), "b": jnp.full((8,), 0.5)}  # 64 and 8 elements: rows of 8 and 1


def zero_vs_replicated(inner_of, grads, **update_kwargs):
    """Updates of ``adascale(inner_of(zero))`` with and without ``shard_optimizer_state`` (vmap replicas)."""
    out = []
    for zero in (True, False):
        tx = optax_adascale.adascale(
            inner_of(zero), 0.1, axis_name="data", shard_optimizer_state=ZERO_N if zero else None
        )
        state = tx.init(ZERO_PARAMS)
        axes = optax_adascale.state_axes(state)
        step = jax.vmap(
            lambda g, s, p, tx=tx: tx.update(g, s, p, **update_kwargs),
            in_axes=(0, axes, None),
            out_axes=(None, axes),
            axis_name="data",
        )
        out.append(step(grads, state, ZERO_PARAMS)[0])
    return out


def zero_grads(scale):
    rng = np.random.default_rng(2)
    return jax.tree.map(
        lambda p: jnp.asarray(scale * (1 + rng.normal(size=(ZERO_N, *p.shape))), jnp.float32), ZERO_PARAMS
    )


def test_zero_rejects_a_mask_computed_from_sizes_that_rows_change():
    # `x.size > 16` is True for w (64 elements) but False for its ZeRO rows (8 elements): w's decay would vanish.
    inner = optax.chain(
        optax.add_decayed_weights(1e-2, mask=lambda p: jax.tree.map(lambda x: x.size > 16, p)), optax.trace(0.9)
    )
    tx = optax_adascale.adascale(inner, 0.1, axis_name="data", shard_optimizer_state=ZERO_N)
    with pytest.raises(ValueError, match=r"shard_optimizer_state.*masks and labels must be given as trees"):
        tx.init(ZERO_PARAMS)


def test_zero_rejects_optax_clip_by_global_norm_with_a_large_threshold():
    # Clipping at 1e6 acts on gradients of norm ~3e6 (entries ~3e5): per-row norms would clip differently.
    tx = optax_adascale.adascale(optax.clip_by_global_norm(1e6), 0.1, axis_name="data", shard_optimizer_state=ZERO_N)
    with pytest.raises(ValueError, match=r"optax_adascale\.clip_by_global_norm"):
        tx.init(ZERO_PARAMS)


def test_zero_shard_aware_clip_with_a_large_threshold_equals_the_replicated_optax_clip():
    grads = zero_grads(3e5)
    sharded, replicated = zero_vs_replicated(
        lambda zero: optax_adascale.clip_by_global_norm(1e6) if zero else optax.clip_by_global_norm(1e6), grads
    )
    jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-5), sharded, replicated)
    assert float(optax.tree.norm(jax.tree.map(lambda g: g.mean(0), grads))) > 1e6  # the clip was active


def test_zero_refuses_an_inner_it_cannot_run_naming_elementwise():
    # scale_by_polyak needs the loss (`value=`) as an extra argument: the check cannot run it.
    tx = optax_adascale.adascale(optax.scale_by_polyak(), 0.1, axis_name="data", shard_optimizer_state=ZERO_N)
    with pytest.raises(ValueError, match=r"optax_adascale\.elementwise\(inner\)"):
        tx.init(ZERO_PARAMS)


def _scale_by_loss():
    """An elementwise inner that needs an extra argument: the update is ``loss · g``."""

    def update(updates, state, params=None, *, loss, **extra):
        del params, extra
        return jax.tree.map(lambda g: loss * g, updates), state

    return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)


def test_an_inner_declared_elementwise_trains_under_zero_as_replicated():
    sharded, replicated = zero_vs_replicated(
        lambda zero: optax_adascale.elementwise(_scale_by_loss()) if zero else _scale_by_loss(),
        zero_grads(1.0),
        loss=jnp.float32(3.0),
    )
    jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-8), sharded, replicated)


def test_elementwise_returns_a_gradient_transformation_with_extra_args():
    tx = optax_adascale.elementwise(optax.trace(0.9))
    assert isinstance(tx, optax.GradientTransformationExtraArgs)
    np.testing.assert_array_equal(tx.update(jnp.ones(2), tx.init(jnp.zeros(2)))[0], jnp.ones(2))


# --------------------------------------------------------------------------- bug 1: clipping with TP-split params

from jax.sharding import PartitionSpec as P  # noqa: E402

TP_MESH = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
TP = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None), "b2": P()}


def tp_params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "w1": jax.random.normal(k1, (8, 16)) * 0.5,
        "b1": jnp.zeros(16),
        "w2": jax.random.normal(k2, (16, 4)) * 0.5,
        "b2": jnp.full(4, 0.1),
    }


def tp_grads():
    """Per-replica gradients ``(4, ...)`` of a small MLP, whole (the truth sees them unsplit)."""

    def loss(p, x, y):
        h = jnp.tanh(x @ p["w1"] + p["b1"])
        return optax.softmax_cross_entropy_with_integer_labels(h @ p["w2"] + p["b2"], y).mean()

    x = jax.random.normal(jax.random.key(1), (4, 4, 8))
    y = jax.random.randint(jax.random.key(2), (4, 4), 0, 4)
    return jax.vmap(jax.grad(loss), in_axes=(None, 0, 0))(tp_params(), x, y)


def tp_update(inner, *, check_vma, param_specs=None):
    """AdaScale alone under shard_map over (data, model), fed each shard's piece of the replica gradients."""
    tx = optax_adascale.adascale(inner, 0.1, axis_name="data", param_specs=param_specs)
    params = tp_params()
    specs = optax_adascale.state_partition_specs(tx.init(params), "data", TP, tx=tx)
    grad_specs = {k: P("data", *tuple(s)) for k, s in TP.items()}

    def step(params, state, grads):
        return tx.update(jax.tree.map(lambda g: g[0], grads), state, params)

    f = jax.jit(
        jax.shard_map(step, mesh=TP_MESH, in_specs=(TP, specs, grad_specs), out_specs=(TP, specs), check_vma=check_vma)
    )
    return f(params, tx.init(params), tp_grads())


def tp_reference(inner):
    tx = optax_adascale.adascale(inner, 0.1, axis_name="data")
    params = tp_params()
    return jax.vmap(tx.update, in_axes=(0, None, None), out_axes=(None, None), axis_name="data")(
        tp_grads(), tx.init(params), params
    )


CLIP = 0.05
VMA_CASES = {"check_vma": dict(check_vma=True), "param_specs": dict(check_vma=False, param_specs=TP)}


@pytest.mark.parametrize("case", VMA_CASES)
def test_shard_aware_clip_in_inner_clips_tensor_parallel_params_by_the_global_norm(case):
    updates, state = tp_update(
        optax.chain(optax_adascale.clip_by_global_norm(CLIP), optax.trace(0.9)), **VMA_CASES[case]
    )
    ref_updates, ref_state = tp_reference(optax.chain(optax.clip_by_global_norm(CLIP), optax.trace(0.9)))
    mean_norm = float(optax.tree.norm(jax.tree.map(lambda g: g.mean(0), tp_grads())))
    assert mean_norm > 2 * CLIP  # the clip is active
    assert float(state.gain) == pytest.approx(float(ref_state.gain), rel=1e-6)
    for k in ref_updates:
        np.testing.assert_allclose(updates[k], ref_updates[k], rtol=1e-5, atol=1e-7, err_msg=k)


@pytest.mark.parametrize("case", VMA_CASES)
def test_optax_clip_in_inner_with_tensor_parallel_params_is_refused_naming_the_shard_aware_clip(case):
    with pytest.raises(ValueError, match=r"optax_adascale\.clip_by_global_norm"):
        tp_update(optax.chain(optax.clip_by_global_norm(CLIP), optax.trace(0.9)), **VMA_CASES[case])


def test_an_elementwise_inner_with_tensor_parallel_params_is_not_refused():
    inner = optax.chain(
        optax.add_decayed_weights(1e-2, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)), optax.trace(0.9)
    )
    updates, _ = tp_update(inner, check_vma=True)
    ref_updates, _ = tp_reference(inner)
    for k in ref_updates:
        np.testing.assert_allclose(updates[k], ref_updates[k], rtol=1e-5, atol=1e-7, err_msg=k)

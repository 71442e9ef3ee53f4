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


@pytest.mark.parametrize("horizon", [(2.0, None), (1, 2, 3), (2.0,), ()], ids=["none_inside", "triple", "single", "empty"])
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

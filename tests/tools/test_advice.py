"""What ``done()`` tells a user once the statistics have settled: what a larger S buys (a batch well above the noise
scale), and a learning rate at the edge of stability at the base batch (a schedule multiplied by S). Both warnings
name their numbers, read from the state against values computed here."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import replica_update

import optax_adascale
from optax_adascale import _state


@pytest.fixture(autouse=True)
def fresh_advice(monkeypatch):
    monkeypatch.setattr(_state, "_ADVISED", set())


def _run(lr, n, noise, updates, h=1.0):
    """``adascale_sgd(lr, momentum=0.9)`` on ``½ Σ h_i x_i²`` in 4 dimensions with ``n`` replicas whose gradients
    carry independent noise of scale ``noise`` (both per dimension, or scalars); ``done()`` called after every
    update, as a loop does."""
    tx = optax_adascale.adascale_sgd(lr, momentum=0.9, axis_name="i")
    update = replica_update(tx)
    x, state, rng = jnp.ones(4), tx.init(jnp.ones(4)), np.random.default_rng(0)
    for _ in range(updates):
        g = h * x + noise * rng.normal(size=(n, 4)).astype(np.float32)
        u, state = update(jnp.asarray(g), state, x)
        x = optax.apply_updates(x, u)
        optax_adascale.done(state, 4 * updates)  # a quarter of the budget: the advice's reading
    return state


def test_a_batch_well_above_the_noise_scale_is_said_once_with_its_numbers():
    """Little noise against the gradient: 16 replicas' gradients nearly agree, the gain stays near 1, the efficiency
    r/S near 1/16 (read at a quarter of the budget)."""
    with pytest.warns(UserWarning, match=r"after \d+ updates, at S = 16 each update is worth r = [\d.]+") as seen:
        state = _run(1e-3, 16, 0.05, 60)
    said = [str(w.message) for w in seen if "noise scale" in str(w.message)]
    assert len(said) == 1  # once
    m = optax_adascale.metrics(state)
    assert float(m["estimated_gain"]) / 16 < _state.LOW_EFFICIENCY
    assert f"B = {float(m['noise_scale']):.3g}" in optax_adascale.scale_advice(state)
    assert "critical batch" in said[0] and "goodput.choose_scale" in said[0]
    # What 2S and 4S would buy, by the paper's gain with these statistics: r = S(1 + B)/(S + B), B = σ̄²/μ̄²
    b = float(m["grad_var"]) / float(m["grad_sqr"])
    for at in (32, 64):
        assert f"r ≈ {at * (1 + b) / (at + b):.3g} at S = {at}" in said[0]
    assert "S is above it" in said[0]


def test_a_schedule_multiplied_by_s_is_said_when_the_guard_holds_the_gain_near_one():
    """lr·h = 1.9 (at the edge of the τ clock's stability at the base batch, as a base rate multiplied by S would
    be), 64 noisy replicas that make the estimator ask for a gain near 4: the guard holds it near 1 and done() says
    why."""
    with pytest.warns(UserWarning, match=r"stability guard holds the gain at [\d.]+ where the estimator asks"):
        state = _run(0.19, 64, 30.0, 60, h=10.0)
    m = optax_adascale.metrics(state)
    assert float(m["gain_limit"]) <= _state.PINNED_LIMIT and float(m["estimated_gain"]) >= _state.PINNED_ESTIMATE


def test_a_run_that_buys_what_it_pays_for_is_not_warned():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _run(1e-3, 8, 3.0, 60)  # noise-dominated: the gain near S, efficiency near 1; the cap far above

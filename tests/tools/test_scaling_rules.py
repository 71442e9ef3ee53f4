"""Tests of the fixed scaling rules (paper baselines) against hand-derived values."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from optax_adascale import scaling_rules

LR0 = 0.1
HALF_LIFE = 100  # exponential base schedule: lr(t) = 0.1 · 0.5^(t/100)


def exponential():
    return optax.exponential_decay(LR0, transition_steps=HALF_LIFE, decay_rate=0.5)


def exp_value(t):
    return LR0 * 0.5 ** (t / HALF_LIFE)


def assert_close(actual, expected, rtol=1e-6):
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=rtol, atol=0)


# --------------------------------------------------------------------------- identity, linear, square root


@pytest.mark.parametrize("t", [0, 7, 50, 300])
def test_identity_returns_base_schedule(t):
    assert_close(scaling_rules.identity(exponential())(t), exp_value(t))
    assert_close(scaling_rules.identity(LR0)(t), LR0)


@pytest.mark.parametrize("scale", [1, 2, 8, 3.5])
@pytest.mark.parametrize("t", [0, 5, 25])
def test_linear_is_scale_times_lr_at_scaled_step(scale, t):
    assert_close(scaling_rules.linear(LR0, scale)(t), scale * LR0)
    assert_close(scaling_rules.linear(exponential(), scale)(t), scale * exp_value(scale * t))


@pytest.mark.parametrize("scale", [1, 4, 9])
@pytest.mark.parametrize("t", [0, 5, 25])
def test_square_root_is_sqrt_scale_times_lr_at_scaled_step(scale, t):
    assert_close(scaling_rules.square_root(LR0, scale)(t), math.sqrt(scale) * LR0)
    assert_close(scaling_rules.square_root(exponential(), scale)(t), math.sqrt(scale) * exp_value(scale * t))


def test_linear_with_exponential_base_halves_every_half_life_over_scale():
    # S = 4: lr(4t) halves every 25 iterations.
    schedule = scaling_rules.linear(exponential(), 4)
    assert_close([schedule(0), schedule(25), schedule(50)], [0.4, 0.2, 0.1])


# --------------------------------------------------------------------------- LSW


def test_linear_warmup_ramp_endpoints_and_midpoint_for_constant_base():
    # T = 2000, S = 10: 200 iterations, ramp over W = 0.055 · 200 = 11 of them.
    schedule = scaling_rules.linear_warmup(LR0, 10, total_steps=2000)
    assert_close(schedule(0), LR0)
    assert_close(schedule(5.5), LR0 * (1 + 10) / 2)  # midpoint: (lr(0) + S·lr(0)) / 2
    assert_close(schedule(11), 10 * LR0)
    assert_close(schedule(150), 10 * LR0)


def test_linear_warmup_ramp_is_linear_in_the_iteration():
    schedule = scaling_rules.linear_warmup(LR0, 10, total_steps=2000)
    t = np.linspace(0.0, 11.0, 23)
    expected = LR0 * (1 + (10 - 1) * t / 11)
    assert_close(jax.jit(jax.vmap(schedule))(jnp.asarray(t)), expected, rtol=1e-5)


def test_linear_warmup_uses_ceil_of_iterations():
    # T = 1000, S = 3: ⌈1000/3⌉ = 334 iterations, W = 0.055 · 334 = 18.37.
    schedule = scaling_rules.linear_warmup(LR0, 3, total_steps=1000)
    w = 0.055 * 334
    assert_close(schedule(9), LR0 * (1 + 2 * 9 / w), rtol=1e-5)
    assert_close(schedule(18), LR0 * (1 + 2 * 18 / w), rtol=1e-5)
    assert_close(schedule(19), 3 * LR0)


def test_linear_warmup_after_ramp_follows_linear_rule():
    schedule = scaling_rules.linear_warmup(exponential(), 4, total_steps=1000)  # W = 0.055 · 250 = 13.75
    linear = scaling_rules.linear(exponential(), 4)
    for t in (14, 25, 100, 249):
        assert_close(schedule(t), linear(t))


def test_linear_warmup_multiplies_decaying_base_by_ramp_factor():
    schedule = scaling_rules.linear_warmup(exponential(), 4, total_steps=1000)  # W = 13.75
    t = 5.0
    factor = 1 / 4 + (1 - 1 / 4) * t / 13.75
    assert_close(schedule(t), factor * 4 * exp_value(4 * t), rtol=1e-5)


def test_linear_warmup_is_continuous_at_end_of_ramp():
    schedule = scaling_rules.linear_warmup(exponential(), 4, total_steps=1000)
    w = 0.055 * 250
    assert_close(schedule(w - 1e-3), schedule(w), rtol=1e-3)


@pytest.mark.parametrize("t", [0, 3, 40])
def test_linear_warmup_with_scale_one_is_identity(t):
    assert_close(scaling_rules.linear_warmup(exponential(), 1, total_steps=1000)(t), exp_value(t))


def test_linear_warmup_without_warmup_is_linear():
    schedule = scaling_rules.linear_warmup(exponential(), 4, total_steps=1000, warmup_fraction=0.0)
    assert_close(schedule(0), 0.4)
    assert_close(schedule(5), 4 * exp_value(20))


# --------------------------------------------------------------------------- LSW+


@pytest.mark.parametrize("scale", [2, 4, 5])
def test_stretched_equals_linear_warmup_when_iterations_are_budget_over_scale(scale):
    total = 1000  # divisible by every scale here, so ⌈T/S⌉ = T/S
    lsw = scaling_rules.linear_warmup(exponential(), scale, total)
    lsw_plus = scaling_rules.stretched_linear_warmup(
        exponential(), scale, total, num_iterations=math.ceil(total / scale)
    )
    t = jnp.arange(total // scale + 1)
    np.testing.assert_allclose(jax.jit(jax.vmap(lsw_plus))(t), jax.jit(jax.vmap(lsw))(t), rtol=1e-5)


def test_stretched_evaluates_base_at_stretched_step():
    # T = 1000 over N = 400 iterations: 2.5 base steps per iteration; W = 0.055 · 400 = 22.
    schedule = scaling_rules.stretched_linear_warmup(exponential(), 4, total_steps=1000, num_iterations=400)
    for t in (22, 40, 200, 399):
        assert_close(schedule(t), 4 * exp_value(2.5 * t), rtol=1e-5)


def test_stretched_ramp_endpoints_and_midpoint():
    schedule = scaling_rules.stretched_linear_warmup(LR0, 8, total_steps=1000, num_iterations=400)  # W = 22
    assert_close(schedule(0), LR0)
    assert_close(schedule(11), LR0 * (1 + 8) / 2)
    assert_close(schedule(22), 8 * LR0)


def test_stretched_moves_step_decay_boundary():
    base = optax.piecewise_constant_schedule(LR0, {500: 0.1})
    schedule = scaling_rules.stretched_linear_warmup(base, 4, total_steps=1000, num_iterations=500)
    # Base step 500 is iteration 250 (2 base steps per iteration).
    assert_close(schedule(249), 4 * LR0)
    assert_close(schedule(250), 4 * LR0 * 0.1)


# --------------------------------------------------------------------------- jit, dtypes, traced arguments


def test_schedules_are_jittable_and_float32():
    rules = [
        scaling_rules.identity(exponential()),
        scaling_rules.linear(exponential(), 4),
        scaling_rules.square_root(exponential(), 4),
        scaling_rules.linear_warmup(exponential(), 4, 1000),
        scaling_rules.stretched_linear_warmup(exponential(), 4, 1000, 300),
    ]
    for rule in rules:
        eager = rule(jnp.asarray(17, jnp.int32))
        jitted = jax.jit(rule)(jnp.asarray(17, jnp.int32))
        assert jitted.dtype == jnp.float32
        np.testing.assert_allclose(jitted, eager, rtol=1e-6)


def test_traced_scale_and_iterations_are_accepted():
    @jax.jit
    def lr_at(t, scale, iterations):
        return scaling_rules.stretched_linear_warmup(exponential(), scale, 1000, iterations)(t)

    assert_close(lr_at(100, 4.0, 400), 4 * exp_value(250), rtol=1e-5)


def test_schedule_works_in_optax_sgd():
    schedule = scaling_rules.linear_warmup(LR0, 10, total_steps=2000)
    tx = optax.sgd(schedule)
    params = jnp.zeros(())
    state = tx.init(params)
    updates, state = tx.update(jnp.ones(()), state, params)
    assert_close(updates, -LR0)  # first iteration: lr(0)


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize("scale", [0.5, 0, -2, float("nan"), float("inf")])
def test_bad_scale_raises_naming_argument(scale):
    for make in (
        lambda: scaling_rules.linear(LR0, scale),
        lambda: scaling_rules.square_root(LR0, scale),
        lambda: scaling_rules.linear_warmup(LR0, scale, 100),
        lambda: scaling_rules.stretched_linear_warmup(LR0, scale, 100, 10),
    ):
        with pytest.raises(ValueError, match="scale="):
            make()


@pytest.mark.parametrize("value", [0, -5, 2.5])
def test_bad_total_steps_raises_naming_argument(value):
    with pytest.raises(ValueError, match=f"total_steps={value!r}"):
        scaling_rules.linear_warmup(LR0, 2, value)
    with pytest.raises(ValueError, match=f"total_steps={value!r}"):
        scaling_rules.stretched_linear_warmup(LR0, 2, value, 10)


@pytest.mark.parametrize("value", [0, -1, 1.5])
def test_bad_num_iterations_raises_naming_argument(value):
    with pytest.raises(ValueError, match=f"num_iterations={value!r}"):
        scaling_rules.stretched_linear_warmup(LR0, 2, 100, value)


@pytest.mark.parametrize("value", [-0.1, 1.5])
def test_bad_warmup_fraction_raises_naming_argument(value):
    with pytest.raises(ValueError, match=f"warmup_fraction={value!r}"):
        scaling_rules.linear_warmup(LR0, 2, 100, warmup_fraction=value)


@pytest.mark.parametrize("value", [-0.1, float("nan")])
def test_bad_constant_learning_rate_raises_naming_argument(value):
    with pytest.raises(ValueError, match="learning_rate="):
        scaling_rules.linear(value, 2)


def test_non_numeric_argument_raises_type_error():
    with pytest.raises(TypeError, match="scale="):
        scaling_rules.linear(LR0, "4")
    with pytest.raises(TypeError, match="total_steps="):
        scaling_rules.linear_warmup(LR0, 2, True)

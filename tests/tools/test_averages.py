"""``base_step_average``: a model's own moving average (BatchNorm's running statistics, a weight EMA) re-weighted so
that it decays per base-batch step, checked against the average run step by step (the closed form of an EMA of a
constant, and r base steps of the same update), and the NNX reference trap refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optax_adascale
from optax_adascale import BaseSteps


def _state_with_gain(gain: float):
    """An ``adascale_sgd`` state whose last update was worth ``gain`` base-batch steps."""
    tx = optax_adascale.adascale_sgd(0.1, accumulation_steps=2)
    return tx.init(jnp.zeros(1))._replace(gain=jnp.float32(gain))


def _ema(a, x, decay, steps):
    for _ in range(steps):
        a = decay * a + (1 - decay) * x
    return a


@pytest.mark.parametrize(("gain", "updates"), [(1.0, 1), (4.0, 1), (5.0, 4), (3.0, 3), (2.5, 1)])
def test_an_update_worth_r_base_steps_decays_the_average_as_r_base_steps_would(gain, updates):
    """Fed a constant x, ``r`` base steps of ``a ← μa + (1 − μ)x`` give ``x + (a − x)μ^r`` (any real ``r``); the model
    advanced ``updates`` times, and the re-weighted average is the ``r``-step one."""
    decay, old, x = 0.9, np.array([0.0, 2.0, -1.0], np.float32), np.array([1.0, 1.0, 3.0], np.float32)
    new = _ema(old, x, decay, updates)
    got = optax_adascale.base_step_average(jnp.asarray(old), jnp.asarray(new), decay, _state_with_gain(gain), updates)
    want = x + (old - x) * decay**gain
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    if gain == updates:  # nothing to re-weight: the model's own average
        np.testing.assert_allclose(got, new, rtol=1e-6)
    if float(gain).is_integer():  # and the same as running the average r times, step by step
        np.testing.assert_allclose(got, _ema(old, x, decay, int(gain)), rtol=1e-5, atol=1e-6)


def test_a_pytree_of_statistics_keeps_its_structure_and_dtypes_and_leaves_integers_alone():
    old = {"mean": jnp.zeros(3, jnp.bfloat16), "var": jnp.ones(3), "count": jnp.int32(7)}
    new = {"mean": jnp.full(3, 0.1, jnp.bfloat16), "var": jnp.full(3, 0.9), "count": jnp.int32(8)}
    got = optax_adascale.base_step_average(old, new, 0.9, _state_with_gain(2.0))
    assert jax.tree.structure(got) == jax.tree.structure(new)
    assert got["mean"].dtype == jnp.bfloat16 and int(got["count"]) == 8
    np.testing.assert_allclose(got["var"], 1 - 0.1 * (1 - 0.9**2) / 0.1, rtol=1e-6)  # 1 + (0.9 − 1)·1.9


def test_the_gain_is_read_from_base_steps_and_from_a_jitted_step():
    """Inside jit (as in a train step) with the gain of the state the update returned."""
    tx = optax_adascale.adascale_sgd(0.1, axis_name="i")
    state = tx.init(jnp.zeros(2))

    @jax.jit
    def step(old, new, state):
        return optax_adascale.base_step_average(old, new, 0.99, state)

    state = state._replace(gain=jnp.float32(6.0))
    got = step(jnp.zeros(2), jnp.full(2, 0.01), state)  # one step of 0.99 towards 1
    np.testing.assert_allclose(got, 1 - 0.99**6, rtol=1e-5)
    assert isinstance(BaseSteps.by_hand(2.0), BaseSteps)


def test_nnx_batchnorm_statistics_decay_per_base_step_and_the_reference_trap_is_refused():
    """Flax NNX's ``nnx.state`` returns the model's own Variables, which the forward pass updates in place: taken
    before the forward pass without a copy it *is* ``new`` and nothing would be re-weighted, silently. That is refused;
    with a copy, BatchNorm's statistics after one update worth 5 base steps on a constant batch are 5 steps of its
    own momentum, computed here by running BatchNorm five times."""
    nnx = pytest.importorskip("flax.nnx")
    x = jnp.asarray(np.random.default_rng(0).normal(2.0, 3.0, size=(64, 4)), jnp.float32)
    state = _state_with_gain(5.0)

    def step(bn, x, copy):
        before = nnx.state(bn, nnx.BatchStat)
        if copy:
            before = jax.tree.map(lambda a: a, before)
        bn(x)
        nnx.update(bn, optax_adascale.base_step_average(before, nnx.state(bn, nnx.BatchStat), 0.9, state))

    step = nnx.jit(step, static_argnums=2)

    bn = nnx.BatchNorm(4, momentum=0.9, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"jax.tree.map\(lambda x: x, nnx.state\(model, nnx.BatchStat\)\)"):
        step(bn, x, False)
    step(bn, x, True)
    five = nnx.BatchNorm(4, momentum=0.9, rngs=nnx.Rngs(0))
    for _ in range(5):
        five(x)
    np.testing.assert_allclose(bn.mean[...], five.mean[...], rtol=1e-5)
    np.testing.assert_allclose(bn.var[...], five.var[...], rtol=1e-5)
    assert float(jnp.abs(bn.mean[...] - 0.1 * x.mean(0)).max()) > 0.1  # not one step's 10 %

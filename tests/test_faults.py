"""Bad input gives a clear error; a non-finite step is skipped identically on every replica, losing nothing."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import optax_adascale

PARAMS = {"w": jnp.array([[1.0, 2.0], [3.0, 4.0]]), "b": jnp.array([0.5, -0.5])}


def grads_for(seed, n=None):
    key = jax.random.PRNGKey(seed)
    shape = lambda x: x.shape if n is None else (n,) + x.shape  # noqa: E731
    return jax.tree.map(lambda x: 1.0 + jax.random.normal(key, shape(x)), PARAMS)


def bits_equal(a, b):
    return jax.tree.all(jax.tree.map(lambda x, y: bool(np.array_equal(np.asarray(x), np.asarray(y))), a, b))


# --------------------------------------------------------------------------- bad input


def _update(tx, grads=None, params=PARAMS):
    grads = PARAMS if grads is None else grads
    return tx.update(grads, tx.init(params), params)


def _summed_under_shard_map():
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("i",))
    tx = optax_adascale.adascale_sgd(0.1, axis_name="i")

    def step(params, state, x):
        grads = jax.grad(lambda p: jnp.sum(p["w"] @ x[0]) + jnp.sum(p["b"]))(params)  # forgot pcast
        return tx.update(grads, state, params)

    f = jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P("i")), out_specs=(P(), P()))
    return f(PARAMS, tx.init(PARAMS), jnp.ones((8, 2)))


BAD_INPUTS = {
    "accumulation_steps=0": (lambda: optax_adascale.adascale_sgd(0.1, accumulation_steps=0), ValueError,
                             r"accumulation_steps=0"),
    "accumulation_steps=2.0": (lambda: optax_adascale.adascale_sgd(0.1, accumulation_steps=2.0), TypeError,
                               r"accumulation_steps=2\.0"),
    "accumulation_steps=array": (lambda: optax_adascale.adascale_sgd(0.1, accumulation_steps=jnp.array(2)),
                                 TypeError, r"static_args"),
    "scale=0.5": (lambda: optax_adascale.adascale_sgd(0.1, scale=0.5), ValueError, r"scale=0\.5"),
    "smoothing=1.0": (lambda: optax_adascale.adascale_sgd(0.1, smoothing=1.0), ValueError, r"smoothing=1\.0"),
    "smoothing=-0.1": (lambda: optax_adascale.adascale_sgd(0.1, smoothing=-0.1), ValueError, r"smoothing=-0\.1"),
    "eps=0": (lambda: optax_adascale.adascale_sgd(0.1, eps=0.0), ValueError, r"eps=0\.0"),
    "eps=-1": (lambda: optax_adascale.adascale_sgd(0.1, eps=-1.0), ValueError, r"eps=-1\.0"),
    "learning_rate=-0.1": (lambda: optax_adascale.adascale_sgd(-0.1), ValueError, r"learning_rate=-0\.1"),
    "learning_rate=nan": (lambda: optax_adascale.adascale_sgd(float("nan")), ValueError, r"learning_rate=nan"),
    "learning_rate=inf": (lambda: optax_adascale.adascale_sgd(float("inf")), ValueError, r"learning_rate=inf"),
    "averaging=typo": (lambda: optax_adascale.experimental.adascale(optax.identity(), 0.1, averaging="ema"), ValueError, r"averaging='ema'"),
    "nesterov without momentum": (lambda: optax_adascale.adascale_sgd(0.1, nesterov=True), ValueError,
                                  r"momentum=None"),
    "n=1 with S>1": (lambda: _update(optax_adascale.adascale_sgd(0.1, scale=4.0)), ValueError,
                     r"n=1 sample.*scale=4\.0.*axis_name"),
    "axis not bound": (lambda: _update(optax_adascale.adascale_sgd(0.1, axis_name="data")), ValueError,
                       r"axis_name='data'.*not bound"),
    "summed grads under shard_map": (_summed_under_shard_map, ValueError, r"summed.*pcast"),
    "grads tree differs from params": (
        lambda: _update(optax_adascale.adascale_sgd(0.1, accumulation_steps=2), grads={"w": PARAMS["w"]}),
        ValueError, r"same tree structure"),
    "integer grads": (
        lambda: _update(optax_adascale.adascale_sgd(0.1, accumulation_steps=2),
                        grads={"w": jnp.ones((2, 2), jnp.int32), "b": PARAMS["b"]}),
        TypeError, r"floating-point grads, got dtype int32 at grads\['w'\]"),
    "microbatch_stats of the wrong type": (
        lambda: optax_adascale.adascale_sgd(0.1, accumulation_steps=2).update(
            PARAMS, optax_adascale.adascale_sgd(0.1, accumulation_steps=2).init(PARAMS), PARAMS,
            microbatch_stats={"w": 1.0}),
        TypeError, r"microbatch_stats must be a MicrobatchStats"),
    "num_microbatches=0": (lambda: optax_adascale.value_and_microbatch_grad(jnp.sum, 0), ValueError,
                           r"num_microbatches=0"),
}


@pytest.mark.parametrize("make, error, message", BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_bad_input_raises_a_clear_error(make, error, message):
    with pytest.raises(error, match=message):
        make()


# --------------------------------------------------------------------------- non-finite steps


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_gradient_in_one_replica_skips_the_step_on_every_replica(bad):
    n = 4
    tx = optax_adascale.adascale_sgd(0.1, momentum=0.9, axis_name="i")

    def step(grads, state):
        return tx.update(grads, state, PARAMS)

    # pmap with out_axes=0 returns every replica's own updates and state.
    step = jax.pmap(step, axis_name="i", in_axes=(0, None), devices=jax.devices()[:n])
    state = tx.init(PARAMS)
    _, state = step(grads_for(0, n), state)
    state = jax.tree.map(lambda x: x[0], state)
    poisoned = grads_for(1, n)
    poisoned["w"] = poisoned["w"].at[2, 0, 1].set(bad)

    updates, new_states = step(poisoned, state)
    assert all(bool(jnp.all(u == 0)) for u in jax.tree.leaves(updates))
    for r in range(n):
        s = jax.tree.map(lambda x, r=r: x[r], new_states)
        assert int(s.skipped_steps) == 1
        assert bits_equal(s._replace(skipped_steps=state.skipped_steps, skip_streak=state.skip_streak), state)

    # Training then continues exactly as if the poisoned step had never happened.
    clean_updates, clean_state = step(grads_for(2, n), state)
    updates, after = step(grads_for(2, n), jax.tree.map(lambda x: x[0], new_states))
    assert bits_equal(updates, clean_updates)
    counters = dict(skipped_steps=clean_state.skipped_steps, skip_streak=clean_state.skip_streak)
    assert bits_equal(after._replace(**counters), clean_state)


def test_non_finite_gradient_under_shard_map_gives_replicated_zero_updates():
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("i",))
    tx = optax_adascale.adascale_sgd(0.1, axis_name="i")

    def step(state, grads):
        updates, state = tx.update(jax.tree.map(lambda g: g[0], grads), state, PARAMS)
        return jax.tree.map(lambda u: jax.lax.pcast(u, "i", to="varying")[None], updates), state

    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P("i")), out_specs=(P("i"), P())))
    grads = grads_for(0, 8)
    grads["b"] = grads["b"].at[5, 0].set(np.nan)
    state = tx.init(PARAMS)
    per_replica_updates, new_state = f(state, grads)
    assert all(u.shape[0] == 8 and bool(jnp.all(u == 0)) for u in jax.tree.leaves(per_replica_updates))
    assert bits_equal(new_state._replace(skipped_steps=state.skipped_steps, skip_streak=state.skip_streak), state)
    assert int(new_state.skipped_steps) == 1


def test_non_finite_call_drops_the_whole_accumulation_window():
    k = 3
    tx = optax_adascale.adascale_sgd(0.1, momentum=0.9, accumulation_steps=k)
    update = jax.jit(tx.update)
    state = tx.init(PARAMS)
    for seed in range(k):  # one good update first, so the state is not trivial
        _, state = update(grads_for(seed), state, PARAMS)
    start = state

    poisoned = grads_for(10)
    poisoned["b"] = poisoned["b"].at[1].set(np.nan)
    for g in (grads_for(11), poisoned, grads_for(12)):
        updates, state = update(g, state, PARAMS)
        assert all(bool(jnp.all(u == 0)) for u in jax.tree.leaves(updates))
    assert int(state.skipped_steps) == 1 and int(state.micro_step) == 0
    assert bits_equal(state.acc_grads, jax.tree.map(jnp.zeros_like, start.acc_grads))
    assert bits_equal(state._replace(skipped_steps=start.skipped_steps, skip_streak=start.skip_streak), start)

    # The next window trains normally.
    for seed in range(20, 20 + k):
        updates, state = update(grads_for(seed), state, PARAMS)
    assert int(state.count) == 2 and optax.tree.norm(updates) > 0

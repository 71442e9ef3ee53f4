"""Mistakes a new user makes that used to train with no message: each now raises, or is counted and stops the loop."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import optax_adascale

PARAMS = {"w": jnp.array([[1.0, 2.0], [3.0, 4.0]]), "b": jnp.array([0.5, -0.5])}
MESH = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("data",))


def replica_grads(n, seed=0):
    key = jax.random.key(seed)
    return jax.tree.map(lambda x: 1.0 + jax.random.normal(key, (n,) + x.shape), PARAMS)


def vmap_step(tx, n):
    return jax.jit(jax.vmap(tx.update, in_axes=(0, None, None), out_axes=(None, None), axis_name="data",
                            axis_size=n))


# --------------------------------------------------------------------------- inner with its own learning rate


@pytest.mark.parametrize(
    "inner", [optax.sgd(0.1), optax.sgd(0.01, momentum=0.9), optax.adamw(1e-3), optax.adamw(1.0), optax.adam(3e-4)],
    ids=["sgd", "sgd-momentum", "adamw", "adamw-lr1", "adam"],
)
@pytest.mark.parametrize("traced_init", [False, True], ids=["eager", "jit"])
def test_inner_with_its_own_learning_rate_is_rejected_at_init(inner, traced_init):
    tx = optax_adascale.adascale(inner, 0.1, axis_name="data")
    init = jax.jit(tx.init) if traced_init else tx.init
    with pytest.raises(ValueError, match=r"against the gradient.*optax\.trace\(0\.9\)"):
        init(PARAMS)


@pytest.mark.parametrize(
    "inner",
    [optax.trace(0.9), optax.identity(), optax.scale_by_adam(),
     optax.chain(optax.clip_by_global_norm(1.0), optax.trace(0.9, nesterov=True)),
     optax.chain(optax.add_decayed_weights(1e-4), optax.trace(0.9)),
     optax.multi_transform({"a": optax.trace(0.9), "b": optax.identity()}, {"w": "a", "b": "b"})],
    ids=["trace", "identity", "scale_by_adam", "clip-nesterov", "decay-trace", "multi_transform"],
)
def test_learning_rate_free_inners_are_accepted(inner):
    tx = optax_adascale.adascale(inner, 0.1)
    updates, _ = tx.update(PARAMS, tx.init(PARAMS), PARAMS)
    # The step points against the gradient (every gradient entry here is >= -0.5 and the sum positive).
    assert float(sum(jnp.vdot(u, g) for u, g in zip(jax.tree.leaves(updates), jax.tree.leaves(PARAMS)))) < 0


# --------------------------------------------------------------------------- gradients averaged before update


@pytest.mark.parametrize("path", ["vmap", "pmap"])
def test_gradients_averaged_before_update_are_counted_as_floored_steps(path):
    n, steps = 4, 3
    tx = optax_adascale.adascale_sgd(0.1, momentum=0.9, axis_name="data")

    def averaged_first(g, s, p):  # the mistake: pmean before AdaScale sees the per-replica gradients
        return tx.update(jax.lax.pmean(g, "data"), s, p)

    if path == "vmap":
        wrong = jax.jit(jax.vmap(averaged_first, in_axes=(0, None, None), out_axes=(None, None), axis_name="data"))
        right = vmap_step(tx, n)
    else:
        wrong = jax.pmap(averaged_first, axis_name="data", in_axes=(0, None, None), out_axes=(None, None),
                         devices=jax.devices()[:n])
        right = jax.pmap(tx.update, axis_name="data", in_axes=(0, None, None), out_axes=(None, None),
                         devices=jax.devices()[:n])
    s_wrong = s_right = tx.init(PARAMS)
    for seed in range(steps):
        _, s_wrong = wrong(replica_grads(n, seed), s_wrong, PARAMS)
        _, s_right = right(replica_grads(n, seed), s_right, PARAMS)
    m_wrong, m_right = optax_adascale.metrics(s_wrong), optax_adascale.metrics(s_right)
    assert int(m_wrong["floored_steps"]) == steps  # every update: identical replicas
    assert float(m_wrong["gain"]) == pytest.approx(1.0, abs=1e-5)
    assert int(m_right["floored_steps"]) == 0
    assert float(m_right["gain"]) > 1.05


# --------------------------------------------------------------------------- every step non-finite


def test_done_raises_when_every_update_is_skipped_instead_of_looping_forever():
    tx = optax_adascale.adascale_sgd(lambda t: jnp.float32(jnp.nan), momentum=0.9, axis_name="data")
    step, state = vmap_step(tx, 4), tx.init(PARAMS)
    calls = 0
    with pytest.raises(RuntimeError, match=r"stuck.*last 5 updates were all skipped"):
        while not optax_adascale.done(state, total_steps=100, max_skip_streak=5):
            _, state = step(replica_grads(4, calls), state, PARAMS)
            calls += 1
    assert calls == 5
    assert int(optax_adascale.metrics(state)["skipped_steps"]) == 5


def test_done_is_true_once_tau_reaches_the_budget_and_a_skip_does_not_reset_the_clock():
    lr = lambda t: jnp.where(t == 2, jnp.nan, 0.1)  # noqa: E731 - one bad schedule value, then fine again
    tx = optax_adascale.adascale_sgd(lr, axis_name="data")
    step, state = vmap_step(tx, 4), tx.init(PARAMS)
    updates = 0
    while not optax_adascale.done(state, total_steps=12, max_skip_streak=3):
        _, state = step(replica_grads(4, updates), state, PARAMS)
        updates += 1
    tau = float(optax_adascale.scale_invariant_steps(state))
    assert tau >= 12
    s = optax_adascale.get_adascale_state(state)
    assert int(s.skip_streak) == 0 and int(s.skipped_steps) <= 1
    assert updates == int(s.count) + int(s.skipped_steps)


# --------------------------------------------------------------------------- shard_map mistakes


def local_grads(params, x):
    """This replica's gradient under shard_map: params marked varying over the data axis first."""
    return jax.grad(lambda p: jnp.sum(p["w"] @ x[0]) + jnp.sum(p["b"] * x[0]))(
        jax.lax.pcast(params, "data", to="varying"))


def _shard_map(fn, n_in, check_vma=True):
    return jax.jit(jax.shard_map(fn, mesh=MESH, in_specs=(P(),) * (n_in - 1) + (P("data"),), out_specs=(P(), P()),
                                 check_vma=check_vma))


def test_axis_name_none_with_per_replica_gradients_under_shard_map_names_the_axis():
    tx = optax_adascale.adascale_sgd(0.1)  # forgot axis_name="data"

    def step(params, state, x):
        grads = local_grads(params, x)
        return tx.update(grads, state, params)

    with pytest.raises(ValueError, match=r"varies over the shard_map axes \[.data.\].*axis_name=.data."):
        _shard_map(step, 3)(PARAMS, tx.init(PARAMS), jnp.ones((4, 2)))


def test_a_per_device_ensemble_without_axis_name_is_legitimate():
    # Parameters that vary over the axis too: each device trains its own member, no error.
    tx = optax_adascale.adascale_sgd(0.1)
    loss = lambda p, x: jnp.sum(p["w"] @ x) + jnp.sum(p["b"] * x)  # noqa: E731

    def member_step(stacked, state, x):
        params = jax.tree.map(lambda a: a[0], stacked)
        updates, _ = tx.update(jax.grad(loss)(params, x[0]), state, params)
        return jax.tree.map(lambda a: a[None], optax.apply_updates(params, updates))

    ensemble = jax.tree.map(lambda x: jnp.stack([x * (i + 1) for i in range(4)]), PARAMS)
    x = jnp.arange(8.0).reshape(4, 2)
    f = jax.jit(jax.shard_map(member_step, mesh=MESH, in_specs=(P("data"), P(), P("data")), out_specs=P("data")))
    out = f(ensemble, tx.init(PARAMS), x)
    for i in range(4):
        member = jax.tree.map(lambda a, i=i: a[i], ensemble)
        expected = optax.apply_updates(member, jax.tree.map(lambda g: -0.1 * g, jax.grad(loss)(member, x[i])))
        jax.tree.map(lambda a, b, i=i: np.testing.assert_allclose(a[i], b, rtol=1e-6), out, expected)


@pytest.mark.parametrize("reduction", ["psum", "pmean"])
def test_gradients_reduced_after_pcast_name_the_reduction_as_the_cause(reduction):
    tx = optax_adascale.adascale_sgd(0.1, axis_name="data")

    def step(params, state, x):
        grads = local_grads(params, x)
        grads = getattr(jax.lax, reduction)(grads, "data")
        return tx.update(grads, state, params)

    with pytest.raises(ValueError, match=r"does not vary.*psum/pmean.*MultiSteps"):
        _shard_map(step, 3)(PARAMS, tx.init(PARAMS), jnp.ones((4, 2)))


def test_accumulation_under_shard_map_without_replicate_buffers_names_the_fix():
    tx = optax_adascale.adascale_sgd(0.1, axis_name="data", accumulation_steps=2)

    def step(params, state, x):
        grads = local_grads(params, x)
        return tx.update(grads, state, params)

    with pytest.raises(ValueError, match=r"replicate_buffers.*state_partition_specs"):
        _shard_map(step, 3)(PARAMS, tx.init(PARAMS), jnp.ones((4, 2)))


# --------------------------------------------------------------------------- one device meant to scale


def test_a_single_replica_axis_warns_that_adascale_is_the_identity():
    tx = optax_adascale.adascale_sgd(0.1, axis_name="data")
    with pytest.warns(UserWarning, match=r"single replica.*identity.*value_and_microbatch_grad"):
        vmap_step(tx, 1)(replica_grads(1), tx.init(PARAMS), PARAMS)

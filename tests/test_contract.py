"""The optax contract (after optax/contrib/_common_test.py), chaining and the S = 1 identity."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_adascale


def params_tree(dtype=jnp.float32):
    return {"a": jnp.array([1.0, -2.0, 3.0], dtype), "b": {"c": jnp.array([[0.5, -0.5]], dtype)}}


def vmapped(tx, **kw):
    return jax.vmap(
        lambda g, s, p: tx.update(g, s, p, **kw), in_axes=(0, None, None), out_axes=(None, None), axis_name="i"
    )


def replica_grads(params, n=4, seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed), len(jax.tree.leaves(params)))
    leaves, treedef = jax.tree.flatten(params)
    noisy = [(1.0 + jax.random.normal(k, (n,) + x.shape)).astype(x.dtype) for k, x in zip(keys, leaves)]
    return treedef.unflatten(noisy)


def assert_same_updates(tx_a, tx_b, *, steps, rtol):
    """Train both transformations on the same single-replica gradients; updates must agree every step."""
    params = params_tree()
    s_a, s_b = tx_a.init(params), tx_b.init(params)
    for seed in range(steps):
        grads = jax.tree.map(lambda x: x[0], replica_grads(params, n=1, seed=seed))
        u_a, s_a = jax.jit(tx_a.update)(grads, s_a, params)
        u_b, s_b = jax.jit(tx_b.update)(grads, s_b, params)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=rtol, atol=0), u_a, u_b)
        params = optax.apply_updates(params, u_a)
    return s_a, s_b


def test_extra_args_are_accepted_and_forwarded_to_inner():
    seen = {}

    def inner_update(updates, state, params=None, *, note=None, **extra):
        seen["note"] = note
        return updates, state

    inner = optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), inner_update)
    tx = optax_adascale.adascale(inner, 0.1, accumulation_steps=1)
    params = params_tree()
    tx.update(params, tx.init(params), params, note="hello", unrelated=3)
    assert seen["note"] == "hello"


def test_no_recompilation_on_second_call():
    traces = []
    tx = optax_adascale.adascale_sgd(0.1, momentum=0.9, axis_name="i")
    update = vmapped(tx)

    @jax.jit
    def step(grads, state, params):
        traces.append(1)
        return update(grads, state, params)

    params = params_tree()
    state = tx.init(params)
    for seed in range(3):
        _, state = step(replica_grads(params, seed=seed), state, params)
    assert len(traces) == 1


def test_converges_on_a_parabola():
    # f(x) = ½‖x − c‖² with noisy replica gradients; AdaScale must drive x to c.
    c = jnp.array([1.0, -2.0, 3.0])
    tx = optax_adascale.adascale_sgd(0.1, momentum=0.5, axis_name="i")
    update = vmapped(tx)

    @jax.jit
    def step(x, state, key):
        noise = 0.01 * jax.random.normal(key, (4, 3))
        updates, state = update((x - c) + noise, state, x)
        return optax.apply_updates(x, updates), state

    x = jnp.zeros(3)
    state = tx.init(x)
    for key in jax.random.split(jax.random.PRNGKey(0), 200):
        x, state = step(x, state, key)
    np.testing.assert_allclose(x, c, atol=1e-2)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_updates_and_state_keep_their_dtypes(dtype):
    tx = optax_adascale.adascale_sgd(0.1, momentum=0.9, axis_name="i")
    params = params_tree(dtype)
    state = tx.init(params)
    with jax.numpy_dtype_promotion("strict"), jax.numpy_rank_promotion("raise"):
        updates, new_state = jax.jit(vmapped(tx))(replica_grads(params), state, params)
    assert jax.tree.map(lambda u: u.dtype, updates) == jax.tree.map(lambda p: p.dtype, params)
    assert jax.tree.map(jax.typeof, new_state) == jax.tree.map(jax.typeof, state)
    s = optax_adascale.get_adascale_state(new_state)
    assert s.gain.dtype == s.grad_var.dtype == jnp.float32  # statistics stay in float32


@pytest.mark.parametrize("accumulation_steps", [1, 2])
def test_state_types_are_stable_across_init_update_and_jit_on_an_explicit_mesh(accumulation_steps):
    # optax/_src/sharding_test.py: jax.typeof (shape, dtype, sharding) of every state leaf must not
    # change from init to update, with or without jit, or every step would recompile.
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
    tx = optax_adascale.adascale_sgd(0.1, momentum=0.9, accumulation_steps=accumulation_steps, scale=1.0)
    with jax.set_mesh(mesh):
        params = {
            "w": jnp.ones((2, 8, 4), jnp.float16, out_sharding=NamedSharding(mesh, P(None, "x"))),
            "b": jnp.ones((8,), jnp.float32, out_sharding=NamedSharding(mesh, P())),
        }
        types = lambda tree: jax.tree.map(jax.typeof, tree)
        state0 = tx.init(params)
        assert types(jax.jit(tx.init)(params)) == types(state0)
        _, state1 = tx.update(params, state0, params)
        _, state2 = jax.jit(tx.update)(params, state0, params)
        assert types(state1) == types(state2) == types(state0)
        _, state3 = jax.jit(tx.update)(params, state2, params)
        assert types(state3) == types(state0)


def test_state_is_stable_under_lax_cond():
    tx = optax_adascale.adascale_sgd(0.1, momentum=0.9, axis_name="i")
    params = params_tree()
    state = tx.init(params)
    grads = replica_grads(params)

    @jax.jit
    def maybe_step(pred, state):
        return jax.lax.cond(pred, lambda s: vmapped(tx)(grads, s, params)[1], lambda s: s, state)

    stepped = maybe_step(True, state)
    kept = maybe_step(False, state)
    assert int(optax_adascale.get_adascale_state(stepped).count) == 1
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), kept, state))


@pytest.mark.parametrize("accumulation_steps", [1, 3])
def test_state_leaves_are_distinct_buffers_and_donation_works(accumulation_steps):
    tx = optax_adascale.adascale_sgd(0.1, momentum=0.9, accumulation_steps=accumulation_steps, axis_name="i")
    params = params_tree()
    for state in (tx.init(params), jax.jit(tx.init)(params)):
        pointers = [leaf.unsafe_buffer_pointer() for leaf in jax.tree.leaves(state)]
        assert len(set(pointers)) == len(pointers)
    state = optax_adascale.replicate_buffers(jax.jit(tx.init)(params), 4)
    axes = optax_adascale.state_axes(state)
    update = jax.vmap(lambda g, s, p: tx.update(g, s, p), in_axes=(0, axes, None), out_axes=(None, axes), axis_name="i")
    step = jax.jit(update, donate_argnums=1)
    for seed in range(2 * accumulation_steps):
        old_leaves = jax.tree.leaves(state)
        _, state = step(replica_grads(params, seed=seed), state, params)
        assert all(leaf.is_deleted() for leaf in old_leaves)  # every state buffer was donated
    assert int(optax_adascale.get_adascale_state(state).count) == 2


@pytest.mark.parametrize("nesterov", [False, True])
def test_scale_one_is_exactly_the_inner_optimizer(nesterov):
    schedule = optax.exponential_decay(0.1, transition_steps=3, decay_rate=0.5)
    ours = optax_adascale.adascale_sgd(schedule, momentum=0.9, nesterov=nesterov, weight_decay=1e-2)
    theirs = optax.chain(optax.add_decayed_weights(1e-2), optax.sgd(schedule, momentum=0.9, nesterov=nesterov))
    s_ours, _ = assert_same_updates(ours, theirs, steps=7, rtol=1e-7)
    m = optax_adascale.metrics(s_ours)
    assert float(m["gain"]) == 1.0 and float(m["scale_invariant_steps"]) == 7.0
    assert float(m["learning_rate"]) == pytest.approx(float(schedule(6)))


def test_inject_hyperparams_with_structural_args_static():
    static = ("learning_rate", "nesterov", "axis_name", "accumulation_steps", "scale", "smoothing", "param_labels")
    injected = optax.inject_hyperparams(optax_adascale.adascale_sgd, static_args=static)(
        learning_rate=optax.linear_schedule(0.2, 0.05, 10), momentum=0.9, weight_decay=1e-3, accumulation_steps=2
    )
    plain = optax_adascale.adascale_sgd(
        optax.linear_schedule(0.2, 0.05, 10), 0.9, weight_decay=1e-3, accumulation_steps=2
    )
    s_inj, s_plain = assert_same_updates(injected, plain, steps=6, rtol=1e-6)
    np.testing.assert_allclose(
        optax_adascale.metrics(s_inj)["scale_invariant_steps"], optax_adascale.metrics(s_plain)["scale_invariant_steps"]
    )
    # The injected momentum is a live hyperparameter.
    params = params_tree()
    s_inj.hyperparams["momentum"] = jnp.asarray(0.0)
    assert injected.update(params, s_inj, params)[1].hyperparams["momentum"] == 0.0


def test_chaining_after_adascale_and_reading_state_through_the_chain():
    tx = optax.chain(optax_adascale.adascale_sgd(0.1, axis_name="i"), optax.scale(0.5))
    params = params_tree()
    state = tx.init(params)
    updates, state = vmapped(tx)(replica_grads(params), state, params)
    alone = optax_adascale.adascale_sgd(0.1, axis_name="i")
    ref, ref_state = vmapped(alone)(replica_grads(params), alone.init(params), params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, 0.5 * b, rtol=1e-6), updates, ref)
    assert optax_adascale.metrics(state)["gain"] == optax_adascale.metrics(ref_state)["gain"]


def test_clipping_inside_inner_sees_the_averaged_gradient():
    lr, clip = 0.1, 0.5
    tx = optax_adascale.adascale(optax.chain(optax.clip_by_global_norm(clip), optax.trace(0.9)), lr, axis_name="i")
    params = params_tree()
    grads = replica_grads(params)
    updates, state = vmapped(tx)(grads, tx.init(params), params)
    mean = jax.tree.map(lambda g: g.mean(0), grads)
    clipped = jax.tree.map(lambda g: g * clip / optax.tree.norm(mean), mean)
    gain = optax_adascale.metrics(state)["gain"]
    jax.tree.map(lambda u, c: np.testing.assert_allclose(u, -gain * lr * c, rtol=1e-5), updates, clipped)
    assert float(optax.tree.norm(updates)) == pytest.approx(float(gain) * lr * clip, rel=1e-5)


def test_clipping_chained_before_adascale_sees_per_replica_gradients():
    # Documented pitfall: a transformation before AdaScale clips each replica's gradient, which
    # changes the samples AdaScale estimates the variance from.
    clip = 0.5
    before = optax.chain(optax.clip_by_global_norm(clip), optax_adascale.adascale_sgd(0.1, axis_name="i"))
    params = params_tree()
    grads = replica_grads(params)
    _, state = vmapped(before)(grads, before.init(params), params)

    per_replica_clipped = jax.vmap(lambda g: optax.clip_by_global_norm(clip).update(g, None)[0])(grads)
    alone = optax_adascale.adascale_sgd(0.1, axis_name="i")
    _, ref_state = vmapped(alone)(per_replica_clipped, alone.init(params), params)
    _, unclipped_state = vmapped(alone)(grads, alone.init(params), params)
    assert optax_adascale.metrics(state)["gain"] == optax_adascale.metrics(ref_state)["gain"]
    assert optax_adascale.metrics(state)["grad_sqr"] != optax_adascale.metrics(unclipped_state)["grad_sqr"]


def test_apply_if_finite_inside_inner_is_harmless_and_superseded_by_the_skip():
    tx = optax_adascale.adascale(optax.apply_if_finite(optax.trace(0.9), 3), 0.1, axis_name="i")
    params = params_tree()
    state = tx.init(params)
    _, state = vmapped(tx)(replica_grads(params, seed=0), state, params)
    bad = replica_grads(params, seed=1)
    bad["a"] = bad["a"].at[0, 0].set(jnp.nan)
    updates, after = vmapped(tx)(bad, state, params)
    assert all(bool(jnp.all(u == 0)) for u in jax.tree.leaves(updates))
    # AdaScale skipped the step and kept the inner state, apply_if_finite's counters included.
    assert int(after.skipped_steps) == 1 and int(after.inner_state.total_notfinite) == 0


@pytest.mark.parametrize("wrap", ["gradient_transformation", "multisteps_object"])
def test_multisteps_inside_inner_is_rejected_at_init_and_accumulation_steps_is_the_fix(wrap):
    # With optax.MultiSteps inside `inner` every call would be an AdaScale update, so τ would advance on
    # every call although the parameters move every k-th call. We refuse it; accumulation_steps=k is the
    # right tool: one update, one gain, per k calls.
    params = params_tree()
    multi = optax.MultiSteps(optax.trace(0.9), 2)
    wrong = optax_adascale.adascale(multi.gradient_transformation() if wrap == "gradient_transformation" else multi,
                                    0.1, axis_name="i")
    with pytest.raises(ValueError, match=r"optax.MultiSteps.*accumulation_steps=k"):
        wrong.init(params)
    right = optax_adascale.adascale(optax.trace(0.9), 0.1, axis_name="i", accumulation_steps=2)
    s_right = optax_adascale.replicate_buffers(right.init(params), 4)
    axes = optax_adascale.state_axes(s_right)
    step_right = jax.vmap(right.update, in_axes=(0, axes, None), out_axes=(None, axes), axis_name="i")
    for seed in range(2):
        _, s_right = step_right(replica_grads(params, seed=seed), s_right, params)
    assert int(optax_adascale.get_adascale_state(s_right).count) == 1
    assert float(optax_adascale.metrics(s_right)["scale"]) == 8.0  # 4 replicas × 2 calls

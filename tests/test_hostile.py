"""Hostile input and mixed precision: a clear error or a counted skip, never a corrupted state."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_adascale

N = 4


def vmap_update(tx, **kw):
    return jax.jit(
        jax.vmap(
            lambda g, s, p: tx.update(g, s, p, **kw), in_axes=(0, None, None), out_axes=(None, None), axis_name="i"
        )
    )


def noisy(params, seed=0, n=N):
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(seed), max(len(leaves), 1))
    return treedef.unflatten(
        [(1.0 + jax.random.normal(k, (n,) + jnp.shape(x))).astype(jnp.result_type(x)) for k, x in zip(keys, leaves)]
    )


def bits_equal(a, b):
    return jax.tree.all(jax.tree.map(lambda x, y: bool(np.array_equal(np.asarray(x), np.asarray(y))), a, b))


def assert_skipped(before, after, updates):
    assert all(bool(jnp.all(u == 0)) for u in jax.tree.leaves(updates))
    assert int(after.skipped_steps) == int(before.skipped_steps) + 1
    assert bits_equal(after._replace(skipped_steps=before.skipped_steps, skip_streak=before.skip_streak), before)


# --------------------------------------------------------------------------- odd trees


def test_empty_param_tree_is_a_harmless_no_op():
    # No gradient means no signal: σ̂² = eps, μ̂² = 0, so the gain is S (as FairScale computes it).
    tx = optax_adascale.adascale_sgd(0.1, momentum=0.9, accumulation_steps=2)
    state = tx.init({})
    update = jax.jit(tx.update)
    for _ in range(2):
        updates, state = update({}, state, {})
    assert updates == {}
    m = optax_adascale.metrics(state)
    assert int(state.count) == 1 and int(m["skipped_steps"]) == 0
    assert float(m["gain"]) == 2.0 and float(m["noise_scale"]) == np.inf  # pure noise: σ̄² = eps, μ̄² = 0
    assert all(np.isfinite(float(v)) for k, v in m.items() if k != "noise_scale")


def test_scalar_params_with_per_replica_accumulation():
    params = {"scalar": jnp.float32(1.0), "vector": jnp.ones(3)}
    tx = optax_adascale.adascale_sgd(0.1, axis_name="i", accumulation_steps=2)
    state = optax_adascale.replicate_buffers(tx.init(params), N)
    axes = optax_adascale.state_axes(state)
    step = jax.jit(
        jax.vmap(lambda g, s, p: tx.update(g, s, p), in_axes=(0, axes, None), out_axes=(None, axes), axis_name="i")
    )
    for seed in range(2):
        updates, state = step(noisy(params, seed), state, params)
    assert updates["scalar"].shape == () and float(updates["scalar"]) != 0.0
    assert 1.0 <= float(optax_adascale.metrics(state)["gain"]) <= 2 * N


def test_mixed_dtypes_in_one_tree_keep_their_dtypes():
    params = {"bf16": jnp.ones(3, jnp.bfloat16), "f16": jnp.ones(2, jnp.float16), "f32": jnp.ones(4)}
    tx = optax_adascale.adascale_sgd(0.1, momentum=0.9, axis_name="i")
    updates, state = vmap_update(tx)(noisy(params), tx.init(params), params)
    assert {k: v.dtype for k, v in updates.items()} == {k: v.dtype for k, v in params.items()}
    assert optax_adascale.metrics(state)["gain"].dtype == jnp.float32


def test_none_leaves_are_ignored():
    params = {"w": jnp.ones(3), "unused": None}
    tx = optax_adascale.adascale_sgd(0.1, axis_name="i")
    grads = {"w": noisy(params["w"]), "unused": None}
    updates, _ = vmap_update(tx)(grads, tx.init(params), params)
    assert updates["unused"] is None and updates["w"].shape == (3,)


def test_frozen_subtree_via_multi_transform():
    params = {"train": {"w": jnp.ones(3)}, "frozen": {"w": jnp.ones(2)}}
    labels = {"train": {"w": "train"}, "frozen": {"w": "frozen"}}
    tx = optax.multi_transform(
        {"train": optax_adascale.adascale_sgd(0.1, axis_name="i"), "frozen": optax.set_to_zero()}, labels
    )
    grads = noisy(params)
    updates, state = vmap_update(tx)(grads, tx.init(params), params)
    assert bool(jnp.all(updates["frozen"]["w"] == 0))
    # The trainable part is exactly AdaScale on the trainable subtree alone.
    alone = optax_adascale.adascale_sgd(0.1, axis_name="i")
    ref, ref_state = vmap_update(alone)(grads["train"], alone.init(params["train"]), params["train"])
    np.testing.assert_array_equal(updates["train"]["w"], ref["w"])
    assert optax_adascale.metrics(state)["gain"] == optax_adascale.metrics(ref_state)["gain"]


def test_integer_params_are_rejected_with_the_fix_named_and_the_fix_works():
    params = {"w": jnp.ones(3), "step": jnp.int32(0)}
    grads = jax.grad(lambda p: jnp.sum(p["w"] ** 2), allow_int=True)(params)  # float0 for the int leaf
    tx = optax_adascale.adascale_sgd(0.1, accumulation_steps=2)
    with pytest.raises(TypeError, match=r"params\['step'\].*set_to_zero"):
        tx.init(params)
    with pytest.raises(TypeError, match=r"grads\['step'\].*set_to_zero"):
        tx.update(grads, tx.init({"w": params["w"], "step": jnp.float32(0)}), params)
    fixed = optax.multi_transform(
        {"float": optax_adascale.adascale_sgd(0.1, accumulation_steps=2), "int": optax.set_to_zero()},
        {"w": "float", "step": "int"},
    )
    grads = {"w": grads["w"], "step": jnp.int32(0)}
    updates, _ = fixed.update(grads, fixed.init(params), params)
    assert updates["step"] == 0


def test_inner_that_changes_the_tree_structure_is_rejected():
    def bad_update(updates, state, params=None):
        return {"flat": jnp.concatenate([u.ravel() for u in jax.tree.leaves(updates)])}, state

    inner = optax.GradientTransformation(lambda p: optax.EmptyState(), bad_update)
    tx = optax_adascale.adascale(inner, 0.1, accumulation_steps=1)
    params = {"a": jnp.ones(2), "b": jnp.ones(3)}
    with pytest.raises(ValueError, match="inner must return updates with the structure of the gradients"):
        tx.update(params, tx.init(params), params)


# --------------------------------------------------------------------------- counted skips


@pytest.mark.parametrize("bad_value", [float("nan"), -0.5])
def test_schedule_returning_nan_or_negative_skips_and_counts(bad_value):
    # Decision: the effective learning rate must be finite and >= 0, else the update is skipped.
    # τ then stays put, so every later step skips too: `skipped_steps` growing is the signal.
    schedule = lambda count: jnp.where(count >= 3, bad_value, 0.1)
    tx = optax_adascale.adascale_sgd(schedule, axis_name="i", scale=1.0)
    params = {"w": jnp.ones(3)}
    update = vmap_update(tx)
    state = tx.init(params)
    for seed in range(3):
        _, state = update(noisy(params, seed), state, params)
    assert int(state.tau_whole) == 3 and int(state.skipped_steps) == 0
    for seed in range(3, 5):
        before = state
        updates, state = update(noisy(params, seed), state, params)
        assert_skipped(before, state, updates)
    assert int(state.skipped_steps) == 2


def test_inf_in_one_replica_only_is_skipped():
    params = {"w": jnp.ones(3)}
    tx = optax_adascale.adascale_sgd(0.1, momentum=0.9, axis_name="i")
    state = tx.init(params)
    _, state = vmap_update(tx)(noisy(params, 0), state, params)
    grads = noisy(params, 1)
    grads["w"] = grads["w"].at[3, 1].set(jnp.inf)
    updates, after = vmap_update(tx)(grads, state, params)
    assert_skipped(state, after, updates)


def test_nan_only_in_the_squared_norm_path_is_skipped():
    params = {"w": jnp.ones(3)}
    tx = optax_adascale.adascale_sgd(0.1, momentum=0.9)
    loss = lambda p, x: jnp.sum((p["w"] * x) ** 2)
    _, grads, stats = optax_adascale.value_and_microbatch_grad(loss, 2)(params, jnp.ones((4, 3)))
    state = tx.init(params)
    _, state = tx.update(grads, state, params, microbatch_stats=stats)
    poisoned = optax_adascale.MicrobatchStats({"w": jnp.float32(jnp.nan)}, 2)
    updates, after = tx.update(grads, state, params, microbatch_stats=poisoned)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
    assert_skipped(state, after, updates)


def test_replica_gradient_of_1e30_is_skipped_not_propagated():
    # ‖g‖² = 3e60 overflows float32: the statistic is non-finite, so the step is skipped.
    params = {"w": jnp.ones(3)}
    tx = optax_adascale.adascale_sgd(0.1, axis_name="i")
    state = tx.init(params)
    _, state = vmap_update(tx)(noisy(params, 0), state, params)
    grads = noisy(params, 1)
    grads["w"] = grads["w"].at[0].set(1e30)
    updates, after = vmap_update(tx)(grads, state, params)
    assert_skipped(state, after, updates)


def test_bfloat16_gradient_near_its_maximum_is_skipped_not_propagated():
    # bf16 shares float32's range: a squared norm of entries near 3e38 has no finite float32 value,
    # so the statistic is non-finite and the step is skipped (and counted), never half-applied.
    params = {"w": jnp.ones(3, jnp.bfloat16)}
    tx = optax_adascale.adascale_sgd(0.1, momentum=0.9, axis_name="i")
    state = tx.init(params)
    _, state = vmap_update(tx)(noisy(params, 0), state, params)
    grads = noisy(params, 1)
    grads["w"] = grads["w"].at[2, 1].set(jnp.bfloat16(3.0e38))
    assert bool(jnp.all(jnp.isfinite(grads["w"])))
    updates, after = vmap_update(tx)(grads, state, params)
    assert_skipped(state, after, updates)


# --------------------------------------------------------------------------- mixed precision


@pytest.mark.parametrize("dtype, big", [(jnp.float16, 6.0e4), (jnp.bfloat16, 1.0e18)])
def test_squared_norms_of_large_low_precision_gradients_do_not_overflow(dtype, big):
    # 60000² overflows float16 (max 65504) and 1e18² overflows bfloat16's float32-sized range only
    # after summing in low precision: statistics square after casting to float32.
    rng = np.random.default_rng(0)
    g = (big * (0.5 + 0.5 * rng.random((N, 8)))).astype(np.float32)
    g_low = jnp.asarray(g, dtype)
    tx = optax_adascale.adascale_sgd(1e-12, axis_name="i")
    params = jnp.zeros(8, dtype)
    _, state = vmap_update(tx)(g_low, tx.init(params), params)
    g64 = np.asarray(g_low.astype(jnp.float32), np.float64)
    a, b = np.mean(np.sum(g64**2, axis=1)), np.sum(g64.mean(0) ** 2)
    var = max(N / (N - 1) * (a - b), 1e-6)
    sqr = max(b - var / N, 0.0)
    m = optax_adascale.metrics(state)
    assert int(m["skipped_steps"]) == 0
    assert float(m["grad_sqr"]) == pytest.approx(sqr, rel=1e-2)
    assert float(m["gain"]) == pytest.approx((var + sqr) / (var / N + sqr), rel=1e-2)


def test_loss_scaled_float16_gradients_unscaled_before_update_match_float32():
    # Mixed-precision recipe: scale the loss by L for the backward pass, divide the gradient by L
    # (in float32) before handing it to AdaScale, as for any optax optimizer.
    L = 2.0**12
    x = jnp.asarray(np.random.default_rng(1).normal(size=(N, 16, 8)), jnp.float32)
    params32 = {"w": jnp.asarray(np.random.default_rng(2).normal(size=(8,)), jnp.float32)}
    params16 = jax.tree.map(lambda p: p.astype(jnp.float16), params32)
    loss = lambda p, xb: jnp.mean((xb.astype(p["w"].dtype) @ p["w"]) ** 2)
    g32 = jax.vmap(jax.grad(loss), in_axes=(None, 0))(params32, x)
    g16 = jax.vmap(jax.grad(lambda p, xb: loss(p, xb) * L), in_axes=(None, 0))(params16, x)
    unscaled = jax.tree.map(lambda g: (g.astype(jnp.float32) / L), g16)

    tx = optax_adascale.adascale_sgd(0.1, axis_name="i")
    _, s32 = vmap_update(tx)(g32, tx.init(params32), params32)
    _, s16 = vmap_update(tx)(unscaled, tx.init(params32), params32)
    assert float(optax_adascale.metrics(s16)["gain"]) == pytest.approx(
        float(optax_adascale.metrics(s32)["gain"]), rel=1e-2
    )

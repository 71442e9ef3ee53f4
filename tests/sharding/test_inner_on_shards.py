"""What ``inner`` may be where it sees shards: ZeRO's rows and tensor-parallel pieces (issue 16, bugs 1 and 2).

The sharded update must equal the replicated one: an ``inner`` that computes something else on a shard
(a norm, a mask from sizes) is refused, an ``inner`` that cannot be judged needs
:func:`optax_adascale.elementwise`, and the shard-aware clip clips by the norm over every shard.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import optax_adascale

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

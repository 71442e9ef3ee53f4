"""Squared norms over many small leaves: the fused reductions give the per-key sums exactly, in few reductions.

``_norms.fused_sq_norms`` concatenates the small leaves of one key (group and model axes) and reduces them once;
the truth is each leaf's ``Σ|x|²`` in float64 NumPy, summed per key.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import optax_adascale
from benchmarks import hlo as _hlo
from optax_adascale.core import _norms


def _tree(num_leaves, rng):
    """Leaves of mixed sizes (one above the small-leaf bound) and dtypes: biases, kernels, a large matrix."""
    sizes = [(3,), (4, 5), (2, 3, 3, 4), (_norms.SMALL_LEAF + 7,)] + [(int(rng.integers(1, 300)),)] * num_leaves
    dtypes = [jnp.float32, jnp.bfloat16, jnp.float16, jnp.float32, jnp.complex64]
    leaves = []
    for i, shape in enumerate(sizes):
        dtype = dtypes[i % len(dtypes)]
        x = rng.normal(size=shape) + (1j * rng.normal(size=shape) if dtype == jnp.complex64 else 0)
        leaves.append(jnp.asarray(x * (300.0 if dtype == jnp.float16 else 1.0), dtype))
    return leaves


def test_fused_squared_norms_sum_to_each_keys_squared_norm():
    rng = np.random.default_rng(0)
    leaves = _tree(30, rng)
    keys = [i % 3 for i in range(len(leaves))]
    got = jax.jit(lambda xs: _norms.fused_sq_norms(xs, keys))(leaves)
    assert all(g.dtype == jnp.float32 and g.shape == () for g in got)
    for key in set(keys):
        # float16 values near 300² would overflow if squared before the upcast: the truth squares in float64.
        truth = sum(float(np.sum(np.abs(np.asarray(x, np.complex128)) ** 2)) for x, k in zip(leaves, keys) if k == key)
        total = sum(float(g) for g, k in zip(got, keys) if k == key)
        assert total == pytest.approx(truth, rel=1e-6)


def test_a_large_leaf_keeps_its_own_squared_norm():
    rng = np.random.default_rng(1)
    big = jnp.asarray(rng.normal(size=_norms.SMALL_LEAF + 1), jnp.float32)
    small = [jnp.ones(3), jnp.ones(4)]
    got = _norms.fused_sq_norms([small[0], big, small[1]], [0, 0, 0])
    assert float(got[1]) == pytest.approx(float(np.sum(np.asarray(big, np.float64) ** 2)), rel=1e-6)
    assert float(got[0]) + float(got[2]) == 7.0


def _reduces_in_the_update(num_leaves):
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("i",))
    params = {f"b{i}": jnp.ones(16) for i in range(num_leaves)}
    # The statistics' reductions: on the update clock (the guarded τ clock's momentum adds three fused multiply-reduce
    # per leaf for its curvature, reading the state buffers in place: stacking them would copy them, memory first).
    tx = optax_adascale.adascale_sgd(0.1, momentum=0.9, axis_name="i", clock="update")

    def step(p, s, g):
        updates, s = tx.update(jax.tree.map(lambda x: x[0], g), s, p)
        return optax.apply_updates(p, updates), s

    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P("i")), out_specs=(P(), P())))
    grads = jax.tree.map(lambda x: jnp.stack([x * (i + 1) for i in range(8)]), params)
    return _hlo.count(_hlo.compiled_text(f, params, tx.init(params), grads), "reduce")


def test_the_update_takes_the_squared_norms_of_many_small_leaves_in_a_few_reductions():
    # 0.3 ran two reductions per leaf (each replica's ‖g‖², then ‖ḡ‖² after the all-reduce): 120 more for 60 leaves.
    assert _reduces_in_the_update(60) - _reduces_in_the_update(1) <= 2


def test_each_leafs_squared_norm_from_the_stacked_reductions():
    rng = np.random.default_rng(2)
    leaves = _tree(30, rng)
    got = jax.jit(_norms.leaf_sq_norms)(leaves)
    for x, g in zip(leaves, got, strict=True):
        assert g.dtype == jnp.float32 and g.shape == ()
        assert float(g) == pytest.approx(float(np.sum(np.abs(np.asarray(x, np.complex128)) ** 2)), rel=1e-6)


def test_the_micro_batch_helper_takes_many_small_leaves_norms_in_a_few_reductions_per_micro_batch():
    def reduces(num_leaves):
        params = {f"b{i}": jnp.ones(16) for i in range(num_leaves)}

        def loss(p, x):  # distinct gradients: the loss's own reductions are two per leaf (forward, backward)
            return sum(jnp.sum(jnp.sin(x * (i + 1)) * p[f"b{i}"]) for i in range(num_leaves))

        fn = optax_adascale.value_and_grad(loss, num_microbatches=4)
        return _hlo.count(_hlo.compiled_text(fn, params, jnp.ones((8, 16))), "reduce")

    # 0.3 took one more reduction per leaf in the loop body: 177 more for 60 leaves.
    assert reduces(60) - reduces(1) <= 2 * 59 + 4

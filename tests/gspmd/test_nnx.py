"""Flax NNX modules and ``nnx.Rngs`` passed to the drop-in as to ``nnx.value_and_grad`` (Flax's MNIST example).

Flax's example differentiates ``loss_fn(model, batch, rngs)`` with ``nnx.value_and_grad`` inside ``nnx.jit``: the
model holds BatchNorm's running statistics, the loss draws dropout from ``rngs`` at call time, and
``nnx.Optimizer(model, tx, wrt=nnx.Param).update(model, grads)`` takes the ``nnx.Param`` gradients. On 0.3 the
drop-in took the module as a plain pytree: ``grads`` covered every variable, the statistics and the RNG counts
were not written back, and ``optimizer.update(..., microbatch_stats=stats)`` raised "microbatch_stats.sq_norms must
have the structure of the gradients" (with the Auto-mesh ``param_specs`` warning). The truth here is
``nnx.value_and_grad`` of the same loss on the same global batch, with the same keys.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_adascale


class Net(nnx.Module):
    def __init__(self, rngs):
        self.linear1 = nnx.Linear(16, 32, rngs=rngs)
        self.bn = nnx.BatchNorm(32, rngs=rngs)
        self.dropout = nnx.Dropout(0.5)
        self.linear2 = nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x, rngs):
        return self.linear2(self.dropout(nnx.relu(self.bn(self.linear1(x))), rngs=rngs))


def loss_fn(model, batch, rngs):  # Flax's example's signature
    logits = model(batch["x"], rngs)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), logits


def make_batch(rows=64, seed=0):
    rng = np.random.default_rng(seed)
    return {"x": rng.normal(size=(rows, 16)).astype(np.float32), "y": rng.integers(0, 4, rows).astype(np.int32)}


def close(a, b, rtol=1e-5, atol=1e-6):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


MESHES = {
    "auto": lambda: jax.sharding.Mesh(np.array(jax.devices()), ("data",)),
    "explicit": lambda: jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,)),
}


@pytest.mark.parametrize("kind", sorted(MESHES))
def test_flax_example_step_swapping_only_value_and_grad_equals_nnx_and_trains(kind):
    mesh = MESHES[kind]()
    ours, theirs = Net(nnx.Rngs(0)), Net(nnx.Rngs(0))
    rngs_ours, rngs_theirs = nnx.Rngs(7), nnx.Rngs(7)
    # the update clock: the step checked below is its first, r·lr·g (the guarded τ clock's is tested in core/)
    optimizer = nnx.Optimizer(ours, optax_adascale.adascale_sgd(0.1, momentum=0.9, clock="update"), wrt=nnx.Param)
    batch = make_batch()

    @nnx.jit
    def step(model, optimizer, batch, rngs):  # Flax's train_step with the drop-in swapped in
        grad_fn = optax_adascale.value_and_grad(loss_fn, data_axes="data", has_aux=True)
        (loss, logits), grads, stats = grad_fn(model, batch, rngs)
        optimizer.update(model, grads, microbatch_stats=stats)
        return loss, logits, grads, stats

    reference = nnx.jit(nnx.value_and_grad(loss_fn, has_aux=True))
    with jax.set_mesh(mesh), warnings.catch_warnings():
        warnings.simplefilter("error")  # no Auto-mesh param_specs warning: the variables' metadata says P()
        rows = jax.device_put(batch, NamedSharding(mesh, P("data"))) if kind == "explicit" else batch
        (loss_ref, logits_ref), grads_ref = reference(theirs, batch, rngs_theirs)
        loss, logits, grads, stats = step(ours, optimizer, rows, rngs_ours)
        close((loss, logits), (loss_ref, logits_ref))
        close(grads, grads_ref)  # an nnx.State of the nnx.Param variables, as nnx.value_and_grad returns
        assert jax.tree.structure(stats.sq_norms) == jax.tree.structure(grads_ref)
        for s, g in zip(jax.tree.leaves(stats.sq_norms), jax.tree.leaves(grads), strict=True):
            assert float(s) >= float(jnp.sum(g**2)) * (1 - 1e-5)  # mean ‖g_i‖² ≥ ‖mean g_i‖²
        # the state the loss advanced is written back, as nnx.value_and_grad writes it
        close(nnx.state(ours, nnx.BatchStat), nnx.state(theirs, nnx.BatchStat))
        assert int(rngs_ours.default.count[...]) == int(rngs_theirs.default.count[...]) > 0
        # the update applied the AdaScale step to the parameters: r · lr · grads (momentum starts at 0)
        m = optax_adascale.metrics(optimizer)
        assert float(m["scale"]) == 8 and 1.0 <= float(m["gain"]) <= 8.0
        moved = optax.apply_updates(nnx.state(theirs, nnx.Param), jax.tree.map(lambda g: -0.1 * m["gain"] * g, grads))
        close(nnx.state(ours, nnx.Param), moved, rtol=1e-4, atol=1e-6)


def test_micro_batches_thread_the_module_state_as_sequential_nnx_calls():
    mesh = MESHES["explicit"]()
    k, shards, rows = 2, 8, 64
    ours, theirs = Net(nnx.Rngs(0)), Net(nnx.Rngs(0))
    rngs_ours, rngs_theirs = nnx.Rngs(3), nnx.Rngs(3)
    batch = make_batch(rows)
    grad_fn = optax_adascale.value_and_grad(loss_fn, data_axes="data", has_aux=True, num_microbatches=k)
    with jax.set_mesh(mesh):
        (loss, _), grads, stats = nnx.jit(grad_fn)(
            ours, jax.device_put(batch, NamedSharding(mesh, P("data"))), rngs_ours
        )
    assert stats.num_microbatches == shards * k
    # micro-batch j: the j-th block of every data shard's rows; each call starts from the last one's state
    per = rows // (shards * k)
    reference = nnx.value_and_grad(loss_fn, has_aux=True)
    losses, all_grads = [], []
    for j in range(k):
        idx = np.concatenate([s * (rows // shards) + j * per + np.arange(per) for s in range(shards)])
        (value, _), g = reference(theirs, jax.tree.map(lambda a: a[idx], batch), rngs_theirs)  # noqa: B023
        losses.append(value)
        all_grads.append(g)
    close(loss, np.mean(losses))
    close(grads, jax.tree.map(lambda *g: sum(g) / k, *all_grads))
    close(nnx.state(ours, nnx.BatchStat), nnx.state(theirs, nnx.BatchStat))
    assert int(rngs_ours.default.count[...]) == int(rngs_theirs.default.count[...])


def test_diff_state_argnums_as_nnx_value_and_grad():
    mesh = MESHES["explicit"]()
    wrt = nnx.DiffState(0, nnx.All(nnx.Param, nnx.PathContains("linear2")))
    ours, theirs = Net(nnx.Rngs(0)), Net(nnx.Rngs(0))
    batch = make_batch()
    with jax.set_mesh(mesh):
        rows = jax.device_put(batch, NamedSharding(mesh, P("data")))
        _, grads, stats = nnx.jit(optax_adascale.value_and_grad(loss_fn, data_axes="data", has_aux=True, argnums=wrt))(
            ours, rows, nnx.Rngs(1)
        )
        _, grads_ref = nnx.jit(nnx.value_and_grad(loss_fn, has_aux=True, argnums=wrt))(theirs, batch, nnx.Rngs(1))
    close(grads, grads_ref)
    assert len(jax.tree.leaves(grads)) == 2  # linear2's kernel and bias only
    assert jax.tree.structure(stats.sq_norms) == jax.tree.structure(grads_ref)


def test_a_module_inside_another_argument_is_refused_naming_the_fix():
    model = Net(nnx.Rngs(0))
    mesh = MESHES["explicit"]()
    grad_fn = optax_adascale.value_and_grad(lambda pair, batch: loss_fn(pair[0], batch, pair[1])[0], data_axes="data")
    with jax.set_mesh(mesh), pytest.raises(ValueError, match=r"argument 0 holds an NNX module.*argument of its own"):
        grad_fn((model, nnx.Rngs(1)), make_batch())


def test_arg_specs_name_the_arguments_as_the_user_passes_them():
    # arg_specs: one entry per argument not differentiated, the nnx.Rngs included (its entry is not used: an NNX
    # object's variables are state, passed whole)
    mesh = MESHES["auto"]()
    ours, theirs = Net(nnx.Rngs(0)), Net(nnx.Rngs(0))
    batch = make_batch()
    grad_fn = optax_adascale.value_and_grad(loss_fn, data_axes="data", has_aux=True, arg_specs=(P("data"), P()))
    with jax.set_mesh(mesh):
        (loss, _), grads, _ = nnx.jit(grad_fn)(ours, batch, nnx.Rngs(1))
        (loss_ref, _), grads_ref = nnx.jit(nnx.value_and_grad(loss_fn, has_aux=True))(theirs, batch, nnx.Rngs(1))
    close((loss, grads), (loss_ref, grads_ref))
    with pytest.raises(ValueError, match=r"arg_specs must give one entry per argument that is not differentiated"):
        optax_adascale.value_and_grad(loss_fn, data_axes="data", has_aux=True, arg_specs=(P("data"),))(
            ours, batch, nnx.Rngs(1)
        )

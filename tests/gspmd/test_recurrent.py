"""Recurrent layers through the drop-in: a scan whose carry starts unsharded (a zero state, Flax's
``initialize_carry``) and comes out split over the data axes. On an Auto mesh plain ``jax.value_and_grad`` runs it
(GSPMD decides the carry's layout); the drop-in, which runs the loss with the axes made Explicit, lays the carry out
as the body makes it. Value and gradients are ``jax.value_and_grad``'s on the same mesh, the per-copy statistics each
data shard's rows differentiated alone (no mesh). On an Explicit mesh the same loss with the zero state written the
Explicit way (``out_sharding=``) is exact too."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_adascale

B, T, D, H, SHARDS = 16, 5, 3, 4, 4


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(B, T, D)).astype(np.float32)
    y = rng.normal(size=(B, 1)).astype(np.float32)
    return x, y


def _hand_written(explicit: bool):
    rng = np.random.default_rng(1)
    params = {
        "wx": (rng.normal(size=(D, H)) / 2).astype(np.float32),
        "wh": (rng.normal(size=(H, H)) / 2).astype(np.float32),
        "out": rng.normal(size=(H, 1)).astype(np.float32),
    }

    def loss(p, x, y):
        def cell(h, xt):
            return jnp.tanh(xt @ p["wx"] + h @ p["wh"]), None

        on_mesh = explicit and jax.typeof(x).sharding.mesh.axis_names
        zero = jnp.zeros((x.shape[0], H), out_sharding=P("data") if on_mesh else None)
        h, _ = jax.lax.scan(cell, zero, jnp.swapaxes(x, 0, 1))
        return jnp.mean((h @ p["out"] - y) ** 2)

    return params, loss


def _flax_rnn(cell: str, seed: int):
    """Flax Linen's ``nn.RNN`` over ``nn.LSTMCell`` or ``nn.GRUCell`` (by name), a dense head on the last state."""
    from flax import linen as nn

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.RNN(getattr(nn, cell)(H))(x)
            return nn.Dense(1)(h[:, -1])

    model = Model()
    x, _ = _data()
    params = model.init(jax.random.key(seed), x[:2])["params"]

    def loss(p, x, y):
        return jnp.mean((model.apply({"params": p}, x) - y) ** 2)

    return params, loss


def _nnx_model_class():
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.rnn = nnx.RNN(nnx.LSTMCell(D, H, rngs=rngs))  # its carry RNG stream: state the loss advances
            self.out = nnx.Linear(H, 1, rngs=rngs)

        def __call__(self, x):
            return self.out(self.rnn(x)[:, -1])

    return Model


def _NnxModel(*args, **kwargs):  # noqa: N802 - a class built where Flax is imported
    return _nnx_model_class()(*args, **kwargs)


MODELS = {
    "hand_written": lambda: _hand_written(False),
    "flax_lstm": lambda: _flax_rnn("LSTMCell", 2),
    "flax_gru": lambda: _flax_rnn("GRUCell", 3),
}


def _per_shard_sq_norms(loss, params, x, y, k):
    """``mean_i ‖g_i‖²`` per leaf: sample ``i`` is micro-batch ``j`` of data shard ``s``'s rows, differentiated
    alone (no mesh)."""
    rows = B // (SHARDS * k)
    blocks = np.arange(B).reshape(SHARDS, k, rows)
    grads = [jax.grad(loss)(params, x[blocks[s, j]], y[blocks[s, j]]) for s in range(SHARDS) for j in range(k)]
    return jax.tree.map(lambda *g: float(np.mean([np.sum(np.square(a)) for a in g])), *grads)


@pytest.mark.parametrize(
    ("model", "k", "layout"),
    [(m, k, "replicated") for m in MODELS for k in (1, 2)]
    + [("hand_written", 2, "fsdp"), ("flax_lstm", 1, "fsdp"), ("flax_gru", 2, "fsdp")],
)
def test_a_recurrent_layer_on_an_auto_mesh_is_exact(model, k, layout):
    """Replicated parameters (as Flax writes them), or FSDP (each weight's last dimension split over the data axis,
    where it divides)."""
    params, loss = MODELS[model]()
    x, y = _data()
    mesh = jax.sharding.Mesh(np.array(jax.devices()[: SHARDS * 2]).reshape(SHARDS, 2), ("data", "model"))

    def spec(a):
        split = layout == "fsdp" and a.ndim == 2 and a.shape[-1] % SHARDS == 0
        return P(*([None] * (a.ndim - 1)), "data") if split else P()

    specs = jax.tree.map(spec, params)
    assert layout == "replicated" or any(sp != P() for sp in jax.tree.leaves(specs, is_leaf=lambda v: isinstance(v, P)))
    with jax.set_mesh(mesh):
        params = jax.tree.map(lambda a, sp: jax.device_put(a, NamedSharding(mesh, sp)), params, specs)
        xs, ys = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, y))
        fn = optax_adascale.value_and_grad(loss, data_axes="data", num_microbatches=k, param_specs=specs)
        value, grads, stats = jax.jit(fn)(params, xs, ys)
        blocks = np.arange(B).reshape(SHARDS, k, -1)
        refs = [
            jax.jit(jax.value_and_grad(loss))(params, *(jax.device_put(a[blocks[:, j].ravel()]) for a in (x, y)))
            for j in range(k)
        ]
    ref_value = np.mean([float(r[0]) for r in refs])
    ref_grads = jax.tree.map(lambda *g: np.mean(np.stack(g), axis=0), *[r[1] for r in refs])
    np.testing.assert_allclose(float(value), ref_value, rtol=2e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7), grads, ref_grads)
    expected = _per_shard_sq_norms(loss, params, x, y, k)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(float(a), b, rtol=2e-5), stats.sq_norms, expected)


@pytest.mark.parametrize("k", [1, 2])
def test_a_recurrent_layer_written_the_explicit_way_is_exact_on_an_explicit_mesh(k):
    params, loss = _hand_written(True)
    x, y = _data()
    mesh = jax.make_mesh((SHARDS, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    with jax.set_mesh(mesh):
        xs, ys = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, y))
        value, grads, stats = jax.jit(optax_adascale.value_and_grad(loss, data_axes="data", num_microbatches=k))(
            params, xs, ys
        )
    blocks = np.arange(B).reshape(SHARDS, k, -1)
    refs = [jax.value_and_grad(loss)(params, x[blocks[:, j].ravel()], y[blocks[:, j].ravel()]) for j in range(k)]
    np.testing.assert_allclose(float(value), np.mean([float(r[0]) for r in refs]), rtol=2e-5)
    ref_grads = jax.tree.map(lambda *g: np.mean(np.stack(g), axis=0), *[r[1] for r in refs])
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7), grads, ref_grads)
    expected = _per_shard_sq_norms(loss, params, x, y, k)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(float(a), b, rtol=2e-5), stats.sq_norms, expected)


@pytest.mark.parametrize("k", [1, 2])
def test_nnx_rnn_passed_as_a_module_on_an_auto_mesh_is_nnx_value_and_grads(k):
    """NNX's native form: the module itself to the drop-in, as to ``nnx.value_and_grad``; ``nnx.RNN``'s default
    carry RNG stream is state the loss advances (threaded through the k calls). Against ``nnx.value_and_grad`` on
    each global micro-batch, and the statistics against each sample differentiated alone."""
    from flax import nnx

    def loss(model, x, y):
        return jnp.mean((model(x) - y) ** 2)

    x, y = _data()
    model, twin = _NnxModel(nnx.Rngs(4)), _NnxModel(nnx.Rngs(4))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[: SHARDS * 2]).reshape(SHARDS, 2), ("data", "model"))
    with jax.set_mesh(mesh):
        xs, ys = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, y))
        fn = optax_adascale.value_and_grad(loss, data_axes="data", num_microbatches=k)
        value, grads, stats = nnx.jit(fn)(model, xs, ys)
    blocks = np.arange(B).reshape(SHARDS, k, -1)
    refs = [nnx.value_and_grad(loss)(twin, x[blocks[:, j].ravel()], y[blocks[:, j].ravel()]) for j in range(k)]
    np.testing.assert_allclose(float(value), np.mean([float(r[0]) for r in refs]), rtol=2e-5)
    ref_grads = jax.tree.map(lambda *g: np.mean(np.stack(g), axis=0), *[r[1] for r in refs])
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7), grads, ref_grads)
    # each sample (micro-batch j of data shard s) differentiated alone, by nnx.grad on a fresh copy
    rows = B // (SHARDS * k)
    samples = np.arange(B).reshape(SHARDS, k, rows)
    per_sample = [
        nnx.grad(loss)(_NnxModel(nnx.Rngs(4)), x[samples[i, j]], y[samples[i, j]])
        for i in range(SHARDS)
        for j in range(k)
    ]
    expected = jax.tree.map(lambda *g: float(np.mean([np.sum(np.square(a)) for a in g])), *per_sample)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(float(a), b, rtol=2e-5), stats.sq_norms, expected)

"""``value_and_grad`` as trainers call ``jax.value_and_grad``: several differentiated arguments (``argnums``, MaxText's
NNX ``argnums=(0, 1)``), a Python object among the others (MaxText's ``config``), what the loss closes over from the
enclosing jit (PRNG keys of every implementation, counters), and state the loss advances and returns in its aux
(NNX's RNG counters: ``state_argnum``), threaded through the micro-batches as the user's own accumulation threads it.
Each against ``jax.value_and_grad`` of the unmodified function (with ``k`` micro-batches: the user's own accumulation
over the same micro-batches)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_adascale

B, D, H, C = 32, 8, 16, 4
SHARDS = 4


def mesh_of(kind):
    if kind == "auto":
        return jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(SHARDS, 2), ("data", "model"))
    return jax.make_mesh((SHARDS, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)


def batch():
    rng = np.random.default_rng(0)
    return rng.normal(size=(B, D)).astype(np.float32), rng.integers(0, C, B).astype(np.int32)


def micro(x, k, j):
    """Micro-batch ``j`` of ``k``: the ``j``-th block of every data shard's rows (the drop-in's split)."""
    return x.reshape(SHARDS, k, -1, *x.shape[1:])[:, j].reshape(-1, *x.shape[1:])


def close(a, b, rtol=2e-5, atol=1e-6):
    jax.tree.map(lambda u, v: np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=rtol, atol=atol), a, b)


@dataclasses.dataclass(frozen=True)
class Config:  # a Python object among the arguments, as MaxText's config
    scale: float = 0.5
    layers: int = 2


def two_part_loss(w, b, config, x, y):
    h = x
    for _ in range(config.layers):  # a Python int read from the object: it must arrive as it is
        h = jnp.tanh(h @ w)
    return optax.softmax_cross_entropy_with_integer_labels(config.scale * h[:, :C] + b, y).mean()


@pytest.mark.parametrize("mesh_kind", ["explicit", "auto"])
@pytest.mark.parametrize("k", [1, 2])
def test_argnums_and_a_python_object_among_the_arguments(mesh_kind, k):
    rng = np.random.default_rng(1)
    w, b = (rng.normal(size=(D, D)) / 3).astype(np.float32), np.zeros(C, np.float32)
    x, y = batch()
    mesh = mesh_of(mesh_kind)
    with jax.set_mesh(mesh):
        xs, ys = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, y))
        fn = optax_adascale.value_and_grad(two_part_loss, argnums=(0, 1), data_axes="data", num_microbatches=k)
        value, grads, stats = jax.jit(fn, static_argnums=2)(w, b, Config(), xs, ys)
    ref = jax.value_and_grad(two_part_loss, argnums=(0, 1))
    refs = [ref(w, b, Config(), micro(x, k, j), micro(y, k, j)) for j in range(k)]
    ref_value = np.mean([r[0] for r in refs])
    ref_grads = jax.tree.map(lambda *g: np.mean(g, axis=0), *[r[1] for r in refs])
    assert isinstance(grads, tuple) and isinstance(stats.sq_norms, tuple)  # jax.value_and_grad's structure
    close((value, grads), (ref_value, ref_grads))
    assert stats.num_microbatches == SHARDS * k


KEYS = {
    "threefry": lambda: jax.random.key(3),
    "unsafe_rbg": lambda: jax.random.key(3, impl="unsafe_rbg"),
    "rbg": lambda: jax.random.key(3, impl="rbg"),
    "raw uint32": lambda: jax.random.PRNGKey(3),
}


@pytest.mark.parametrize("mesh_kind", ["explicit", "auto"])
@pytest.mark.parametrize("key_kind", list(KEYS))
def test_what_the_loss_closes_over_from_the_enclosing_jit(mesh_kind, key_kind):
    """A key and a counter that are arguments of the user's jitted step, closed over by the loss (typed on the
    user's mesh: on an Auto mesh, not the Explicit one the drop-in runs the loss on), k = 2."""
    rng = np.random.default_rng(2)
    w = (rng.normal(size=(D, C)) / 3).astype(np.float32)
    x, y = batch()
    mesh = mesh_of(mesh_kind)

    def step(w, x, y, key, count, scale):
        def loss(w, x, y):
            noise = jax.random.normal(jax.random.fold_in(key, count + 1), (x.shape[0], C))
            return optax.softmax_cross_entropy_with_integer_labels(x @ w + 0.1 * noise, y).mean() * scale

        ours = optax_adascale.value_and_grad(loss, data_axes="data", num_microbatches=2)(w, x, y)
        ref = [jax.value_and_grad(loss)(w, micro(x, 2, j), micro(y, 2, j)) for j in range(2)]
        return ours[:2], jax.tree.map(lambda *r: sum(r) / 2, *ref)

    with jax.set_mesh(mesh):
        xs, ys = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, y))
        ours, ref = jax.jit(step)(w, xs, ys, KEYS[key_kind](), jnp.uint32(5), jnp.float32(2.0))
    close(ours, ref)


class Dropped(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(D, H, rngs=rngs)
        self.drop = nnx.Dropout(0.3, rngs=rngs)
        self.l2 = nnx.Linear(H, C, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.drop(jnp.tanh(self.l1(x))))


def nnx_parts(impl):
    model = Dropped(nnx.Rngs(params=0, dropout=jax.random.key(1, impl=impl)))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def diff_wrapper(params, rest, x, y):  # MaxText's shape: (loss, (aux, non_param_rest))
        local = nnx.merge(graphdef, params, rest, copy=True)
        losses = optax.softmax_cross_entropy_with_integer_labels(local(x), y)
        aux = {"xent_sum": jnp.sum(losses), "tokens": jnp.int32(losses.shape[0])}
        return jnp.mean(losses), (aux, nnx.state(local, nnx.Not(nnx.Param)))

    return diff_wrapper, params, rest


def own_accumulation(diff_wrapper, params, rest, x, y, k, split):
    """The user's own accumulation (MaxText's gradient_accumulation_loss_and_grad for NNX): the state threaded."""
    grad_fn = jax.value_and_grad(diff_wrapper, has_aux=True)
    values, auxes, grads = [], [], []
    for j in range(k):
        (value, (aux, rest)), g = grad_fn(params, rest, split(x, k, j), split(y, k, j))
        values.append(value), auxes.append(aux), grads.append(g)
    aux = {"xent_sum": np.mean([a["xent_sum"] for a in auxes]), "tokens": sum(int(a["tokens"]) for a in auxes)}
    return (np.mean(values), (aux, rest)), jax.tree.map(lambda *g: sum(g) / k, *grads)


@pytest.mark.parametrize("impl", ["threefry2x32", "unsafe_rbg"])
@pytest.mark.parametrize("mesh_kind", ["explicit", "auto", "per_replica"])
def test_state_is_threaded_through_the_micro_batches(mesh_kind, impl):
    """NNX's RNG counters advance once per micro-batch in the user's own accumulation: with state_argnum the
    drop-in threads them the same way (each micro-batch its own dropout mask), and returns the last state."""
    diff_wrapper, params, rest = nnx_parts(impl)
    x, y = batch()
    k = 2
    fn = optax_adascale.value_and_grad(
        diff_wrapper,
        has_aux=True,
        state_argnum=1,
        num_microbatches=k,
        data_axes=None if mesh_kind == "per_replica" else "data",
    )
    if mesh_kind == "per_replica":
        contiguous = lambda a, k, j: a.reshape(k, -1, *a.shape[1:])[j]  # noqa: E731
        (value, (aux, new_rest)), grads, _ = jax.jit(fn)(params, rest, x, y)
        ref = own_accumulation(diff_wrapper, params, rest, x, y, k, contiguous)
    else:
        mesh = mesh_of(mesh_kind)
        with jax.set_mesh(mesh):
            xs, ys = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, y))
            (value, (aux, new_rest)), grads, _ = jax.jit(fn)(params, rest, xs, ys)
        ref = own_accumulation(diff_wrapper, params, rest, x, y, k, micro)
    (ref_value, (ref_aux, ref_rest)), ref_grads = ref
    close((value, grads), (ref_value, ref_grads))
    assert int(aux["tokens"]) == B and float(aux["xent_sum"]) == pytest.approx(float(ref_aux["xent_sum"]), rel=1e-5)
    counts = [int(c) for c in jax.tree.leaves(new_rest) if not jax.dtypes.issubdtype(c.dtype, jax.dtypes.prng_key)]
    assert counts == [
        int(c) for c in jax.tree.leaves(ref_rest) if not jax.dtypes.issubdtype(c.dtype, jax.dtypes.prng_key)
    ]
    assert max(counts) == k  # advanced once per micro-batch, not summed, not once


def test_state_argnum_needs_aux_and_is_not_differentiated():
    loss = lambda w, s, x: (jnp.sum(w * x), (0.0, s))  # noqa: E731
    with pytest.raises(ValueError, match="state_argnum=1 needs has_aux=True"):
        optax_adascale.value_and_grad(loss, state_argnum=1)
    with pytest.raises(ValueError, match="also in argnums"):
        optax_adascale.value_and_grad(loss, argnums=(0, 1), state_argnum=1, has_aux=True)
    with pytest.raises(TypeError, match="argnums must be"):
        optax_adascale.value_and_grad(loss, argnums="0")


@pytest.mark.parametrize("mesh_kind", ["explicit", "auto"])
def test_state_closed_over_is_not_summed_over_micro_batches_and_a_warning_names_state_argnum(mesh_kind):
    """A counter the loss advances from what it closes over (NNX's rest in a lambda): every micro-batch computes the
    same value; summed it read k times it. It is returned as it is, with a warning naming state_argnum; a count of
    the batch's rows is still summed."""
    rng = np.random.default_rng(3)
    w = (rng.normal(size=(D, C)) / 3).astype(np.float32)
    x, y = batch()
    mesh = mesh_of(mesh_kind)

    def step(w, x, y, count):
        def loss(w, x, y):
            out = optax.softmax_cross_entropy_with_integer_labels(x @ w, y).mean()
            return out, {"count": count + 1, "rows": jnp.int32(x.shape[0])}

        return optax_adascale.value_and_grad(loss, data_axes="data", num_microbatches=2, has_aux=True)(w, x, y)[0]

    with jax.set_mesh(mesh):
        xs, ys = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, y))
        with pytest.warns(UserWarning, match=r"do not depend on the batch.*state_argnum"):
            _, aux = jax.jit(step)(w, xs, ys, jnp.uint32(5))
    assert int(aux["count"]) == 6 and int(aux["rows"]) == B

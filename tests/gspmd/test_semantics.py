"""``value_and_grad(data_axes=...)`` keeps the loss as written: its value, grads and aux are
``jax.value_and_grad``'s of the unmodified loss on the global batch, and its statistics are the
per-copy contributions ``g_i = n·∂L/∂θ_i``, against a reference that gives each data shard's rows
their own copy of the parameters (no mesh, no drop-in).

The model is an embedding + MLP written the Explicit way (``jax.make_mesh``'s default axes): it is
valid for ``jax.value_and_grad`` on every layout below, which is what a user's own step needs.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_adascale

B, D, H, C, V = 32, 8, 16, 4, 12
SHARDS = 4
LAYOUTS = {
    "replicated": {"emb": P(), "w1": P(), "b1": P(), "w2": P(), "b2": P()},
    "TP": {"emb": P(None, "model"), "w1": P(None, "model"), "b1": P("model"), "w2": P("model", None), "b2": P()},
    "FSDP": {"emb": P(None, "data"), "w1": P("data", None), "b1": P("data"), "w2": P("data", None), "b2": P()},
    "TPxFSDP": {
        "emb": P("data", None),
        "w1": P("data", "model"),
        "b1": P("model"),
        "w2": P("model", "data"),
        "b2": P(),
    },
}


@functools.cache
def data():
    rng = np.random.default_rng(0)
    params = {
        "emb": rng.normal(size=(V, D)).astype(np.float32),
        "w1": (rng.normal(size=(D, H)) / 3).astype(np.float32),
        "b1": (0.1 * rng.normal(size=(H,))).astype(np.float32),
        "w2": (rng.normal(size=(H, C)) / 4).astype(np.float32),
        "b2": (0.1 * rng.normal(size=(C,))).astype(np.float32),
    }
    x = rng.normal(size=(B, D)).astype(np.float32)
    tok = rng.integers(0, V, size=(B,)).astype(np.int32)
    y = rng.integers(0, C, size=(B,)).astype(np.int32)
    # unequal real-token counts per data shard: 7, 2, 5, 8 of 8 rows
    mask = np.concatenate([np.arange(8) < k for k in (7, 2, 5, 8)]).astype(np.float32)
    return params, x, tok, y, mask


def feature_spec(x):
    """The Explicit-mode spec of an activation's feature dimension (so a bias lines up with it)."""
    return jax.typeof(x).sharding.spec[-1] if len(jax.typeof(x).sharding.spec) == x.ndim else None


def model(p, x, tok):
    """Embedding lookup + a tanh MLP, written the Explicit way (valid on every layout of LAYOUTS)."""
    e = p["emb"].at[tok].get(out_sharding=P("data", None))
    h = jnp.einsum("bd,dh->bh", x + e, p["w1"], out_sharding=P("data", jax.typeof(p["w1"]).sharding.spec[1]))
    h = jnp.tanh(h + jax.reshard(p["b1"], P(feature_spec(h))))
    out = jnp.einsum("bh,hc->bc", h, p["w2"], out_sharding=P("data", None))
    return out + p["b2"]


def model_rows(p, x, tok):
    """The same model, each row through its own copy of the parameters (leading axis of every leaf: the rows)."""

    def row(p, x, t):
        h = jnp.tanh((x + p["emb"][t]) @ p["w1"] + p["b1"])
        return h @ p["w2"] + p["b2"]

    return jax.vmap(row)(p, x, tok)


def replicated(x):
    """An activation gathered over the data axes (on a mesh): how an Explicit-way loss couples the rows."""
    spec = getattr(jax.typeof(x).sharding, "spec", None)
    return jax.reshard(x, P()) if spec is not None and any(s is not None for s in spec) else x


# Heads: (outputs, labels, mask, parameters as the head sees them) -> loss. Each is written once and used both
# in the global loss (on the mesh) and in the per-copy reference (no mesh).
HEADS = {
    "mean_xent": lambda o, y, m, p: optax.softmax_cross_entropy_with_integer_labels(o, y).mean(),
    "token_weighted": lambda o, y, m, p: (
        jnp.sum(optax.softmax_cross_entropy_with_integer_labels(o, y) * m) / jnp.sum(m)
    ),
    "penalty": lambda o, y, m, p: (
        optax.softmax_cross_entropy_with_integer_labels(o, y).mean() + 0.01 * jnp.sum(p["w1"] ** 2)
    ),
    "batch_norm": lambda o, y, m, p: optax.softmax_cross_entropy_with_integer_labels(
        (o - o.mean(0)) / (o.std(0) + 1e-3), y
    ).mean(),
    "logsumexp": lambda o, y, m, p: jax.nn.logsumexp(o[:, 0] * m),
    "in_batch_negatives": lambda o, y, m, p: (
        -jnp.mean(jnp.diagonal(jax.nn.log_softmax(replicated(o) @ replicated(o).T, axis=1)))
    ),
    "sort": lambda o, y, m, p: jnp.sum(jnp.sort(replicated(o[:, 0])) * jnp.linspace(-1.0, 1.0, o.shape[0])),
    "top_k": lambda o, y, m, p: jnp.sum(jax.lax.top_k(replicated(o[:, 1]), 5)[0]),
    "cumsum": lambda o, y, m, p: jnp.sum(jnp.cumsum(replicated(o[:, 2])) ** 2) / o.shape[0] ** 2,
    "relu_integer_xent": lambda o, y, m, p: optax.softmax_cross_entropy_with_integer_labels(jax.nn.relu(o), y).mean(),
}


def global_loss(head):
    def loss(p, x, tok, y, mask):
        return head(model(p, x, tok), y, mask, p)

    return loss


def per_copy_stats(head, k=1):
    """``mean_i ‖n·∂L/∂θ_i‖²`` per leaf, θ_i the copy that sample i's rows use (``k`` contiguous micro-batches
    per shard, the loss the mean of the micro-batches' losses); a term of the parameters alone (the penalty)
    sees the mean of the copies."""
    params, x, tok, y, mask = data()
    n = SHARDS * k
    rows = np.arange(B).reshape(SHARDS, k, B // n)  # rows[i, j]: shard i's j-th micro-batch

    def total(stack):
        copy = np.zeros(B, np.int32)
        for i in range(SHARDS):
            for j in range(k):
                copy[rows[i, j]] = i * k + j
        out = model_rows(jax.tree.map(lambda a: a[copy], stack), x, tok)
        mean_p = jax.tree.map(lambda a: a.mean(0), stack)
        micro = [rows[:, j].ravel() for j in range(k)]
        return sum(head(out[r], y[r], mask[r], mean_p) for r in micro) / k

    grads = jax.grad(total)(jax.tree.map(lambda a: np.stack([a] * n), params))
    return {
        name: float(np.mean(np.sum((n * np.asarray(g)) ** 2, axis=tuple(range(1, g.ndim)))))
        for name, g in grads.items()
    }


def run(loss, layout, *, k=1, axis_type=AxisType.Explicit, has_aux=False, extra=(), specs=False, arg_specs=None):
    """(drop-in's (value, grads, stats), jax.value_and_grad's) on the same mesh and shardings. With ``k > 1`` the
    reference is the mean over the k global micro-batches (the j-th block of every shard's rows) of it.
    ``specs``: pass the layout's specs as ``param_specs`` (how an Auto mesh keeps it)."""
    params, x, tok, y, mask = data()
    types = axis_type if isinstance(axis_type, tuple) else (axis_type,) * 2
    mesh = jax.make_mesh((SHARDS, 2), ("data", "model"), axis_types=types)
    blocks = np.arange(B).reshape(SHARDS, k, -1)
    with jax.set_mesh(mesh):
        put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
        placed = {name: put(a, LAYOUTS[layout][name]) for name, a in params.items()}
        batch = [put(a, P("data")) for a in (x, tok, y, mask)]
        fn = optax_adascale.value_and_grad(
            loss,
            data_axes="data",
            num_microbatches=k,
            has_aux=has_aux,
            param_specs=LAYOUTS[layout] if specs else None,
            arg_specs=arg_specs,
        )
        ours = jax.jit(fn)(placed, *batch, *extra)
        reference = jax.jit(jax.value_and_grad(loss, has_aux=has_aux))
        refs = [
            reference(placed, *(put(a[blocks[:, j].ravel()], P("data")) for a in (x, tok, y, mask)), *extra)
            for j in range(k)
        ]
    ref = refs[0] if k == 1 else jax.tree.map(lambda *r: np.mean(np.asarray(r), axis=0), *refs)
    return ours, ref


def assert_close(a, b, rtol=2e-5, atol=1e-7):
    jax.tree.map(lambda u, v: np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=rtol, atol=atol), a, b)


def assert_stats(stats, head, k=1, rtol=2e-5):
    assert stats.num_microbatches == SHARDS * k
    expected = per_copy_stats(head, k)
    for name, value in expected.items():
        assert float(stats.sq_norms[name]) == pytest.approx(value, rel=rtol), name


# --------------------------------------------------------------------------- any loss, on the Explicit mesh


CASES = [(head, "TPxFSDP") for head in HEADS] + [
    (head, layout) for head in ("mean_xent", "token_weighted", "penalty") for layout in ("replicated", "TP", "FSDP")
]


@pytest.mark.parametrize(("head", "layout"), CASES)
def test_value_grads_and_statistics_are_those_of_the_loss_as_written(head, layout):
    (value, grads, stats), (ref_value, ref_grads) = run(global_loss(HEADS[head]), layout)
    assert_close(value, ref_value)
    assert_close(grads, ref_grads)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        assert g.sharding.is_equivalent_to(r.sharding, g.ndim)  # sharded as jax.value_and_grad's: like the params
    assert_stats(stats, HEADS[head])
    assert float(sum(jax.tree.leaves(stats.mean_sq_norms))) == pytest.approx(
        float(sum(np.sum(np.square(g)) for g in jax.tree.leaves(ref_grads))), rel=2e-5
    )


@pytest.mark.parametrize("head", ["token_weighted", "batch_norm", "penalty"])
def test_micro_batches_are_the_mean_of_value_and_grad_on_each(head):
    """num_microbatches=2: value and grads are the mean over the 2 global micro-batches (micro-batch j holds the
    j-th half of every shard's rows) of jax.value_and_grad on each; the samples are shards × 2."""
    (value, grads, stats), (ref_value, ref_grads) = run(global_loss(HEADS[head]), "TPxFSDP", k=2)
    assert_close((value, grads), (ref_value, ref_grads))
    assert_stats(stats, HEADS[head], k=2)


# --------------------------------------------------------------------------- what else a loss does


def test_aux_of_any_type_is_the_global_calls():
    def loss(p, x, tok, y, mask):
        out = model(p, x, tok)
        losses = optax.softmax_cross_entropy_with_integer_labels(out, y)
        aux = {
            "tokens": jnp.sum(mask).astype(jnp.int32),
            "loss_sum": jnp.sum(losses * mask),
            "per_example": losses,
            "nested": (jnp.argmax(out, -1) == y, {"w1_norm": jnp.sum(p["w1"] ** 2)}),
        }
        return jnp.sum(losses * mask) / jnp.sum(mask), aux

    ((value, aux), grads, _), ((ref_value, ref_aux), ref_grads) = run(loss, "TPxFSDP", has_aux=True)
    assert_close((value, grads), (ref_value, ref_grads))
    assert jax.tree.structure(aux) == jax.tree.structure(ref_aux)
    assert aux["tokens"].dtype == jnp.int32 and int(aux["tokens"]) == int(data()[4].sum())
    assert_close(aux, ref_aux)


def test_aux_over_micro_batches_is_averaged_and_counts_add_up():
    def loss(p, x, tok, y, mask):
        losses = optax.softmax_cross_entropy_with_integer_labels(model(p, x, tok), y)
        return jnp.mean(losses), {"tokens": jnp.sum(mask).astype(jnp.int32), "mean_loss": jnp.mean(losses)}

    ((value, aux), _, _), _ = run(loss, "replicated", k=2, has_aux=True)
    assert int(aux["tokens"]) == int(data()[4].sum())  # integers: summed over the micro-batches
    assert float(aux["mean_loss"]) == pytest.approx(float(value), rel=1e-6)  # floats: averaged


def test_maxtext_token_weighted_accumulation_recipe_is_exact():
    """MaxText accumulates Σ numerators / Σ counts over micro-batches. With num_microbatches=k the same gradient
    comes from each micro-batch's loss k·Σ(xent·mask)/W, W the whole batch's token count passed in."""

    def loss(p, x, tok, y, mask, total_weights):
        xent = optax.softmax_cross_entropy_with_integer_labels(model(p, x, tok), y)
        return 2 * jnp.sum(xent * mask) / total_weights

    weights = jnp.float32(data()[4].sum())
    (value, grads, _), _ = run(loss, "TPxFSDP", k=2, extra=(weights,))
    _, (ref_value, ref_grads) = run(global_loss(HEADS["token_weighted"]), "TPxFSDP")
    assert_close((value, grads), (ref_value, ref_grads))


@pytest.mark.parametrize("layout", ["replicated", "TPxFSDP"])
def test_random_draws_of_any_kind_are_the_global_calls(layout):
    """A dropout mask from a key passed unbatched, per-example keys from fold_in over the rows, a permutation
    of the rows: the loss as written (each draw the global call's)."""

    def loss(p, x, tok, y, mask, key):
        out = model(p, x, tok)
        k1, k2, k3 = jax.random.split(key, 3)
        keep = jax.random.bernoulli(k1, 0.7, out.shape)
        out = jnp.where(keep, out / 0.7, 0.0)
        keys = jax.vmap(lambda i: jax.random.fold_in(k2, i))(jnp.arange(out.shape[0]))
        noise = jax.vmap(lambda kk: jax.random.normal(kk, (C,)))(keys)
        out = out + 0.1 * jax.reshard(noise, jax.typeof(out).sharding.spec)
        perm = jax.random.permutation(k3, out.shape[0])
        shuffled = replicated(out)[perm]
        return optax.softmax_cross_entropy_with_integer_labels(out, y).mean() + jnp.mean(shuffled[:8] ** 2)

    (value, grads, _), (ref_value, ref_grads) = run(loss, layout, extra=(jax.random.key(3),))
    assert_close((value, grads), (ref_value, ref_grads))


def test_an_rbg_key_works_as_maxtext_uses_it():
    def loss(p, x, tok, y, mask, key):
        out = model(p, x, tok)
        return optax.softmax_cross_entropy_with_integer_labels(
            jnp.where(jax.random.bernoulli(key, 0.8, out.shape), out, 0.0), y
        ).mean()

    (value, grads, _), (ref_value, ref_grads) = run(loss, "FSDP", extra=(jax.random.key(3, impl="unsafe_rbg"),))
    assert_close((value, grads), (ref_value, ref_grads))


def test_custom_vjp_and_custom_jvp_of_any_kind_keep_their_rules():
    """A custom_vjp that clips its cotangent (on activations) and one on the weights themselves (a rule that is
    not the function's derivative), and jax.nn.relu's custom_jvp: the loss's own gradient, rules included."""

    @jax.custom_vjp
    def clip_grad(h):
        return h

    clip_grad.defvjp(lambda h: (h, None), lambda _, g: (jnp.clip(g, -1e-3, 1e-3),))

    @jax.custom_vjp
    def scaled(w):
        return w

    scaled.defvjp(lambda w: (w, None), lambda _, g: (3.0 * g,))

    def loss(p, x, tok, y, mask):
        p = dict(p, w2=scaled(p["w2"]))
        out = clip_grad(jax.nn.relu(model(p, x, tok)))
        return optax.softmax_cross_entropy_with_integer_labels(out, y).mean()

    def rows_loss(stack):
        copy = np.repeat(np.arange(SHARDS), B // SHARDS)
        params, x, tok, y, _ = data()
        stack = dict(stack, w2=scaled(stack["w2"]))
        out = clip_grad(jax.nn.relu(model_rows(jax.tree.map(lambda a: a[copy], stack), x, tok)))
        return optax.softmax_cross_entropy_with_integer_labels(out, y).mean()

    (value, grads, stats), (ref_value, ref_grads) = run(loss, "TP")
    assert_close((value, grads), (ref_value, ref_grads))
    g = jax.grad(rows_loss)(jax.tree.map(lambda a: np.stack([a] * SHARDS), data()[0]))
    for name, leaf in g.items():
        expected = np.mean(np.sum((SHARDS * np.asarray(leaf)) ** 2, axis=tuple(range(1, leaf.ndim))))
        assert float(stats.sq_norms[name]) == pytest.approx(expected, rel=2e-5), name


@pytest.mark.parametrize("over", ["data", "model"])
def test_shard_map_inside_the_loss(over):
    """A kernel written with jax.shard_map, over the data axes (a per-shard op) or over the model axes only."""

    def kernel(h):
        if over == "data":
            return jax.shard_map(
                lambda t: t * jax.lax.rsqrt(jnp.mean(t * t, axis=-1, keepdims=True) + 1e-6),
                in_specs=P("data", None),
                out_specs=P("data", None),
                axis_names={"data"},
            )(h)
        return jax.shard_map(
            lambda t: jnp.tanh(t), in_specs=P(None, None), out_specs=P(None, None), axis_names={"model"}
        )(h)

    def loss(p, x, tok, y, mask):
        return optax.softmax_cross_entropy_with_integer_labels(kernel(model(p, x, tok)), y).mean()

    (value, grads, _), (ref_value, ref_grads) = run(loss, "replicated")
    assert_close((value, grads), (ref_value, ref_grads))


def test_a_non_batch_argument_with_the_batchs_leading_size_is_not_split():
    """An argument whose first dimension happens to equal the batch's, not sharded over the data axes: the
    loss sees it whole (on every micro-batch too)."""

    def loss(p, x, tok, y, mask, table):
        out = model(p, x, tok)
        return optax.softmax_cross_entropy_with_integer_labels(out, y).mean() + 1e-2 * jnp.sum(out @ table[:C].T)

    table = jnp.asarray(np.random.default_rng(1).normal(size=(B, C)), jnp.float32)
    (value, grads, _), (ref_value, ref_grads) = run(loss, "TPxFSDP", extra=(table,))
    assert_close((value, grads), (ref_value, ref_grads))
    ours, ref = run(loss, "TPxFSDP", k=2, extra=(table,))
    assert_close(ours[:2], ref)


def test_a_custom_vjp_on_an_fsdp_parameter_before_its_gather_is_refused_with_the_fix():
    @jax.custom_vjp
    def scaled(w):
        return w

    scaled.defvjp(lambda w: (w, None), lambda _, g: (3.0 * g,))

    def loss(p, x, tok, y, mask):
        return optax.softmax_cross_entropy_with_integer_labels(model(dict(p, w2=scaled(p["w2"])), x, tok), y).mean()

    with pytest.raises(ValueError, match=r"custom_vjp.*sharded over the data axes.*Gather the parameter first"):
        run(loss, "TPxFSDP")


def test_device_put_inside_the_loss_on_an_explicit_mesh():
    def loss(p, x, tok, y, mask):
        out = model(p, x, tok)
        y = jax.device_put(y, P("data"))
        return optax.softmax_cross_entropy_with_integer_labels(out, y).mean()

    (value, grads, _), (ref_value, ref_grads) = run(loss, "TP")
    assert_close((value, grads), (ref_value, ref_grads))


@pytest.mark.parametrize("layout", ["replicated", "FSDP"])
def test_the_users_named_scopes_stay_in_the_compiled_step(layout):
    """Profiles under the drop-in show the user's ``jax.named_scope``\\ s: the re-evaluated loss keeps each
    operation's name stack, inside a scanned, rematerialised layer too (the op metadata of the lowered step)."""
    params, x, tok, y, mask = data()
    mesh = jax.make_mesh((SHARDS, 2), ("data", "model"))

    def loss(p, x, tok, y, mask):
        with jax.named_scope("user_embed"):
            h = x + p["emb"].at[tok].get(out_sharding=P("data", None))

        def layer(h, _):
            with jax.named_scope("user_layer"):
                return jnp.tanh(jnp.einsum("bd,de->be", h, p["w1"][:, :D], out_sharding=P("data", None))), None

        h, _ = jax.lax.scan(jax.checkpoint(layer), h, None, length=2)
        return optax.softmax_cross_entropy_with_integer_labels(h[:, :C], y).mean()

    with jax.set_mesh(mesh):
        placed = {k: jax.device_put(v, NamedSharding(mesh, LAYOUTS[layout][k])) for k, v in params.items()}
        batch = [jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, tok, y, mask)]
        text = (
            jax.jit(optax_adascale.value_and_grad(loss, data_axes="data"))
            .lower(placed, *batch)
            .as_text(debug_info=True)
        )
    assert "user_embed" in text and "user_layer" in text


# --------------------------------------------------------------------------- Auto meshes


@pytest.mark.parametrize("head", ["mean_xent", "token_weighted", "penalty", "batch_norm", "relu_integer_xent"])
def test_auto_mesh_is_exact_for_the_mean_and_token_weighted_losses(head):
    """MaxText's default is an Auto mesh: there the loss runs with every axis made Explicit (its constraints lose
    those axes), exact for these losses; without param_specs the parameters are replicated (the warning says so)."""

    def loss(p, x, tok, y, mask):
        e = p["emb"][tok]
        h = jax.lax.with_sharding_constraint(jnp.tanh((x + e) @ p["w1"] + p["b1"]), P("data", None))
        return HEADS[head](h @ p["w2"] + p["b2"], y, mask, p)

    with pytest.warns(UserWarning, match=r"replicated inside the loss.*Pass their PartitionSpecs as param_specs="):
        (value, grads, stats), (ref_value, ref_grads) = run(loss, "TPxFSDP", axis_type=AxisType.Auto)
    assert_close((value, grads), (ref_value, ref_grads))
    assert_stats(stats, HEADS[head])


@pytest.mark.parametrize("k", [1, 2])
def test_auto_mesh_dropout_is_the_global_call(k):
    """jax.random.bernoulli(..., out_sharding=) on an Auto mesh casts its key and mask to the Auto mesh (auto_axes):
    on the Explicit mesh the loss runs on, those casts are sharding hints (JAX 0.11.2 failed: 'NoneType' has no
    'spec')."""

    def loss(p, x, tok, y, mask, key):  # the key an argument and the mask's sharding named, as NNX's Dropout does
        h = jnp.tanh((x + p["emb"][tok]) @ p["w1"] + p["b1"])
        keep = jax.random.bernoulli(key, 0.8, h.shape, out_sharding=jax.typeof(h).sharding)
        h = jnp.where(keep, h / 0.8, 0.0)
        return HEADS["mean_xent"](h @ p["w2"] + p["b2"], y, mask, p)

    (value, grads, stats), (ref_value, ref_grads) = run(
        loss, "TP", k=k, axis_type=AxisType.Auto, extra=(jax.random.key(7),), specs=True
    )
    assert_close((value, grads), (ref_value, ref_grads))
    assert stats.num_microbatches == SHARDS * k and all(np.isfinite(float(v)) for v in jax.tree.leaves(stats.sq_norms))


def auto_loss(head):
    """The model written for Auto axes: no annotation at all (GSPMD decides every sharding)."""

    def loss(p, x, tok, y, mask):
        h = jnp.tanh((x + p["emb"][tok]) @ p["w1"] + p["b1"])
        return HEADS[head](h @ p["w2"] + p["b2"], y, mask, p)

    return loss


@pytest.mark.parametrize("layout", ["TP", "FSDP", "TPxFSDP"])
@pytest.mark.parametrize("head", ["mean_xent", "token_weighted", "penalty", "batch_norm"])
def test_auto_mesh_with_param_specs_keeps_the_layout_and_is_exact(head, layout, recwarn):
    """param_specs lay the parameters out inside the loss as the user placed them (an Auto mesh does not record
    it): FSDP weights are gathered at their use, the TP contraction sums its partial products, as GSPMD does.
    Value and grads are jax.value_and_grad's on the same Auto mesh, the statistics the per-copy ones."""
    (value, grads, stats), (ref_value, ref_grads) = run(auto_loss(head), layout, axis_type=AxisType.Auto, specs=True)
    assert_close((value, grads), (ref_value, ref_grads))
    assert_stats(stats, HEADS[head])
    assert not [w for w in recwarn if "param_specs" in str(w.message)]


def test_auto_mesh_with_param_specs_and_micro_batches_is_exact():
    (value, grads, stats), (ref_value, ref_grads) = run(
        auto_loss("token_weighted"), "TPxFSDP", k=2, axis_type=AxisType.Auto, specs=True
    )
    assert_close((value, grads), (ref_value, ref_grads))
    assert_stats(stats, HEADS["token_weighted"], k=2)


@pytest.mark.parametrize(
    "types", [(AxisType.Auto, AxisType.Explicit), (AxisType.Explicit, AxisType.Auto)], ids=["data Auto", "model Auto"]
)
def test_a_mesh_partly_auto_is_refused_with_the_fix(types):
    """A mesh of Auto and Explicit axes together: with the data axis Auto the statistics were 11 % off, silently
    (JAX 0.10 and 0.12); now refused, naming a mesh of one kind."""
    with pytest.raises(ValueError, match=r"all Explicit .* or all Auto .* not a mix \(data: \w+, model: \w+\)"):
        run(auto_loss("mean_xent"), "replicated", axis_type=types, specs=True)


def weighted_loss(p, x, tok, y, mask, class_weights):
    """Written for Auto axes, with a replicated argument whose first dimension the shards divide (per-class
    weights): it is not the batch."""
    h = jnp.tanh((x + p["emb"][tok]) @ p["w1"] + p["b1"])
    xent = optax.softmax_cross_entropy_with_integer_labels(h @ p["w2"] + p["b2"], y)
    return jnp.mean(xent * class_weights[y])


def test_auto_mesh_refuses_to_guess_which_argument_is_the_batch():
    weights = jnp.arange(1.0, 2 * C + 1.0)  # 8 (room for more classes): shards × k = 8 divide it, as the batch's 32
    with pytest.raises(ValueError, match=r"cannot tell which arguments are the batch.*\[8, 32\].*arg_specs="):
        run(weighted_loss, "TP", k=2, axis_type=AxisType.Auto, specs=True, extra=(weights,))


@pytest.mark.parametrize("k", [1, 2])
def test_auto_mesh_arg_specs_say_which_argument_is_the_batch(k):
    weights = jnp.arange(1.0, 2 * C + 1.0)
    arg_specs = (P("data"), P("data"), P("data"), P("data"), P())
    (value, grads, _), (ref_value, ref_grads) = run(
        weighted_loss, "TP", k=k, axis_type=AxisType.Auto, specs=True, extra=(weights,), arg_specs=arg_specs
    )
    assert_close((value, grads), (ref_value, ref_grads))


def test_param_specs_that_disagree_with_an_explicit_mesh_are_refused():
    with pytest.raises(ValueError, match=r"param_specs: leaf .* typed .* but param_specs says"):
        fn = optax_adascale.value_and_grad(global_loss(HEADS["mean_xent"]), data_axes="data")
        params, x, tok, y, mask = data()
        mesh = jax.make_mesh((SHARDS, 2), ("data", "model"))
        with jax.set_mesh(mesh):
            placed = {n: jax.device_put(a, NamedSharding(mesh, LAYOUTS["TP"][n])) for n, a in params.items()}
            batch = [jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, tok, y, mask)]
            fn = optax_adascale.value_and_grad(
                global_loss(HEADS["mean_xent"]), data_axes="data", param_specs=LAYOUTS["FSDP"]
            )
            jax.jit(fn)(placed, *batch)


def test_param_specs_not_shaped_like_the_params_are_refused():
    params, x, tok, y, mask = data()
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(SHARDS, 2), ("data", "model"))
    with jax.set_mesh(mesh):
        batch = [jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, tok, y, mask)]
        fn = optax_adascale.value_and_grad(auto_loss("mean_xent"), data_axes="data", param_specs={"w1": P()})
        with pytest.raises(ValueError, match=r"param_specs must be a pytree like params"):
            jax.jit(fn)(params, *batch)


@pytest.mark.parametrize("layout", ["replicated", "TPxFSDP"])
@pytest.mark.parametrize("head", ["in_batch_negatives", "sort", "top_k", "cumsum", "logsumexp"])
def test_auto_mesh_takes_gspmds_decisions_for_losses_that_couple_the_rows(head, layout):
    """Written for Auto axes, a loss across the rows (in-batch negatives, sort, top-k, cumsum) meets Explicit types
    that ask where the rows go: the drop-in gathers them, as GSPMD does (and as the Explicit way writes it);
    value, grads and the per-copy statistics are exact."""
    (value, grads, stats), (ref_value, ref_grads) = run(auto_loss(head), layout, axis_type=AxisType.Auto, specs=True)
    assert_close((value, grads), (ref_value, ref_grads))
    assert_stats(stats, HEADS[head])


def test_auto_mesh_keeps_a_custom_rule_on_an_fsdp_weight():
    """A custom rule (not the derivative) on an FSDP weight, on an Auto mesh: the loss's own gradient, rule
    included, and the per-copy statistics with the rule applied to each copy."""

    @jax.custom_vjp
    def scaled(w):
        return w

    scaled.defvjp(lambda w: (w, None), lambda _, g: (3.0 * g,))

    def loss(p, x, tok, y, mask):
        return auto_loss("mean_xent")(dict(p, w2=scaled(p["w2"])), x, tok, y, mask)

    (value, grads, stats), (ref_value, ref_grads) = run(loss, "TPxFSDP", axis_type=AxisType.Auto, specs=True)
    assert_close((value, grads), (ref_value, ref_grads))
    expected = per_copy_stats(HEADS["mean_xent"])
    assert float(stats.sq_norms["w2"]) == pytest.approx(9 * expected["w2"], rel=2e-5)
    for name in ("emb", "w1", "b1", "b2"):
        assert float(stats.sq_norms[name]) == pytest.approx(expected[name], rel=2e-5), name


def test_an_auto_loss_that_explicit_axes_refuse_gets_our_error_naming_the_fix():
    """A reshape merging the rows' split dimension runs on an Auto mesh (GSPMD decides) but not with the data axes
    Explicit, where the drop-in runs it: our ValueError names an Explicit mesh, JAX's error as its cause."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("data",))

    def loss(w, x):
        return jnp.mean(x.T.reshape(-1) ** 2) * jnp.sum(w * w)

    with jax.set_mesh(mesh):
        w = jax.device_put(jnp.ones(3), NamedSharding(mesh, P()))
        x = jax.device_put(jnp.ones((8, 3)), NamedSharding(mesh, P("data")))
        fn = optax_adascale.value_and_grad(loss, data_axes="data", param_specs=P())
        with pytest.raises(ValueError, match="Build the mesh with Explicit axes") as info:
            jax.jit(fn)(w, x)
    assert "reshape is not supported" in str(info.value.__cause__)

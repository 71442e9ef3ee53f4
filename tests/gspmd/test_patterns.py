"""Every pattern a big model is made of, through the drop-in: exact (value and grads ``jax.value_and_grad``'s of
the unmodified loss, the statistics the per-copy samples of ``patterns.py``), or our ``ValueError`` naming the
cause; never a raw JAX error, never silently wrong. Explicit meshes (the user's own step must be valid there)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_adascale
from tests.gspmd import patterns


def run(pattern, layout, k=1):
    """The drop-in with ``k`` micro-batches, and ``jax.value_and_grad``'s mean over the same micro-batches."""
    mesh = jax.make_mesh(pattern.mesh_shape, pattern.axis_names)
    specs = pattern.layouts[layout]
    batch_specs = pattern.batch_specs or (P(pattern.data_axes),) * len(pattern.batch)
    with jax.set_mesh(mesh):
        params = {k_: jax.device_put(v, NamedSharding(mesh, specs[k_])) for k_, v in pattern.params.items()}
        put = lambda bs: [jax.device_put(b, NamedSharding(mesh, s)) for b, s in zip(bs, batch_specs, strict=True)]  # noqa: E731
        fn = optax_adascale.value_and_grad(pattern.loss, data_axes=pattern.data_axes, num_microbatches=k)
        ours = jax.jit(fn)(params, *put(pattern.batch))
        ref_fn = jax.jit(jax.value_and_grad(pattern.loss))
        refs = [ref_fn(params, *put(pattern.micro_batch(j, k) if k > 1 else pattern.batch)) for j in range(k)]
    return ours, jax.tree.map(lambda *xs: sum(xs) / k, *refs)


def check(pattern, layout, k=1):
    (value, grads, stats), (ref_value, ref_grads) = run(pattern, layout, k)
    np.testing.assert_allclose(float(value), float(ref_value), rtol=2e-5)
    for name in ref_grads:
        np.testing.assert_allclose(np.asarray(grads[name]), np.asarray(ref_grads[name]), rtol=2e-5, atol=1e-6)
    expected = pattern.samples(k)
    for name, value in expected.items():
        assert float(stats.sq_norms[name]) == pytest.approx(value, rel=2e-5), name


@pytest.mark.parametrize("layout", ["replicated", "TP", "FSDP"])
def test_lora_merged_into_the_weight(layout):
    check(patterns.lora(), layout)


@pytest.mark.parametrize("layout", ["replicated", "TP", "FSDP"])
def test_terms_of_the_parameters_alone(layout):
    check(patterns.param_terms(), layout)


@pytest.mark.parametrize("layout", ["replicated", "EP", "FSDP"])
def test_mixture_of_experts_with_dense_dispatch(layout):
    check(patterns.moe(), layout)


def test_sequence_parallelism():
    check(patterns.sequence_parallel(), "replicated")


@pytest.mark.parametrize("data_axes", ["data", ("data", "fsdp")])
def test_hsdp(data_axes):
    check(patterns.hsdp(data_axes), "HSDP")


def test_shard_map_kernels_taking_parameters():
    """A matmul kernel manual over the data axis and an expert block manual over (model, data), both taking
    parameters: each device gets its own copy, exact."""
    check(patterns.kernels(), "replicated")


def test_an_expert_block_manual_over_the_model_axis_alone_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"shard_map that is manual over other axes.*manual over the data axes too"):
        run(patterns.kernels(manual_data=False), "replicated")


def test_pipeline_stages_manual_over_the_data_axes_too():
    check(patterns.pipeline(manual_data=True), "stages")


def test_pipeline_stages_manual_over_the_stage_axis_alone_are_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"shard_map that is manual over other axes.*manual over the data axes too"):
        run(patterns.pipeline(), "stages")


@pytest.mark.parametrize("layout", ["replicated", "TP", "FSDP"])
def test_cond_with_a_constant_branch(layout):
    check(patterns.cond_constant_branch(), layout)


@pytest.mark.parametrize("layout", ["replicated", "TP", "FSDP"])
@pytest.mark.parametrize("kind", ["batch_norm", "linear", "aqt_per_row_int8", "per_tensor_int4"])
def test_custom_rules_on_parameters(kind, layout):
    """A custom_jvp batch norm taking (rows, γ) whose rule couples the rows; straight-through custom_vjp matmuls
    (plain, AQT per-row int8, per-tensor int4): each rule's own backward pass, per copy. A custom_vjp applied to
    an FSDP parameter before its gather is refused: its backward rule is typed for the shards."""
    if layout == "FSDP" and kind != "batch_norm":
        with pytest.raises(ValueError, match=r"custom_vjp.*Gather the parameter first"):
            run(patterns.custom_rule(kind), layout)
        return
    check(patterns.custom_rule(kind), layout)


def test_a_convolution_runs_its_vjp_on_each_devices_rows():
    check(patterns.conv(), "replicated")


@pytest.mark.parametrize("layout", ["replicated", "TP", "FSDP"])
def test_a_bias_reshaped_to_a_row_before_it_is_added(layout):
    check(patterns.reshaped_bias(), layout)


@pytest.mark.parametrize("layout", ["replicated", "TP", "FSDP"])
def test_a_while_loop_closing_over_a_parameter_and_a_bound(layout):
    check(patterns.spectral_norm(), layout)


# Every layout at k = 1, and k = 2 where it meets an FSDP gather: the suite stays as fast as it was.
LAYOUTS_AND_MICROBATCHES = [("replicated", 1), ("TP", 1), ("FSDP", 1), ("FSDP", 2)]


@pytest.mark.parametrize(("layout", "k"), LAYOUTS_AND_MICROBATCHES)
def test_fused_weights_split_where_they_are_used(layout, k):
    """``jnp.split`` of a fused QKV and a fused gate/up weight (a primitive of class ALONG on a parameter's copy)."""
    check(patterns.fused_split(), layout, k)


@pytest.mark.parametrize(("layout", "k"), LAYOUTS_AND_MICROBATCHES)
def test_parameters_stacked_into_an_einsum(layout, k):
    check(patterns.stacked_slices(), layout, k)


@pytest.mark.parametrize(("layout", "k"), LAYOUTS_AND_MICROBATCHES)
def test_a_cholesky_layer_whitening_the_rows_by_a_triangular_solve(layout, k):
    check(patterns.cholesky_layer(), layout, k)


def _on_auto_mesh(pattern, layout, k, fn):
    """``fn(loss, params, *batch)`` on an Auto mesh, the pattern's ``layout`` placed; the micro-batches' mean."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(pattern.mesh_shape), pattern.axis_names)
    specs = pattern.layouts[layout]
    with jax.set_mesh(mesh):
        params = {name: jax.device_put(v, NamedSharding(mesh, specs[name])) for name, v in pattern.params.items()}
        put = lambda bs: [jax.device_put(b, NamedSharding(mesh, P("data"))) for b in bs]  # noqa: E731
        return fn(pattern.loss, params, put, specs)


def _check_against(pattern, k, ours, ref_value, ref_grads):
    value, grads, stats = ours
    np.testing.assert_allclose(float(value), float(ref_value), rtol=2e-5)
    for name in ref_grads:
        np.testing.assert_allclose(np.asarray(grads[name]), np.asarray(ref_grads[name]), rtol=2e-5, atol=1e-6)
    for name, value in pattern.samples(k).items():
        assert float(stats.sq_norms[name]) == pytest.approx(value, rel=2e-5), name


def _reference_on_auto_mesh(pattern, layout, k):
    """``jax.value_and_grad`` of the pattern written for an Auto mesh, on one (where JAX differentiates ``ragged_dot``
    itself), averaged over the micro-batches."""

    def ref(loss, params, put, specs):
        f = jax.jit(jax.value_and_grad(loss))
        refs = [f(params, *put(pattern.micro_batch(j, k) if k > 1 else pattern.batch)) for j in range(k)]
        return jax.tree.map(lambda *xs: sum(xs) / k, *refs)

    return _on_auto_mesh(pattern, layout, k, ref)


@pytest.mark.parametrize(("layout", "k"), [("replicated", 1), ("TP", 2)])
def test_a_sparse_moe_with_ragged_dot_on_an_auto_mesh(layout, k):
    """Top-1 routing, tokens sorted within each data shard's rows, one ``lax.ragged_dot`` over the stacked experts
    (MaxText's sparse MoE written for an Auto mesh): exact, the grouped matmul on each device's rows with its own
    copy and its own groups' sizes."""
    pattern = patterns.ragged_moe(explicit=False)

    def ours(loss, params, put, specs):
        fn = optax_adascale.value_and_grad(
            loss, data_axes="data", num_microbatches=k, param_specs=specs, arg_specs=(P("data"), P("data"))
        )
        return jax.jit(fn)(params, *put(pattern.batch))

    _check_against(pattern, k, _on_auto_mesh(pattern, layout, k, ours), *_reference_on_auto_mesh(pattern, layout, k))


@pytest.mark.parametrize(("layout", "k"), [("TP", 1), ("FSDP", 2)])
def test_a_sparse_moe_with_ragged_dot_on_an_explicit_mesh(layout, k):
    """The same MoE written for an Explicit mesh: ``lax.ragged_dot(..., out_sharding=P("data", None))``, the
    sharding JAX asks for. JAX 0.10-0.12 cannot differentiate it there (its transpose infers no sharding: the user's
    own ``jax.value_and_grad`` raises); the drop-in runs it on each device's rows, exact against JAX's own gradient
    of the Auto-mesh loss."""
    pattern = patterns.ragged_moe(explicit=True)
    mesh = jax.make_mesh(pattern.mesh_shape, pattern.axis_names)
    specs = pattern.layouts[layout]
    with jax.set_mesh(mesh):
        params = {name: jax.device_put(v, NamedSharding(mesh, specs[name])) for name, v in pattern.params.items()}
        batch = [jax.device_put(b, NamedSharding(mesh, P("data"))) for b in pattern.batch]
        ours = jax.jit(optax_adascale.value_and_grad(pattern.loss, data_axes="data", num_microbatches=k))(
            params, *batch
        )
    ref_value, ref_grads = _reference_on_auto_mesh(patterns.ragged_moe(explicit=False), "replicated", k)
    _check_against(pattern, k, ours, ref_value, ref_grads)


def test_ragged_dot_of_rows_not_split_over_the_data_axes_alone_is_refused_naming_the_layout():
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    w = np.ones((2, 8, 4), np.float32)
    x = np.ones((16, 8), np.float32)

    def loss(w, x):
        h = jax.lax.ragged_dot(x, w, jnp.array([6, 10], jnp.int32), out_sharding=P(("data", "model"), None))
        return jnp.mean(h)

    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P(("data", "model"))))
        with pytest.raises(ValueError, match=r"grouped contraction 'ragged_dot_general'.*P\('data', None\)"):
            jax.jit(optax_adascale.value_and_grad(loss, data_axes="data"))(w, xs)


def _auto_axes_ragged_loss(w, x):
    ids = (x[:, 0] > 0).astype(jnp.int32).reshape(4, 4, out_sharding=P("data"))
    counts = jnp.sum(jax.nn.one_hot(ids, 2, dtype=jnp.int32), axis=1).reshape(8)
    grouped = jax.sharding.auto_axes(jax.lax.ragged_dot, out_sharding=P("data", None))
    return jnp.sum(jnp.tanh(grouped(x, w, counts)))


def _auto_axes_ragged_data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(8, 8, 6)).astype(np.float32), rng.normal(size=(16, 8)).astype(np.float32)


AUTO_CAST_KEEPS_PARTIALS = jax.__version_info__ < (0, 12, 1)  # _compat.auto_cast_keeps_partials, read independently


def test_jax_transposes_a_ragged_dot_of_a_reduced_parameter_on_auto_axes_wrongly_before_0_12_1():
    """The reason for the grouped matmul's refusal on JAX 0.10-0.12.0, in plain JAX: the gradient of a parameter typed
    ``reduced`` over the data axes, summed from its ``unreduced`` partials, differs from ``jax.grad``'s there. JAX
    0.12.1 transposes it right (the sum); its partials are then refused for another reason (the next test)."""
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    w, x = _auto_axes_ragged_data()

    def through_copies(w, x):
        copy = jax.reshard(w, P(None, None, None, reduced={"data"}))
        return jax.reshard(jax.grad(_auto_axes_ragged_loss)(copy, x), P())

    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P("data")))
        ours = jax.jit(through_copies)(w, xs)
        ref = jax.jit(jax.grad(_auto_axes_ragged_loss))(w, xs)
    assert np.allclose(np.asarray(ours), np.asarray(ref), rtol=1e-3, atol=1e-3) == (not AUTO_CAST_KEEPS_PARTIALS)


def _partials_through_auto_axes(mesh, w, x):
    """Each device's ``unreduced`` partial of a copy of ``w`` (``reduced`` over ``data``) cast into Auto axes and
    contracted there with the rows ``x``: stacked on a leading axis, one row per data shard."""

    def partials(w, x):
        copy = jax.reshard(w, P(None, None, reduced={"data"}))
        _, vjp = jax.vjp(lambda c: jax.sharding.auto_axes(jnp.matmul, out_sharding=P("data", None))(x, c), copy)
        (g,) = vjp(jnp.ones((x.shape[0], w.shape[1]), out_sharding=P("data", None)))
        spec = jax.typeof(g).sharding.spec
        return jax.shard_map(lambda b: b[None], mesh=mesh, in_specs=spec, out_specs=P("data"), check_vma=False)(g)

    return np.asarray(jax.jit(partials)(w, x))


def test_jax_keeps_each_devices_partial_through_a_cast_to_auto_axes_only_before_0_12_1():
    """Plain JAX, the fact ``_compat.auto_cast_keeps_partials`` gates on: a copy cast into ``auto_axes`` gets back
    each device's partial of its own rows on JAX 0.10-0.12.0, and the whole sum on one device from 0.12.1 (the sum,
    the gradient, right on both)."""
    mesh = jax.make_mesh((8,), ("data",))
    rng = np.random.default_rng(1)
    w, x = rng.normal(size=(4, 3)).astype(np.float32), rng.normal(size=(32, 4)).astype(np.float32)
    own = np.stack([x[i * 4 : (i + 1) * 4].T @ np.ones((4, 3), np.float32) for i in range(8)])
    with jax.set_mesh(mesh):
        got = _partials_through_auto_axes(mesh, w, jax.device_put(x, NamedSharding(mesh, P("data"))))
    np.testing.assert_allclose(got.sum(0), own.sum(0), rtol=1e-5, atol=1e-5)
    assert np.allclose(got, own, rtol=1e-5, atol=1e-5) == AUTO_CAST_KEEPS_PARTIALS


def test_a_parameter_cast_to_auto_axes_is_exact_before_0_12_1_and_refused_from_it():
    """``jax.sharding.auto_axes`` around a matmul of a parameter on an Explicit mesh: exact per copy where JAX keeps
    the partials (against each data shard's rows differentiated alone), our refusal naming the Explicit call where it
    does not (JAX 0.12.1 made the drop-in's statistics 2.9x off here, silently, before the refusal)."""
    mesh = jax.make_mesh((8,), ("data",))
    rng = np.random.default_rng(2)
    w, x = rng.normal(size=(4, 3)).astype(np.float32), rng.normal(size=(32, 4)).astype(np.float32)

    def loss(w, x):
        h = jax.sharding.auto_axes(jnp.matmul, out_sharding=P("data", None))(x, w)
        return jnp.mean(jnp.tanh(h) ** 2)

    fn = jax.jit(optax_adascale.value_and_grad(loss, data_axes="data"))
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P("data")))
        if not AUTO_CAST_KEEPS_PARTIALS:
            with pytest.raises(ValueError, match=r"auto_axes.*0\.12\.1.*out_sharding=P\('data', None\)"):
                fn(w, xs)
            return
        _, grads, stats = fn(w, xs)
    shards = [np.asarray(jax.grad(loss)(w, x[i * 4 : (i + 1) * 4])) for i in range(8)]
    np.testing.assert_allclose(np.asarray(grads), np.mean(shards, axis=0), rtol=2e-5, atol=1e-7)
    assert float(stats.sq_norms) == pytest.approx(np.mean([np.sum(g**2) for g in shards]), rel=2e-5)


def test_ragged_dot_of_a_parameter_under_auto_axes_is_refused_naming_the_explicit_call():
    """``jax.sharding.auto_axes`` around ``lax.ragged_dot`` (how plain JAX differentiates it on an Explicit mesh):
    JAX 0.10-0.12.0's transpose of it gives wrong partials for a parameter typed reduced (its gradient differs from
    ``jax.value_and_grad``'s), and from 0.12.1 no copy keeps its partials through the cast: either way the drop-in
    refuses it and names the call it runs exactly."""
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    w, x = _auto_axes_ragged_data()
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P("data")))
        with pytest.raises(ValueError, match=r"auto_axes.*out_sharding=P\('data', None\)"):
            jax.jit(optax_adascale.value_and_grad(_auto_axes_ragged_loss, data_axes="data"))(w, xs)


def test_ragged_dot_of_gathered_tokens_on_a_mesh_with_a_model_axis_runs_as_jax_value_and_grad():
    """Tokens gathered off the data axes into ``lax.ragged_dot(..., out_sharding=P())`` with a parameter, on a mesh
    with a model axis: JAX 0.12.1 differentiates it itself, and the drop-in's per-copy backward pass (manual over
    every axis, so that no sharding is left for JAX to infer) gives its value and gradients, where it raised JAX's
    ``NotImplementedError`` before. The reference: ``jax.value_and_grad`` without a mesh."""
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    rng = np.random.default_rng(3)
    w, x = (rng.normal(size=(4, 4, 6)) / 2).astype(np.float32), rng.normal(size=(32, 4)).astype(np.float32)
    sizes = np.array([5, 11, 9, 7], np.int32)

    def loss(w, x, sizes):
        out = P() if jax.typeof(x).sharding.mesh.axis_names else None
        h = jax.lax.ragged_dot(jax.reshard(x, P()) if out is not None else x, w, sizes, out_sharding=out)
        return jnp.mean(jnp.tanh(h) ** 2)

    ref_value, ref_grads = jax.value_and_grad(loss)(w, x, sizes)
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P("data")))
        value, grads, stats = jax.jit(
            optax_adascale.value_and_grad(loss, data_axes="data", arg_specs=(P("data"), P()))
        )(w, xs, sizes)
    np.testing.assert_allclose(float(value), float(ref_value), rtol=2e-5)
    np.testing.assert_allclose(np.asarray(grads), np.asarray(ref_grads), rtol=2e-5, atol=1e-7)
    assert np.isfinite(float(stats.sq_norms))

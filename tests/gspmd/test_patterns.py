"""Every pattern a big model is made of, through the drop-in: exact (value and grads ``jax.value_and_grad``'s of
the unmodified loss, the statistics the per-copy samples of ``patterns.py``), or our ``ValueError`` naming the
cause; never a raw JAX error, never silently wrong. Explicit meshes (the user's own step must be valid there)."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_adascale
from tests.gspmd import patterns


def run(pattern, layout, k=1):
    mesh = jax.make_mesh(pattern.mesh_shape, pattern.axis_names)
    specs = pattern.layouts[layout]
    batch_specs = pattern.batch_specs or (P(pattern.data_axes),) * len(pattern.batch)
    with jax.set_mesh(mesh):
        params = {k_: jax.device_put(v, NamedSharding(mesh, specs[k_])) for k_, v in pattern.params.items()}
        batch = [jax.device_put(b, NamedSharding(mesh, s)) for b, s in zip(pattern.batch, batch_specs, strict=True)]
        fn = optax_adascale.value_and_grad(pattern.loss, data_axes=pattern.data_axes, num_microbatches=k)
        ours = jax.jit(fn)(params, *batch)
        ref = jax.jit(jax.value_and_grad(pattern.loss))(params, *batch)
    return ours, ref


def check(pattern, layout):
    (value, grads, stats), (ref_value, ref_grads) = run(pattern, layout)
    np.testing.assert_allclose(float(value), float(ref_value), rtol=2e-5)
    for name in ref_grads:
        np.testing.assert_allclose(np.asarray(grads[name]), np.asarray(ref_grads[name]), rtol=2e-5, atol=1e-6)
    expected = pattern.samples()
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

"""A test per read of JAX internals in ``optax_adascale._compat``: each fails where a JAX release moves what it
reads, on every JAX the suite runs on (CI: the oldest and the newest supported)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from optax_adascale import _compat


def test_literal_type_is_the_class_of_a_literal_operand():
    jaxpr = jax.make_jaxpr(lambda x: x * 2.0)(1.0).jaxpr
    assert any(isinstance(v, _compat.literal_type()) for eqn in jaxpr.eqns for v in eqn.invars)


def test_scan_counts_reads_the_consts_and_carries_of_a_scan_equation():
    w = jnp.ones(3)

    def f(c1, c2, xs):
        return jax.lax.scan(lambda c, x: ((c[0] + x * w, c[1] * 2.0), x), (c1, c2), xs)

    jaxpr = jax.make_jaxpr(f)(jnp.zeros(3), 1.0, jnp.ones((4, 3))).jaxpr
    (eqn,) = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
    assert _compat.scan_counts(eqn.params) == (1, 2)  # w closed over; two carries (both change: not forwarded)


def test_shard_map_manual_axes_are_the_axes_the_equation_makes_manual():
    mesh = jax.make_mesh((2, 2), ("data", "stage"), devices=jax.devices()[:4])
    with jax.set_mesh(mesh):

        def f(x):
            return jax.shard_map(lambda b: b * 2, in_specs=P("stage"), out_specs=P("stage"), axis_names={"stage"})(x)

        x = jax.device_put(jnp.ones(4), jax.sharding.NamedSharding(mesh, P("stage")))
        jaxpr = jax.make_jaxpr(f)(x).jaxpr
    (eqn,) = [e for e in jaxpr.eqns if e.primitive.name == "shard_map"]
    assert _compat.shard_map_manual_axes(eqn.params) == frozenset({"stage"})


def test_legacy_mesh_sees_the_old_with_mesh_form_only():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
    assert _compat.legacy_mesh() is None
    with mesh:
        assert _compat.legacy_mesh().shape == mesh.shape
    with jax.set_mesh(mesh):
        assert _compat.legacy_mesh() is None


def test_named_axis_sizes_are_the_axes_bound_by_vmap():
    assert _compat.named_axis_sizes() == {}
    seen = []
    jax.vmap(lambda x: seen.append(_compat.named_axis_sizes()) or x, axis_name="i")(jnp.ones(3))
    assert seen == [{"i": 3}]


def test_varying_axes_is_shard_maps_varying_type():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))  # Auto axes: the inputs need no placing
    seen = []

    def body(w, v):
        seen.append((_compat.varying_axes(w), _compat.varying_axes(jax.lax.pcast(w, "x", to="varying") * v)))
        return v

    jax.shard_map(body, mesh=mesh, in_specs=(P(), P("x")), out_specs=P("x"))(jnp.ones(2), jnp.ones(2))
    assert seen == [(frozenset(), frozenset({"x"}))]


def test_vma_checks_off_stops_shard_map_tracking_varying_types():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))  # Auto axes: the inputs need no placing
    seen = []

    def body(v):
        with _compat.vma_checks_off():
            seen.append(_compat.varying_axes(v * 2))
        seen.append(_compat.varying_axes(v * 2))
        return v

    jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"))(jnp.ones(2))
    assert seen == [frozenset(), frozenset({"x"})]


def test_batch_trace_axes_name_the_vmap_axes_a_value_is_batched_over():
    seen = []

    def inner(x):
        seen.append([getattr(d, "name", None) for d in _compat.batch_trace_axes(x)])
        return x

    jax.vmap(jax.vmap(inner, axis_name="j"), axis_name="i")(jnp.ones((2, 3)))
    assert seen == [["j", "i"]]
    assert _compat.batch_trace_axes(jnp.ones(2)) == []


@pytest.mark.parametrize("kind", ["custom_jvp", "custom_vjp"])
def test_custom_call_bind_params_rebinds_a_custom_call_through_an_evaluator(kind):
    if kind == "custom_jvp":

        @jax.custom_jvp
        def f(x):
            return jnp.sin(x)

        f.defjvp(lambda primals, tangents: (jnp.sin(primals[0]), 7.0 * tangents[0]))  # a rule, not the derivative
    else:

        @jax.custom_vjp
        def f(x):
            return jnp.sin(x)

        f.defvjp(lambda x: (jnp.sin(x), None), lambda _, g: (7.0 * g,))

    closed = jax.make_jaxpr(f)(0.5)
    (eqn,) = [e for e in closed.jaxpr.eqns if e.primitive.name.startswith("custom_")]
    evaluated = []

    def evaluate(jaxpr, consts, args):
        evaluated.append(jaxpr)
        return jax.core.eval_jaxpr(jaxpr, consts, *args)

    def rebound(x):
        params = _compat.custom_call_bind_params(eqn, evaluate)
        return eqn.primitive.bind(x, **params)[0]

    value, grad = jax.value_and_grad(rebound)(0.5)
    assert float(value) == pytest.approx(np.sin(0.5))
    assert float(grad) == pytest.approx(7.0)  # the rule survived
    assert evaluated  # the traced jaxprs ran through the evaluator


# --------------------------------------------------------------------------- core reads


def test_is_tracer_tells_a_traced_value_from_a_concrete_one():
    seen = []
    jax.jit(lambda x: seen.append(_compat.is_tracer(x)) or x)(1.0)
    jax.vmap(lambda x: seen.append(_compat.is_tracer(x)) or x)(jnp.ones(2))
    jax.grad(lambda x: seen.append(_compat.is_tracer(x)) or x)(1.0)
    assert seen == [True, True, True]
    assert not any(_compat.is_tracer(v) for v in (1.0, np.float32(1.0), jnp.ones(2), None, "x"))

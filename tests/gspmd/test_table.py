"""The interpreter's dispatch table (``optax_adascale/gspmd/_table.py``) against the JAX it runs on (CI: 0.10.2, 0.11.2,
0.12): every primitive name in it is one this JAX binds (or is listed with the versions that have it), and every
primitive the test zoo's losses bind, forward and backward, is in it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_adascale
from optax_adascale import _compat
from optax_adascale.gspmd import _table
from tests.gspmd import patterns
from tests.helpers import primitive

VERSION = tuple(int(p) for p in jax.__version__.split(".")[:3])  # (0, 12, 1): ONLY_ON names patch releases too


def _version(text):
    return tuple(int(p) for p in text.split("."))


@pytest.mark.parametrize("name", sorted(_table.TABLE))
def test_every_name_in_the_table_is_a_primitive_of_this_jax(name):
    first, gone = _table.ONLY_ON.get(name, (None, None))
    expected = (first is None or VERSION >= _version(first)) and (gone is None or VERSION < _version(gone))
    found = primitive(name)
    assert (found is not None) == expected, (name, jax.__version__, _table.ONLY_ON.get(name))
    if found is not None:
        assert found.name == name


def test_the_primitive_names_the_rules_compare_with_are_in_the_table():
    """A rule that singles out one primitive of its class by name (``gather``, ``pad``) names one the table holds."""
    import pathlib
    import re

    source = "".join(p.read_text() for p in pathlib.Path(_table.__file__).parent.glob("*.py"))
    named = set(re.findall(r"primitive_name\(\w+\) (?:==|!=) \"([\w-]+)\"", source))
    named |= set(re.findall(r"\bname (?:==|!=) \"([\w-]+)\"", source)) - {"param_specs"}
    assert named and named <= set(_table.TABLE), named - set(_table.TABLE)


@pytest.mark.parametrize(
    "name", ["pjit", "core_call", "checkpoint", "pcast", "custom_vjp_call_jaxpr", "argsort", "expand_dims", "copy_p"]
)
def test_names_no_supported_jax_binds_are_not_in_the_table(name):
    assert name not in _table.TABLE
    assert primitive(name) is None, f"JAX {jax.__version__} binds '{name}' again: classify it"


def test_an_unknown_primitive_on_a_parameter_gets_our_error_naming_it_and_the_nearest_class():
    message = _table.unknown("cumlogsumexp2", carries_jaxprs=False)
    assert "'cumlogsumexp2'" in message and "ALONG" in message
    assert "CALL" in _table.unknown("my_call", carries_jaxprs=True)


def _names(jaxpr, found=None):
    """Every primitive name bound in ``jaxpr`` and the jaxprs its equations carry."""
    found = set() if found is None else found
    for eqn in jaxpr.eqns:
        found.add(eqn.primitive.name)
        for sub, _ in _compat.sub_jaxprs(eqn):
            _names(sub, found)
    return found


def test_psum_inside_shard_map_binds_a_primitive_the_table_knows():
    """``lax.psum`` inside ``shard_map`` binds ``psum_invariant`` on JAX 0.12 and ``psum`` before."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
    f = jax.shard_map(lambda v: jax.lax.psum(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P())
    names = _names(jax.make_jaxpr(f)(jnp.ones(2)).jaxpr) - {"shard_map"}
    assert names & {"psum", "psum_invariant"}
    assert names <= set(_table.TABLE), names - set(_table.TABLE)


# The zoo's families, named without building anything: collection (in every xdist worker, and for `-k` runs that
# select none of them) builds no model; each family's cases are built when its test runs.
PATTERN_FAMILIES = ("lora", "param_terms", "moe", "cond_constant_branch", "conv", "custom_rule", "spectral_norm")
SHARDED_PATTERNS = {"sequence_parallel": "replicated", "hsdp": "HSDP", "kernels": "replicated", "pipeline": "stages"}
MODELS = (("lm", "TP×FSDP", "reshard"), ("lm", "FSDP", "einsum"), ("stack", "FSDP", "reshard"))
ZOO = (*PATTERN_FAMILIES, *SHARDED_PATTERNS, "semantics", "traps", "runs", *(f"{m}-{g}" for m, _, g in MODELS))


def _zoo(family):
    """The ``(label, mesh shape, axes, loss, params, specs, batch, batch specs)`` of one family of the losses of
    tests/gspmd and benchmarks/gspmd."""
    if family in PATTERN_FAMILIES:
        make = getattr(patterns, family)
        kinds = list(patterns.QUANTIZERS) + ["batch_norm"] if family == "custom_rule" else [None]
        built = [(kind, make(kind) if kind else make()) for kind in kinds]
        cases = [(f"{family}-{kind}-{layout}", p, layout) for kind, p in built for layout in p.layouts]
    elif family in SHARDED_PATTERNS:
        p = patterns.pipeline(manual_data=True) if family == "pipeline" else getattr(patterns, family)()
        cases = [(f"{p.axis_names}-{SHARDED_PATTERNS[family]}", p, SHARDED_PATTERNS[family])]
    else:
        cases = []
    out = []
    for label, p, layout in cases:
        batch_specs = p.batch_specs or (P(p.data_axes),) * len(p.batch)
        out.append((label, p.mesh_shape, p.axis_names, p.loss, p.params, p.layouts[layout], p.batch, batch_specs))
    if family == "semantics":
        from tests.gspmd import test_semantics

        params, x, tok, y, mask = test_semantics.data()
        for head in test_semantics.HEADS:
            loss = test_semantics.global_loss(test_semantics.HEADS[head])
            batch = (x, tok, y, mask)
            out.append(
                (
                    f"semantics-{head}",
                    (4, 2),
                    ("data", "model"),
                    loss,
                    params,
                    test_semantics.LAYOUTS["TPxFSDP"],
                    batch,
                    (P("data"),) * 4,
                )
            )
    elif family == "traps":
        from tests.gspmd import test_traps

        x, y = test_traps.batch()
        out.append(("traps", (4, 2), ("data", "model"), test_traps.loss_fn, test_traps.init_params(), {}, (x, y), None))
    elif family == "runs":
        from tests.gspmd import test_runs

        xs, ys = test_runs.batches()
        out.append(
            ("runs", (4, 2), ("data", "model"), test_runs.loss_fn, test_runs.init_params(), {}, (xs[0], ys[0]), None)
        )
    for name, layout, gather in MODELS:
        if family == f"{name}-{gather}":
            from benchmarks.gspmd import models

            model = models.build(name, layout, gather=gather, **{"layers": 2, "rows": 16})
            out.append((family, (4, 2), ("data", "model"), model.loss, model.params, model.specs, model.batch, None))
    assert out, f"no case in the zoo's family {family!r}"
    return out


def _unclassified(case):
    """The primitives one case's loss binds, forward and backward, that the table lacks."""
    _, shape, axes, loss, params, specs, batch, batch_specs = case
    mesh = jax.make_mesh(shape, axes)
    with jax.set_mesh(mesh):
        put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
        placed = jax.tree.map(lambda a: a, {k: put(v, specs.get(k, P())) for k, v in params.items()})
        batch_specs = batch_specs or (P("data"),) * len(batch)
        args = [put(b, s) for b, s in zip(batch, batch_specs, strict=True)]
        names = _names(jax.make_jaxpr(jax.value_and_grad(loss))(placed, *args).jaxpr)
    return sorted(names - set(_table.TABLE))


@pytest.mark.parametrize("family", ZOO)
def test_every_primitive_the_zoos_losses_bind_is_classified(family):
    """Forward and backward (what the interpreter re-evaluates, and what JAX's transposes bind in custom rules'
    backward passes), on the mesh with the layout the tests use, for every case of the family."""
    missing = {case[0]: _unclassified(case) for case in _zoo(family)}
    assert not any(missing.values()), {label: names for label, names in missing.items() if names}


def _unknown_primitive():
    """A primitive no table knows (``x ↦ 2x``), with an implementation and a lowering, and no rule for reduced types."""
    from jax.extend.core import Primitive
    from jax.interpreters import mlir

    double = Primitive("optax_adascale_test_double")
    double.def_impl(lambda x: 2 * x)
    double.def_abstract_eval(lambda x: x)
    mlir.register_lowering(double, mlir.lower_fun(lambda x: 2 * x, multiple_results=False))
    return double


DOUBLE = _unknown_primitive()


def _drop_in_on(loss):
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    w = np.linspace(-1.0, 1.0, 8 * 4, dtype=np.float32).reshape(8, 4)
    x = np.linspace(0.0, 2.0, 16 * 8, dtype=np.float32).reshape(16, 8)
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P("data")))
        ours = jax.jit(optax_adascale.value_and_grad(loss, data_axes="data"))(w, xs)
        ref = jax.jit(jax.value_and_grad(loss))(w, xs)
    return ours, ref


def test_an_unknown_primitive_applied_to_a_parameter_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"primitive 'optax_adascale_test_double' to a parameter.*nearest class is"):
        _drop_in_on(lambda w, x: jnp.mean(jnp.tanh(x @ DOUBLE.bind(w))))


def test_an_unknown_primitive_applied_to_the_batch_alone_is_bound_as_traced():
    (value, grads, _), (ref_value, ref_grads) = _drop_in_on(lambda w, x: jnp.mean(jnp.tanh(DOUBLE.bind(x) @ w)))
    np.testing.assert_allclose(float(value), float(ref_value), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grads), np.asarray(ref_grads), rtol=1e-5, atol=1e-7)

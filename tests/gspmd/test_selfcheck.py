"""The drop-in's check of JAX's rules (``gspmd/_selfcheck.py``): its probe agrees with each data shard's own
gradient (in forward mode) on every kind of layout, and a rule that moves a copy's partial between devices (what JAX
0.12.1 did to the transpose of a cast into Auto axes) is refused at the first call, naming the primitive and the JAX
version, while a loss that does not bind that primitive runs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_adascale
from optax_adascale.gspmd import _copies, _selfcheck

LAYOUTS = [
    (("data",), (8,), False, ("data",)),
    (("data",), (8,), True, ("data",)),
    (("data", "model"), (4, 2), False, ("data",)),
    (("data", "model"), (4, 2), True, ("data",)),
    (("replica", "data", "model"), (2, 2, 2), False, ("replica", "data")),
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda v: f"{v[1]}-{'auto' if v[2] else 'explicit'}-{len(v[3])}")
def test_the_probe_agrees_with_each_shards_forward_mode_gradient(layout):
    verdict = _selfcheck._verdict(*layout)
    assert isinstance(verdict, dict), verdict
    assert set(verdict) == set(_selfcheck.PROBED)
    assert max(verdict.values()) < _selfcheck.RTOL, verdict


@pytest.fixture
def misplaced_partials(monkeypatch):
    """Each per-copy partial the drop-in assembles from its per-shard rows (``_copies.unstack_partials``: a lookup's
    backward pass) with shard 1's partial moved onto shard 0: the sum (the gradient) unchanged, the samples wrong."""
    original = _copies.unstack_partials

    def moved(layout, stacked, like):
        shape = (stacked.shape[0],) + (1,) * (stacked.ndim - 1)
        first, second = (np.arange(stacked.shape[0]).reshape(shape) == i for i in (0, 1))
        from_second = jnp.sum(jnp.where(second, stacked, 0), axis=0)  # an Explicit mesh: no slice of a split axis
        return original(layout, jnp.where(second, 0, stacked) + jnp.where(first, from_second, 0), like)

    _selfcheck._verdict.cache_clear()
    monkeypatch.setattr(_copies, "unstack_partials", moved)
    yield
    _selfcheck._verdict.cache_clear()


def _run(loss, auto: bool):
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto if auto else AxisType.Explicit,) * 2)
    rng = np.random.default_rng(0)
    params = {"emb": rng.normal(size=(10, 3)).astype(np.float32), "w": rng.normal(size=(3, 2)).astype(np.float32)}
    tok = rng.integers(0, 10, size=(16,)).astype(np.int32)
    fn = optax_adascale.value_and_grad(loss, data_axes="data", param_specs={"emb": P(), "w": P()} if auto else None)
    with jax.set_mesh(mesh):
        return jax.jit(fn)(params, jax.device_put(tok, NamedSharding(mesh, P("data"))))


@pytest.mark.parametrize("auto", [True, False], ids=["auto", "explicit"])
def test_a_rule_that_moves_partials_between_devices_is_refused_at_the_first_call(misplaced_partials, auto):
    if not auto and jax.__version_info__ < (0, 12, 1):
        pytest.skip("before JAX 0.12.1 .at[].get(out_sharding=) casts into auto_axes: JAX's rule, not the fixture's")

    def loss(p, tok):
        e = p["emb"][tok] if auto else p["emb"].at[tok].get(out_sharding=P("data", None))
        return jnp.mean(jnp.tanh(e @ p["w"]) ** 2)

    pattern = rf"on JAX {jax.__version__}, the per-copy gradient statistics through 'gather' disagree"
    with pytest.raises(ValueError, match=pattern):
        _run(loss, auto)


def test_a_loss_that_binds_no_broken_primitive_still_runs(misplaced_partials):
    def loss(p, tok):  # no lookup: the embedding enters through a contraction with one-hot rows
        onehot = jax.nn.one_hot(tok, 10, dtype=jnp.float32)
        return jnp.mean(jnp.tanh((onehot @ p["emb"]) @ p["w"]) ** 2)

    _, grads, stats = _run(loss, auto=True)
    assert np.isfinite(float(stats.sq_norms["emb"]))


def test_the_probe_runs_once_per_layout_and_process(monkeypatch):
    calls = []
    original = _selfcheck._run
    monkeypatch.setattr(_selfcheck, "_run", lambda *a: calls.append(a) or original(*a))
    _selfcheck._verdict.cache_clear()

    def loss(p, tok):
        return jnp.mean(jnp.tanh(p["emb"][tok] @ p["w"]) ** 2)

    for _ in range(2):
        _run(loss, auto=True)
    _selfcheck._verdict.cache_clear()
    assert calls == [(("data", "model"), (4, 2), True, ("data",))]


def test_a_jax_newer_than_the_newest_tested_is_named_once(monkeypatch):
    from optax_adascale import _compat
    from optax_adascale.gspmd import _drop_in

    monkeypatch.setattr(_compat, "untested_jax", lambda: "9.9.9")
    _drop_in._warn_untested_jax.cache_clear()
    tested = ".".join(map(str, _compat.NEWEST_TESTED_JAX))
    with pytest.warns(UserWarning, match=rf"JAX 9\.9\.9 is newer than .* tested on \({tested}\).*jax=={tested}"):
        optax_adascale.value_and_grad(lambda p, x: jnp.sum(p * x), data_axes="data")
    _drop_in._warn_untested_jax.cache_clear()

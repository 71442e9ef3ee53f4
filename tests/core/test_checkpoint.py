"""Checkpointing with Orbax, configuration changes and elastic scaling.

* A checkpoint taken mid-accumulation (per-replica buffers included) resumes
  bit-identically to a run that never stopped.
* ``transfer_state`` moves a restored state to a different ``accumulation_steps``.
* The state accessors read a checkpoint restored without a target.
* Elastic scaling: train at 8 replicas, resume at 4 or 16; the moving averages
  carry over, and the first resumed gain is the one the formula predicts.
* A tensor-parallel run (``helpers.TP``: a ``(data=4, model=2)`` mesh, weights split over
  ``model``) saves sharded params and state and restores them onto abstract targets with
  shardings: onto the same mesh (bit-identical resume, also mid-accumulation) and onto a
  ``(data=2, model=2)`` mesh, where it goes on like the unsharded run at S = 2.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (
    TP,
    TP_D,
    TP_DATA,
    TP_H,
    TP_MESH,
    TP_MODEL,
    assert_trees_equal,
    full_loss,
    gain_and_tau,
    init_tp_params,
    make_tp_tx,
    make_tx,
    restore,
    save,
    scratch_dir,
    tp_batches,
    tp_loss,
)
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_adascale
from optax_adascale import AdaScaleState

AXIS = "data"
DIM = 6
BATCH = 4  # rows per replica and call
MODES = ("none", "vmap", "shard_map")
SCHEDULE = optax.exponential_decay(0.05, transition_steps=4, decay_rate=0.7, staircase=True)


def loss_fn(params, x, y):
    return 0.5 * jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


def init_params() -> dict[str, jax.Array]:
    return {"w": jnp.zeros(DIM, jnp.float32), "b": jnp.zeros([], jnp.float32)}


def batch(call: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Call ``call``'s data for ``n`` replicas: ``(n, BATCH, DIM)`` and ``(n, BATCH)``."""
    rng = np.random.default_rng(call)
    x = rng.normal(size=(n, BATCH, DIM)).astype(np.float32)
    y = (x @ np.linspace(-1.0, 1.0, DIM) + 0.5 * rng.normal(size=(n, BATCH))).astype(np.float32)
    return x, y


def tx_for(n_replicas: int, accumulation_steps: int = 1):
    axis = None if n_replicas == 1 else AXIS
    return make_tx(SCHEDULE, axis_name=axis, accumulation_steps=accumulation_steps)


class Replicas:
    """``n`` data-parallel replicas as a vmap axis, a shard_map axis over ``n`` devices, or none (``n = 1``)."""

    def __init__(self, mode: str, n: int, tx: optax.GradientTransformation):
        assert (mode == "none") == (n == 1)
        self.mode, self.n, self.tx = mode, n, tx
        template = jax.eval_shape(self._fresh_state, init_params())
        self.mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]), (AXIS,)) if mode == "shard_map" else None
        if self.mesh is not None:
            specs = optax_adascale.state_partition_specs(template, AXIS)
            self.state_shardings = jax.tree.map(lambda s: NamedSharding(self.mesh, s), specs)
            self.replicated = NamedSharding(self.mesh, P())

        def local(params, opt_state, x, y):
            p = jax.lax.pcast(params, AXIS, to="varying") if mode == "shard_map" else params
            grads = jax.grad(loss_fn)(p, x, y)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        if mode == "none":
            self._step = jax.jit(local)
        elif mode == "vmap":
            axes = optax_adascale.state_axes(template)
            self._step = jax.jit(jax.vmap(local, in_axes=(None, axes, 0, 0), out_axes=(None, axes), axis_name=AXIS))
        else:
            specs = optax_adascale.state_partition_specs(template, AXIS)
            self._step = jax.jit(
                jax.shard_map(local, mesh=self.mesh, in_specs=(P(), specs, P(AXIS), P(AXIS)), out_specs=(P(), specs))
            )

    def _fresh_state(self, params):
        state = self.tx.init(params)
        return state if self.mode == "none" else optax_adascale.replicate_buffers(state, self.n)

    def place(self, params, opt_state):
        """Put params and state where this layout's step expects them."""
        if self.mesh is None:
            return jax.device_put(params, jax.devices()[0]), jax.device_put(opt_state, jax.devices()[0])
        return jax.device_put(params, self.replicated), jax.device_put(opt_state, self.state_shardings)

    def init(self, params):
        """A fresh state of this layout (also the restore target)."""
        return self.place(params, jax.jit(self._fresh_state)(params))

    def step(self, params, opt_state, call: int):
        x, y = batch(call, self.n)
        if self.mode == "none":
            x, y = x[0], y[0]
        elif self.mode == "shard_map":
            rows = NamedSharding(self.mesh, P(AXIS))
            x = jax.device_put(x.reshape(-1, DIM), rows)
            y = jax.device_put(y.reshape(-1), rows)
        return self._step(params, opt_state, x, y)

    def run(self, params, opt_state, calls: range):
        gains = []
        for call in calls:
            params, opt_state = self.step(params, opt_state, call)
            gains.append(optax_adascale.get_adascale_state(opt_state).gain)
        return params, opt_state, np.asarray(gains)


def n_replicas(mode: str) -> int:
    return {"none": 1, "vmap": 4, "shard_map": 8}[mode]


# --------------------------------------------------------------------------- (a) mid-accumulation


@pytest.mark.parametrize("mode", MODES)
def test_checkpoint_mid_accumulation_resumes_bit_identically(tmp_path, mode):
    n, k = n_replicas(mode), 4
    replicas = Replicas(mode, n, tx_for(n, accumulation_steps=k))
    params, opt_state = replicas.init(init_params())

    # Uninterrupted: 3 updates of 4 calls each.
    ref_params, ref_state, ref_gains = replicas.run(params, opt_state, range(12))

    # Interrupted after 6 calls: one update applied, two calls sitting in the buffers.
    mid_params, mid_state, gains_before = replicas.run(params, opt_state, range(6))
    mid = optax_adascale.get_adascale_state(mid_state)
    assert int(mid.count) == 1 and int(mid.micro_step) == 2
    assert mid.acc_grads["w"].shape == ((DIM,) if mode == "none" else (n, DIM))
    assert np.all(np.abs(np.asarray(mid.acc_sq_norm)) > 0)
    save(tmp_path / "ckpt", {"params": mid_params, "opt_state": mid_state})

    target_params, target_state = replicas.init(init_params())
    restored = restore(tmp_path / "ckpt", {"params": target_params, "opt_state": target_state})
    assert isinstance(restored["opt_state"], AdaScaleState)
    assert_trees_equal(restored, {"params": mid_params, "opt_state": mid_state})
    if mode == "shard_map":
        buffers = restored["opt_state"].acc_grads["w"]
        assert buffers.sharding.is_equivalent_to(replicas.state_shardings.acc_grads["w"], buffers.ndim)

    new_params, new_state, gains_after = replicas.run(restored["params"], restored["opt_state"], range(6, 12))
    assert_trees_equal(new_params, ref_params)
    assert_trees_equal(new_state, ref_state)
    np.testing.assert_array_equal(np.concatenate([gains_before, gains_after]), ref_gains)
    assert int(optax_adascale.get_adascale_state(new_state).count) == 3


# --------------------------------------------------------------------------- (b) a new accumulation_steps

_STATISTICS = (
    "count",
    "gain",
    "tau_whole",
    "tau_frac",
    "grad_sqr",
    "grad_var",
    "ema_weight",
    "sqr_weight",
    "inner_state",
)


def test_transfer_state_to_new_accumulation_steps_after_restore(tmp_path):
    n, old_k, new_k = 4, 4, 2
    old = Replicas("vmap", n, tx_for(n, accumulation_steps=old_k))
    params, opt_state = old.init(init_params())
    params, opt_state, _ = old.run(params, opt_state, range(2 * old_k))  # two updates: a boundary
    save(tmp_path / "ckpt", {"params": params, "opt_state": opt_state})

    # Restore with the configuration that wrote the checkpoint, then move to the new one.
    restored = restore(tmp_path / "ckpt", dict(zip(("params", "opt_state"), old.init(init_params()), strict=True)))
    new = Replicas("vmap", n, tx_for(n, accumulation_steps=new_k))
    _, template = new.init(restored["params"])
    moved = optax_adascale.transfer_state(restored["opt_state"], template)
    source, state = optax_adascale.get_adascale_state(restored["opt_state"]), optax_adascale.get_adascale_state(moved)
    for field in _STATISTICS:
        assert_trees_equal(getattr(state, field), getattr(source, field))
    assert int(state.micro_step) == 0
    assert state.acc_grads["w"].shape == (n, DIM) and not np.any(np.asarray(state.acc_grads["w"]))
    params_new, state_new, gains = new.run(restored["params"], moved, range(100, 100 + 2 * new_k))
    assert int(optax_adascale.get_adascale_state(state_new).count) == 4

    # Independent reference: 4 replicas × 2 calls is n = 8 samples per update, i.e. 8 vmap
    # replicas with no accumulation, whose state is the old statistics without buffers.
    flat = Replicas("vmap", n * new_k, tx_for(n * new_k))
    ref_state = flat.tx.init(restored["params"])._replace(**{f: getattr(source, f) for f in _STATISTICS})
    ref_params, ref_gains = restored["params"], []
    for update in range(2):
        micro = [batch(100 + update * new_k + j, n) for j in range(new_k)]  # replica r, call j -> sample j·n + r
        x = np.concatenate([xb for xb, _ in micro])
        y = np.concatenate([yb for _, yb in micro])
        ref_params, ref_state = flat._step(ref_params, ref_state, x, y)
        ref_gains.append(optax_adascale.get_adascale_state(ref_state).gain)
    np.testing.assert_allclose(gains[new_k - 1 :: new_k], ref_gains, rtol=1e-5)
    np.testing.assert_array_equal(gains[: new_k - 1], source.gain)  # accumulation-only calls keep the gain
    ref = optax_adascale.get_adascale_state(ref_state)
    final = optax_adascale.get_adascale_state(state_new)
    for field in ("gain", "grad_sqr", "grad_var", "ema_weight"):
        np.testing.assert_allclose(getattr(final, field), getattr(ref, field), rtol=1e-5, err_msg=field)
    np.testing.assert_allclose(
        optax_adascale.scale_invariant_steps(final), optax_adascale.scale_invariant_steps(ref), rtol=1e-6
    )
    for a, b in zip(jax.tree.leaves(params_new), jax.tree.leaves(ref_params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_transfer_state_takes_a_checkpoint_restored_without_target_onto_new_devices(tmp_path):
    old = Replicas("vmap", 4, tx_for(4, accumulation_steps=2))
    params, opt_state = old.init(init_params())
    params, opt_state, _ = old.run(params, opt_state, range(4))
    save(tmp_path / "ckpt", {"opt_state": opt_state})
    raw = restore(tmp_path / "ckpt")["opt_state"]  # plain dicts and lists

    device = jax.devices()[3]
    template = jax.device_put(tx_for(4, accumulation_steps=4).init(init_params()), device)
    moved = optax_adascale.transfer_state(raw, template)
    assert jax.tree.structure(moved) == jax.tree.structure(template)
    assert all(leaf.devices() == {device} for leaf in jax.tree.leaves(moved))
    source = optax_adascale.get_adascale_state(opt_state)
    for field in _STATISTICS:
        assert_trees_equal(getattr(moved, field), getattr(source, field))


def test_transfer_state_refuses_a_restored_mid_accumulation_state(tmp_path):
    old = Replicas("vmap", 4, tx_for(4, accumulation_steps=4))
    params, opt_state = old.init(init_params())
    params, opt_state, _ = old.run(params, opt_state, range(5))
    save(tmp_path / "ckpt", {"opt_state": opt_state})
    restored = restore(tmp_path / "ckpt", {"opt_state": old.init(init_params())[1]})
    _, template = Replicas("vmap", 4, tx_for(4, accumulation_steps=2)).init(params)
    with pytest.raises(ValueError, match="mid-accumulation"):
        optax_adascale.transfer_state(restored["opt_state"], template)


# --------------------------------------------------------------------------- (c) restored without a target


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: tx_for(4, accumulation_steps=2), id="accumulation"),
        pytest.param(
            lambda: optax.chain(
                optax.clip_by_global_norm(10.0),
                optax_adascale.adascale_sgd(
                    0.05, momentum=0.9, axis_name=AXIS, param_labels={"w": "weights", "b": "bias"}
                ),
            ),
            id="chain-labels",
        ),
        pytest.param(
            lambda: optax.inject_hyperparams(
                optax_adascale.adascale_sgd, static_args=("axis_name", "accumulation_steps")
            )(learning_rate=0.05, momentum=0.9, axis_name=AXIS),
            id="inject_hyperparams",
        ),
    ],
)
def test_accessors_read_a_checkpoint_restored_without_target(tmp_path, make):
    replicas = Replicas("vmap", 4, make())
    params, opt_state = replicas.init(init_params())
    params, opt_state, _ = replicas.run(params, opt_state, range(5))
    save(tmp_path / "ckpt", {"opt_state": opt_state})
    raw = restore(tmp_path / "ckpt")["opt_state"]
    assert not isinstance(raw, AdaScaleState)  # plain dicts and lists

    restored = optax_adascale.get_adascale_state(raw)
    original = optax_adascale.get_adascale_state(opt_state)
    for field in AdaScaleState._fields:  # the containers are plain (inner_state: lists, dicts), the leaves equal
        # Matched by key path, not by position: a NamedTuple restored as a dict lists its leaves in the order of its
        # sorted keys (the τ clock's TraceState: curvature, decay, ..., trace), not in the order of its fields.
        a, b = _leaves_by_path(getattr(restored, field)), _leaves_by_path(getattr(original, field))
        assert a.keys() == b.keys(), field
        for path in b:
            np.testing.assert_array_equal(a[path], b[path], err_msg=f"{field} {path}")
    expected = optax_adascale.metrics(opt_state)
    actual = optax_adascale.metrics(raw)
    assert actual.keys() == expected.keys()
    assert_trees_equal(actual, expected)
    assert float(actual["gain"]) > 1
    np.testing.assert_array_equal(
        optax_adascale.scale_invariant_steps(raw), optax_adascale.scale_invariant_steps(opt_state)
    )


def _leaves_by_path(tree: Any) -> dict[tuple[str, ...], Any]:
    """A tree's leaves keyed by the names along their paths (a field, a dict key and an index all read as a name)."""
    name = lambda k: str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))  # noqa: E731
    return {tuple(name(k) for k in path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def _as_0_1_0_checkpoint(state: AdaScaleState) -> dict[str, Any]:
    """The state as optax_adascale 0.1.0 wrote it: old field names, no fields added since."""
    fields = state._asdict()
    fields["learning_rate"] = fields.pop("effective_lr")
    fields["group_gain"] = fields.pop("group_gains")
    for added in ("base_lr", "skip_streak", "floored_steps"):
        del fields[added]
    return fields


def test_a_checkpoint_written_with_the_0_1_0_field_names_restores_and_resumes(tmp_path):
    replicas = Replicas("vmap", 4, tx_for(4))
    params, opt_state = replicas.init(init_params())
    params, opt_state, _ = replicas.run(params, opt_state, range(5))
    save(tmp_path / "ckpt", {"params": params, "opt_state": _as_0_1_0_checkpoint(opt_state)})
    raw = restore(tmp_path / "ckpt")

    m_old, m_new = optax_adascale.metrics(raw["opt_state"]), optax_adascale.metrics(opt_state)
    for key in ("gain", "scale_invariant_steps", "grad_sqr", "grad_var", "learning_rate", "scale", "skipped_steps"):
        np.testing.assert_array_equal(m_old[key], m_new[key], err_msg=key)
    np.testing.assert_allclose(m_old["base_learning_rate"], m_new["base_learning_rate"], rtol=1e-6)

    resumed = optax_adascale.transfer_state(raw["opt_state"], replicas.init(init_params())[1])
    _, a, gains_a = replicas.run(raw["params"], resumed, range(5, 9))
    _, b, gains_b = replicas.run(params, opt_state, range(5, 9))
    np.testing.assert_array_equal(gains_a, gains_b)
    assert_trees_equal(optax_adascale.metrics(a), optax_adascale.metrics(b))


def test_a_0_2_0_checkpoint_restores_and_continues_with_the_new_default_estimator(tmp_path):
    # 0.2.0 trained with FairScale's estimator and had no negative_lr_steps field. Its checkpoint restores
    # (without a target), moves into the new default's fresh state, and the next update is the default
    # estimator's update of the carried averages (its memory, max(0.05·τ, 4 updates), reads the carried τ).
    old = Replicas("vmap", 4, make_tx(SCHEDULE, axis_name=AXIS, estimator="fairscale"))
    params, opt_state = old.init(init_params())
    params, opt_state, _ = old.run(params, opt_state, range(5))
    fields = optax_adascale.get_adascale_state(opt_state)._asdict()
    del fields["negative_lr_steps"]
    save(tmp_path / "ckpt", {"params": params, "opt_state": fields})
    raw = restore(tmp_path / "ckpt")
    assert int(optax_adascale.metrics(raw["opt_state"])["skipped_negative_lr_steps"]) == 0

    # clock="update": 0.2.0's inner state is optax.TraceState (its momentum per update); the default τ clock's
    # TraceState holds the guard's scalars besides, so the state moves only into the update clock's (what this test
    # is about is the checkpoint's format and the estimator's averages, not the clock).
    default = Replicas("vmap", 4, make_tx(SCHEDULE, axis_name=AXIS))
    with pytest.raises(ValueError, match="clock='update'"):  # into 0.4.0's default: refused, naming the fix
        optax_adascale.transfer_state(raw["opt_state"], default.init(init_params())[1])
    new = Replicas("vmap", 4, make_tx(SCHEDULE, axis_name=AXIS, clock="update"))
    resumed = optax_adascale.transfer_state(raw["opt_state"], new.init(init_params())[1])
    before = optax_adascale.get_adascale_state(resumed)
    _, state, _ = new.run(raw["params"], resumed, range(5, 6))
    after = optax_adascale.get_adascale_state(state)
    expected = _expected_gain(before, _grads_per_replica(jax.device_get(params), 5, 4), guarded=False)
    for field, value in expected.items():
        np.testing.assert_allclose(float(getattr(after, field)), value, rtol=1e-5, err_msg=field)
    assert int(after.count) == 6


def test_an_nnx_optimizer_restored_without_target_is_readable_and_transferable(tmp_path):
    nnx = pytest.importorskip("flax.nnx")

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(DIM, 2, rngs=rngs)

    model = Model(nnx.Rngs(0))
    tx = optax_adascale.adascale_sgd(0.1, momentum=0.9, accumulation_steps=2)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x):
        optimizer.update(model, nnx.grad(lambda m: jnp.sum(m.linear(x) ** 2))(model))

    for call in range(4):
        step(model, optimizer, jnp.asarray(batch(call, 1)[0][0]))
    save(tmp_path / "ckpt", nnx.state(optimizer))
    raw = restore(tmp_path / "ckpt")  # NNX variables come back as {"value": array}
    assert_trees_equal(optax_adascale.metrics(raw), optax_adascale.metrics(optimizer))
    moved = optax_adascale.transfer_state(raw, tx.init(nnx.state(model, nnx.Param)))
    assert_trees_equal(optax_adascale.metrics(moved), optax_adascale.metrics(optimizer))


# --------------------------------------------------------------------------- (d) elastic scaling


def _grads_per_replica(params, call: int, n: int) -> np.ndarray:
    """Each replica's gradient on call ``call``, flattened, float64: ``(n, DIM + 1)``."""
    x, y = batch(call, n)
    grads = jax.vmap(jax.grad(loss_fn), in_axes=(None, 0, 0))(params, x, y)
    return np.concatenate([np.asarray(grads["w"], np.float64), np.asarray(grads["b"], np.float64)[:, None]], axis=1)


def _expected_gain(prev: AdaScaleState, grads: np.ndarray, *, guarded: bool = True) -> dict[str, float]:
    """AdaScale's update of the carried moving averages by this step's moments, in float64, with the default
    estimator: a memory of max(0.05·τ, 4·r_{t−1}) base steps (θ = exp(−r_{t−1}/max(0.05·τ_t, 4·r_{t−1}))),
    μ̂² averaged unfloored.

    ``guarded``: the default τ clock's applied gain, min(estimated gain, 1.1·max(r_{t−1}, 1), curvature cap). Its
    curvature cap is left out: it only lowers the gain, so where the expected value matches it did not bind (these
    runs, five updates of a small MLP, are held by the 10 % growth cap). ``False``: the update clock's, the
    estimated gain itself."""
    n = S = grads.shape[0]
    a = np.mean(np.sum(grads**2, axis=1))
    b = np.sum(np.mean(grads, axis=0) ** 2)
    var = max(S / (n - 1) * (a - b), 1e-6)
    sqr = b - var / S
    tau = float(prev.tau_whole) + float(prev.tau_frac)
    theta = np.exp(-float(prev.gain) / max(0.05 * tau, 4.0 * float(prev.gain)))
    w_prev = float(prev.ema_weight)
    w = theta * w_prev + (1 - theta)
    grad_var = (theta * w_prev * float(prev.grad_var) + (1 - theta) * var) / w
    grad_sqr = (theta * w_prev * float(prev.grad_sqr) + (1 - theta) * sqr) / w
    mu2 = max(grad_sqr, 0.0)
    gain = float(np.clip((grad_var + mu2) / (grad_var / S + mu2), 1.0, S))
    if guarded:
        gain = min(gain, 1.1 * max(float(prev.gain), 1.0))
    return {"gain": gain, "grad_var": grad_var, "grad_sqr": grad_sqr, "ema_weight": w}


@pytest.fixture(scope="module")
def trained_at_8(tmp_path_factory):
    """Five updates at 8 replicas (shard_map over 8 devices), checkpointed."""
    replicas = Replicas("shard_map", 8, tx_for(8))
    params, opt_state = replicas.init(init_params())
    params, opt_state, gains = replicas.run(params, opt_state, range(5))
    path = tmp_path_factory.mktemp("elastic") / "ckpt"
    save(path, {"params": params, "opt_state": opt_state})
    return path, params, opt_state


@pytest.mark.parametrize(("mode", "n"), [("shard_map", 4), ("vmap", 16)])
def test_elastic_resume_carries_statistics_and_matches_in_process_rescale(trained_at_8, mode, n):
    path, params_8, state_8 = trained_at_8
    before = optax_adascale.get_adascale_state(state_8)
    assert int(before.count) == 5 and float(before.scale) == 8

    # Resume from the checkpoint at the new replica count: the new configuration's fresh state is the target.
    replicas = Replicas(mode, n, tx_for(n))
    restored = restore(path, dict(zip(("params", "opt_state"), replicas.init(init_params()), strict=True)))
    resumed = optax_adascale.get_adascale_state(restored["opt_state"])
    for field in _STATISTICS:  # no reset
        assert_trees_equal(getattr(resumed, field), getattr(before, field))
    if mode == "shard_map":
        assert len(restored["params"]["w"].sharding.device_set) == n
    call = 100
    params_r, state_r = replicas.step(restored["params"], restored["opt_state"], call)

    # The run that never stopped: rebuild the transformation for n replicas and keep the opt_state.
    params_k, state_k = replicas.place(params_8, state_8)
    params_k, state_k = replicas.step(params_k, state_k, call)
    assert_trees_equal(params_r, params_k)
    assert_trees_equal(state_r, state_k)

    # The formula: the carried moving averages updated by this step's moments at S = n.
    after = optax_adascale.get_adascale_state(state_r)
    expected = _expected_gain(before, _grads_per_replica(jax.device_get(params_8), call, n))
    for field, value in expected.items():
        np.testing.assert_allclose(float(getattr(after, field)), value, rtol=1e-5, err_msg=field)
    assert 1 < float(after.gain) <= n and float(after.scale) == n
    assert int(after.count) == 6
    tau_before = float(optax_adascale.scale_invariant_steps(state_8))
    np.testing.assert_allclose(float(optax_adascale.scale_invariant_steps(state_r)), tau_before + float(after.gain))


def test_elastic_resume_with_accumulation_buffers_goes_through_transfer_state(tmp_path):
    # 8 devices × 2 calls per update, checkpointed at an update boundary; resumed on 4 devices × 2 calls.
    k = 2
    old = Replicas("shard_map", 8, tx_for(8, accumulation_steps=k))
    params, opt_state = old.init(init_params())
    params, opt_state, _ = old.run(params, opt_state, range(3 * k))
    save(tmp_path / "ckpt", {"params": params, "opt_state": opt_state})

    # The buffers' shape depends on the replica count, so restore the *old* layout (abstractly, straight
    # onto the new devices), then move its statistics into the new layout's fresh state.
    new = Replicas("shard_map", 4, tx_for(4, accumulation_steps=k))
    old_layout = jax.eval_shape(lambda p: old.init(p), init_params())
    target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=new.replicated), old_layout)
    restored = restore(tmp_path / "ckpt", dict(zip(("params", "opt_state"), target, strict=True)))
    template = new.init(restored["params"])[1]
    resumed = optax_adascale.transfer_state(restored["opt_state"], template)
    params_r, state_r, _ = new.run(restored["params"], resumed, range(100, 100 + k))

    # Never stopped: the in-memory state, moved the same way (its statistics still live on the old
    # devices, so put the result on the new ones).
    moved = jax.device_put(optax_adascale.transfer_state(opt_state, template), new.state_shardings)
    params_k, state_k, _ = new.run(jax.device_put(params, new.replicated), moved, range(100, 100 + k))
    assert_trees_equal(params_r, params_k)
    assert_trees_equal(state_r, state_k)

    before = optax_adascale.get_adascale_state(opt_state)
    after = optax_adascale.get_adascale_state(state_r)
    host_params = jax.device_get(params)
    grads = np.concatenate([_grads_per_replica(host_params, 100 + j, 4) for j in range(k)])  # n = 8 samples
    for field, value in _expected_gain(before, grads).items():
        np.testing.assert_allclose(float(getattr(after, field)), value, rtol=1e-5, err_msg=field)
    assert int(after.count) == 4 and float(after.scale) == 8


# --------------------------------------------------------------------------- tensor-parallel checkpoints

SAVED_AT, RESUMED = 4, 3  # updates before the checkpoint, updates after it
MESH_2x2 = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))


def tp_place(params, mesh):
    return jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), params, TP)


def tp_fresh(tx, mesh, accumulation: int = 1):
    """Params split over ``model`` on ``mesh``, their state, and the state's partition specs."""
    params = tp_place(init_tp_params(), mesh)
    state = tx.init(params)
    if accumulation > 1:
        state = optax_adascale.replicate_buffers(state, mesh.shape["data"], model_shards=mesh.shape["model"])
    specs = optax_adascale.state_partition_specs(state, "data", TP, tx=tx)
    return params, jax.device_put(state, jax.tree.map(lambda s: NamedSharding(mesh, s), specs)), specs


@functools.cache
def tp_step(mesh, accumulation: int = 1):
    """One call of the TP training step under shard_map over ``mesh``; returns ``(tx, step, specs)``."""
    tx = make_tp_tx(accumulation_steps=accumulation)
    _, _, specs = tp_fresh(tx, mesh, accumulation)

    def step(params, state, x, y):
        p = jax.lax.pcast(params, "data", to="varying")
        updates, state = tx.update(jax.grad(tp_loss)(p, x[0], y[0]), state, params)
        return optax.apply_updates(params, updates), state

    step = jax.shard_map(step, mesh=mesh, in_specs=(TP, specs, P("data"), P("data")), out_specs=(TP, specs))
    return tx, jax.jit(step), specs


def tp_abstract(tree, specs, mesh):
    """The restore target: ``tree``'s shapes and dtypes with ``specs`` on ``mesh``."""
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s)), tree, specs
    )


def tp_run(step, params, state, xs, ys):
    """One call per ``(x, y)``; the ``(gain, τ)`` after each."""
    log = []
    for x, y in zip(xs, ys, strict=True):
        params, state = step(params, state, x, y)
        log.append(gain_and_tau(state))
    return params, state, log


def tp_checkpoint(test):
    """The tests of the saved TP run (> 10 s on a 2-core CPU): slow, and on one xdist worker, which saves it once."""
    return pytest.mark.slow(pytest.mark.xdist_group("tp_checkpoint")(test))


def momentum_of(state):
    return optax.tree.get(state, "trace")


def assert_same_shardings(tree, target) -> None:
    for (path, a), t in zip(jax.tree_util.tree_leaves_with_path(tree), jax.tree.leaves(target), strict=True):
        assert a.sharding.is_equivalent_to(t.sharding, a.ndim), jax.tree_util.keystr(path)


@functools.cache
def _tp_saved():
    """``SAVED_AT`` TP updates on the (4, 2) mesh, checkpointed; returns the path and the in-memory run."""
    tx, step, specs = tp_step(TP_MESH)
    params, state, _ = tp_fresh(tx, TP_MESH)
    x, y = tp_batches(TP_DATA)
    params, state, log = tp_run(step, params, state, x[:SAVED_AT], y[:SAVED_AT])
    assert int(state.count) == SAVED_AT and float(state.scale) == TP_DATA and min(g for g, _ in log) > 1
    path = scratch_dir("tp") / "ckpt"
    save(path, {"params": params, "opt_state": state})
    return path, params, state, specs


@pytest.fixture
def tp_saved():
    """_tp_saved, computed once per process (xdist may tear module fixtures down between tests)."""
    return _tp_saved()


@tp_checkpoint
def test_tp_checkpoint_resumes_bit_identically_on_the_same_mesh(tp_saved):
    path, params, state, specs = tp_saved
    _, step, _ = tp_step(TP_MESH)
    target = {"params": tp_abstract(params, TP, TP_MESH), "opt_state": tp_abstract(state, specs, TP_MESH)}
    restored = restore(path, target)
    assert isinstance(restored["opt_state"], optax_adascale.AdaScaleState)
    assert_trees_equal(restored, {"params": params, "opt_state": state})
    assert_same_shardings(restored, target)
    momentum = momentum_of(restored["opt_state"])["w1"]
    assert momentum.sharding.spec == TP["w1"] and momentum.addressable_shards[0].data.shape == (TP_D, TP_H // 2)

    x, y = tp_batches(TP_DATA)
    later = slice(SAVED_AT, SAVED_AT + RESUMED)
    p_r, s_r, log_r = tp_run(step, restored["params"], restored["opt_state"], x[later], y[later])
    p_k, s_k, log_k = tp_run(step, params, state, x[later], y[later])  # never stopped
    assert_trees_equal(p_r, p_k)
    assert_trees_equal(s_r, s_k)
    assert log_r == log_k


@tp_checkpoint
def test_tp_checkpoint_restores_onto_fewer_replicas_and_matches_the_unsharded_run(tp_saved):
    path, params, state, _ = tp_saved
    tx, step, specs = tp_step(MESH_2x2)
    assert jax.tree.leaves(specs) == jax.tree.leaves(tp_saved[3])  # the layout does not depend on the data size
    target = {"params": tp_abstract(params, TP, MESH_2x2), "opt_state": tp_abstract(state, specs, MESH_2x2)}
    restored = restore(path, target)
    assert_trees_equal(restored, {"params": params, "opt_state": state})
    assert_same_shardings(restored, target)
    assert restored["params"]["w1"].sharding.device_set == set(MESH_2x2.devices.flat)

    n = MESH_2x2.shape["data"]
    x, y = tp_batches(TP_DATA)
    later = slice(SAVED_AT, SAVED_AT + RESUMED)
    xs, ys = x[later, :n], y[later, :n]  # update t: the first n samples
    p_r, s_r, log_r = tp_run(step, restored["params"], restored["opt_state"], xs, ys)
    assert float(s_r.scale) == n and int(s_r.count) == SAVED_AT + RESUMED

    # The truth: the unsharded run, n replicas as a vmap axis, from the saved params and statistics.
    def ref_step(params, state, x, y):
        updates, state = tx.update(jax.grad(full_loss)(params, x, y), state, params)
        return optax.apply_updates(params, updates), state

    ref_step = jax.jit(jax.vmap(ref_step, in_axes=(None, None, 0, 0), out_axes=(None, None), axis_name="data"))
    p_ref, s_ref, log_ref = tp_run(ref_step, jax.device_get(params), jax.device_get(state), xs, ys)
    np.testing.assert_allclose(np.array(log_r), np.array(log_ref), rtol=1e-5)
    assert min(g for g, _ in log_ref) > 1.0  # the gains are not trivially 1
    for name in p_ref:
        np.testing.assert_allclose(np.asarray(p_r[name]), p_ref[name], rtol=1e-5, atol=1e-6, err_msg=name)
    for name, m in momentum_of(s_ref).items():
        np.testing.assert_allclose(np.asarray(momentum_of(s_r)[name]), m, rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.slow  # > 10 s on a 2-core CPU
def test_tp_checkpoint_mid_accumulation_resumes_bit_identically(tmp_path):
    k = 2
    tx, step, specs = tp_step(TP_MESH, accumulation=k)
    params, state, _ = tp_fresh(tx, TP_MESH, k)
    x, y = tp_batches(TP_DATA * k)
    # Update t, call c: replica r takes sample r·k + c.
    xs = [x[t, c::k] for t in range(3) for c in range(k)]
    ys = [y[t, c::k] for t in range(3) for c in range(k)]
    mid = 3  # an odd call: one update applied, one call in the buffers

    p_ref, s_ref, log_ref = tp_run(step, params, state, xs, ys)
    p_mid, s_mid, log_mid = tp_run(step, params, state, xs[:mid], ys[:mid])
    assert int(s_mid.count) == 1 and int(s_mid.micro_step) == 1
    assert s_mid.acc_grads["w1"].shape == (TP_DATA, TP_D, TP_H)
    assert s_mid.acc_sq_norm.shape[:2] == (TP_DATA, TP_MODEL) and np.all(np.asarray(s_mid.acc_sq_norm) > 0)
    save(tmp_path / "ckpt", {"params": p_mid, "opt_state": s_mid})

    target = {"params": tp_abstract(p_mid, TP, TP_MESH), "opt_state": tp_abstract(s_mid, specs, TP_MESH)}
    restored = restore(tmp_path / "ckpt", target)
    assert_trees_equal(restored, {"params": p_mid, "opt_state": s_mid})
    assert_same_shardings(restored, target)
    buffers = restored["opt_state"].acc_grads["w1"]
    assert buffers.sharding.spec == P("data", None, "model")
    assert buffers.addressable_shards[0].data.shape == (1, TP_D, TP_H // TP_MODEL)

    p_r, s_r, log_r = tp_run(step, restored["params"], restored["opt_state"], xs[mid:], ys[mid:])
    assert_trees_equal(p_r, p_ref)
    assert_trees_equal(s_r, s_ref)
    assert log_mid + log_r == log_ref
    assert int(s_r.count) == 3 and int(s_r.micro_step) == 0


def test_a_0_4_0_checkpoint_of_the_guarded_default_is_refused_with_what_to_do(tmp_path):
    """0.4.0's default (the guarded τ clock) stored β and nesterov in its momentum state, behind a decayed-weights
    state, and had no limit; 0.5.0's does not restore it silently: the message says it is 0.4.0's and what to do."""
    tx = make_tx(SCHEDULE, axis_name=AXIS)
    fields = optax_adascale.get_adascale_state(tx.init(init_params()))._asdict()
    (trace,) = fields["inner_state"]
    old = {k: v for k, v in trace._asdict().items() if k != "limit"}
    old.update(decay=jnp.float32(0.9), nesterov=jnp.bool_(False))
    fields["inner_state"] = ({}, old)  # chain(add_decayed_weights(λ), trace(β)): 0.4.0's layout
    save(tmp_path / "ckpt", {"opt_state": fields})
    raw = restore(tmp_path / "ckpt")
    with pytest.raises(ValueError, match=r"0\.4\.0 checkpoint of the guarded τ clock.*tx\.init\(params\)"):
        optax_adascale.transfer_state(raw["opt_state"], tx.init(init_params()))

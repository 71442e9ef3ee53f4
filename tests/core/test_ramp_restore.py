"""A run restored from an Orbax checkpoint mid-ramp and mid-accumulation-window is the uninterrupted run, bit for
bit, and its loader, positioned from the optimizer state, feeds every example once: none dropped or repeated
across the changes of ``S`` or across the restore.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from helpers import DIM, bits_equal, init_mlp, mlp_loss

import optax_adascale

R, ROWS, EXAMPLES, CALLS = 2, 3, 240, 36
SCHEDULE = optax.exponential_decay(0.3, transition_steps=10, decay_rate=0.5)


def dataset():
    kx, ky = jax.random.split(jax.random.key(3))
    x = np.asarray(jax.random.normal(kx, (EXAMPLES, DIM)))
    return x, np.asarray(jax.random.randint(ky, (EXAMPLES,), 0, 3))


def microbatch(position):
    """Call ``position``'s micro-batch for every replica: rows ``[position·R·m, (position + 1)·R·m)`` of a
    permutation of the data set (one epoch here), whatever the ramp's ``k``."""
    order = np.random.default_rng(0).permutation(EXAMPLES)
    rows = order[position * R * ROWS : (position + 1) * R * ROWS]
    x, y = dataset()
    return x[rows].reshape(R, ROWS, DIM), y[rows].reshape(R, ROWS), rows


def make(ramp=None):
    ramp = ramp or optax_adascale.BatchRamp(1, 4, efficiency=0.5, patience=1)
    tx = optax_adascale.adascale_sgd(SCHEDULE, momentum=0.9, axis_name="i", accumulation_steps=ramp)
    fresh = optax_adascale.replicate_buffers(tx.init(init_mlp()), R)
    axes = optax_adascale.state_axes(fresh)

    def replica_step(params, state, x, y):
        updates, state = tx.update(jax.grad(mlp_loss)(params, x, y), state, params)
        return optax.apply_updates(params, updates), state

    step = jax.jit(jax.vmap(replica_step, in_axes=(None, axes, 0, 0), out_axes=(None, axes), axis_name="i"))
    return step, fresh


def train(step, params, state, until, fed):
    """The user's loop: the position comes from the state; stop after call ``until``."""
    while int(optax_adascale.batch_plan(state)["microbatches_seen"]) < until:
        x, y, rows = microbatch(int(optax_adascale.batch_plan(state)["microbatches_seen"]))
        fed.extend(rows.tolist())
        params, state = step(params, state, x, y)
    return params, state


def test_a_run_restored_mid_ramp_and_mid_window_is_the_uninterrupted_run_bit_for_bit(tmp_path):
    step, fresh = make()
    fed_straight = []
    straight = train(step, init_mlp(), fresh, CALLS, fed_straight)

    fed = []
    params, state = train(step, init_mlp(), fresh, 0, fed)
    # Stop where the ramp has moved and a window is half full.
    while True:
        params, state = train(step, params, state, int(optax_adascale.batch_plan(state)["microbatches_seen"]) + 1, fed)
        s = optax_adascale.get_adascale_state(state)
        if int(s.micro_step) > 0 and int(s.ramp.microbatches) > 1 and int(s.count) >= 3:
            break
    stopped_at = int(optax_adascale.batch_plan(state)["microbatches_seen"])
    assert stopped_at < CALLS
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "ckpt", {"params": params, "opt_state": state})
    del params, state
    _, fresh_again = make()  # a new process would build the optimizer again
    with ocp.StandardCheckpointer() as ckpt:
        restored = ckpt.restore(tmp_path / "ckpt", {"params": init_mlp(), "opt_state": fresh_again})
        without_target = ckpt.restore(tmp_path / "ckpt")
    assert int(optax_adascale.batch_plan(without_target["opt_state"])["microbatches_seen"]) == stopped_at
    resumed = train(step, restored["params"], restored["opt_state"], CALLS, fed)

    assert bits_equal(resumed, straight)
    assert fed == fed_straight  # the same examples, in the same order
    assert sorted(fed) == sorted(set(fed)) and len(fed) == CALLS * R * ROWS  # none repeated, none skipped
    ks = {int(k) for k in np.asarray(straight[1].ramp.microbatches).ravel()}
    assert max(ks) > 1


# --------------------------------------------------------------------------- into another ramp (issue 40 item 3)


def greedy(max_microbatches):
    """A ramp whose policy always asks for 8 micro-batches: it climbs to its top rung at its first update."""
    return optax_adascale.BatchRamp(1, max_microbatches, patience=1, policy=lambda inputs: 8.0)


def calls_per_update(step, params, state, calls):
    """Feed ``calls`` more calls; the calls each applied update took (the first counts from the restore)."""
    taken, since = [], 0
    for _ in range(calls):
        count = int(optax_adascale.get_adascale_state(state).count)
        params, state = train(step, params, state, int(optax_adascale.batch_plan(state)["microbatches_seen"]) + 1, [])
        since += 1
        if int(optax_adascale.get_adascale_state(state).count) > count:
            taken.append(since)
            since = 0
    return params, state, taken


def test_a_state_restored_into_a_smaller_ramp_moves_k_onto_its_ladder(tmp_path):
    """Saved with BatchRamp(1, 8) at k = 8, restored into a state built with BatchRamp(1, 4): on main the batch
    stayed at 8 micro-batches (400 calls in the report). At an update boundary k is 4 from the first call; in the
    middle of a window the window finishes at the k its calls were fed for (nothing dropped: the update is the
    uninterrupted run's), then 4. transfer_state into a BatchRamp(1, 4) state does the same."""
    step8, fresh8 = make(greedy(8))
    step4, fresh4 = make(greedy(4))
    params, state, taken = calls_per_update(step8, init_mlp(), fresh8, 9)
    assert taken == [1, 8] and int(optax_adascale.batch_plan(state)["microbatches"]) == 8  # the old run at k = 8
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "boundary", {"params": params, "opt_state": state})
        restored = ckpt.restore(tmp_path / "boundary", {"params": init_mlp(), "opt_state": fresh4})
    with pytest.warns(UserWarning, match=r"k = 8 micro-batches.*ladder \(1, 2, 4\): k moves from 8 to 4 here"):
        transferred = optax_adascale.transfer_state(state, fresh4)
    for p, s in ((restored["params"], restored["opt_state"]), (params, transferred)):
        _, s, taken = calls_per_update(step4, p, s, 8)
        assert taken == [4, 4] and int(optax_adascale.batch_plan(s)["microbatches"]) == 4

    params, state, _ = calls_per_update(step8, params, state, 3)  # 3 calls into a window of 8
    straight_params, straight, taken = calls_per_update(step8, params, state, 5)
    assert taken == [5]
    moved_params, moved, taken = calls_per_update(step4, params, state, 13)
    assert taken == [5, 4, 4]
    first_update = calls_per_update(step4, params, state, 5)[:2]
    assert bits_equal(first_update, (straight_params, straight._replace(ramp=straight.ramp._replace(microbatches=4))))


def _warnings(fn, *args):
    """``fn(*args)`` and the package's warnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn(*args)
    return out, [str(w.message) for w in caught if "BatchRamp state" in str(w.message)]


def test_a_state_moved_onto_another_ladder_says_so_once_naming_both_ks_and_the_ladder():
    """Issue 44: a k restored onto another ladder moved without a word. Where the host sees k (transfer_state into a
    ramp's fresh state; an update outside jit) one warning names the old k, the new k and the ladder."""
    params = jnp.zeros(3)
    ramp_tx = lambda ramp: optax_adascale.adascale_sgd(0.1, accumulation_steps=ramp)  # noqa: E731
    big, small, wide = (
        ramp_tx(optax_adascale.BatchRamp(*ends, patience=1, policy=lambda _: 8.0)) for ends in ((2, 8), (2, 4), (2, 16))
    )
    state, big_update = big.init(params), jax.jit(big.update)
    for t in range(10):  # an update at k = 2, then one at k = 8
        state = big_update(jnp.full(3, 1.0 + t), state, params)[1]
    assert int(state.ramp.microbatches) == 8 and int(state.micro_step) == 0

    moved, said = _warnings(optax_adascale.transfer_state, state, small.init(params))
    assert said == [
        "the state given to transfer_state holds a BatchRamp state at k = 8 micro-batches, which is not a rung of "
        "this ramp's ladder (2, 4): k moves from 8 to 4 here (the largest rung at or below it; the lowest if it is "
        "below them all). To keep the batch at k = 8, build the optimizer with a ramp whose ladder holds 8."
    ]
    assert int(optax_adascale.batch_plan(moved)["microbatches"]) == 4  # the loader sees the new k at once
    kept, said = _warnings(optax_adascale.transfer_state, state, wide.init(params))
    assert said == [] and int(optax_adascale.batch_plan(kept)["microbatches"]) == 8  # 8 is a rung of (2, 4, 8, 16)

    # A state restored straight into the smaller ramp's (not through transfer_state), updated outside jit: one
    # warning for the whole window, which runs at the new k.
    restored, calls = state, []
    for _ in range(4):
        (_, restored), said = _warnings(small.update, jnp.full(3, 1.0), restored, params)
        calls.append(said)
    assert [len(c) for c in calls] == [1, 0, 0, 0] and "k moves from 8 to 4 at this update" in calls[0][0]
    assert int(restored.count) == int(state.count) + 1 and int(restored.ramp.microbatches) == 4

"""The aliases' inner transformations (``core/_keeps_state.py``): optax's ``trace`` and ``scale_by_adam`` bit for
bit where the update is taken, their old state kept where it is skipped."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import bits_equal

import optax_adascale
from optax_adascale.core import _keeps_state

PARAMS = {"w": jnp.linspace(-1.0, 1.0, 12, dtype=jnp.float32).reshape(3, 4), "b": jnp.zeros(4, jnp.float32)}

PAIRS = {  # ours, optax's
    "trace": (lambda: _keeps_state.trace(0.9), lambda: optax.trace(0.9)),
    "trace-nesterov": (lambda: _keeps_state.trace(0.9, nesterov=True), lambda: optax.trace(0.9, nesterov=True)),
    "adam": (
        lambda: _keeps_state.scale_by_adam(0.9, 0.999, 1e-8, 0.0, None, False),
        lambda: optax.scale_by_adam(0.9, 0.999, 1e-8, 0.0),
    ),
    "adam-nesterov-eps-root": (
        lambda: _keeps_state.scale_by_adam(0.8, 0.99, 1e-3, 1e-6, None, True),
        lambda: optax.scale_by_adam(0.8, 0.99, 1e-3, 1e-6, nesterov=True),
    ),
    "adam-bf16-mu": (
        lambda: _keeps_state.scale_by_adam(0.9, 0.999, 1e-8, 0.0, jnp.bfloat16, False),
        lambda: optax.scale_by_adam(0.9, 0.999, 1e-8, 0.0, mu_dtype=jnp.bfloat16),
    ),
}


def _taken(taken):
    """The keyword AdaScale passes: ``base_steps`` with ``taken`` set (an update worth one base step)."""
    return {"base_steps": dataclasses.replace(optax_adascale.BaseSteps.by_hand(1.0), taken=taken)}


def _grads(t):
    rng = np.random.default_rng(t)
    return jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), p.dtype), PARAMS)


@pytest.mark.parametrize("taken", [None, True], ids=["no-argument", "taken"])
@pytest.mark.parametrize("pair", sorted(PAIRS))
def test_a_taken_update_is_optaxs_bit_for_bit(pair, taken):
    ours, theirs = (make() for make in PAIRS[pair])
    extra = {} if taken is None else _taken(jnp.bool_(taken))
    ours_update = jax.jit(lambda g, s: ours.update(g, s, PARAMS, **extra))
    theirs_update = jax.jit(lambda g, s: theirs.update(g, s, PARAMS))
    s_ours, s_theirs = ours.init(PARAMS), theirs.init(PARAMS)
    assert bits_equal(s_ours, s_theirs)
    for t in range(4):
        u_ours, s_ours = ours_update(_grads(t), s_ours)
        u_theirs, s_theirs = theirs_update(_grads(t), s_theirs)
        assert bits_equal((u_ours, s_ours), (u_theirs, s_theirs)), t


@pytest.mark.parametrize("pair", sorted(PAIRS))
def test_a_skipped_update_keeps_the_old_state_bit_for_bit(pair):
    ours, _ = (make() for make in PAIRS[pair])
    update = jax.jit(lambda g, s, taken: ours.update(g, s, PARAMS, **_taken(taken)))
    state = ours.init(PARAMS)
    for t in range(2):
        _, state = update(_grads(t), state, jnp.bool_(True))
    poisoned = jax.tree.map(lambda g: g.at[0].set(jnp.nan), _grads(2))
    _, kept = update(poisoned, state, jnp.bool_(False))
    assert bits_equal(kept, state)
    assert not bits_equal(update(_grads(2), state, jnp.bool_(True))[1], state)  # a taken update does change it


def test_keeps_state_marks_a_chain_and_keeps_its_numbers():
    chain = optax.chain(_keeps_state.scale_by_adam(0.9, 0.999, 1e-8, 0.0, None, False), optax.add_decayed_weights(0.1))
    marked = _keeps_state.keeps_state(chain)
    assert isinstance(marked, _keeps_state.KeepsStateOnSkip)
    state = marked.init(PARAMS)
    taken = _taken(jnp.bool_(True))
    assert bits_equal(marked.update(_grads(0), state, PARAMS, **taken), chain.update(_grads(0), state, PARAMS))

"""``inner`` on the averaged gradient, and the skip's choice of its new or its old state, in public JAX.

A skipped update keeps ``inner``'s old state. Where the state is donated, XLA writes the kept state in place, over
the old buffers; whatever else reads the old buffers must run before that write, or XLA copies them first.
Selecting ``where(ok, new, old)`` *after* ``inner`` leaves its updates reading the old state (XLA recomputes the new
state inside the parameter update's fusion), unordered with the in-place write: XLA copies every state buffer the
updates read (Adam's μ and ν: 11.0 MiB of temporaries per device against optax.adamw's 8.0 on
``tests/sharding/test_skip_memory.py``'s MLP). Three ways keep the write in place, chosen per ``inner`` at trace time:

* **inner selects** (:class:`~optax_adascale.core._keeps_state.KeepsStateOnSkip`: ``adascale_sgd``'s and
  ``adascale_adamw``'s inner): it gets ``base_steps.taken=ok`` and selects each state leaf where it computes it, so
  its updates read the state it writes, as optax's own step does (that MLP: 6.0 MiB).
* **select** (every update leaf *is* a leaf of the new state, as ``optax.trace``'s momentum, or ``inner`` holds no
  array state beyond scalars, as ``optax.identity``): the updates are the *selected* state leaves. Identical where
  the step is taken; where it is skipped ``_step`` scales them to zero with a select, which ignores what it reads.
* **cond** (any other ``inner``: optax's own Adam, Nesterov): ``lax.cond(ok, inner, keep)``. The state is written in
  place inside the taken branch; the updates that are not state leaves leave the conditional as buffers and cannot
  fuse into the parameter update (that MLP: 8.0 MiB on JAX 0.10.2, 9.0 on 0.12, against optax's 8.0). Under ``vmap``
  with a batched predicate JAX runs both branches and selects, which brings the copies back; XLA:GPU reads a
  conditional's predicate on the host (not measured here: the accumulation path's cond already does).

Numbers: where the step is taken, updates and state are ``inner.update``'s bit for bit on every path. Not an
``optimization_barrier`` between the updates and the state write: XLA:CPU lowers it to an ordering that fusion then
crosses, and the copies stay (14.0 MiB). Not ``inner`` traced to a jaxpr and re-evaluated with the select where each
state leaf is written (the previous way, 6.0 MiB for any ``inner``): it needs JAX's private evaluator.
"""

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from optax_adascale.core import _checks, _clock, _keeps_state
from optax_adascale.core._varying import fresh_zeros, match_varying

Array = jax.Array


class _Twins(NamedTuple):
    """For each update leaf, the index of the new-state leaf it *is* (typed as the old one), else ``None``."""

    of_update: list[int | None]

    @property
    def every_update(self) -> bool:
        return all(i is not None for i in self.of_update)


def run(inner: optax.GradientTransformationExtraArgs, ok: Array, grads, inner_state, params, extra_args):
    """``inner.update`` on ``grads``; its updates, and its new state where ``ok`` else ``inner_state``.

    The new state keeps the old state's dtypes (stable types: an inner fed f32 gradients for bf16 params must not
    widen its state). The module docstring says how the choice stays copy-free.
    """
    if isinstance(inner, _keeps_state.KeepsStateOnSkip):  # selects where it writes (the aliases' inner)
        steps = dataclasses.replace(extra_args[_clock.KEYWORD], taken=ok)
        updates, new_state = _update(inner, grads, inner_state, params, {**extra_args, _clock.KEYWORD: steps})
        return updates, _keep_dtypes(new_state, inner_state)
    updates, new_state = _update(inner, grads, inner_state, params, extra_args)
    if jax.tree.structure(new_state) != jax.tree.structure(inner_state):
        return updates, optax.tree.where(ok, _keep_dtypes(new_state, inner_state), inner_state)  # raises, as before
    old = jax.tree.leaves(inner_state)
    twins = _twins(updates, new_state, old)
    if twins.every_update or not any(jnp.ndim(x) for x in old):
        kept = optax.tree.where(ok, _keep_dtypes(new_state, inner_state), inner_state)
        return _with_twins(updates, twins, [None] * len(twins.of_update), kept), kept
    # the types both branches return, read off this trace's values (unused beyond their types: DCE drops them)
    rest_types = [None if i is not None else u for u, i in zip(jax.tree.leaves(updates), twins.of_update, strict=True)]
    state_types = _keep_dtypes(new_state, inner_state)

    def taken(state):
        u, new = _update(inner, grads, state, params, extra_args)
        rest = [None if i is not None else x for x, i in zip(jax.tree.leaves(u), twins.of_update, strict=True)]
        return match_varying((rest, _keep_dtypes(new, state)), (rest_types, state_types))

    def skipped(state):
        rest = [None if t is None else fresh_zeros(t) for t in rest_types]  # thrown away by _step's select
        return match_varying((rest, state), (rest_types, state_types))

    rest, kept = lax.cond(ok, taken, skipped, inner_state)
    return _with_twins(updates, twins, rest, kept), kept


def _update(inner, grads, inner_state, params, extra_args):
    """``inner.update``; our message where ``inner_state`` is not ``inner``'s; the updates' structure checked."""
    try:
        updates, new_state = inner.update(grads, inner_state, params, **extra_args)
    except (AttributeError, TypeError, ValueError, KeyError, IndexError) as err:
        _checks.explain_inner_state_mismatch(inner, inner_state, grads, err)
        raise
    if jax.tree.structure(updates) != jax.tree.structure(grads):
        raise ValueError(
            "inner must return updates with the structure of the gradients: got "
            f"{jax.tree.structure(updates)} for gradients {jax.tree.structure(grads)}."
        )
    return updates, new_state


def _twins(updates: Any, new_state: Any, old: list[Any]) -> _Twins:
    """Which update leaves are leaves of the new state (object identity: the only link optax leaves between an
    update and its state), where that leaf keeps the old leaf's type (so the selected leaf can stand in for it)."""
    index = {id(x): i for i, x in enumerate(jax.tree.leaves(new_state))}

    def twin(u: Any) -> int | None:
        i = index.get(id(u))
        same = i is not None and isinstance(u, jax.Array) and jax.typeof(u) == jax.typeof(old[i])
        return i if same else None

    return _Twins([twin(u) for u in jax.tree.leaves(updates)])


def _with_twins(updates: Any, twins: _Twins, rest: list[Any], kept: Any) -> Any:
    """The updates: each twin leaf the selected state leaf, the others ``rest`` (or, where ``None``, as computed)."""
    kept_leaves = jax.tree.leaves(kept)
    leaves = [
        kept_leaves[i] if i is not None else (u if r is None else r)
        for u, i, r in zip(jax.tree.leaves(updates), twins.of_update, rest, strict=True)
    ]
    return jax.tree.structure(updates).unflatten(leaves)


def _keep_dtypes(new: Any, old: Any) -> Any:
    """``new`` with ``old``'s dtypes (an inner fed f32 gradients for bf16 params must not widen its state)."""
    try:
        return jax.tree.map(lambda x, y: x.astype(y.dtype) if hasattr(x, "astype") else x, new, old)
    except (ValueError, TypeError):  # inner changed its state's structure: leave it
        return new

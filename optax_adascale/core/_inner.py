"""``inner`` on the averaged gradient, with the skip's select where each leaf of its new state is written.

A skipped update keeps ``inner``'s old state. Selecting the new or the old state *after* ``inner``
leaves its update reading the unselected new state, an expression XLA recomputes from the old
buffers, while the selected state overwrites those same buffers in place (a donated state): XLA
must then copy every old buffer first (Adam's μ and ν: two state-sized copies per step, 1.22× the
memory of MaxText's own AdamW step). Here ``inner`` is traced once to a jaxpr and evaluated with
each new state value replaced by ``where(ok, new, old)`` as soon as it is computed, so the update
reads the selected state as the inner optimizer's own update reads its new state: the state is
written in place, then read.

The numbers do not change: where ``ok`` the selected value *is* the new one, bit for bit; where the
update is skipped it is scaled to zero by a select (``_step``), which ignores what it reads.
``tests/sharding/test_skip_memory.py`` holds the compiled temporaries to ``optax.adamw``'s (an MLP:
11.0 MiB per device before, 6.0 after, optax 8.0; a scanned FSDP stack: 12.1 before, 10.1 after and optax).

Not ``lax.cond(ok, inner, keep_old)``, the simpler fix: its outputs cannot fuse into the parameter update (one
more parameter-sized buffer: 9.0 MiB against 8.0 for SGD with momentum on that MLP), its branches must agree
on explicit shardings, and under ``vmap`` (per-replica updates) a batched predicate runs both branches and
selects after them, which brings the copies back.
"""

from typing import Any

import jax
import jax.numpy as jnp
import optax

from optax_adascale import _compat
from optax_adascale.core import _checks

Array = jax.Array


def run(inner: optax.GradientTransformationExtraArgs, ok: Array, grads, inner_state, params, extra_args):
    """``inner.update`` on ``grads``; its updates, and its new state where ``ok`` else ``inner_state``.

    The updates read the selected state (the module docstring says why). The new state keeps the old
    state's dtypes (stable types: an inner fed f32 gradients for bf16 params must not widen its state).
    """
    leaves, tree = jax.tree.flatten((grads, inner_state, params))
    traced = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]  # the rest stays Python

    def flat_update(*xs):
        full = list(leaves)
        for i, x in zip(traced, xs, strict=True):
            full[i] = x
        g, s, p = tree.unflatten(full)
        return inner.update(g, s, p, **extra_args)

    try:
        closed, shapes = jax.make_jaxpr(flat_update, return_shape=True)(*(leaves[i] for i in traced))
    except (AttributeError, TypeError, ValueError, KeyError, IndexError) as err:
        _checks.explain_inner_state_mismatch(inner, inner_state, grads, err)
        raise
    if jax.tree.structure(shapes[0]) != jax.tree.structure(grads):
        raise ValueError(
            "inner must return updates with the structure of the gradients: got "
            f"{jax.tree.structure(shapes[0])} for gradients {jax.tree.structure(grads)}."
        )
    jaxpr, n = closed.jaxpr, len(jax.tree.leaves(shapes[0]))
    new_vars, old = jaxpr.outvars[n:], jax.tree.leaves(inner_state)
    own = dict(zip(jaxpr.invars, (leaves[i] for i in traced), strict=True))  # input variable -> its value
    twins = _twins(new_vars, old, own)
    written = set()

    def write(var, value):
        twin = twins.get(var)
        if twin is None or jax.typeof(value) != jax.typeof(twin):
            return value
        written.add(var)
        return jnp.where(ok, value, twin)

    out = _compat.eval_jaxpr(jaxpr, closed.consts, list(own.values()), write)
    updates = jax.tree.structure(shapes[0]).unflatten(out[:n])
    new_state = jax.tree.structure(shapes[1]).unflatten(out[n:])
    if jax.tree.structure(new_state) != jax.tree.structure(inner_state):
        return updates, optax.tree.where(ok, _keep_dtypes(new_state, inner_state), inner_state)  # raises, as before
    kept = [
        x if v in written or _passed_through(v, own, o) else jnp.where(ok, _keep_dtypes(x, o), o)
        for v, x, o in zip(new_vars, out[n:], old, strict=True)
    ]
    return updates, jax.tree.structure(inner_state).unflatten(kept)


def _twins(new_vars: list[Any], old: list[Any], own: dict[Any, Any]) -> dict[Any, Any]:
    """Each variable of the new state that stands for one leaf of the old state, and that leaf.

    Left out: literals, a variable standing for several leaves, a leaf ``inner`` passes through.
    """
    if len(new_vars) != len(old):
        return {}
    literal = _compat.literal_type()
    seen: dict[Any, list[Any]] = {}
    for v, o in zip(new_vars, old, strict=True):
        if not isinstance(v, literal):
            seen.setdefault(v, []).append(o)
    return {v: olds[0] for v, olds in seen.items() if len(olds) == 1 and not _passed_through(v, own, olds[0])}


def _passed_through(var: Any, own: dict[Any, Any], old: Any) -> bool:
    """Whether ``var`` is the input variable of ``old`` itself (``inner`` returned that leaf unchanged)."""
    return not isinstance(var, _compat.literal_type()) and own.get(var) is old


def _keep_dtypes(new: Any, old: Any) -> Any:
    """``new`` with ``old``'s dtypes (an inner fed f32 gradients for bf16 params must not widen its state)."""
    try:
        return jax.tree.map(lambda x, y: x.astype(y.dtype) if hasattr(x, "astype") else x, new, old)
    except (ValueError, TypeError):  # inner changed its state's structure: leave it
        return new

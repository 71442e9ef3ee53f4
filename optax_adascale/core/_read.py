"""Reading states: a leaf as a plain array, a depth-first search for a state type, the noise scale.

Shared by the AdaScale state's readers (``_state``) and the noise monitor's (``tools/_noise``): both find their
state through optax containers, Flax NNX states and checkpoints restored as plain dicts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def value(x: Any) -> Any:
    """A plain array from a leaf (unwraps Flax NNX variables, also restored without a target as ``{"value": x}``)."""
    if isinstance(x, Mapping) and set(x.keys()) == {"value"}:
        return value(x["value"])
    for attr in ("get_value", "value"):
        if hasattr(x, attr) and not isinstance(x, (jax.Array, np.ndarray)):
            v = getattr(x, attr)
            return value(v() if callable(v) else v)
    return jnp.asarray(x)


def search(node: Any, kind: type, from_mapping: Callable[[Mapping], Any], found: list[Any]) -> None:
    """Depth-first search for states of type ``kind`` through mappings, sequences and pytree nodes; a mapping
    that ``from_mapping`` turns into one (a checkpoint restored as dicts) counts as one."""
    if isinstance(node, kind):
        found.append(node)
        return
    if isinstance(node, Mapping):
        state = from_mapping(node)
        if state is not None:
            found.append(state)
            return
        children = list(node.values())
    elif isinstance(node, (list, tuple)):
        children = list(node)
    else:
        children = jax.tree_util.tree_flatten(node, is_leaf=lambda x: x is not node)[0]
        if len(children) == 1 and children[0] is node:
            return
    for child in children:
        search(child, kind, from_mapping, found)


def noise_ratio(var: Any, sqr: Any) -> jax.Array:
    """``σ̄²/μ̄²`` (``μ̄²`` floored at 0) as the batch ramp's controller reads it: ``+inf`` where ``μ̄² = 0 < σ̄²``
    (pure noise: any batch pays), 0 where ``σ̄² = 0``. Readers show :func:`noise_scale` instead (never ``±inf``)."""
    sqr = jnp.maximum(sqr, 0.0)
    return jnp.where(sqr > 0, var / jnp.where(sqr > 0, sqr, 1.0), jnp.where(var > 0, jnp.inf, 0.0))


def noise_scale(var: Any, sqr: Any, started: Any) -> tuple[jax.Array, jax.Array]:
    """``(σ̄²/μ̄², measured)``, never ``±inf``, so that any logger takes it.

    ``measured`` where ``started`` (an estimate was made) and ``μ̄² > 0`` (``μ̄²`` floored at 0):
    then the ratio (0 where ``σ̄² = 0``: identical samples). Not measurable yet (before the first
    estimate, or ``μ̄² = 0``: no mean gradient above the noise so far, as for pure noise): 0 and
    ``measured`` False. Non-finite statistics (a broken state): NaN.
    """
    var, sqr = jnp.asarray(var, jnp.float32), jnp.maximum(jnp.asarray(sqr, jnp.float32), 0.0)
    finite = jnp.isfinite(var) & jnp.isfinite(sqr)
    measured = jnp.asarray(started) & finite & (sqr > 0)
    ratio = jnp.where(measured, var / jnp.where(measured, sqr, 1.0), 0.0)
    return jnp.where(finite, ratio, jnp.nan), measured

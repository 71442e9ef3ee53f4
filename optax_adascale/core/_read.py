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


def noise_scale(var: Any, sqr: Any, started: Any) -> tuple[jax.Array, jax.Array]:
    """``(B, measured)``: the noise scale ``B = σ̄²/μ̄²`` (``μ̄²`` floored at 0), one convention for every reader
    (``metrics``, the ramp's ``RampInputs``, the monitor, ``goodput.Choice.noise_scale``).

    * NaN: not measured. Before the first estimate (``started`` False), while nothing was measured
      (``σ̄² = μ̄² = 0``: only ``n = 1`` updates), or statistics that are not finite (a broken state).
    * ``+inf``: pure noise, ``μ̄² = 0 < σ̄²``: no mean gradient above the noise, so every larger batch pays.
    * otherwise ``σ̄²/μ̄²`` (0 where ``σ̄² = 0 < μ̄²``: identical samples).

    ``measured`` is ``B`` not NaN (``+inf`` included).
    """
    var, sqr = jnp.asarray(var, jnp.float32), jnp.maximum(jnp.asarray(sqr, jnp.float32), 0.0)
    measured = jnp.asarray(started) & jnp.isfinite(var) & jnp.isfinite(sqr) & ((var > 0) | (sqr > 0))
    ratio = jnp.where(sqr > 0, var / jnp.where(sqr > 0, sqr, 1.0), jnp.inf)
    return jnp.where(measured, ratio, jnp.nan), measured

"""The stand-in check ZeRO and tensor parallelism share: ``inner`` run whole and in pieces on made-up values.

A sharded update hands ``inner`` pieces of each leaf (ZeRO rows, model-axis shards). Whether it computes on
a piece what it computes on the whole cannot be read from its code, so it is run: on a stand-in of the
parameters (a fixed pattern per leaf), at gradient magnitudes from ``1e-3`` to ``1e12`` (moderate ones show
masks and decay; large ones reach any realistic clip threshold).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_adascale.core import _clock

GRAD_SCALES = (1e-3, 1.0, 1e3, 1e6, 1e9, 1e12)


class _Elementwise(optax.GradientTransformationExtraArgs):
    """An ``inner`` the user declared elementwise (or shard-aware): :func:`elementwise`."""


def elementwise(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """Declare that ``inner`` computes on a shard of the parameters what it computes on the whole.

    AdaScale runs ``inner`` on shards where the parameters are split: each
    replica's ``1/n`` row with ``shard_optimizer_state=n`` (ZeRO), and the
    model-axis pieces of tensor-parallel parameters. It checks that ``inner``
    is elementwise by running it on a stand-in of the parameters, whole and in
    shards, at gradient magnitudes from ``1e-3`` to ``1e12``. An ``inner`` that
    cannot run on the stand-in (it needs extra arguments, such as
    ``optax.scale_by_polyak``'s ``value``, or particular values) cannot be
    judged and is refused; declare it with this function if it is elementwise
    (``u_i`` depends on ``g_i``, ``p_i`` and its own state only) or shard-aware
    (it reduces across leaves only through the ``base_steps.sq_norm``
    argument, as :func:`clip_by_global_norm` does). A wrong declaration gives
    wrong updates: nothing is checked.

    Args:
      inner: the transformation to declare.

    Returns:
      The same transformation (an ``optax.GradientTransformationExtraArgs``),
      marked as elementwise.

    Examples:
      >>> import jax.numpy as jnp, optax, optax_adascale
      >>> inner = optax_adascale.elementwise(optax.trace(0.9))
      >>> tx = optax_adascale.adascale(inner, 0.1, axis_name="data", shard_optimizer_state=2)
      >>> tx.init(jnp.zeros(3)).inner_state.rows.trace.shape  # two rows of two
      (2, 2)
    """
    inner = optax.with_extra_args_support(inner)
    return _Elementwise(inner.init, inner.update)


def is_declared_elementwise(inner: Any) -> bool:
    return isinstance(inner, _Elementwise)


def _pattern(shape: tuple[int, ...], dtype: Any, k: int) -> jax.Array:
    return (1.0 + (jnp.arange(math.prod(shape)) % k) / k).astype(dtype).reshape(shape)


def compare(
    inner: optax.GradientTransformationExtraArgs,
    treedef: Any,
    shapes: list[tuple[int, ...]],
    dtypes: list[Any],
    pieces: Callable[[Any, Callable[[Any], list[Any]]], Callable[[Any], tuple[list[Any], list[Any]]]],
    *,
    cannot_run: str,
    differs: str,
    context: Callable[[], Any] | None = None,
) -> None:
    """Raise ``ValueError(differs)`` unless ``inner``'s pieces equal its whole update at every magnitude.

    ``pieces(full_params, whole_of)`` returns ``run(full_grads) -> (expected, got)``: the whole update laid out
    as the pieces (from ``whole_of(full_grads)``, the whole update's leaves) and the pieces' update. An
    ``inner`` that cannot run on the stand-in raises ``ValueError(cannot_run + the error)``: it cannot be
    judged, so it is refused unless declared with :func:`optax_adascale.elementwise`.
    """
    dtypes = [jnp.promote_types(d, jnp.float32) for d in dtypes]
    import contextlib

    try:
        with jax.ensure_compile_time_eval(), (context or contextlib.nullcontext)():
            full_p = treedef.unflatten([0.5 * _pattern(s, d, 5) for s, d in zip(shapes, dtypes, strict=True)])
            base_g = treedef.unflatten([_pattern(s, d, 7) for s, d in zip(shapes, dtypes, strict=True)])
            state = inner.init(full_p)
            whole_of = lambda g: jax.tree.leaves(inner.update(g, state, full_p, **_clock.probe_args())[0])  # noqa: E731
            run = pieces(full_p, whole_of)
            results = []
            for scale in GRAD_SCALES:
                expected, got = run(jax.tree.map(lambda g, c=scale: g * jnp.asarray(c, g.dtype), base_g))
                results.append(([np.asarray(e) for e in expected], [np.asarray(g) for g in got]))
    except Exception as err:  # noqa: BLE001 - an inner we cannot run cannot be judged: refuse it
        raise ValueError(
            f"{cannot_run} ({type(err).__name__}: {err}). If inner is elementwise (each entry of the update "
            "depends on the same entry of the gradient, the parameters and its own state only) or shard-aware, "
            "declare it: optax_adascale.elementwise(inner)."
        ) from err
    for expected, got in results:
        for e, g in zip(expected, got, strict=True):
            tolerance = 1e-6 * max(1.0, float(np.max(np.abs(e), initial=0.0)))
            if not np.allclose(np.broadcast_to(e, g.shape), g, rtol=1e-4, atol=tolerance):
                raise ValueError(differs)

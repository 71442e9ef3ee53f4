"""The aliases' inner transformations, keeping their own state where AdaScale skips the update.

``adascale_sgd`` and ``adascale_adamw`` run ``optax.trace`` and ``optax.scale_by_adam`` with one change: given
the field ``taken`` of the ``base_steps`` AdaScale passes (a boolean scalar, False where the update is skipped), each
selects ``where(taken, new, old)`` for every state leaf *where it computes it*, and computes its update from the
selected leaf. A donated state is then written in place and read after, as in optax's own step: no copy of the
momentum or of Adam's μ and ν (``_inner``'s docstring says why a select after the whole of ``inner`` copies them).

The arithmetic is optax 0.2.8's, line for line, through optax's public tree functions: where the update is taken
the select returns the new value itself, so updates and state are those of ``optax.trace`` / ``optax.scale_by_adam``
bit for bit (``tests/core/test_keeps_state.py``); with ``taken`` ``None`` (``init``'s probes, the ZeRO stand-in
check) they are exactly those transformations. Where the update is skipped, the updates read the old state and are
thrown away by AdaScale's own select.
"""

from typing import Any

import jax
import jax.numpy as jnp
import optax


class KeepsStateOnSkip(optax.GradientTransformationExtraArgs):
    """An ``inner`` whose every array state leaf is selected where it is written, given ``base_steps.taken``.

    AdaScale sets ``taken`` for such an ``inner`` only (``None`` for any other), and uses its new state as the kept
    one.
    """

    __slots__ = ()


def keeps_state(inner: optax.GradientTransformation) -> KeepsStateOnSkip:
    """Mark ``inner`` (a chain of the transformations below and stateless ones) as keeping its state on a skip."""
    return KeepsStateOnSkip(*optax.with_extra_args_support(inner))


def taken_of(extra_args: dict[str, Any]) -> Any:
    """``base_steps.taken`` where AdaScale passed ``base_steps`` (``None`` where not: run by hand, as optax's)."""
    return getattr(extra_args.get("base_steps"), "taken", None)


def kept(taken: Any, new: Any, old: Any) -> Any:
    """``where(taken, new, old)`` per leaf (``None`` leaves, optax's masked updates, left alone); the identity where
    ``taken`` is ``None``."""
    if taken is None:
        return new
    return jax.tree.map(
        lambda n, o: None if n is None else jnp.where(taken, n, o.astype(n.dtype)),
        new,
        old,
        is_leaf=lambda x: x is None,
    )


def trace(decay: Any, nesterov: bool = False, accumulator_dtype: Any = None) -> optax.GradientTransformationExtraArgs:
    """``optax.trace(decay, nesterov, accumulator_dtype)``, keeping its trace on a skip."""
    base = optax.trace(decay=decay, nesterov=nesterov, accumulator_dtype=accumulator_dtype)
    accumulator_dtype = None if accumulator_dtype is None else jax.dtypes.canonicalize_dtype(accumulator_dtype)

    def update_fn(updates, state, params=None, **extra_args):
        del params
        f = lambda g, t: g + decay * t  # noqa: E731
        new_trace = jax.tree.map(
            lambda g, t: None if g is None else f(g, t), updates, state.trace, is_leaf=lambda g: g is None
        )
        new_trace = kept(taken_of(extra_args), new_trace, state.trace)
        updates = jax.tree.map(f, updates, new_trace) if nesterov else new_trace
        return updates, optax.TraceState(trace=optax.tree.cast(new_trace, accumulator_dtype))

    return optax.GradientTransformationExtraArgs(base.init, update_fn)


def scale_by_adam(
    b1: Any, b2: Any, eps: Any, eps_root: Any, mu_dtype: Any, nesterov: bool
) -> optax.GradientTransformationExtraArgs:
    """``optax.scale_by_adam`` with these arguments, keeping its moments and count on a skip."""
    base = optax.scale_by_adam(b1=b1, b2=b2, eps=eps, eps_root=eps_root, mu_dtype=mu_dtype, nesterov=nesterov)
    mu_dtype = None if mu_dtype is None else jax.dtypes.canonicalize_dtype(mu_dtype)

    def update_fn(updates, state, params=None, **extra_args):
        del params
        taken = taken_of(extra_args)
        mu = kept(taken, optax.tree.update_moment(updates, state.mu, b1, 1), state.mu)
        nu = kept(taken, optax.tree.update_moment_per_elem_norm(updates, state.nu, b2, 2), state.nu)
        count_inc = kept(taken, optax.safe_increment(state.count), state.count)
        if nesterov:
            mu_hat = jax.tree.map(
                lambda m, g: b1 * m + (1 - b1) * g,
                optax.tree.bias_correction(mu, b1, optax.safe_increment(count_inc)),
                optax.tree.bias_correction(updates, b1, count_inc),
            )
        else:
            mu_hat = optax.tree.bias_correction(mu, b1, count_inc)
        nu_hat = optax.tree.bias_correction(nu, b2, count_inc)
        updates = jax.tree.map(
            lambda m, v: None if m is None else m / (jnp.sqrt(v + eps_root) + eps),
            mu_hat,
            nu_hat,
            is_leaf=lambda x: x is None,
        )
        mu = optax.tree.cast(mu, mu_dtype)
        nu = optax.tree.cast_like(nu, state.nu)
        return updates, optax.ScaleByAdamState(count=count_inc, mu=mu, nu=nu)

    return optax.GradientTransformationExtraArgs(base.init, update_fn)

"""Every argument check, in one style: the message names the argument, its value and the fix.

Checks run at construction (the factories), at ``init`` (what ``inner`` is) and at
trace time of ``update`` (what the gradients are). Traced hyperparameters (under
``optax.inject_hyperparams``) cannot be checked and pass through.
"""

import math
import os
import sys
import sysconfig
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_adascale import _compat
from optax_adascale.core import _clock

# --------------------------------------------------------------------------- warnings


def _is_library(filename: str) -> bool:
    """Whether a frame's file is this package, a library between it and the user, or the stdlib."""
    filename = os.path.abspath(filename)
    for name in ("optax_adascale", "optax", "flax", "jax", "jaxlib"):
        module = sys.modules.get(name)
        where = getattr(module, "__file__", None)
        if where and filename.startswith(os.path.join(os.path.dirname(where), "")):
            return True
    stdlib = os.path.join(sysconfig.get_paths()["stdlib"], "")
    return filename.startswith(stdlib) and not any(d in filename for d in ("site-packages", "dist-packages"))


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` attributed to the user's line: the first frame outside this package and the
    libraries between it and the user (optax chains, Flax's ``TrainState``, JAX's transformations)."""
    frame: Any = sys._getframe(0)
    level = 1
    while frame is not None and _is_library(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


# --------------------------------------------------------------------------- numbers


def concrete_float(value: Any) -> float | None:
    """``value`` as a Python float, or ``None`` if it is traced or not a real scalar."""
    if _compat.is_tracer(value):
        return None
    try:
        arr = np.asarray(value)
    except Exception:  # noqa: BLE001 - anything non-numeric is reported by the caller
        return None
    if arr.shape != () or not (np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating)):
        return None
    return float(arr)


def check_number(
    name: str,
    value: Any,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    integer: bool = False,
) -> None:
    """Raise unless ``value`` is a finite real number in the interval (``None`` passes; traced values pass).

    Raises:
      TypeError: ``value`` is a bool, not a real scalar, or not integral where ``integer``.
      ValueError: ``value`` is non-finite or outside the interval.
    """
    if value is None or _compat.is_tracer(value):
        return
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a number, got {name}={value!r}")
    x = concrete_float(value)
    if x is None:
        raise TypeError(f"{name} must be a real number, got {name}={_describe(value)}")
    kind = "an integer" if integer else "finite"
    left = "(" if low_open or low is None else "["  # an infinite end is never included: values are finite
    right = ")" if high_open or high is None else "]"
    interval = f"{left}{'-inf' if low is None else low}, {'inf' if high is None else high}{right}"
    bad = not math.isfinite(x) or (integer and x != int(x))
    bad = bad or (low is not None and (x < low or (low_open and x == low)))
    bad = bad or (high is not None and (x > high or (high_open and x == high)))
    if bad:
        raise ValueError(f"{name} must be {kind} in {interval}, got {name}={value!r}")


def check_static_int(name: str, value: Any, *, low: int = 1, hint: str = "") -> None:
    """Raise unless ``value`` is a Python int ``>= low`` (not an array: it shapes the program)."""
    if _compat.is_tracer(value) or hasattr(value, "dtype"):
        raise TypeError(f"{name} must be a static Python int, got an array ({_describe(value)}).{hint}")
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int >= {low}, got {name}={_describe(value)}")
    if value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {name}={value!r}")


def static_int(name: str, value: Any, *, low: int = 1, hint: str = "") -> Any:
    """``value`` as a Python int ``>= low``, also from a concrete integer array; a traced value as it is.

    ``optax.inject_hyperparams`` turns every int argument of a factory into an array of its state and
    calls the factory again inside ``update`` with that array, traced under ``jax.jit``: the caller
    resolves a traced value from the state it was built for (see ``_adascale.accumulation_steps``).
    """
    if _compat.is_tracer(value):
        return value
    if hasattr(value, "dtype") and np.ndim(value) == 0 and np.issubdtype(np.asarray(value).dtype, np.integer):
        value = int(value)
    check_static_int(name, value, low=low, hint=hint)
    return value


def _describe(value: Any) -> str:
    """``repr(value)``, or for an array of more than one element its shape and dtype (never all its values)."""
    if np.ndim(value) > 0 and np.size(value) > 1:
        return f"an array of shape {tuple(np.shape(value))} and dtype {jnp.result_type(value)}"
    return repr(value)


def check_learning_rate(learning_rate: Any) -> None:
    """A constant learning rate must be finite and non-negative; a schedule is checked when it runs.

    (A schedule that ``optax.inject_hyperparams`` evaluates on its own count is refused when the state is
    read: ``_state.get_adascale_state``.)
    """
    if callable(learning_rate):
        return
    if not _compat.is_tracer(learning_rate) and np.ndim(learning_rate) > 0 and np.size(learning_rate) > 1:
        raise TypeError(
            f"learning_rate must be a number or a schedule (a function of the step), got {_describe(learning_rate)}."
            " To follow a table of values, pass a function of the step: table = jnp.asarray(values); "
            "learning_rate=lambda t: table[jnp.minimum(t, len(table) - 1)]"
        )
    if (
        concrete_float(learning_rate) is None
        and not _compat.is_tracer(learning_rate)
        and not hasattr(learning_rate, "dtype")
    ):
        raise TypeError(f"learning_rate must be a number or a schedule, got learning_rate={learning_rate!r}")
    check_number("learning_rate", learning_rate, low=0.0)
    if concrete_float(learning_rate) == 0.0:
        warn(
            "learning_rate=0: every update is zero, so the parameters never move while τ still "
            "advances. Pass the base-batch learning rate (or a schedule)."
        )


def schedule_magnitude(learning_rate: Any) -> float:
    """The largest ``|lr|`` of a schedule over base steps 0 … 10⁸ (sampled), or of a constant; 0 if unknown.

    Evaluated once at construction, on the host (``jax.ensure_compile_time_eval``):
    the scale against which a negative value counts as float rounding.
    """
    points = np.unique(np.concatenate([np.arange(64), np.geomspace(64, 1e8, 200).astype(np.int64)]))
    try:
        with jax.ensure_compile_time_eval():
            values = np.asarray(
                learning_rate(jnp.asarray(points, jnp.int32)) if callable(learning_rate) else learning_rate, np.float64
            )
    except Exception:  # noqa: BLE001 - a schedule that cannot run on the host: no rounding tolerance
        return 0.0
    values = values[np.isfinite(values)]
    return float(np.max(np.abs(values))) if values.size else 0.0


def check_choice(name: str, value: Any, choices: tuple[Any, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {name}={value!r}")


def check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {name}={value!r}")


# --------------------------------------------------------------------------- pytrees


def check_inexact(tree: Any, name: str) -> None:
    """Raise unless every leaf is floating point or complex."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        dtype = jnp.result_type(leaf)
        if not jnp.issubdtype(dtype, jnp.inexact):
            raise TypeError(
                f"AdaScale needs floating-point {name}, got dtype {dtype} at "
                f"{name}{jax.tree_util.keystr(path)}. Integer or boolean leaves cannot be "
                "scaled; keep them out of the optimized tree (e.g. optax.multi_transform "
                "with optax.set_to_zero)."
            )


def check_has_leaves(tree: Any, name: str, where: str = "AdaScale") -> None:
    """Raise if ``tree`` has no array leaves (``{}``, ``None`` leaves only, or every leaf masked off by optax)."""
    if jax.tree.leaves(tree):
        return
    shown = repr(tree) if len(repr(tree)) <= 120 else repr(tree)[:117] + "..."
    raise ValueError(
        f"{where} got {name} with no array leaves ({name}={shown}): nothing to train. With no gradient the "
        "estimator would read pure noise: gain S and τ += S per update while no parameter moves. If every "
        "parameter is frozen, leave AdaScale out of the optimizer (or give this optax.multi_transform / "
        "optax.masked label at least one trainable parameter)."
    )


def check_grads(grads: Any, params: Any) -> None:
    """Gradients are inexact and shaped like the params."""
    check_inexact(grads, "grads")
    if params is not None and jax.tree.structure(grads) != jax.tree.structure(params):
        raise ValueError(
            "grads and params must have the same tree structure, got "
            f"grads={jax.tree.structure(grads)} and params={jax.tree.structure(params)}."
        )


def check_horizon(horizon: Any) -> tuple[Any, Any] | None:
    """``horizon``: ``None``, a positive number, or a pair of them; returned as ``(H_σ², H_μ²)``."""
    if horizon is None:
        return None
    pair = horizon if isinstance(horizon, tuple | list) else (horizon, horizon)
    if len(pair) != 2 or any(h is None for h in pair):
        raise ValueError(
            f"horizon must be a positive number or a pair (H_var, H_sqr) of positive numbers, got horizon={horizon!r}"
        )
    for h in pair:
        try:
            check_number("horizon", h, low=0.0, low_open=True)
        except (TypeError, ValueError) as err:
            raise type(err)(f"{err} (horizon={horizon!r}: a positive number or a pair of them)") from None
    return tuple(pair)


_MISMATCH = (
    "opt_state does not match this transformation: it was made by another one ({what}). Make it "
    "with this transformation's init, or carry a state over to a new configuration with "
    "optax_adascale.transfer_state(old_state, new_tx.init(params))."
)


def check_opt_state(state: Any, fields: tuple[str, ...]) -> None:
    """Raise unless ``state`` is an AdaScale state (has ``fields``), e.g. not ``optax.sgd(...).init(params)``."""
    if not all(hasattr(state, f) for f in fields):
        raise ValueError(_MISMATCH.format(what=f"got a {type(state).__name__}, not an AdaScaleState"))


def explain_inner_state_mismatch(inner: Any, inner_state: Any, grads: Any, err: Exception) -> None:
    """After ``inner.update`` failed: raise our message if ``inner_state`` is not shaped like ``inner.init``'s."""
    try:
        expected = jax.eval_shape(inner.init, jax.tree.map(lambda g: jax.ShapeDtypeStruct(g.shape, g.dtype), grads))
    except Exception:  # noqa: BLE001 - cannot tell: the original error stands
        return
    if jax.tree.structure(expected) != jax.tree.structure(inner_state):
        raise ValueError(
            _MISMATCH.format(
                what=f"its inner state is {jax.tree.structure(inner_state)}, this inner's is "
                f"{jax.tree.structure(expected)}"
            )
        ) from err


# --------------------------------------------------------------------------- what inner is


def _is_multisteps_state(x: Any) -> bool:
    return isinstance(x, optax.MultiStepsState)


def _is_schedule_state(x: Any) -> bool:
    return isinstance(x, optax.ScaleByScheduleState)


def check_inner_state(inner_state: Any) -> None:
    """Reject an ``inner`` that accumulates itself (``optax.MultiSteps``): τ would advance on calls that do not step;
    or that runs a schedule on its own count (``optax.scale_by_schedule``): it would ignore τ."""
    scheduled = jax.tree.leaves(inner_state, is_leaf=_is_schedule_state)
    if any(_is_schedule_state(x) for x in scheduled):
        raise ValueError(
            "inner contains optax.scale_by_schedule (or scale_by_learning_rate with a schedule): it evaluates its "
            "schedule on inner's own update count, while AdaScale's schedule must run on the scale-invariant "
            "step τ (gain times faster). Remove it from inner and pass the schedule as AdaScale's "
            "learning_rate: adascale(inner, learning_rate=schedule)."
        )
    found = jax.tree.leaves(inner_state, is_leaf=_is_multisteps_state)
    if any(_is_multisteps_state(x) for x in found):
        raise ValueError(
            "inner contains optax.MultiSteps: every call would be an AdaScale update, so τ would "
            "advance on calls that do not move the parameters. Use adascale(..., accumulation_steps=k) "
            "instead; it also feeds every micro-batch into the variance estimate."
        )


MULTISTEPS_AROUND = (
    "optax.MultiSteps around AdaScale: MultiSteps averages k calls' gradients and passes AdaScale the last call's "
    "statistics only, so its samples, scale and gain are one call's, not the k calls'. Accumulate inside AdaScale "
    "instead: adascale_sgd(..., accumulation_steps=k) for per-replica steps, or "
    "optax_adascale.value_and_grad(loss_fn, data_axes=..., num_microbatches=k) in a jit step over the global batch."
)


def check_not_inside_multisteps() -> None:
    """Raise if ``update`` runs inside ``optax.MultiSteps.update`` (AdaScale wrapped by MultiSteps).

    Seen from the Python stack while ``update`` is traced (MultiSteps calls it inside its own ``update``;
    its state would otherwise be refused only when read, and under ``jax.vmap`` JAX fails first on
    MultiSteps' per-replica accumulator). Where optax has no ``MultiSteps.update`` this checks nothing.
    """
    code = getattr(getattr(optax.MultiSteps, "update", None), "__code__", None)
    frame: Any = sys._getframe(1)
    while code is not None and frame is not None:
        if frame.f_code is code:
            raise ValueError(MULTISTEPS_AROUND)
        frame = frame.f_back


def probe_inner(inner: optax.GradientTransformationExtraArgs, params: Any) -> None:
    """Reject an ``inner`` that carries its own (negative-signed) learning rate, e.g. ``optax.sgd(lr)``.

    AdaScale multiplies ``inner``'s output by ``−r·lr``, so ``inner`` must return a
    direction *along* the gradient (``optax.trace``, ``optax.identity``,
    ``optax.scale_by_adam``). A full optimizer returns ``−lr·direction``: the
    sign flips and training ascends. We run ``inner`` once on a stand-in with
    one element per leaf (same tree and ranks, gradient 1, parameter 0) at
    compile time; an ``inner`` that cannot run on the stand-in is not judged.
    """
    leaves, treedef = jax.tree.flatten(params)
    if not leaves:
        return
    try:
        with jax.ensure_compile_time_eval(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            stand_in = treedef.unflatten([jnp.zeros((1,) * jnp.ndim(p), jnp.result_type(p)) for p in leaves])
            grads = jax.tree.map(jnp.ones_like, stand_in)
            state = inner.init(stand_in)
            updates, _ = inner.update(grads, state, stand_in, **_clock.probe_args())
            values = np.concatenate([np.real(np.ravel(np.asarray(u))) for u in jax.tree.leaves(updates)])
    except Exception:  # noqa: BLE001 - an inner we cannot probe (shape-specific, needs extra args) is not judged
        return
    if values.size and np.all(np.isfinite(values)) and np.any(values < 0):
        raise ValueError(
            "inner returns updates pointing against the gradient (it maps a gradient of 1 to "
            f"{values.min():.3g}): it already contains a learning rate, e.g. optax.sgd(lr) or "
            "optax.adamw(lr). AdaScale applies the learning rate itself (−gain·lr(⌊τ⌋)), so the sign "
            "would flip and training would ascend. Pass a learning-rate-free direction: "
            "optax.trace(0.9) for momentum SGD, optax.identity(), or optax.scale_by_adam() for Adam (or use "
            "optax_adascale.adascale_sgd / adascale_adamw)."
        )

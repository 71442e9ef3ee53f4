"""Reading AdaScale's state: the readers a training loop calls.

Readers (:func:`get_adascale_state`, :func:`metrics`, :func:`scale_invariant_steps`,
:func:`done`, :func:`batch_plan`) accept any nested optax state, a Flax ``TrainState`` or NNX optimizer,
and checkpoints restored as plain dicts (also those written before a field was
renamed). Laying the state out over replicas is ``_placement``'s.
"""

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_adascale import _compat
from optax_adascale.core import _checks, _clock, _read
from optax_adascale.core import _estimator as _estimator
from optax_adascale.core._adascale import AdaScaleState
from optax_adascale.core._ramp import RampState
from optax_adascale.tools import _noise

# Fields renamed since 0.1.0 checkpoints: old name -> new name.
_RENAMED = {"learning_rate": "effective_lr", "group_gain": "group_gains"}
# Fields added since: a checkpoint without them restores them as zeros.
_ADDED = ("base_lr", "sqr_weight", "skip_streak", "floored_steps", "negative_lr_steps", "altered_grads_steps")
# Fields a restored or NNX-split state always has (containers that may be empty can be dropped).
_REQUIRED = ("count", "gain", "tau_whole", "tau_frac", "grad_sqr", "grad_var", "scale", "skipped_steps", "micro_step")


def is_state(x: Any) -> bool:
    return isinstance(x, AdaScaleState)


_value = _read.value


def _from_mapping(x: Mapping) -> AdaScaleState | None:
    """An AdaScaleState from a mapping of its field names (Orbax without target, NNX State), old names too."""
    keys = {_RENAMED.get(k, k) for k in x.keys()}
    if not set(_REQUIRED) <= keys:
        return None
    fields: dict[str, Any] = {_RENAMED.get(k, k): v for k, v in x.items()}
    if "base_lr" not in fields and "effective_lr" in fields and "gain" in fields:
        fields["base_lr"] = _value(fields["effective_lr"]) / jnp.maximum(_value(fields["gain"]), 1.0)
    if "sqr_weight" not in fields and "ema_weight" in fields:
        fields["sqr_weight"] = fields["ema_weight"]
    for name in _ADDED:
        fields.setdefault(name, jnp.zeros([], jnp.float32 if name == "base_lr" else jnp.int32))
    fields.setdefault("group_gains", {})
    if isinstance(fields.get("ramp"), Mapping):
        fields["ramp"] = RampState(**{f: fields["ramp"].get(f) for f in RampState._fields})
    return AdaScaleState(**{f: fields.get(f) for f in AdaScaleState._fields})  # type: ignore[arg-type]


def _search(node: Any, found: list[AdaScaleState]) -> None:
    """Depth-first search (where optax.tree.get cannot reach): checkpoints restored as dicts, NNX states."""
    _read.search(node, AdaScaleState, _from_mapping, found)


def get_adascale_state(opt_state: Any) -> AdaScaleState:
    """Find the :class:`AdaScaleState` inside any nested optax state.

    Uses ``optax.tree.get(opt_state, "AdaScaleState")`` (through
    ``optax.chain``, ``optax.inject_hyperparams``, ``optax.multi_transform``,
    Flax ``TrainState.opt_state``); where that cannot reach, a search that
    also reads checkpoints restored as plain dicts (Orbax without a target,
    including those written with the field names of 0.1.0) and Flax NNX states.

    Args:
      opt_state: an optimizer state containing exactly one AdaScale state.

    Returns:
      The AdaScale state.

    Raises:
      ValueError: if there is no AdaScale state, or more than one.

    Examples:
      >>> import jax.numpy as jnp, optax, optax_adascale
      >>> tx = optax.chain(optax_adascale.adascale_sgd(0.1), optax.scale(1.0))
      >>> optax_adascale.get_adascale_state(tx.init(jnp.zeros(2))).count
      Array(0, dtype=int32)
    """
    if is_state(opt_state):
        return opt_state
    _refuse_wrappers_around(opt_state)
    try:
        state = optax.tree.get(opt_state, "AdaScaleState", filtering=lambda _, v: is_state(v))
    except KeyError as err:
        raise ValueError(f"expected exactly one AdaScaleState in opt_state, found several ({err})") from err
    if state is not None:
        return state
    found: list[AdaScaleState] = []
    _search(opt_state, found)
    if len(found) != 1:
        raise ValueError(f"expected exactly one AdaScaleState in opt_state, found {len(found)}")
    return found[0]


def _readable(opt_state: Any) -> AdaScaleState:
    """:func:`get_adascale_state`, for the readers' eager arithmetic. Under ``jax.set_mesh`` JAX refuses an eager
    operation on an array of another mesh (a ``jax.pmap`` state under a mesh kept around the loop: "context mesh ...
    should match the aval mesh"): such scalars are read to the host first. Tracers, arrays of the context mesh and
    large buffers (which the readers do not touch) are left alone."""
    s = get_adascale_state(opt_state)
    context = jax.sharding.get_abstract_mesh()
    if context.empty:
        return s

    def read(x: Any) -> Any:
        if not isinstance(x, jax.Array) or _compat.is_tracer(x) or x.size > 4096:
            return x
        mesh = getattr(x.sharding, "mesh", None)
        if mesh is not None and getattr(mesh, "abstract_mesh", mesh) == context:
            return x
        return np.asarray(x) if x.is_fully_addressable else x

    return jax.tree.map(read, s)


def _refuse_wrappers_around(opt_state: Any) -> None:
    """Two optax wrappers change what AdaScale sees, recognisable from their states around AdaScale's:
    ``optax.MultiSteps`` (one update per k calls, on the last call's statistics) and ``optax.inject_hyperparams``
    with a learning-rate schedule (evaluated on its own count, so AdaScale gets a number, not a schedule on τ)."""

    def holds_adascale(tree: Any) -> bool:
        return any(is_state(x) for x in jax.tree.leaves(tree, is_leaf=is_state))

    wrapper = lambda x: isinstance(x, (optax.MultiStepsState, optax.InjectStatefulHyperparamsState))  # noqa: E731
    for node in jax.tree.leaves(opt_state, is_leaf=wrapper):
        inside = getattr(node, "inner_opt_state", None) if isinstance(node, optax.MultiStepsState) else None
        inside = getattr(node, "inner_state", None) if inside is None else inside
        if not wrapper(node) or not holds_adascale(inside):
            continue
        if isinstance(node, optax.MultiStepsState):
            raise ValueError(_checks.MULTISTEPS_AROUND)
        _check_structural_hyperparams(node.hyperparams, inside)
        scheduled = sorted(k for k in node.hyperparams_states if "learning_rate" in k or k in ("lr", "step_size"))
        if scheduled:
            raise ValueError(
                f"optax.inject_hyperparams around AdaScale with a schedule for {scheduled[0]!r}: inject_hyperparams "
                "evaluates it on its own iteration count and hands AdaScale a number, but AdaScale runs the "
                "schedule on the scale-invariant step τ, which advances gain times faster. Hand the schedule to "
                "AdaScale itself: optax.inject_hyperparams(factory, static_args=('learning_rate',))"
                "(learning_rate=schedule, ...) (the other hyperparameters stay injected), or call the factory "
                "without inject_hyperparams; the learning rate AdaScale applied is "
                "metrics(opt_state)['learning_rate']."
            )


def _check_structural_hyperparams(hyperparams: Mapping[str, Any], inside: Any) -> None:
    """``accumulation_steps`` under ``optax.inject_hyperparams`` is an entry of ``opt_state.hyperparams`` but shapes
    the state: with no accumulation buffers it is 1, and setting it to anything else would change nothing."""
    value = hyperparams.get("accumulation_steps")
    if value is None or _compat.is_tracer(value):
        return
    found: list[AdaScaleState] = []
    _search(inside, found)
    k = np.asarray(jax.device_get(value))
    if len(found) == 1 and found[0].acc_grads is None and k.size == 1 and int(k) != 1:
        raise ValueError(
            f"opt_state.hyperparams['accumulation_steps'] is {int(k)}, but this AdaScale state was built for "
            "accumulation_steps=1 (it has no accumulation buffers), so the value changes nothing: accumulation_steps "
            "shapes the state and is fixed when the optimizer is built. Build the optimizer with "
            "accumulation_steps=k (optax.inject_hyperparams(factory, static_args=('accumulation_steps',))) and move "
            "the state over with optax_adascale.transfer_state(opt_state, new_tx.init(params))."
        )


def scale_invariant_steps(opt_state: Any) -> jax.Array:
    """``τ``: base-batch steps done so far, as float32 (for display; ``⌊τ⌋`` is exact in ``tau_whole``).

    Examples:
      >>> import jax.numpy as jnp, optax_adascale
      >>> tx = optax_adascale.adascale_sgd(0.1, accumulation_steps=2)
      >>> state = tx.init(jnp.zeros(2))
      >>> optax_adascale.scale_invariant_steps(state)
      Array(0., dtype=float32)
    """
    s = _readable(opt_state)
    return _value(s.tau_whole).astype(jnp.float32) + _value(s.tau_frac)


def metrics(opt_state: Any) -> dict[str, Any]:
    """Plain arrays describing the last update, for logging.

    Keys: ``gain`` (``r_t``), ``scale_invariant_steps`` (``τ``), ``grad_sqr``
    (``μ̄²``), ``grad_var`` (``σ̄²``, base-batch units), ``learning_rate``
    (``r_t·lr(⌊τ_t⌋)``, the step actually taken), ``base_learning_rate``
    (``lr(⌊τ_t⌋)``, the schedule's value), ``scale`` (``S``), ``skipped_steps``
    (and why: ``skipped_nonfinite_steps`` for non-finite gradients, statistics or
    learning rates, ``skipped_negative_lr_steps`` for a negative learning rate,
    ``skipped_altered_grads_steps`` for updates whose gradients were changed between
    :func:`value_and_grad` and ``update`` (per-replica statistics; the drop-in's when
    accumulating): clipped or scaled before AdaScale, which :func:`done` refuses),
    ``floored_steps`` (applied updates whose variance estimate was zero up to
    rounding: if it grows with ``count``, the replicas see identical
    gradients — typically gradients averaged *before* ``update``; :func:`done`
    warns once it is half of 10 or more updates),
    ``noise_scale`` (``B_noise = σ̄²/μ̄²``, McCandlish et al. 2018: the critical
    batch size in base batches — well below it a larger batch buys an almost
    proportional speed-up, well above it little): NaN while not measured
    (before the first update, with ``n = 1`` sample per update, or for a state
    whose statistics are non-finite), ``+inf`` for pure noise (``μ̄² = 0 <
    σ̄²``: no mean gradient above the noise, every larger batch pays), the
    ratio otherwise; ``noise_scale_measured`` is ``noise_scale`` not NaN. The
    same reading as a ramp's ``RampInputs``, the monitor's and
    ``goodput.Choice``'s. ``estimated_gain`` is the gain the estimator gives
    from the averages at the last update's ``S`` (the gain before the τ
    clock's stability guard); ``gain_limit`` the largest gain the guard lets
    the next update apply by the curvature measured along the steps
    (``curvature``; ``+inf`` and 0 where nothing is measured or no τ-clock
    momentum guards the gain); the next gain is also at most ``1.1·max(gain,
    1)``. With ``param_labels``, ``group_gains`` (label →
    gain); with a :class:`BatchRamp`, ``microbatches`` (``k``, micro-batches
    per replica in the update in progress: the next update's),
    ``next_scale`` (its ``S``; 0 before the first call; ``scale`` stays the
    last update's) and ``microbatches_seen`` (calls so far, per replica).
    Before the first update: gain 1, τ 0, ``noise_scale`` NaN, the rest 0.

    With a :func:`noise_scale_monitor` (and no AdaScale) in the chain, its keys:
    ``noise_scale``, ``noise_scale_examples``, ``noise_scale_tokens``,
    ``grad_sqr``, ``grad_var``; with both, AdaScale's keys plus the monitor's
    ``noise_scale_examples`` and ``noise_scale_tokens``.

    Examples:
      >>> import jax.numpy as jnp, optax_adascale
      >>> tx = optax_adascale.adascale_sgd(0.1, accumulation_steps=2)
      >>> m = optax_adascale.metrics(tx.init(jnp.zeros(2)))
      >>> m["gain"], m["scale_invariant_steps"], m["grad_var"]
      (Array(1., dtype=float32), Array(0., dtype=float32), Array(0., dtype=float32))
    """
    monitor = _noise.metrics(opt_state) if _noise.has_noise_state(opt_state) else None
    try:
        s = _readable(opt_state)
    except ValueError:
        if monitor is None:
            raise
        return monitor
    total = lambda v: sum(jax.tree.leaves(jax.tree.map(_value, v)))  # noqa: E731
    out = {
        "gain": _value(s.gain),
        "scale_invariant_steps": scale_invariant_steps(s),
        "grad_sqr": jnp.maximum(total(s.grad_sqr), 0.0),
        "grad_var": total(s.grad_var),
        "learning_rate": _value(s.effective_lr),
        "base_learning_rate": _value(s.base_lr),
        "scale": _value(s.scale),
        "skipped_steps": _value(s.skipped_steps),
        "skipped_nonfinite_steps": _value(s.skipped_steps)
        - _value(s.negative_lr_steps)
        - _value(s.altered_grads_steps),
        "skipped_negative_lr_steps": _value(s.negative_lr_steps),
        "skipped_altered_grads_steps": _value(s.altered_grads_steps),
        "floored_steps": _value(s.floored_steps),
    }
    out["noise_scale"], out["noise_scale_measured"] = _noise_scale(s)
    out.update(_guard(s))
    if isinstance(s.group_gains, Mapping) and s.group_gains:
        out["group_gains"] = {k: _value(v) for k, v in s.group_gains.items()}
    if s.ramp is not None:
        plan = batch_plan(s)
        out.update({k: plan[k] for k in ("microbatches", "next_scale", "microbatches_seen")})
    if monitor is not None:
        out.update({k: v for k, v in monitor.items() if k not in out})
    return out


def _guard(s: AdaScaleState) -> dict[str, jax.Array]:
    """The gain the estimator gives (from the averages, at the last update's ``S``: the gain before the guard), and
    what the τ clock's guard holds: the largest gain the next update may apply by the measured curvature, and that
    curvature (``+inf`` and 0 where nothing is measured, or no τ-clock momentum guards the gain)."""
    var: Any = sum(jax.tree.leaves(jax.tree.map(_value, s.grad_var)))
    sqr: Any = sum(jax.tree.leaves(jax.tree.map(_value, s.grad_sqr)))
    scale = jnp.maximum(_value(s.scale), 1.0)
    estimated = jnp.where(_value(s.count) > 0, _estimator.gain_ratio(var, jnp.maximum(sqr, 0.0), scale), 1.0)
    found: list[Any] = []  # the guarded traces, also in a checkpoint restored without a target (dicts)
    _read.search(s.inner_state, _clock.TraceState, _trace_state_from_mapping, found)
    limit = jnp.min(jnp.stack([_value(x.limit) for x in found])) if found else jnp.float32(jnp.inf)
    curvature = jnp.max(jnp.stack([_value(x.curvature) for x in found])) if found else jnp.float32(0)
    return {"estimated_gain": estimated, "gain_limit": limit, "curvature": curvature}


def _trace_state_from_mapping(x: Mapping) -> Any:
    fields = _clock.TraceState._fields
    return _clock.TraceState(**{k: x[k] for k in fields}) if set(fields) <= set(x.keys()) else None


def _noise_scale(s: AdaScaleState) -> tuple[jax.Array, jax.Array]:
    """``(σ̄²/μ̄², measured)`` in base batches: see ``_read.noise_scale``."""
    var: Any = sum(jax.tree.leaves(jax.tree.map(_value, s.grad_var)))
    sqr: Any = sum(jax.tree.leaves(jax.tree.map(_value, s.grad_sqr)))
    return _read.noise_scale(var, sqr, _value(s.count) > 0)


def batch_plan(opt_state: Any) -> dict[str, jax.Array]:
    """Where the data loader stands under a :class:`BatchRamp`: the update in progress and the calls so far.

    Each call of ``update`` takes one micro-batch per replica, whatever ``k_t``,
    so a loader that hands out the micro-batches of one stream in order (the
    ``microbatches_seen``-th next) drops and repeats nothing across a change of
    ``S``, and, restored from a checkpoint of the optimizer state, resumes at
    the right one. Plain int32 arrays; reading them on the host is a sync.

    Keys: ``microbatches`` (``k_t``: calls per replica that make the update in
    progress), ``remaining`` (calls until it applies: ``k_t − micro_step``),
    ``next_scale`` (its ``S_t = k_t × samples per call``: the *next* update's,
    as ``metrics()["next_scale"]``, where ``metrics()["scale"]`` is the last
    one's; 0 before the first call, which tells how many replicas there are),
    ``microbatches_seen`` (calls so far, per replica: the loader's position).
    Deprecated: ``scale``, the same value as ``next_scale``, kept so that
    existing loops do not break (its name did not say which update it is).

    Raises:
      ValueError: the state has no ramp (``accumulation_steps`` is not a :class:`BatchRamp`).

    Examples:
      >>> import jax.numpy as jnp, optax_adascale
      >>> tx = optax_adascale.adascale_sgd(0.1, accumulation_steps=optax_adascale.BatchRamp(2, 8))
      >>> params = jnp.zeros(2)
      >>> _, state = tx.update(jnp.ones(2), tx.init(params), params)
      >>> {k: int(v) for k, v in optax_adascale.batch_plan(state).items()}
      {'microbatches': 2, 'remaining': 1, 'next_scale': 2, 'scale': 2, 'microbatches_seen': 1}
    """
    s = _readable(opt_state)
    if s.ramp is None:
        raise ValueError(
            "batch_plan reads a BatchRamp's state, and this optimizer state has none: build the optimizer with "
            "accumulation_steps=optax_adascale.BatchRamp(min_microbatches, max_microbatches)."
        )
    k = _value(s.ramp.microbatches)
    next_scale = k * _value(s.ramp.scale_per_microbatch)
    return {
        "microbatches": k,
        "remaining": k - _value(s.micro_step),
        "next_scale": next_scale,
        "scale": next_scale,  # deprecated: next_scale
        "microbatches_seen": _value(s.ramp.microbatches_seen),
    }


# done() raises once the trailing skip streak is as long as the applied updates before it, and at least this long.
EARLY_SKIP_STREAK = 5


def done(
    opt_state: Any, total_steps: float, *, max_skip_streak: int = 100, max_early_skip_streak: int = EARLY_SKIP_STREAK
) -> bool:
    """Whether training has done ``total_steps`` base-batch steps (``τ ≥ T``); raise if it is stuck.

    The loop condition for ``while not optax_adascale.done(opt_state, T): ...``.
    A run whose updates are all skipped (a schedule or model that makes every
    step non-finite) never advances ``τ``, so a bare ``while τ < T`` loop would
    never end; this raises instead once ``max_skip_streak`` consecutive updates
    were skipped, and sooner where training went non-finite early: once the
    skipped updates in a row (at least ``max_early_skip_streak``) outnumber the
    updates applied before them. A run that turns non-finite in its first
    updates (typically a learning-rate schedule written for the large batch,
    where AdaScale's is written for the base batch) does not recover, since a
    skipped update leaves the parameters where they are; the error says so. Reads a few scalars
    from the device (a host sync, like any loop condition on ``τ``). Warns (``UserWarning``) once 10 or more updates
    were applied and at least half of them had replicas that agreed exactly
    (``metrics()["floored_steps"]``): gradients averaged before ``update``, or one
    batch read by every replica, leave the gain at 1.

    Args:
      opt_state: any state containing an AdaScale state.
      total_steps: ``T``, the base-batch step budget.
      max_skip_streak: consecutive skipped updates tolerated.
      max_early_skip_streak: consecutive skipped updates always tolerated,
        however few updates were applied before them (raise it where skips at
        the start are expected, e.g. a dynamic loss scale settling).

    Returns:
      ``True`` once ``τ ≥ total_steps``.

    Raises:
      RuntimeError: the last ``max_skip_streak`` updates were all skipped, or
        the last ``max(max_early_skip_streak, applied updates)``; or an
        update was skipped because ``update`` was given gradients other than those
        :func:`value_and_grad` measured (``skipped_altered_grads_steps``: a
        transformation chained before AdaScale changed them).

    Examples:
      >>> import jax.numpy as jnp, optax_adascale
      >>> tx = optax_adascale.adascale_sgd(0.1, accumulation_steps=2)
      >>> optax_adascale.done(tx.init(jnp.zeros(2)), total_steps=100)
      False
    """
    s = _readable(opt_state)
    _raise_if_altered(s)
    streak = int(np.max(np.asarray(jax.device_get(_value(s.skip_streak)))))
    applied = int(np.max(np.asarray(jax.device_get(_value(s.count)))))
    early = streak >= max(min(max_early_skip_streak, max_skip_streak), applied)
    if streak >= max_skip_streak or early:
        raise RuntimeError(_stuck_message(s, streak, applied, early))
    _warn_if_mostly_floored(s)
    tau = np.asarray(jax.device_get(scale_invariant_steps(s)))
    _advise_once(s, float(np.min(tau)) / total_steps if total_steps > 0 else 1.0)
    return bool(np.min(tau) >= total_steps)


def _stuck_message(s: AdaScaleState, streak: int, applied: int, early: bool) -> str:
    """Why ``τ`` cannot advance, and the likeliest cause first: a schedule written for the large batch."""
    skipped = int(np.max(np.asarray(jax.device_get(_value(s.skipped_steps)))))
    negative = int(np.max(np.asarray(jax.device_get(_value(s.negative_lr_steps)))))
    scale = float(np.max(np.asarray(jax.device_get(_value(s.scale)))))
    base_lr = float(np.max(np.asarray(jax.device_get(_value(s.base_lr)))))
    where = f"after only {applied} applied update(s)" if early else f"({applied} updates applied before them)"
    if negative:
        cause = f"{negative} of them for a negative learning rate: check that the schedule returns values >= 0."
    else:
        cause = (
            "AdaScale's learning-rate schedule is written for the base batch (the lr you would use at S = 1, one "
            "gradient sample's batch); AdaScale multiplies it by the gain r ∈ [1, S] itself. A schedule written for "
            "the large batch (e.g. lr 3.2 at S = 32 for a schedule tuned at lr 0.1 on the base batch) is S times too "
            "large: divide it by S."
        )
        if applied and scale > 0:
            cause += (
                f" The last applied update ran at S = {scale:g} with lr = {base_lr:.4g} from the schedule (base batch: "
                f"{base_lr / scale:.4g} if it was written for the batch of S = {scale:g})."
            )
        cause += " Otherwise check the loss for NaN/inf, or lower the learning rate."
    return (
        f"training is stuck: the last {streak} updates were all skipped for non-finite gradients, statistics or "
        f"learning rate {where} (skipped_steps={skipped}), so τ cannot advance. {cause}"
    )


def _raise_if_altered(s: AdaScaleState) -> None:
    """Gradients changed between ``value_and_grad`` and an accumulating ``update`` (found inside jit, said here)."""
    altered = int(np.max(np.asarray(jax.device_get(_value(s.altered_grads_steps)))))
    if altered:
        raise RuntimeError(ALTERED_GRADS.format(altered=altered))


ALTERED_GRADS = (
    "{altered} update(s) were skipped because update was given other gradients than the ones "
    "optax_adascale.value_and_grad measured (their squared norm differs from microbatch_stats' by more than 1 %): "
    "a transformation chained before AdaScale changed them, e.g. optax.chain(optax.clip_by_global_norm(c), tx), "
    "or a pmean/psum of the gradients before update. AdaScale takes the squared norm of the mean gradient from the "
    "gradients it is given (per replica, data_axes=None: always; from the GSPMD drop-in: when it accumulates, with "
    "accumulation_steps > 1 or a BatchRamp) and the samples' from the statistics, so the two would describe "
    "different gradients (a clip inflates the variance and the gain with it; accumulated, the gain sticks at S, "
    "grad_sqr at 0, and τ runs ahead). Clip inside AdaScale, on the averaged gradient: "
    "optax_adascale.adascale(optax.chain(optax.clip_by_global_norm(c), inner), learning_rate, ...), e.g. "
    "inner = optax.chain(optax.scale_by_adam(), optax.add_decayed_weights(wd)) for AdamW, optax.trace(0.9) for SGD "
    "with momentum."
)


# done() warns once FLOORED_RUN or more updates were applied and at least half of them had a zero variance estimate.
FLOORED_RUN = 10


# After this many applied updates and this share of the budget T, the averages have settled enough to say what S
# buys: the noise scale grows as training goes on (the flagship's at S = 8 is 2 base batches 100 updates in, where
# r/S = 30 %, and the run's mean r/S is 60 %), so the reading waits for a quarter of the run. An efficiency r/S below
# LOW_EFFICIENCY then says the batch is well above the noise scale; a stability limit at most PINNED_LIMIT while the
# estimator asks for PINNED_ESTIMATE or more says the learning rate is at the edge of stability at the base batch.
ADVICE_AFTER, ADVICE_SHARE = 50, 0.25
LOW_EFFICIENCY = 1 / 3
PINNED_LIMIT, PINNED_ESTIMATE = 1.05, 1.5
_ADVISED: set[str] = set()  # one warning of each kind per process


def scale_advice(opt_state: Any) -> str:
    """What the measured statistics say a larger ``S`` buys: the estimated gain, its efficiency ``r/S``, the noise
    scale ``B`` in base batches, what an update would be worth at ``2S`` and ``4S`` with the same statistics (the
    paper's gain ``r = S(B + 1)/(S + B)``) and the critical batch (McCandlish et al. 2018: the ``S`` of efficiency
    1/2, ``B + 2``). The text of :func:`done`'s warning when the efficiency stays low.

    Examples:
      >>> import jax.numpy as jnp, optax_adascale
      >>> tx = optax_adascale.adascale_sgd(0.1, accumulation_steps=8)
      >>> one = jnp.float32(1.0)
      >>> state = tx.init(jnp.zeros(1))._replace(  # σ̄² = 3, μ̄² = 1: B = 3 base batches, at S = 8
      ...     count=jnp.int32(100), scale=jnp.float32(8), grad_var=jnp.float32(3), grad_sqr=one,
      ...     ema_weight=one, sqr_weight=one)
      >>> print(optax_adascale.scale_advice(state))  # r = 8·4/11; 16·4/19; 32·4/35
      at S = 8 each update is worth r = 2.91 base-batch steps (efficiency r/S = 36%): the gradient noise scale is
      B = 3 base batches, and with these statistics an update would be worth r ≈ 3.37 at S = 16 and r ≈ 3.66 at
      S = 32 (r = S(B + 1)/(S + B)). The critical batch, where r/S = 1/2, is S ≈ B + 2 = 5; S is above it: a larger
      S trades compute for fewer updates at a falling rate. optax_adascale.goodput.choose_scale(metrics, step_times)
      picks the S with the most base-batch steps per second from your measured step times.
    """
    s = _readable(opt_state)
    m = jax.device_get(metrics(s))
    scale, gain = float(np.max(m["scale"])), float(np.max(m["estimated_gain"]))
    noise = float(np.max(m["noise_scale"]))
    if not np.isfinite(noise):
        return (
            f"at S = {scale:g} each update is worth r = {gain:.2f} base-batch steps "
            f"(efficiency r/S = {gain / scale:.0%}); the gradient noise scale is not measured yet."
        )

    def worth(at: float) -> float:
        return at * (noise + 1) / (at + noise)

    critical = noise + 2
    where = (
        "S is above it: a larger S trades compute for fewer updates at a falling rate"
        if scale > critical
        else "S is below it: a larger S, up to about the critical batch, still buys most of what it costs"
    )
    return (
        f"at S = {scale:g} each update is worth r = {gain:.2f} base-batch steps (efficiency r/S = {gain / scale:.0%}): "
        f"the gradient noise scale is B = {noise:.3g} base batches, and with these statistics an update would be worth "
        f"r ≈ {worth(2 * scale):.3g} at S = {2 * scale:g} and r ≈ {worth(4 * scale):.3g} at S = {4 * scale:g} "
        f"(r = S(B + 1)/(S + B)). The critical batch, where r/S = 1/2, is S ≈ B + 2 = {critical:.3g}; {where}. "
        "optax_adascale.goodput.choose_scale(metrics, step_times) picks the S with the most base-batch steps per "
        "second from your measured step times."
    )


def _advise_once(s: AdaScaleState, progress: float) -> None:
    """Warn, once each per process, from :data:`ADVICE_AFTER` updates and :data:`ADVICE_SHARE` of the budget on
    (``progress``: τ/T): the batch is well above the noise scale (what S buys); the stability guard holds the gain
    near 1 (a learning rate at the edge of stability at the base batch: a schedule multiplied by S)."""
    if {"scale", "pinned"} <= _ADVISED:  # both said: no more reads from the device in the loop's done()
        return
    count = int(np.max(np.asarray(jax.device_get(_value(s.count)))))
    if count < ADVICE_AFTER or progress < ADVICE_SHARE:
        return
    m = jax.device_get(metrics(s))
    scale, estimated = float(np.max(m["scale"])), float(np.max(m["estimated_gain"]))
    if "scale" not in _ADVISED and scale >= 4 and estimated / scale < LOW_EFFICIENCY:
        _ADVISED.add("scale")
        _checks.warn(f"optax_adascale: after {count} updates, {scale_advice(s)}")
    if "pinned" not in _ADVISED and float(np.min(m["gain_limit"])) <= PINNED_LIMIT and estimated >= PINNED_ESTIMATE:
        _ADVISED.add("pinned")
        _checks.warn(
            f"optax_adascale: after {count} updates the stability guard holds the gain at "
            f"{float(np.min(m['gain'])):.2f} where the estimator asks for {estimated:.2f}: the learning rate "
            f"({float(np.max(m['base_learning_rate'])):.4g}) is at the edge of stability at the base batch already "
            "(the curvature measured along the steps times it is near 2). AdaScale's schedule is the base batch's (the "
            "lr you would use at S = 1) and it multiplies it by the gain itself: a schedule multiplied by S 'for the "
            "big batch' is S times too large: divide it by S."
        )


def _warn_if_mostly_floored(s: AdaScaleState) -> None:
    """The signature of gradients averaged before ``update`` (or of every replica reading the same batch): the
    replicas' samples agree exactly, so the variance estimate sits at its floor and the gain at 1. Nothing inside
    jit can warn; ``done`` reads the state on the host anyway."""
    count = int(np.max(np.asarray(jax.device_get(_value(s.count)))))
    floored = int(np.max(np.asarray(jax.device_get(_value(s.floored_steps)))))
    if count >= FLOORED_RUN and 2 * floored >= count:
        _checks.warn(
            "AdaScale's replicas agreed exactly (a zero variance estimate) in at least half of the updates so far "
            "(metrics(opt_state)['floored_steps'] against the update count), so the gain stays at 1: AdaScale sees "
            "one gradient, not one per replica. Usual causes: the gradients were averaged before update (a "
            "jax.lax.pmean/psum over the data axis, e.g. Flax's imagenet example): pass each replica's own gradient, "
            "AdaScale reduces it itself; or every replica read the same batch: shard the batch over the data axis."
        )

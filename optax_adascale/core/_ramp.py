r"""The batch follows the noise: a controller that picks the micro-batches per update from AdaScale's statistics.

The mechanism is across-call accumulation with a *traced* count: each call feeds one fixed-size micro-batch per
replica, the update applies when ``k_t`` of them are in, and ``k_t`` is a value in the optimizer state, so one
compiled step serves every rung. After each applied update the controller, a pure function of the state and the
statistics, chooses ``k_{t+1}`` (no host callback, no Python state; it checkpoints with the state).

The default (measured) policy reads the gradient noise scale ``B = σ̄²/μ̄²`` (base batches; McCandlish et al. 2018)
and takes the largest scale whose predicted statistical efficiency stays at or above ``e``: a step at scale ``S``
is worth ``r(S) = S(B + 1)/(B + S)`` base steps, so its efficiency is ``r/S = (B + 1)/(B + S)`` and

.. math::

   S^* = \frac{B + 1}{e} - B = B\,\frac{1 - e}{e} + \frac{1}{e}.

``e = ½`` is the critical batch (``S* = B + 2``: steps and examples both twice their minimum).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from optax_adascale import _compat
from optax_adascale.core import _checks

Array = jax.Array


class RampState(NamedTuple):
    """The batch ramp's state (:attr:`AdaScaleState.ramp`), replicated scalars that checkpoint with the state.

    Attributes:
      microbatches: int32 ``[]``, ``k_t``: micro-batches (calls) per replica in the update in progress.
      streak: int32 ``[]``, the gradient samples of the consecutive applied updates whose target asked to move
        the same way (``+``: up, ``−``: down); ``k`` moves when ``|streak|`` reaches ``patience``.
      microbatches_seen: int32 ``[]``, calls so far (per replica): where the data loader stands.
      scale_per_microbatch: int32 ``[]``, samples one call adds to an update (replicas × micro-batches the call's
        statistics hold), so ``S_t = k_t ×`` this; 0 until the first call.
    """

    microbatches: Array
    streak: Array
    microbatches_seen: Array
    scale_per_microbatch: Array


class RampInputs(NamedTuple):
    """What a ramp's ``policy`` sees after each applied update (all scalars, traced).

    Attributes:
      tau: float32, ``τ`` after the update (base-batch steps).
      updates: int32, updates applied.
      noise_scale: float32, ``B = σ̄²/μ̄²`` in base batches: ``+inf`` for pure noise (``μ̄² = 0 < σ̄²``), NaN while
        not measured (after a skipped first update); as ``metrics()["noise_scale"]`` reads it.
      gain: float32, the gain of the update.
      microbatches: int32, ``k`` of the update just applied.
      scale_per_microbatch: int32, ``S/k``: samples (base batches) one micro-batch step adds.
      microbatches_seen: int32, calls so far, per replica (examples fed = this × the global micro-batch).
    """

    tau: Array
    updates: Array
    noise_scale: Array
    gain: Array
    microbatches: Array
    scale_per_microbatch: Array
    microbatches_seen: Array


def _powers_of_two(low: int, high: int) -> tuple[int, ...]:
    inner = [2**j for j in range(int(np.log2(high)) + 2) if low < 2**j < high]
    return tuple(sorted({low, *inner, high}))


@dataclasses.dataclass(frozen=True)
class BatchRamp:
    r"""A batch that grows with the gradient noise: pass as ``accumulation_steps=BatchRamp(...)``.

    The per-replica micro-batch stays fixed; the number of micro-batches per update, ``k_t``, moves on a ladder
    between ``min_microbatches`` and ``max_microbatches``. ``k_t`` is a traced value in the optimizer state, so
    one compiled step serves the whole ramp; the loop feeds one micro-batch per call (:func:`batch_plan` says
    where it stands). The update's scale is ``S_t = n_t`` (replicas × ``k_t`` × micro-batches per call): the gain
    stays in ``[1, S_t]`` and ``τ`` keeps the schedule's clock, so the schedule needs no retuning.

    After each applied update the controller moves ``k``:

    * target ``k* = S*/u`` (``u`` the samples per micro-batch step), where by default (measured)
      ``S* = (B + 1)/e − B`` for the noise scale ``B = σ̄²/μ̄²``: the largest scale at which a step is worth at
      least ``e = efficiency`` of ``S`` base steps (``r/S = (B + 1)/(B + S)``); or ``policy(inputs)``;
    * up to the largest rung ``≤ k*`` when that is above ``k``; down (to the largest rung ``≤ k*·h``) only once
      ``k* < k/h``, ``h = hysteresis``: between the two nothing moves, so it never oscillates between
      neighbouring rungs;
    * only once consecutive updates holding ``patience`` gradient samples in all have asked to move the same
      way. The evidence is counted in samples because an update of ``n`` samples measures the noise ``n``
      times better: at ``n = 2`` (early in a run) the default 64 takes 32 updates, which a spike of the noise
      scale (its estimate is heavy-tailed where ``μ̄²`` is small) does not outlast; at ``n = 64``, one update.

    Args:
      min_microbatches: ``k`` at the start, the lowest rung (``≥ 1``; the update's ``n = k × replicas ×
        micro-batches per call`` must be ``≥ 2`` to estimate a variance).
      max_microbatches: the highest rung.
      ladder: the allowed ``k``, increasing, from ``min_microbatches`` to ``max_microbatches``; default the
        powers of two in between.
      efficiency: ``e ∈ (0, 1)``, the measured policy's target ``r/S``: a higher ``e`` spends fewer examples per
        unit of ``τ`` (at most ``1/e`` times a step at ``S = 1``'s), a lower one takes fewer updates. ``½`` is the
        critical batch (``S* = B + 2``). The default ``0.6`` was the study's best of 0.5, 0.6, 0.7 and 0.9
        (``benchmarks/ramp``): on a byte-level LM with AdamW it reached the fixed smallest batch's final loss in
        50 % fewer updates with 3 % more examples (3 seeds).
      hysteresis: ``h ≥ 1``, the dead band of the target between going up and coming back down.
      patience: gradient samples (``≥ 1``) that consecutive updates must hold, all asking for the same move,
        before it is made.
      policy: ``None`` (measured, above) or a pure function ``RampInputs -> target k`` (a traced float), e.g. a
        fixed ramp over the examples seen (MaxText's rule) through the same mechanism.

    Raises:
      ValueError: a rung below 1, ``min > max``, a ladder that is not increasing or does not span the range,
        ``efficiency`` outside ``(0, 1)``, ``hysteresis < 1``, ``patience < 1``.

    Examples:
      >>> import jax, jax.numpy as jnp, optax_adascale
      >>> ramp = optax_adascale.BatchRamp(min_microbatches=2, max_microbatches=16)
      >>> ramp.ladder
      (2, 4, 8, 16)
      >>> tx = optax_adascale.adascale_sgd(0.1, accumulation_steps=ramp)
      >>> params = jnp.zeros(2)
      >>> state = tx.init(params)
      >>> int(optax_adascale.batch_plan(state)["microbatches"])
      2
      >>> step = jax.jit(tx.update)
      >>> for g in (jnp.array([1.0, 0.0]), jnp.array([0.0, 1.0])):
      ...     updates, state = step(g, state, params)
      >>> updates, optax_adascale.metrics(state)["gain"]  # orthogonal samples: all noise, gain S = 2
      (Array([-0.1, -0.1], dtype=float32), Array(2., dtype=float32))

    References:
      McCandlish, Kaplan, Amodei, `An Empirical Model of Large-Batch Training
      <https://arxiv.org/abs/1812.06162>`_, 2018; Johnson et al., `AdaScale SGD
      <https://arxiv.org/abs/2007.05105>`_, ICML 2020.
    """

    min_microbatches: int
    max_microbatches: int
    ladder: tuple[int, ...] | None = None
    efficiency: float = 0.6
    hysteresis: float = 2.0
    patience: int = 64
    policy: Callable[[RampInputs], Any] | None = None

    def __post_init__(self) -> None:
        _checks.check_static_int("min_microbatches", self.min_microbatches)
        _checks.check_static_int("max_microbatches", self.max_microbatches)
        if self.min_microbatches > self.max_microbatches:
            raise ValueError(
                f"BatchRamp needs min_microbatches <= max_microbatches, got min_microbatches={self.min_microbatches}"
                f", max_microbatches={self.max_microbatches}"
            )
        ladder = self.ladder
        if ladder is None:
            ladder = _powers_of_two(self.min_microbatches, self.max_microbatches)
        ladder = tuple(ladder)
        for rung in ladder:
            _checks.check_static_int("ladder", rung)
        if any(b <= a for a, b in zip(ladder, ladder[1:], strict=False)) or (
            ladder[:1] != (self.min_microbatches,) or ladder[-1:] != (self.max_microbatches,)
        ):
            raise ValueError(
                "BatchRamp's ladder must increase from min_microbatches to max_microbatches, got "
                f"ladder={self.ladder!r} with min_microbatches={self.min_microbatches}, "
                f"max_microbatches={self.max_microbatches}"
            )
        object.__setattr__(self, "ladder", ladder)
        _checks.check_number("efficiency", self.efficiency, low=0.0, high=1.0, low_open=True, high_open=True)
        _checks.check_number("hysteresis", self.hysteresis, low=1.0)
        _checks.check_static_int("patience", self.patience)
        if self.policy is not None and not callable(self.policy):
            raise TypeError(f"policy must be a function RampInputs -> micro-batches, got policy={self.policy!r}")

    def target(self, inputs: RampInputs) -> Array:
        """``k*``, the wanted micro-batches per update (float32, before the ladder and the hysteresis)."""
        if self.policy is not None:
            return jnp.asarray(self.policy(inputs), jnp.float32)
        e = jnp.float32(self.efficiency)
        scale = inputs.noise_scale * ((1 - e) / e) + 1 / e
        return scale / jnp.maximum(inputs.scale_per_microbatch, 1).astype(jnp.float32)


def init_state(ramp: BatchRamp) -> RampState:
    """The ramp's state before the first call: ``k = min_microbatches``. Its ``k`` array is remembered as this
    ramp's (weakly: :func:`fresh_ramp`), so that ``transfer_state`` into it can say when a ``k`` leaves its ladder."""
    k = jnp.asarray(ramp.min_microbatches, jnp.int32)
    if not _compat.is_tracer(k):  # tx.init under jit returns other arrays: nothing to remember
        key = id(k)
        _FRESH[key] = (weakref.ref(k, lambda _: _FRESH.pop(key, None)), ramp)
    return RampState(
        microbatches=k,
        streak=jnp.zeros([], jnp.int32),
        microbatches_seen=jnp.zeros([], jnp.int32),
        scale_per_microbatch=jnp.zeros([], jnp.int32),
    )


# The k arrays of fresh ramp states made by init (not under jit), weakly: id -> (reference, the ramp).
_FRESH: dict[int, tuple[Any, BatchRamp]] = {}


def fresh_ramp(state: RampState) -> BatchRamp | None:
    """The ramp whose ``init`` made ``state`` (a fresh state, as ``transfer_state``'s target), if known."""
    entry = _FRESH.get(id(state.microbatches))
    return entry[1] if entry is not None and entry[0]() is state.microbatches else None


def warn_if_off_ladder(
    ramp: BatchRamp, k: Any, micro_step: Any, how: str, seen: set[int] | None = None, moved: bool = False
) -> int | None:
    """On the host, where ``k`` is concrete (never inside jit): one warning when a ``k`` from another ramp's state
    (a checkpoint, ``transfer_state``) is not a rung of this ramp's ladder, naming the old ``k``, the new one and
    the ladder; the new ``k`` (or ``None``: on the ladder, or not concrete). At an update boundary (``micro_step``
    0) the next update moves it onto the ladder; a window in progress finishes first. ``seen``: the old ``k``
    already warned about (one warning per transformation); ``moved``: the caller moves it now (``transfer_state``).
    """
    if _compat.is_tracer(k) or _compat.is_tracer(micro_step):
        return None
    ladder: tuple[int, ...] = tuple(ramp.ladder or ())  # set in __post_init__
    ks = np.unique(np.asarray(jax.device_get(k)))  # a pmap-stacked state holds one k per device, all equal
    if ks.size != 1 or int(ks[0]) in ladder:
        return None
    old = int(ks[0])
    new = max([rung for rung in ladder if rung <= old], default=ladder[0])
    if seen is not None:  # each call of a window in progress holds the same old k
        if old in seen:
            return new
        seen.add(old)
    if moved:
        when = "here"
    elif np.any(np.asarray(jax.device_get(micro_step))):
        when = f"once the window in progress (fed for k = {old}) ends"
    else:
        when = "at this update"
    _checks.warn(
        f"{how} holds a BatchRamp state at k = {old} micro-batches, which is not a rung of this ramp's ladder "
        f"{ladder}: k moves from {old} to {new} {when} (the largest rung at or below it; the lowest if it is "
        f"below them all). To keep the batch at k = {old}, build the optimizer with a ramp whose ladder holds {old}."
    )
    return new


def check_samples(ramp: BatchRamp, per_microbatch: int, forgot_stats_on: dict[str, int] | None = None) -> None:
    """Raise where the ramp's lowest rung gives ``n = 1`` sample per update (no variance to estimate).

    ``forgot_stats_on``: the mesh axes a jit step with no ``microbatch_stats`` and no ``axis_name`` is partitioned
    over: the statistics it forgot come first in the message."""
    if ramp.min_microbatches * per_microbatch >= 2:
        return
    n = ramp.min_microbatches * per_microbatch
    if forgot_stats_on:
        devices = int(np.prod(list(forgot_stats_on.values())))
        data = next(iter(forgot_stats_on))
        raise ValueError(
            f"update got no microbatch_stats, but this step is partitioned over {devices} devices (mesh axes "
            f"{forgot_stats_on}): pass the statistics of the drop-in, loss, grads, stats = "
            f"optax_adascale.value_and_grad(loss_fn, data_axes={data!r})(params, *batch); tx.update(grads, "
            "opt_state, params, microbatch_stats=stats). Each data shard's gradient is then a sample, and "
            f"BatchRamp(min_microbatches={ramp.min_microbatches}) has one per data shard and call. Without them "
            f"AdaScale sees one sample per call (the global batch's): n = {n} at the lowest rung, from which no "
            "variance can be estimated (a higher min_microbatches would run at S = k, not one sample per shard)."
        )
    raise ValueError(
        f"BatchRamp(min_microbatches={ramp.min_microbatches}) gives n = {n}"
        " gradient sample per update at its lowest rung, and AdaScale cannot estimate the gradient variance "
        "from one sample. Set min_microbatches >= 2, or average several samples per call: replicas on "
        "axis_name, or microbatch_stats from value_and_grad(..., num_microbatches=2)."
    )


def check_rows(seen: set[tuple[int, ...]], rows: tuple[int, ...] | None) -> None:
    """Warn (when ``update`` is traced) where a ramp's call brings a micro-batch of another size than before: the
    ramp's micro-batch is fixed, and a loader that feeds the whole update's ``k_t`` micro-batches every call
    recompiles at every rung, reads ``k_t`` times the data, and counts each call as one micro-batch. ``seen``: the
    sizes this transformation was traced with (a diagnostic only; the controller reads nothing from it)."""
    if rows is None:
        return
    if seen and rows not in seen:
        _checks.warn(
            f"update under a BatchRamp got a batch whose arrays have {list(rows)} rows, after "
            f"{list(sorted(seen)[0])}: the ramp's micro-batch is fixed and each call is one micro-batch (the "
            "update takes k_t calls), so a batch that changes size recompiles the step, and one that holds the "
            "whole update (k_t micro-batches at once) also reads k_t times the data. Feed one micro-batch per "
            "call, the one at position optax_adascale.batch_plan(opt_state)['microbatches_seen'] of your "
            "stream (not the update count)."
        )
    seen.add(rows)


def _rung_at_most(ladder: Array, x: Array) -> Array:
    """The largest rung ``≤ x`` (the lowest rung if none)."""
    below = jnp.sum((ladder.astype(jnp.float32) <= x).astype(jnp.int32))
    return ladder[jnp.maximum(below - 1, 0)]


def on_ladder(ramp: BatchRamp, k: Array) -> Array:
    """``k`` moved onto this ramp's ladder: the largest rung ``≤ k`` (the lowest rung below it). The identity for a
    ``k`` this ramp chose; it moves a ``k`` restored from another ramp's state (a checkpoint, ``transfer_state``)."""
    return _rung_at_most(jnp.asarray(ramp.ladder, jnp.int32), jnp.asarray(k).astype(jnp.float32)).astype(jnp.int32)


def after_update(ramp: BatchRamp, state: RampState, inputs: RampInputs, applied: Array) -> RampState:
    """The controller: ``k`` for the next update, from the statistics after an applied update (replicated)."""
    ladder = jnp.asarray(ramp.ladder, jnp.int32)
    k = on_ladder(ramp, state.microbatches)  # an update at a k from another ladder (restored) lands on this one
    wanted = ramp.target(inputs)
    up = _rung_at_most(ladder, wanted)
    h = jnp.float32(ramp.hysteresis)
    down = _rung_at_most(ladder, wanted * h)
    valid = ~jnp.isnan(wanted)  # +inf (pure noise) asks for the top rung; NaN asks for nothing
    wants_up = valid & (up > k)
    wants_down = valid & ~wants_up & (wanted * h < k.astype(jnp.float32))
    direction = jnp.where(wants_up, 1, jnp.where(wants_down, -1, 0)).astype(jnp.int32)
    samples = inputs.microbatches * inputs.scale_per_microbatch  # n of the update just applied
    same_way = jnp.sign(state.streak) == direction
    streak = jnp.where(direction == 0, 0, jnp.where(same_way, state.streak, 0) + direction * samples)
    move = applied & (jnp.abs(streak) >= ramp.patience)
    if ramp.policy is None:  # the measured target: one rung a move (a noisy estimate never jumps the ladder)
        at = jnp.argmax(ladder == k)
        up = ladder[jnp.minimum(at + 1, ladder.shape[0] - 1)]
        down = ladder[jnp.maximum(at - 1, 0)]
    return state._replace(
        microbatches=jnp.where(move, jnp.where(wants_up, up, down), k).astype(jnp.int32),
        streak=jnp.where(applied & ~move, streak, jnp.where(move, 0, state.streak)).astype(jnp.int32),
    )

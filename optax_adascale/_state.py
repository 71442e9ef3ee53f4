"""Reading AdaScale's state, and laying it out over replicas: the helpers a training loop calls.

Readers (:func:`get_adascale_state`, :func:`metrics`, :func:`scale_invariant_steps`,
:func:`done`) accept any nested optax state, a Flax ``TrainState`` or NNX optimizer,
and checkpoints restored as plain dicts (also those written before a field was
renamed). Layout helpers (:func:`state_axes`, :func:`state_partition_specs`,
:func:`replicate_buffers`) give the per-replica accumulation buffers and the
ZeRO rows their place; :func:`transfer_state` moves statistics into a new
configuration.
"""

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_adascale.core import _read
from optax_adascale.core._adascale import AdaScaleState
from optax_adascale.sharding import _zero
from optax_adascale.tools import _noise

_PER_REPLICA_FIELDS = ("acc_grads", "acc_sq_norm")

# Fields renamed since 0.1.0 checkpoints: old name -> new name.
_RENAMED = {"learning_rate": "effective_lr", "group_gain": "group_gains"}
# Fields added since: a checkpoint without them restores them as zeros.
_ADDED = ("base_lr", "sqr_weight", "skip_streak", "floored_steps", "negative_lr_steps")
# Fields a restored or NNX-split state always has (containers that may be empty can be dropped).
_REQUIRED = ("count", "gain", "tau_whole", "tau_frac", "grad_sqr", "grad_var", "scale", "skipped_steps", "micro_step")


def _is_state(x: Any) -> bool:
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
    if _is_state(opt_state):
        return opt_state
    _refuse_wrappers_around(opt_state)
    try:
        state = optax.tree.get(opt_state, "AdaScaleState", filtering=lambda _, v: _is_state(v))
    except KeyError as err:
        raise ValueError(f"expected exactly one AdaScaleState in opt_state, found several ({err})") from err
    if state is not None:
        return state
    found: list[AdaScaleState] = []
    _search(opt_state, found)
    if len(found) != 1:
        raise ValueError(f"expected exactly one AdaScaleState in opt_state, found {len(found)}")
    return found[0]


def _refuse_wrappers_around(opt_state: Any) -> None:
    """Two optax wrappers change what AdaScale sees, recognisable from their states around AdaScale's:
    ``optax.MultiSteps`` (one update per k calls, on the last call's statistics) and ``optax.inject_hyperparams``
    with a learning-rate schedule (evaluated on its own count, so AdaScale gets a number, not a schedule on τ)."""

    def holds_adascale(tree: Any) -> bool:
        return any(_is_state(x) for x in jax.tree.leaves(tree, is_leaf=_is_state))

    wrapper = lambda x: isinstance(x, (optax.MultiStepsState, optax.InjectStatefulHyperparamsState))  # noqa: E731
    for node in jax.tree.leaves(opt_state, is_leaf=wrapper):
        inside = getattr(node, "inner_opt_state", None) if isinstance(node, optax.MultiStepsState) else None
        inside = getattr(node, "inner_state", None) if inside is None else inside
        if not wrapper(node) or not holds_adascale(inside):
            continue
        if isinstance(node, optax.MultiStepsState):
            raise ValueError(
                "optax.MultiSteps around AdaScale: MultiSteps averages k calls' gradients and passes AdaScale the "
                "last call's statistics only, so its samples, scale and gain are one call's, not the k calls'. "
                "Accumulate inside AdaScale instead: adascale_sgd(..., accumulation_steps=k) for per-replica "
                "steps, or optax_adascale.value_and_grad(loss_fn, data_axes=..., num_microbatches=k) in a jit "
                "step over the global batch."
            )
        scheduled = sorted(k for k in node.hyperparams_states if "learning_rate" in k or k in ("lr", "step_size"))
        if scheduled:
            raise ValueError(
                f"optax.inject_hyperparams around AdaScale with a schedule for {scheduled[0]!r}: inject_hyperparams "
                "evaluates it on its own iteration count and hands AdaScale a number, but AdaScale runs the "
                "schedule on the scale-invariant step τ, which advances gain times faster. Hand the schedule to "
                "AdaScale itself: optax.inject_hyperparams(factory, static_args=('learning_rate',))"
                "(learning_rate=schedule, ...), or call the factory without inject_hyperparams; the learning rate "
                "AdaScale applied is metrics(opt_state)['learning_rate']."
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
    s = get_adascale_state(opt_state)
    return _value(s.tau_whole).astype(jnp.float32) + _value(s.tau_frac)


def metrics(opt_state: Any) -> dict[str, Any]:
    """Plain arrays describing the last update, for logging.

    Keys: ``gain`` (``r_t``), ``scale_invariant_steps`` (``τ``), ``grad_sqr``
    (``μ̄²``), ``grad_var`` (``σ̄²``, base-batch units), ``learning_rate``
    (``r_t·lr(⌊τ_t⌋)``, the step actually taken), ``base_learning_rate``
    (``lr(⌊τ_t⌋)``, the schedule's value), ``scale`` (``S``), ``skipped_steps``
    (and why: ``skipped_nonfinite_steps`` for non-finite gradients, statistics or
    learning rates, ``skipped_negative_lr_steps`` for a negative learning rate),
    ``floored_steps`` (applied updates whose variance estimate was zero up to
    rounding: if it grows with ``count``, the replicas see identical
    gradients — typically gradients averaged *before* ``update``),
    ``noise_scale`` (``B_noise = σ̄²/μ̄²``, McCandlish et al. 2018: the critical
    batch size in base batches — well below it a larger batch buys an almost
    proportional speed-up, well above it little; ``+inf`` for pure noise, 0
    before the first update); with
    ``param_labels``, ``group_gains`` (label → gain). Before the first update:
    gain 1, τ 0, the rest 0.

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
        s = get_adascale_state(opt_state)
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
        "skipped_nonfinite_steps": _value(s.skipped_steps) - _value(s.negative_lr_steps),
        "skipped_negative_lr_steps": _value(s.negative_lr_steps),
        "floored_steps": _value(s.floored_steps),
        "noise_scale": _noise_scale(s),
    }
    if isinstance(s.group_gains, Mapping) and s.group_gains:
        out["group_gains"] = {k: _value(v) for k, v in s.group_gains.items()}
    if monitor is not None:
        out.update({k: v for k, v in monitor.items() if k not in out})
    return out


def _noise_scale(s: AdaScaleState) -> jax.Array:
    """``σ̄²/μ̄²`` in base batches; ``+inf`` where ``μ̄² = 0 < σ̄²``, 0 before the first update."""
    var: Any = sum(jax.tree.leaves(jax.tree.map(_value, s.grad_var)))
    sqr: Any = sum(jax.tree.leaves(jax.tree.map(_value, s.grad_sqr)))
    var, sqr = jnp.asarray(var, jnp.float32), jnp.asarray(sqr, jnp.float32)
    ratio = _read.noise_ratio(var, sqr)
    return jnp.where(jnp.isfinite(var) & jnp.isfinite(sqr), ratio, jnp.nan)


def done(opt_state: Any, total_steps: float, *, max_skip_streak: int = 100) -> bool:
    """Whether training has done ``total_steps`` base-batch steps (``τ ≥ T``); raise if it is stuck.

    The loop condition for ``while not optax_adascale.done(opt_state, T): ...``.
    A run whose updates are all skipped (a schedule or model that makes every
    step non-finite) never advances ``τ``, so a bare ``while τ < T`` loop would
    never end; this raises instead once ``max_skip_streak`` consecutive updates
    were skipped. Reads two scalars from the device (a host sync, like any
    loop condition on ``τ``).

    Args:
      opt_state: any state containing an AdaScale state.
      total_steps: ``T``, the base-batch step budget.
      max_skip_streak: consecutive skipped updates tolerated.

    Returns:
      ``True`` once ``τ ≥ total_steps``.

    Raises:
      RuntimeError: the last ``max_skip_streak`` updates were all skipped.

    Examples:
      >>> import jax.numpy as jnp, optax_adascale
      >>> tx = optax_adascale.adascale_sgd(0.1, accumulation_steps=2)
      >>> optax_adascale.done(tx.init(jnp.zeros(2)), total_steps=100)
      False
    """
    s = get_adascale_state(opt_state)
    streak = int(np.max(np.asarray(jax.device_get(_value(s.skip_streak)))))
    if streak >= max_skip_streak:
        raise RuntimeError(
            f"training is stuck: the last {streak} updates were all skipped for non-finite gradients, "
            f"statistics or learning rate (skipped_steps={int(np.max(np.asarray(_value(s.skipped_steps))))}), "
            "so τ cannot advance. Check the loss for NaN/inf, lower the learning rate, or check that the "
            "schedule returns finite, non-negative values."
        )
    tau = np.asarray(jax.device_get(scale_invariant_steps(s)))
    return bool(np.min(tau) >= total_steps)


# --------------------------------------------------------------------------- layout


def _map_states(opt_state: Any, fn: Callable[[AdaScaleState], AdaScaleState], other: Callable[[Any], Any]) -> Any:
    return jax.tree.map(lambda x: fn(x) if _is_state(x) else other(x), opt_state, is_leaf=_is_state)


def state_axes(opt_state: Any) -> Any:
    """``in_axes``/``out_axes`` for the optimizer state under ``jax.vmap`` or ``jax.pmap``.

    ``0`` on the per-replica accumulation buffers and on ZeRO's inner-state
    rows, ``None`` (replicated) everywhere else. Together with
    :func:`replicate_buffers` it makes across-call accumulation over a vmap or
    pmap axis a one-liner::

        opt_state = optax_adascale.replicate_buffers(tx.init(params), n)
        axes = optax_adascale.state_axes(opt_state)
        step = jax.vmap(train_step, in_axes=(None, axes, 0), out_axes=(None, axes), axis_name="i")

    (Stacking the whole state, e.g. ``flax.jax_utils.replicate``, works too.)
    """

    def per_state(s: AdaScaleState) -> AdaScaleState:
        fields: dict[str, Any] = dict.fromkeys(AdaScaleState._fields)
        for f in _PER_REPLICA_FIELDS:
            fields[f] = jax.tree.map(lambda _: 0, getattr(s, f))
        fields["inner_state"] = _zero.row_axes(s.inner_state)
        return AdaScaleState(**fields)

    return _map_states(opt_state, per_state, lambda _: None)


def state_partition_specs(
    opt_state: Any, axis_name: str | tuple[str, ...], param_specs: Any = None, *, tx: Any = None
) -> Any:
    """``in_specs``/``out_specs`` for the optimizer state under ``jax.shard_map``.

    * scalars: ``P()`` (replicated);
    * per-replica accumulation buffers (global shape ``(replicas, *shape)`` from
      :func:`replicate_buffers`): ``P(axis_name)``, or with ``param_specs``
      ``P(axis_name, *param_spec)`` so that each replica's buffer is also
      split like its parameter; ``acc_sq_norm`` is then ``P(axis_name, model_axes)``;
    * ZeRO's inner-state rows (``shard_optimizer_state=n``): ``P(axis_name)``;
    * inner-state buffers shaped like the params (momentum): the parameter's
      spec, given ``param_specs`` and ``tx`` (through ``optax.tree_map_params``);
      else ``P()``.

    Args:
      opt_state: the state (or its ``jax.eval_shape``).
      axis_name: the data axes.
      param_specs: the params' ``PartitionSpec``\\ s, for tensor-parallel params.
      tx: the optimizer, needed with ``param_specs`` to find which inner-state
        leaves are shaped like the params.

    Returns:
      A pytree of ``PartitionSpec`` shaped like ``opt_state``.
    """
    P = jax.sharding.PartitionSpec
    data = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    lead = data[0] if len(data) == 1 else data
    if param_specs is not None and tx is None:
        raise ValueError(
            "state_partition_specs with param_specs needs tx= (the optimizer) to find the "
            "inner-state leaves shaped like the params"
        )
    base = jax.tree.map(lambda _: P(), opt_state)
    if param_specs is not None:
        base = optax.tree_map_params(
            tx,
            lambda _, spec: spec,
            opt_state,
            param_specs,
            transform_non_params=lambda _: P(),
            is_leaf=lambda x: x is None,
        )
    model = _model_axes_of(param_specs, data)

    def per_state(s: AdaScaleState, b: AdaScaleState) -> AdaScaleState:
        specs = jax.tree.map(lambda _: P(), s._replace(inner_state=None, acc_grads=None, acc_sq_norm=None))
        if s.acc_grads is not None:
            if param_specs is None:
                acc = jax.tree.map(lambda _: P(lead), s.acc_grads)
            else:
                acc = jax.tree.map(lambda _, spec: P(lead, *tuple(spec)), s.acc_grads, param_specs)
            specs = specs._replace(acc_grads=acc, acc_sq_norm=P(lead, model) if model else P(lead))
        inner = _zero.row_specs(s.inner_state, lead)
        if inner is None:
            inner = b.inner_state
        return specs._replace(inner_state=inner)

    return jax.tree.map(lambda s, b: per_state(s, b) if _is_state(s) else b, opt_state, base, is_leaf=_is_state)


def _model_axes_of(param_specs: Any, data: tuple[str, ...]) -> tuple[str, ...] | None:
    if param_specs is None:
        return None
    names: list[str] = []
    for spec in jax.tree.leaves(param_specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)):
        for entry in tuple(spec):
            for name in (entry,) if isinstance(entry, str) else tuple(entry or ()):
                if name not in data and name not in names:
                    names.append(name)
    return tuple(names) or None


def replicate_buffers(opt_state: Any, num_replicas: int, model_shards: int = 1) -> Any:
    """Give each of ``num_replicas`` replicas its own accumulation buffers.

    Tiles ``acc_grads`` along a new leading axis of size ``num_replicas`` and
    ``acc_sq_norm`` to ``(num_replicas, [model_shards,] G)``; everything else
    is left as it is. A no-op without ``accumulation_steps > 1``. Use with
    :func:`state_axes` (vmap, pmap) or :func:`state_partition_specs` (shard_map).
    With parameters split over model axes (tensor parallelism) each model
    shard keeps its own partial squared norms: pass ``model_shards``, the
    product of the model axes' sizes.
    """

    def per_state(s: AdaScaleState) -> AdaScaleState:
        tile = lambda x, lead: jnp.broadcast_to(x, lead + x.shape).copy()  # noqa: E731
        model = (model_shards,) if model_shards > 1 else ()
        return s._replace(
            acc_grads=jax.tree.map(lambda x: tile(x, (num_replicas,)), s.acc_grads),
            acc_sq_norm=jax.tree.map(lambda x: tile(x, (num_replicas, *model)), s.acc_sq_norm),
        )

    return _map_states(opt_state, per_state, lambda x: x)


def transfer_state(opt_state: Any, target: Any) -> Any:
    """Carry AdaScale's statistics and the inner state from ``opt_state`` into ``target``.

    For changing the configuration at an update boundary: a different
    ``accumulation_steps``, a different number of replicas (elastic scaling;
    with ``shard_optimizer_state`` the inner state's rows are re-cut for the
    new ``n``), or a checkpoint restored into a new transformation (also one
    written with the field names of 0.1.0). ``target`` is a fresh state of
    the new configuration (``new_tx.init(params)``, with
    :func:`replicate_buffers` if needed); every field is copied from
    ``opt_state`` except the accumulation buffers, which keep ``target``'s
    (zero) values. The moving averages are in base-batch units, so they stay
    valid at the new scale: no reset, no rescaling.

    Raises:
      ValueError: if ``opt_state`` is mid-accumulation (``micro_step > 0``),
        which would drop gradients; finish the window first.

    Examples:
      >>> import jax.numpy as jnp, optax_adascale
      >>> params = jnp.zeros(2)
      >>> old_tx = optax_adascale.adascale_sgd(0.1, accumulation_steps=2)
      >>> state = old_tx.init(params)
      >>> for g in (jnp.array([1.0, 0.0]), jnp.array([0.0, 1.0])):
      ...     _, state = old_tx.update(g, state, params)
      >>> new_tx = optax_adascale.adascale_sgd(0.1, accumulation_steps=4)
      >>> new_state = optax_adascale.transfer_state(state, new_tx.init(params))
      >>> optax_adascale.scale_invariant_steps(new_state)
      Array(2., dtype=float32)
    """
    source = get_adascale_state(opt_state)
    micro = np.asarray(jax.device_get(_value(source.micro_step)))
    if np.any(micro != 0):
        raise ValueError(
            f"opt_state is mid-accumulation (micro_step={micro.tolist()}): transfer_state works at "
            "an update boundary; run the remaining calls of the window first."
        )

    def per_state(s: AdaScaleState) -> AdaScaleState:
        fields = source._asdict()
        for f in _PER_REPLICA_FIELDS:
            fields[f] = getattr(s, f)
        fields["inner_state"] = _zero.recut(source.inner_state, s.inner_state)
        return _conform(AdaScaleState(**fields), s)

    return _map_states(target, per_state, lambda x: x)


def _conform(source: Any, target: Any) -> Any:
    """``source``'s leaves in ``target``'s tree structure and on ``target``'s devices.

    Leaves are matched by key path, so a checkpoint restored without a target
    (plain dicts and lists where the target has NamedTuples) fits too.
    """
    name = lambda k: str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))  # noqa: E731

    def key(path):  # an NNX variable (or one restored without target, {"value": x}) is one key deeper
        names = tuple(name(k) for k in path)
        return names[:-1] if names and names[-1] == "value" else names

    src = {key(p): v for p, v in jax.tree_util.tree_leaves_with_path(source)}
    tgt = jax.tree_util.tree_leaves_with_path(target)
    if sorted(src) != sorted(key(p) for p, _ in tgt):
        differ = {k[0] for k in set(src) ^ {key(p) for p, _ in tgt} if k}
        if differ & {"grad_var", "grad_sqr", "group_gains"}:
            raise ValueError(
                "opt_state and target have different parameter groups (param_labels): the moving averages "
                "are kept per group, so they cannot be carried between a labelled and an unlabelled "
                "configuration, or between different labels. Use the same param_labels in both."
            )
        raise ValueError("the inner transformations of opt_state and target differ in structure")

    def place(value, like):
        value = jnp.asarray(_value(value), dtype=getattr(like, "dtype", None))
        sharding = getattr(like, "sharding", None)
        return jax.device_put(value, sharding) if sharding is not None else value

    return jax.tree.structure(target).unflatten([place(src[key(p)], t) for p, t in tgt])

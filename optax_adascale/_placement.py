"""Laying AdaScale's state out over replicas and moving it between configurations.

:func:`state_axes`, :func:`state_partition_specs` and :func:`replicate_buffers` give the per-replica
accumulation buffers and the ZeRO rows their place under ``vmap``/``pmap``/``shard_map``;
:func:`transfer_state` moves the statistics into a new configuration (another scale, ZeRO on or off).
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_adascale import _state
from optax_adascale.core import _ramp, _read
from optax_adascale.core._adascale import AdaScaleState
from optax_adascale.sharding import _zero

_PER_REPLICA_FIELDS = ("acc_grads", "acc_sq_norm")
_value = _read.value


def _map_states(opt_state: Any, fn: Callable[[AdaScaleState], AdaScaleState], other: Callable[[Any], Any]) -> Any:
    return jax.tree.map(lambda x: fn(x) if _state.is_state(x) else other(x), opt_state, is_leaf=_state.is_state)


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
      buffers without a replica axis (a ``jax.jit`` step over the global batch,
      where the tx has no ``axis_name``): the parameter's spec (``P()``
      without ``param_specs``), ``acc_sq_norm`` ``P()``;
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
        if s.acc_grads is not None and jnp.ndim(s.acc_sq_norm) == 1:  # no replica axis: the global-batch step
            acc = jax.tree.map(lambda _: P(), s.acc_grads) if param_specs is None else param_specs
            specs = specs._replace(acc_grads=acc, acc_sq_norm=P())
        elif s.acc_grads is not None:
            if param_specs is None:
                acc = jax.tree.map(lambda _: P(lead), s.acc_grads)
            else:
                acc = jax.tree.map(lambda _, spec: P(lead, *tuple(spec)), s.acc_grads, param_specs)
            specs = specs._replace(acc_grads=acc, acc_sq_norm=P(lead, model) if model else P(lead))
        inner = _zero.row_specs(s.inner_state, lead)
        if inner is None:
            inner = b.inner_state
        return specs._replace(inner_state=inner)

    return jax.tree.map(
        lambda s, b: per_state(s, b) if _state.is_state(s) else b, opt_state, base, is_leaf=_state.is_state
    )


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
    valid at the new scale: no reset, no rescaling. A :class:`BatchRamp`'s state
    is carried where both have one; into a ramp from a state without one, the
    ramp starts at its lowest rung (``target``'s), and out of one it is dropped.

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
    source = _state.get_adascale_state(opt_state)
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
        if source.ramp is None or s.ramp is None:
            fields["ramp"] = s.ramp
        elif (ramp := _ramp.fresh_ramp(s.ramp)) is not None:  # into a ramp whose ladder we know (its init's state)
            k = _ramp.warn_if_off_ladder(
                ramp, source.ramp.microbatches, 0, "the state given to transfer_state", moved=True
            )
            if k is not None:  # on the ladder now: batch_plan says so before the first update (which would move it)
                fields["ramp"] = source.ramp._replace(microbatches=jnp.full_like(source.ramp.microbatches, k))
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
        clock_keys = {"slope", "reach", "curvature", "limit", "base_steps"}  # the τ clock's state fields
        differing = {n for k in set(src) ^ {key(p) for p, _ in tgt} for n in k}
        if {"decay", "nesterov"} & {n for k in src for n in k} and "limit" in differing:
            raise ValueError(
                "opt_state is a 0.4.0 checkpoint of the guarded τ clock (adascale_sgd's default then and now), whose "
                "momentum state changed in 0.5.0 (the weight decay moved into optax_adascale.trace; β and nesterov "
                "are no longer stored, the guard's limit is): it does not restore into 0.5.0's state. Restore the "
                "params and start the optimizer state with tx.init(params) (the momentum and τ restart), or keep "
                "optax_adascale 0.4.0 to finish the run. States of clock='update' restore unchanged."
            )
        moved = differing & clock_keys
        if moved:
            raise ValueError(
                "the inner transformations of opt_state and target differ in structure: one of them runs on the τ "
                f"clock (its state has {sorted(moved)}) and the other on the update clock. A checkpoint of 0.3 "
                "(adascale_sgd's default then, or adascale_adamw with clock='update') restores into a "
                "transformation built with clock='update'; since 0.4.0 the default for both aliases is clock='tau'."
            )
        raise ValueError("the inner transformations of opt_state and target differ in structure")

    def place(value, like):
        value = jnp.asarray(_value(value), dtype=getattr(like, "dtype", None))
        sharding = getattr(like, "sharding", None)
        return jax.device_put(value, sharding) if sharding is not None else value

    return jax.tree.structure(target).unflatten([place(src[key(p)], t) for p, t in tgt])

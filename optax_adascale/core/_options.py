"""Every AdaScale option, checked once, in one frozen object: what the factories build and ``build`` reads.

The factories (:func:`optax_adascale.adascale`, :func:`~optax_adascale.adascale_sgd`,
:func:`~optax_adascale.adascale_adamw`, :func:`optax_adascale.experimental.adascale`)
take their own keywords and hand the AdaScale ones here as keywords; :func:`create`
checks them, folds the spellings of 0.2 into :class:`~optax_adascale.Estimator` (with a
``DeprecationWarning``) and returns :class:`Options`.
"""

import dataclasses
from collections.abc import Mapping
from typing import Any

from optax_adascale.core import _checks
from optax_adascale.core import _estimator as est
from optax_adascale.core._ramp import BatchRamp

# 0.2's estimator keywords, now fields of Estimator (``variance_eps`` was adascale_adamw's name for ``eps``).
DEPRECATED = ("smoothing", "eps", "horizon", "unbiased_sqr", "memory_fraction", "variance_eps")


@dataclasses.dataclass(frozen=True, eq=False)
class Options:
    r"""Every option of an AdaScale transformation, checked.

    Attributes:
      axis_name: the data-parallel axis (a name or a tuple of names) ``update``
        reduces over, or ``None`` (one replica, or statistics that arrive
        reduced from :func:`~optax_adascale.value_and_grad` under ``jax.jit``).
      accumulation_steps: ``k ≥ 1``: each call adds its gradient to per-replica
        buffers and returns zero updates; the ``k``-th call reduces once and steps.
        ``1`` with a ``ramp``. Traced where ``optax.inject_hyperparams`` calls the factory inside
        ``update`` (then the state says ``k``: see ``_adascale.accumulation_steps``).
      scale: ``S``, base batches per update; ``None``: the number of samples ``n``.
      estimator: the :class:`~optax_adascale.Estimator` (the moving averages' memory).
      param_labels: labels shaped like the params (or ``params -> labels``), as in
        ``optax.multi_transform``: statistics and a gain per group.
      param_specs: the params' ``PartitionSpec``\ s, where shard_map's varying
        types cannot tell which parameters are split over model axes
        (``check_vma=False``, ``jax.pmap``).
      shard_optimizer_state: ``None`` (replicated) or ``n``, the data-parallel
        size: the ZeRO layout (traced under ``optax.inject_hyperparams``: then ``n``
        is the data axes' size at the call).
      delayed_gain: the gain of update ``t`` from the averages through ``t − 1``.
      averaging: ``"debiased"`` or ``"paper"`` (experimental).
      gain_exponent: ``p`` in the step ``r^p·lr`` (experimental).
      precondition: ``inner_state -> multipliers`` for the statistics (experimental).
      ramp: ``None``, or the :class:`~optax_adascale.BatchRamp` given as
        ``accumulation_steps``: ``k_t`` is then a traced value in the state.
    """

    axis_name: Any = None
    accumulation_steps: int = 1
    scale: Any = None
    estimator: est.Estimator = est.Estimator()
    param_labels: Any = None
    param_specs: Any = None
    shard_optimizer_state: int | None = None
    delayed_gain: bool = False
    averaging: str = est.DEBIASED
    gain_exponent: float = 1.0
    precondition: Any = None
    ramp: BatchRamp | None = None

    @property
    def accumulates(self) -> bool:
        """Whether calls accumulate into per-replica buffers (``accumulation_steps > 1`` or a ramp); ``False`` for
        a traced ``accumulation_steps`` (``optax.inject_hyperparams``: the state says, see
        ``_adascale.accumulation_steps``)."""
        k = self.accumulation_steps
        return self.ramp is not None or (isinstance(k, int) and k > 1)

    @property
    def settings(self) -> est.Settings:
        """What one update's estimator step reads."""
        return est.Settings(self.estimator, self.delayed_gain, self.averaging, self.gain_exponent)


def create(
    *,
    axis_name: Any = None,
    accumulation_steps: int | BatchRamp = 1,
    scale: Any = None,
    estimator: Any = None,
    param_labels: Any = None,
    param_specs: Any = None,
    shard_optimizer_state: int | None = None,
    delayed_gain: bool = False,
    averaging: str = est.DEBIASED,
    gain_exponent: float = 1.0,
    precondition: Any = None,
    deprecated: Mapping[str, Any] | None = None,
    factory: str = "adascale",
) -> Options:
    """Check every option once and resolve them into :class:`Options`.

    ``deprecated`` holds the keywords a factory caught in its ``**`` argument:
    0.2's estimator keywords (folded into the estimator, with a warning) and
    nothing else (``TypeError``, as Python says for an unknown keyword).
    """
    ramp = accumulation_steps if isinstance(accumulation_steps, BatchRamp) else None
    steps = 1 if ramp is not None else _checks.static_int("accumulation_steps", accumulation_steps, hint=_RAMP_HINT)
    _checks.check_number("scale", scale, low=1.0)
    _checks.check_bool("delayed_gain", delayed_gain)
    _checks.check_choice("averaging", averaging, est.AVERAGING_MODES)
    _checks.check_number("gain_exponent", gain_exponent, low=0.0, high=1.0)
    if precondition is not None and not callable(precondition):
        raise TypeError(f"precondition must be a function of inner's state, got precondition={precondition!r}")
    if shard_optimizer_state is not None:
        shard_optimizer_state = _checks.static_int("shard_optimizer_state", shard_optimizer_state)
        if axis_name is None:
            raise ValueError(
                f"shard_optimizer_state={shard_optimizer_state!r} shards over the data axes, but axis_name=None; "
                "pass the data-parallel axis_name."
            )
        if precondition is not None:
            raise ValueError("precondition is not supported with shard_optimizer_state")
    resolved = _estimator_with_deprecated(estimator, dict(deprecated or {}), factory)
    if ramp is not None:
        _check_ramp(ramp, scale, resolved)
    return Options(
        axis_name=axis_name,
        accumulation_steps=steps,
        scale=scale,
        estimator=resolved,
        param_labels=param_labels,
        param_specs=param_specs,
        shard_optimizer_state=shard_optimizer_state,
        delayed_gain=delayed_gain,
        averaging=averaging,
        gain_exponent=gain_exponent,
        precondition=precondition,
        ramp=ramp,
    )


_RAMP_HINT = " For a number of micro-batches that changes during training pass accumulation_steps=BatchRamp(...)."


def _check_ramp(ramp: BatchRamp, scale: Any, estimator: est.Estimator) -> None:
    """A ramp's scale is the number of samples ``n_t``; FairScale's ``θ = 1 − n/1000`` is defined for a fixed ``n``."""
    if scale is not None:
        raise ValueError(
            f"accumulation_steps={ramp!r} sets the scale of each update to its number of samples, S_t = n_t, "
            f"so it takes no scale=, got scale={scale!r}. Make one micro-batch the base batch of your "
            "learning-rate schedule."
        )
    if estimator.fairscale and estimator.smoothing is None:
        raise ValueError(
            "estimator='fairscale' takes θ = max(1 − n/1000, 0) from a fixed number of samples n, which a "
            f"BatchRamp changes (accumulation_steps={ramp!r}). Use the default estimator (its memory is a "
            "fraction of τ, defined for any S), or give FairScale's estimator a fixed θ: "
            "estimator=optax_adascale.Estimator(fairscale=True, smoothing=0.99)."
        )


def unwrap(kwargs: Mapping[str, Any], name: str) -> dict[str, Any]:
    """A factory's ``**name`` keywords; ``optax.inject_hyperparams`` passes them back nested under ``name``.

    ``inject_hyperparams`` binds the factory's signature and calls it again with every
    bound argument as a keyword, so the ``**`` argument arrives as one keyword of its
    own name holding a dict.
    """
    out = dict(kwargs)
    nested = out.pop(name, None)
    if nested is not None:
        if not isinstance(nested, Mapping):
            raise TypeError(f"got an unexpected keyword argument {name!r}")
        out.update(nested)
    return out


def _estimator_with_deprecated(estimator: Any, old: dict[str, Any], factory: str) -> est.Estimator:
    unknown = sorted(set(old) - set(DEPRECATED))
    if unknown:
        raise TypeError(f"{factory}() got an unexpected keyword argument {unknown[0]!r}")
    if "variance_eps" in old:
        if "eps" in old:
            raise TypeError(f"{factory}() got both variance_eps= and eps=")
        old["eps"] = old.pop("variance_eps")
    given = {k: v for k, v in old.items() if v is not None}
    if not given:
        return est.resolve(estimator)
    if estimator is not None:
        raise ValueError(
            f"{factory}(): pass the estimator's options in estimator= only, got estimator={estimator!r} and "
            f"{', '.join(f'{k}={v!r}' for k, v in given.items())}"
        )
    fields = dict(given)
    if "unbiased_sqr" not in fields and {"smoothing", "horizon", "memory_fraction"} & set(fields):
        fields["unbiased_sqr"] = False  # 0.2's default with an explicit memory: the same averages as before
    new = est.Estimator(**fields)
    spelled = ", ".join(f"{k}={v!r}" for k, v in fields.items())
    _checks.warn(
        f"{', '.join(f'{k}=' for k in given)} is deprecated since optax_adascale 0.3 (the estimator's options "
        f"are one object now): pass estimator=optax_adascale.Estimator({spelled}).",
        DeprecationWarning,
    )
    return new

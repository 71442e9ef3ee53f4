"""The gradient noise scale for any optimizer: a pass-through transformation and its reader.

``noise_scale_monitor`` keeps AdaScale's moving averages ``σ̄²`` and ``μ̄²`` (the same
estimator, :mod:`optax_adascale.core._estimator`) from the statistics that
:func:`optax_adascale.value_and_grad` returns, and hands the gradients on unchanged
to whatever optimizer follows it in an ``optax.chain``. :func:`metrics` reads
``B_simple = σ̄²/μ̄²`` (McCandlish et al., 2018) off any optax state that holds it.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from optax_adascale.core import _axes, _checks, _norms, _options, _read
from optax_adascale.core import _estimator as est
from optax_adascale.core._samples import MicrobatchStats

Array = jax.Array


class NoiseScaleState(NamedTuple):
    """State of :func:`noise_scale_monitor`. Scalars, identical on every replica.

    Attributes:
      count: int32 ``[]``, updates whose statistics entered the averages (updates
        with one sample, or non-finite statistics, do not count).
      grad_sqr: float32 ``[]``, the moving average ``μ̄²`` of ``‖∇L‖²``.
      grad_var: float32 ``[]``, the moving average ``σ̄²`` of the trace of one base
        batch's gradient covariance. The base batch is one gradient sample (one
        micro-batch on one data shard), as AdaScale's default ``S = n``.
      ema_weight: float32 ``[]``, the debiasing weight ``w = Σ θ^j (1−θ)``.
      examples_per_sample: float32 ``[]``, examples in one base batch
        (``batch_size / n`` of the last update); NaN without ``batch_size``.
      tokens_per_example: float32 ``[]``, as given; NaN without it.
      gain: float32 ``[]``, the gain AdaScale would apply at ``S = n``, from these
        averages (1 before the first estimate): the clock of the estimator's memory.
      tau: float32 ``[]``, the sum of those gains (base batches' worth of progress),
        which a memory of ``c·τ`` (the default :class:`Estimator`) reads.
    """

    count: Array  # type: ignore[assignment]  # a field named like tuple.count, as optax's states do
    grad_sqr: Array
    grad_var: Array
    ema_weight: Array
    examples_per_sample: Array
    tokens_per_example: Array
    gain: Array
    tau: Array


def noise_scale_monitor(
    *,
    axis_name: str | tuple[str, ...] | None = None,
    batch_size: int | None = None,
    tokens_per_example: float | None = None,
    estimator: Any = None,
    **deprecated: Any,
) -> optax.GradientTransformationExtraArgs:
    r"""Log the gradient noise scale (critical batch size) of any optimizer; the gradients pass unchanged.

    Each update averages ``n`` gradient samples ``g_i`` (data shards ×
    micro-batches). From ``a = mean_i ‖g_i‖²`` (``microbatch_stats``) and
    ``b = ‖ḡ‖²`` it estimates, per base batch (one sample),

    .. math::

       σ̂² = \frac{n}{n-1}(a - b), \qquad μ̂² = b - σ̂²/n,

    and keeps their moving averages exactly as :func:`adascale` does with the
    same ``estimator`` (at ``S = n``; by default a memory of 5 % of the progress
    so far, counted in the base batches' worth that AdaScale's gain would give). The noise scale
    ``B_simple = σ̄²/μ̄²`` is the batch (in base batches) at which the gradient's
    noise equals its signal; times the examples per sample it is McCandlish et
    al.'s ``tr(Σ)/|G|²`` in examples. Read it with
    ``optax_adascale.metrics(opt_state)`` (keys ``noise_scale``,
    ``noise_scale_examples``, ``noise_scale_tokens``, ``grad_sqr``, ``grad_var``).

    Where the statistics come from:

    * ``axis_name=None``: ``grads`` and ``microbatch_stats`` are already reduced
      over the data shards, as :func:`value_and_grad` returns them under
      ``jax.jit`` over the global batch (``data_axes=...``).
    * ``axis_name`` set (``pmap``, ``shard_map``, ``vmap``): as for
      :func:`adascale`, ``axis_name`` is the axis the monitor *reduces over*:
      give it this replica's gradient and ``microbatch_stats`` (from
      ``value_and_grad(loss_fn)``, ``data_axes=None``); it averages both in one
      ``lax.pmean`` and hands the averaged gradient on, so no ``pmean`` of your
      own is needed (one that was already applied is harmless: the mean of
      identical values). Under ``shard_map`` with ``check_vma=True`` gradients
      that no longer vary over the axis are known to be averaged and are not
      reduced again.

    One sample per update (``n = 1``: one device, no micro-batches) has no
    spread to measure: the monitor warns once at trace time, leaves its
    averages untouched and the noise scales read NaN, not measured
    (``noise_scale_measured`` False). Split the batch:
    ``value_and_grad(loss_fn, num_microbatches=2)``. Updates with non-finite
    statistics (e.g. a loss-scaling overflow) are left out of the averages.

    Args:
      axis_name: the data-parallel axis (a name or a tuple), or ``None`` when
        the statistics arrive reduced.
      batch_size: examples averaged into one update: the global batch, over all
        data shards and micro-batches. Gives ``noise_scale_examples``; must be
        a multiple of ``n``.
      tokens_per_example: tokens in one example (e.g. the sequence length), for
        ``noise_scale_tokens``.
      estimator: as in :func:`adascale`: an :class:`Estimator`, ``"fairscale"``
        or ``None`` (``Estimator()``).
      **deprecated: 0.2's ``smoothing=θ`` (now ``Estimator(smoothing=θ, unbiased_sqr=False)``); warns.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose ``update(grads, state,
      params=None, *, microbatch_stats, **extra_args)`` returns the averaged
      gradient (``grads`` itself without ``axis_name``). Chain it before your optimizer:
      ``optax.chain(noise_scale_monitor(...), optax.adamw(1e-3))``; ``optax.chain``
      forwards ``microbatch_stats=`` to it and optimizers without extra
      arguments ignore it.

    Examples:
      Two samples per update, ``[2, 1]`` and ``[0, 1]``: ``ḡ = [1, 1]``,
      ``a = (5 + 1)/2 = 3`` and ``b = 2``, so ``σ̂² = 2·(a − b) = 2``,
      ``μ̂² = b − σ̂²/2 = 1`` and the noise scale is 2 samples (32 examples of 16):

      >>> import jax.numpy as jnp, optax, optax_adascale
      >>> tx = optax.chain(optax_adascale.noise_scale_monitor(batch_size=32), optax.adamw(1e-3))
      >>> params = jnp.zeros(2)
      >>> state = tx.init(params)
      >>> stats = optax_adascale.MicrobatchStats(jnp.float32(3.0), 2)  # mean_i ‖g_i‖², n
      >>> updates, state = tx.update(jnp.ones(2), state, params, microbatch_stats=stats)
      >>> m = optax_adascale.metrics(state)
      >>> m["noise_scale"], m["noise_scale_examples"]
      (Array(2., dtype=float32), Array(32., dtype=float32))

    References:
      McCandlish, Kaplan, Amodei, `An Empirical Model of Large-Batch Training
      <https://arxiv.org/abs/1812.06162>`_, 2018 (Appendix A.1);
      Johnson et al., `AdaScale SGD <https://arxiv.org/abs/2007.05105>`_, ICML 2020.
    """
    if batch_size is not None:
        _checks.check_static_int("batch_size", batch_size)
    _checks.check_number("tokens_per_example", tokens_per_example, low=0.0, low_open=True)
    settings = est.Settings(
        _options.create(
            estimator=estimator, deprecated=_options.unwrap(deprecated, "deprecated"), factory="noise_scale_monitor"
        ).estimator
    )
    if isinstance(settings.estimator.horizon, tuple):
        raise ValueError(
            f"noise_scale_monitor keeps one memory for both averages: pass one horizon, got "
            f"horizon={settings.estimator.horizon!r}"
        )
    nan = float("nan")

    def init_fn(params):
        del params
        zero = lambda dtype=jnp.float32: jnp.zeros([], dtype)  # noqa: E731 - a fresh buffer per field (donation)
        return NoiseScaleState(
            count=zero(jnp.int32),
            grad_sqr=zero(),
            grad_var=zero(),
            ema_weight=zero(),
            examples_per_sample=jnp.full([], nan, jnp.float32),
            tokens_per_example=jnp.full([], nan if tokens_per_example is None else tokens_per_example, jnp.float32),
            gain=jnp.ones([], jnp.float32),
            tau=zero(),
        )

    def update_fn(updates, state, params=None, *, microbatch_stats=None, **extra_args):
        del extra_args
        with jax.named_scope("noise_scale_monitor"):
            return _update(axis_name, batch_size, settings, updates, state, params, microbatch_stats)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _update(axis_name, batch_size, settings, grads, state, params, stats) -> tuple[Any, NoiseScaleState]:
    if stats is None:
        raise TypeError(
            "noise_scale_monitor needs the samples' statistics: tx.update(grads, opt_state, params, "
            "microbatch_stats=stats) with stats from optax_adascale.value_and_grad, got microbatch_stats=None"
        )
    if not isinstance(stats, MicrobatchStats):
        raise TypeError(f"microbatch_stats must be a MicrobatchStats, got {type(stats).__name__}")
    try:
        sq_leaves = jax.tree.structure(grads).flatten_up_to(stats.sq_norms)
    except (ValueError, TypeError) as err:
        raise ValueError("microbatch_stats.sq_norms must have the structure of the gradients") from err
    n = _axes.axis_size(axis_name) * stats.num_microbatches
    examples = jnp.full([], float("nan"), jnp.float32)
    if batch_size is not None:
        if batch_size % n:
            raise ValueError(
                f"batch_size={batch_size} must be a multiple of the n={n} gradient samples per update "
                "(data shards × micro-batches): batch_size is the global batch of one update"
            )
        examples = jnp.full([], batch_size // n, jnp.float32)
    model = _axes.model_axes(grads, params, axis_name)
    a: Any = sum(model.mask([jnp.asarray(s, jnp.float32) for s in sq_leaves]))
    if axis_name is not None:  # the one collective: the gradients (unless known averaged) and the scalar a
        if _averaged(grads, axis_name):
            a = lax.pmean(a, axis_name)
        else:
            grads, a = lax.pmean((grads, a), axis_name)
    if n == 1:
        warnings.warn(
            "noise_scale_monitor sees n = 1 gradient sample per update: one sample has no spread, so the noise "
            "scale cannot be estimated (it reads NaN, noise_scale_measured False). Split the batch into micro-batches "
            "(optax_adascale.value_and_grad(loss_fn, num_microbatches=2)) or use several data shards.",
            stacklevel=4,
        )
        return grads, state._replace(examples_per_sample=examples)
    b: Any = sum(model.mask([_norms.leaf_sq_norm(g) for g in jax.tree.leaves(grads)]))
    if model.axes:
        a, b = model.psum((a, b))

    var_t, sqr_t = est.step_moments(a, b, n, n, settings.eps, floor_sqr=not settings.unbiased_sqr)
    theta_var, theta_sqr = settings.smoothings(n, state.gain, state.tau)
    count = optax.safe_increment(state.count)
    alpha_var, weight = est.ema_rate(count, state.ema_weight, theta_var)
    alpha_sqr, _ = est.ema_rate(count, state.ema_weight, theta_sqr)
    grad_var = est.ema_update(state.grad_var, var_t, alpha_var)
    grad_sqr = est.ema_update(state.grad_sqr, sqr_t, alpha_sqr)
    gain = est.gain_ratio(grad_var, grad_sqr, n)
    ok = jnp.isfinite(a) & jnp.isfinite(b) & jnp.isfinite(grad_var) & jnp.isfinite(grad_sqr)
    keep = lambda new, old: jnp.where(ok, new, old)  # noqa: E731
    return grads, NoiseScaleState(
        count=keep(count, state.count),
        grad_sqr=keep(grad_sqr, state.grad_sqr),
        grad_var=keep(grad_var, state.grad_var),
        ema_weight=keep(weight, state.ema_weight),
        examples_per_sample=examples,
        tokens_per_example=state.tokens_per_example,
        gain=keep(gain, state.gain),
        tau=keep(state.tau + gain, state.tau),
    )


def _averaged(grads: Any, axis_name: Any) -> bool:
    """Whether shard_map's types show the gradients already averaged (unvarying over every data axis)."""
    names = _axes.axis_names(axis_name)
    if not all(_axes.vma_checked(name) for name in names):
        return False
    return all(name not in _axes.varying_axes(leaf) for leaf in jax.tree.leaves(grads) for name in names)


# --------------------------------------------------------------------------- reading


def get_noise_state(opt_state: Any) -> NoiseScaleState:
    """Find the :class:`NoiseScaleState` in any nested optax state (or a checkpoint restored as dicts).

    Raises:
      ValueError: if there is none, or more than one.
    """
    if isinstance(opt_state, NoiseScaleState):
        return opt_state
    found: list[NoiseScaleState] = []
    _search(opt_state, found)
    if len(found) != 1:
        raise ValueError(f"expected exactly one NoiseScaleState (noise_scale_monitor) in opt_state, found {len(found)}")
    return found[0]


_NOISE_REQUIRED = ("count", "grad_sqr", "grad_var", "ema_weight", "examples_per_sample", "tokens_per_example")


def _from_mapping(node: Mapping) -> NoiseScaleState | None:
    if not set(_NOISE_REQUIRED) <= set(node.keys()):
        return None
    defaults = {"gain": jnp.ones([], jnp.float32), "tau": jnp.zeros([], jnp.float32)}  # 0.2 checkpoints: 1, 0
    return NoiseScaleState(**{f: node.get(f, defaults.get(f)) for f in NoiseScaleState._fields})


def _search(node: Any, found: list[NoiseScaleState]) -> None:
    _read.search(node, NoiseScaleState, _from_mapping, found)


def has_noise_state(opt_state: Any) -> bool:
    """Whether ``opt_state`` holds exactly one :class:`NoiseScaleState`."""
    found: list[NoiseScaleState] = []
    _search(opt_state, found)
    return len(found) == 1


def metrics(opt_state: Any) -> dict[str, Array]:
    """The monitor's readings, as plain float32 arrays.

    Keys: ``noise_scale`` (``σ̄²/μ̄²`` in base batches, i.e. gradient samples),
    ``noise_scale_examples`` (times the examples per sample: ``tr(Σ)/|G|²``),
    ``noise_scale_tokens`` (times ``tokens_per_example``), ``grad_sqr``
    (``μ̄²``), ``grad_var`` (``σ̄²``), ``noise_scale_measured``. The noise
    scales read as ``optax_adascale.metrics`` reads AdaScale's: NaN while not
    measured (before the first estimate, with ``n = 1``, or non-finite
    statistics; ``noise_scale_measured`` False), ``+inf`` for pure noise
    (``μ̄² = 0 < σ̄²``), 0 where ``σ̄² = 0`` (identical samples); the two in
    examples and tokens are NaN without ``batch_size`` / ``tokens_per_example``.
    """
    s = jax.tree.map(_read.value, get_noise_state(opt_state))
    var, sqr = s.grad_var, jnp.maximum(s.grad_sqr, 0.0)
    ratio, measured = _read.noise_scale(var, sqr, s.count > 0)
    examples = ratio * s.examples_per_sample
    return {
        "noise_scale_measured": measured,
        "noise_scale": ratio,
        "noise_scale_examples": examples,
        "noise_scale_tokens": examples * s.tokens_per_example,
        "grad_sqr": sqr,
        "grad_var": var,
    }

"""AdaScale in MaxText 0.2.5's ``train_step``: the optimizer swap and the drop-in's arguments, for ``train_step.patch``.

The patch calls ``optax_adascale.value_and_grad`` in place of MaxText's ``jax.value_and_grad(diff_wrapper,
argnums=(0, 1), has_aux=True)`` when ``ON`` is set (also with ``gradient_accumulation_steps > 1``) and passes the
statistics to the optimizer, ``state.apply_gradients(grads, **extra(stats))``. :func:`use_adascale` sets ``ON``
and makes ``get_optimizer`` build AdaScale around MaxText's own AdamW (or SGD). With ``ON`` unset the patched
``train_step`` is MaxText's, line for line.

The batch ramp (:func:`use_adascale` with ``ramp=optax_adascale.BatchRamp(1, K)``): MaxText's batch is the fixed
micro-batch, the jitted ``train_step`` is called once per global micro-batch, the optimizer accumulates across
calls and applies an update when ``k_t`` are in. MaxText's gradient clipping moves into the optimizer (``RAMP``
turns the step's own off): the gain's ``‖ḡ‖²`` is read from the accumulated gradients, which must be the raw
ones. The patched ``train_loop`` stops on :func:`done`.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import optax

import optax_adascale

ON = False
RAMP: optax_adascale.BatchRamp | None = None
CLOCK: str | None = None  # adascale_adamw's clock (None: the library's default)


def use_adascale(ramp: optax_adascale.BatchRamp | None = None) -> None:
    """Turn AdaScale on: the patched ``train_step`` calls the drop-in, ``get_optimizer`` builds AdaScale. With
    ``ramp``, the batch follows the noise: ``accumulation_steps=ramp`` across calls, MaxText's clipping inside."""
    global ON, RAMP
    from maxtext.optimizers import optimizers

    ON, RAMP = True, ramp
    if getattr(optimizers.get_optimizer, "_adascale", False):
        return

    def get_optimizer(config, learning_rate_schedule, model=None, mesh=None):
        if RAMP is not None:  # MaxText's clipping, on the accumulated mean as its own accumulation clips, then AdamW
            clip = [optax.clip_by_global_norm(config.gradient_clipping_threshold)]
            adamw = [
                optax.scale_by_adam(
                    config.adam_b1, config.adam_b2, config.adam_eps, config.adam_eps_root, mu_dtype=config.mu_dtype
                ),
                optax.add_decayed_weights(config.adam_weight_decay, optimizers.get_adamw_mask(config)),
            ]
            if config.opt_type not in ("adamw", "sgd"):
                raise NotImplementedError(f"AdaScale wraps opt_type adamw or sgd, got {config.opt_type!r}")
            inner = optax.chain(
                *(clip if config.gradient_clipping_threshold > 0 else []),
                *(adamw if config.opt_type == "adamw" else []),
            )
            return optax_adascale.adascale(inner, learning_rate_schedule, accumulation_steps=RAMP)
        if config.opt_type == "adamw":
            return optax_adascale.adascale_adamw(
                learning_rate_schedule,
                b1=config.adam_b1,
                b2=config.adam_b2,
                eps=config.adam_eps,
                eps_root=config.adam_eps_root,
                weight_decay=config.adam_weight_decay,
                mu_dtype=config.mu_dtype,
                mask=optimizers.get_adamw_mask(config),
                **({"clock": CLOCK} if CLOCK is not None else {}),
            )
        if config.opt_type == "sgd":
            return optax_adascale.adascale_sgd(learning_rate_schedule)
        raise NotImplementedError(f"AdaScale wraps opt_type adamw or sgd, got {config.opt_type!r}")

    get_optimizer._adascale = True  # type: ignore[attr-defined]
    optimizers.get_optimizer = get_optimizer


ROW_AXES = ("data", "stage", "fsdp", "fsdp_transpose", "expert")  # MaxText's batch axes (activation_batch)


def options(config, data, params_shardings) -> dict[str, Any]:
    """The drop-in's keywords for MaxText's step: ``data_axes`` (the mesh axes of more than one device the batch's
    rows are split over: the inputs' type on an Explicit mesh, else MaxText's ``data_sharding`` less its model
    axes), ``num_microbatches=gradient_accumulation_steps``, and ``param_specs`` for ``(curr_params,
    custom_params)`` from MaxText's own parameter shardings (on an Auto mesh the parameters keep their FSDP/TP
    layout inside the loss)."""
    mesh = jax.sharding.get_abstract_mesh()
    spec = jax.typeof(data["inputs"]).sharding.spec
    first = spec[0] if len(spec) else None
    if first is None:
        first = tuple(a for e in config.data_sharding[0] for a in ((e,) if isinstance(e, str) else e) if a in ROW_AXES)
    names = (first,) if isinstance(first, str) else tuple(first)
    axes = tuple(a for a in names if a in mesh.axis_names and mesh.shape[a] > 1)
    auto = any(t != jax.sharding.AxisType.Explicit for t in mesh.axis_types)
    if getattr(getattr(config, "lora", None), "enable_lora", False):  # curr_params: the adapters alone
        from flax import nnx

        params_shardings = params_shardings.filter(nnx.LoRAParam)
    return dict(
        data_axes=axes,
        num_microbatches=config.gradient_accumulation_steps,
        param_specs=(params_shardings, None) if auto else None,  # Explicit: the parameters' types say it
    )


def per_token(diff_wrapper, config, data):
    """``diff_wrapper`` as the drop-in's micro-batches must see it. With ``gradient_accumulation_steps = k > 1``
    MaxText's loss is the micro-batch's ``xent_sum`` and its own accumulation divides the summed gradient by the
    global batch's token count ``W``: each micro-batch's loss is weighted ``k / W`` (the drop-in's mean over the
    ``k`` micro-batches is then MaxText's ``Σ xent_sum / W``, gradient and value). With
    ``use_tunix_gradient_accumulation=true`` MaxText's loss already is the micro-batch's mean (``xent_sum / W_j``)
    and its accumulation divides the summed gradient by ``k``: the drop-in's mean over the micro-batches is that,
    so the loss is left unweighted. Either way the logged ``xent_sum`` is weighted by ``k`` (the drop-in's mean of
    it is then the sum MaxText logs, and ``learning/lm_loss`` the global per-token loss). ``k = 1``:
    ``diff_wrapper`` itself."""
    k = config.gradient_accumulation_steps
    if k == 1:
        return diff_wrapper
    if getattr(config, "use_tunix_gradient_accumulation", False):
        scale = None
    else:
        scale = k / jnp.sum(data["targets_segmentation"] != 0).astype(jnp.float32)

    @functools.wraps(diff_wrapper)  # __wrapped__: MaxText's own loss (trial.py's --check differentiates it)
    def loss(*args):
        value, (aux, rest) = diff_wrapper(*args)
        return value if scale is None else value * scale, (dict(aux, xent_sum=aux["xent_sum"] * k), rest)

    return loss


def done(state, config) -> bool:
    """The patched ``train_loop``'s stop: ``τ ≥ steps`` with AdaScale on (its loop counts calls), else never."""
    return ON and optax_adascale.done(state, config.steps)


def extra(stats: list[Any]) -> dict[str, Any]:
    """``state.apply_gradients``' keywords: ``microbatch_stats`` when AdaScale is on, of ``curr_params`` (argnum
    0, the optimizer's ``wrt``; NNX's ``Optimizer.update`` strips the Variables, ``nnx.as_pure``, itself). With
    AdaScale off (:func:`use_adascale` not called in this process) the patched step is MaxText's own: said once, by
    a warning, when the step is traced."""
    if not ON:
        _say_off()
    if not stats:
        return {}
    (s,) = stats
    return {"microbatch_stats": dataclasses.replace(s, sq_norms=s.sq_norms[0], mean_sq_norms=s.mean_sq_norms[0])}


OFF = (
    "MaxText's train.py is patched for AdaScale (integrations/maxtext/train_step.patch), but "
    "adascale_maxtext.use_adascale() was not called in this process before the train step was traced: this run is "
    "MaxText's own step and optimizer, without AdaScale. Call it in the Python process that runs MaxText, after "
    "importing adascale_maxtext and before train.main(argv) (or train_utils.setup_train_loop) builds the optimizer."
)
_said_off = False


def _say_off() -> None:
    global _said_off
    if not _said_off:
        _said_off = True
        warnings.warn(OFF, UserWarning, stacklevel=3)

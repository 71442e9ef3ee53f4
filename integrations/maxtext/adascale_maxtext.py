"""AdaScale in MaxText 0.2.5's ``train_step``: what ``train_step.patch`` calls.

The patch (9 changed lines of ``maxtext/trainers/pre_train/train.py``) routes the gradient through
:func:`value_and_grad` when ``ON`` is set, also with ``gradient_accumulation_steps > 1``, and passes the
statistics to the optimizer with ``state.apply_gradients(grads, **extra(stats))``. :func:`use_adascale`
sets ``ON`` and makes ``get_optimizer`` build AdaScale around MaxText's own AdamW (or SGD).

With ``ON`` unset the patched ``train_step`` is MaxText's, line for line.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

import optax_adascale

ON = False
CHECK = False  # record our gradient against MaxText's own (jax.value_and_grad of the same loss) at every step
CHECKS: list[dict[str, float]] = []


def use_adascale(check: bool = False) -> None:
    """Turn AdaScale on: the patched ``train_step`` uses :func:`value_and_grad`, ``get_optimizer`` AdaScale."""
    global ON, CHECK
    from maxtext.optimizers import optimizers

    ON, CHECK = True, check
    if getattr(optimizers.get_optimizer, "_adascale", False):
        return
    maxtexts = optimizers.get_optimizer

    def get_optimizer(config, learning_rate_schedule, model=None, mesh=None):
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
            )
        if config.opt_type == "sgd":
            return optax_adascale.adascale_sgd(learning_rate_schedule)
        raise NotImplementedError(f"AdaScale wraps opt_type adamw or sgd, got {config.opt_type!r}")

    get_optimizer._adascale = True  # type: ignore[attr-defined]
    get_optimizer.maxtext = maxtexts  # type: ignore[attr-defined]
    optimizers.get_optimizer = get_optimizer


ROW_AXES = ("data", "stage", "fsdp", "fsdp_transpose", "expert")  # MaxText's batch axes (activation_batch)


def data_axes(config, inputs) -> tuple[str, ...]:
    """The mesh axes the batch's rows are split over, those with more than one device: read from the inputs'
    type on an Explicit mesh, else MaxText's ``data_sharding`` less its model axes."""
    mesh = jax.sharding.get_abstract_mesh()
    spec = jax.typeof(inputs).sharding.spec
    first = spec[0] if len(spec) else None
    if first is not None:
        names = (first,) if isinstance(first, str) else tuple(first)
    else:
        names = tuple(a for entry in config.data_sharding[0] for a in ((entry,) if isinstance(entry, str) else entry))
        names = tuple(a for a in names if a in ROW_AXES)
    return tuple(a for a in names if a in mesh.axis_names and mesh.shape[a] > 1)


def value_and_grad(diff_wrapper, config):
    """``diff_wrapper(curr_params, custom_params, rest, config, data)``'s value and gradient with respect to
    ``(curr_params, custom_params)``, MaxText's ``jax.value_and_grad(..., argnums=(0, 1), has_aux=True)``, plus
    the statistics: ``fn(curr_params, custom_params, rest, config, data) -> (value, grads, stats)``.

    ``gradient_accumulation_steps = k > 1`` runs ``k`` micro-batches (``num_microbatches=k``). MaxText's loss is
    then ``xent_sum`` of the micro-batch (unnormalised); it is weighted ``k / W`` with ``W`` the global batch's
    token count, so the mean over micro-batches is MaxText's ``Σ xent_sum / Σ W`` (its own accumulation), and the
    logged ``xent_sum`` is the sum over micro-batches.
    """
    k = config.gradient_accumulation_steps

    def loss(params, rest, data, total):
        value, (aux, non_param_rest) = diff_wrapper(params[0], params[1], rest, config, data)
        if k > 1:
            value = value * (k / total)
        return value, (aux, non_param_rest)

    def fn(curr_params, custom_params, rest, config_, data):
        del config_
        total = jnp.sum(data["targets_segmentation"] != 0).astype(jnp.float32)
        grad_fn = optax_adascale.value_and_grad(
            loss, data_axes=data_axes(config, data["inputs"]), num_microbatches=k, has_aux=True
        )
        (value, (aux, non_param_rest)), grads, stats = grad_fn((curr_params, custom_params), rest, data, total)
        if k > 1:
            aux = dict(aux, xent_sum=aux["xent_sum"] * k)  # floating aux is averaged: MaxText logs the sum
            # each micro-batch advanced the same RNG counters once from the same state: summed, they are k times it
            non_param_rest = jax.tree.map(lambda x: x // k if x.dtype == jnp.uint32 else x, non_param_rest)
        if CHECK:
            _record(diff_wrapper, config, k, (curr_params, custom_params), rest, data, total, grads)
        return (value, (aux, non_param_rest)), grads, stats

    return fn


def extra(stats: list[Any]) -> dict[str, Any]:
    """The keywords for ``state.apply_gradients``: ``microbatch_stats`` when AdaScale is on, for the trained
    parameters (``curr_params``: the optimizer's ``wrt``), as plain dicts like the gradients the optimizer gets."""
    if not stats:
        return {}
    from flax import nnx

    (s,) = stats
    pure = nnx.as_pure  # the optimizer is given nnx.as_pure(nnx.state(grads, wrt))
    return {
        "microbatch_stats": optax_adascale.MicrobatchStats(
            pure(s.sq_norms[0]), s.num_microbatches, mean_sq_norms=pure(s.mean_sq_norms[0])
        )
    }


def _record(diff_wrapper, config, k, params, rest, data, total, grads):
    """MaxText's own gradient of the same loss (k > 1: its accumulation, Σ over micro-batches of the gradient of
    xent_sum, divided by the global token count) against ours, recorded on the host."""
    own = jax.grad(lambda p, d: diff_wrapper(p[0], p[1], rest, config, d)[0])
    if k == 1:
        ref = own(params, data)
    else:
        rows = data["inputs"].shape[0] // k
        parts = [own(params, jax.tree.map(lambda x, j=j: x[j * rows : (j + 1) * rows], data)) for j in range(k)]
        ref = jax.tree.map(lambda *g: sum(g) / total, *parts)
    diff = optax_adascale_norm(jax.tree.map(lambda a, b: a.astype(jnp.float32) - b.astype(jnp.float32), grads, ref))
    jax.debug.callback(
        lambda d, r: CHECKS.append({"grad_rel_error": float(d) / max(float(r), 1e-30), "grad_norm": float(r)}),
        diff,
        optax_adascale_norm(ref),
    )


def optax_adascale_norm(tree) -> jax.Array:
    leaves = [jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)]
    return jnp.sqrt(sum(leaves))

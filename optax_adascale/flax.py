"""Flax integration: a Linen ``TrainState`` whose ``apply_gradients`` forwards optax extra arguments.

Import this module only where Flax is installed (``pip install optax_adascale[flax]``);
``import optax_adascale`` never imports Flax.

What Flax users need, and what they do not:

* Linen: :class:`TrainState` below. Flax's own ``TrainState.apply_gradients(grads=..., **kwargs)``
  treats every keyword as a field replacement, so ``microbatch_stats=`` (from
  :func:`optax_adascale.value_and_grad`) cannot reach ``tx.update``. Ours forwards
  the keywords that are not fields to ``tx.update``.
* Reading the state needs no wrapper: :func:`optax_adascale.metrics`,
  :func:`optax_adascale.scale_invariant_steps` and :func:`optax_adascale.get_adascale_state`
  search any pytree, so they accept a Linen ``TrainState`` (ours or Flax's), its
  ``opt_state``, an NNX ``nnx.Optimizer`` or its ``opt_state``, and return plain arrays.
* NNX needs nothing: ``nnx.Optimizer(model, tx, wrt=nnx.Param).update(model, grads, **kwargs)``
  already forwards keywords, e.g. ``optimizer.update(model, grads, microbatch_stats=stats)``.

Data parallelism is unchanged: inside ``jax.pmap``, ``jax.shard_map`` or
``jax.vmap(..., axis_name=...)`` pass each replica's *local* gradients to
``state.apply_gradients(grads=...)``; the transformation averages them (under
``jax.shard_map`` differentiate with respect to
``jax.lax.pcast(state.params, axis, to="varying")``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import optax
from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT
from flax.training import train_state

__all__ = ("TrainState",)


class TrainState(train_state.TrainState):
    """Flax's Linen ``TrainState``; ``apply_gradients`` also forwards optax extra arguments.

    ``apply_gradients(grads=..., **kwargs)`` splits ``kwargs``: names that are
    fields of the state (``params``, ``opt_state``, or fields a subclass adds,
    such as ``batch_stats``) are replaced in the returned state, exactly as in
    Flax; every other keyword is passed to ``tx.update``. With an AdaScale
    ``tx`` that is ``microbatch_stats=`` from
    :func:`optax_adascale.value_and_grad`; other keywords reach
    ``inner`` (an ``optax.GradientTransformationExtraArgs``). Without extra
    keywords it behaves exactly like Flax's ``TrainState``.

    Examples:
      Four micro-batches in one step: AdaScale estimates the gradient variance
      from them, without an axis or accumulation.

      >>> import jax, jax.numpy as jnp, flax.linen as nn, optax
      >>> import optax_adascale
      >>> from optax_adascale.flax import TrainState
      >>> model = nn.Dense(1)
      >>> x = jnp.arange(8.0).reshape(4, 2)
      >>> state = TrainState.create(
      ...     apply_fn=model.apply,
      ...     params=model.init(jax.random.key(0), x)["params"],
      ...     tx=optax_adascale.adascale_sgd(0.01),
      ... )
      >>> def loss_fn(params, x):
      ...     return jnp.mean(model.apply({"params": params}, x) ** 2)
      >>> grad_fn = optax_adascale.value_and_grad(loss_fn, num_microbatches=4)
      >>> loss, grads, stats = grad_fn(state.params, x)
      >>> state = state.apply_gradients(grads=grads, microbatch_stats=stats)
      >>> state.step, optax_adascale.metrics(state)["scale"]
      (1, Array(4., dtype=float32))
    """

    def apply_gradients(self, *, grads: Any, **kwargs: Any) -> TrainState:
        """Apply ``tx`` to ``grads``; forward non-field ``kwargs`` to ``tx.update``.

        Args:
          grads: gradients shaped like ``params`` (under data parallelism, this
            replica's local gradients).
          **kwargs: fields of the state to replace in the result, and extra
            arguments for ``tx.update`` (e.g. ``microbatch_stats=``).

        Returns:
          The state with ``step`` incremented, ``params`` and ``opt_state``
          updated, and the given fields replaced.
        """
        field_names = {f.name for f in dataclasses.fields(self)}
        replace = {k: v for k, v in kwargs.items() if k in field_names}
        extra_args = {k: v for k, v in kwargs.items() if k not in field_names}

        overwrite = OVERWRITE_WITH_GRADIENT in grads
        grads_with_opt = grads["params"] if overwrite else grads
        params_with_opt = self.params["params"] if overwrite else self.params
        updates, new_opt_state = self.tx.update(grads_with_opt, self.opt_state, params_with_opt, **extra_args)
        new_params_with_opt = optax.apply_updates(params_with_opt, updates)
        if overwrite:
            new_params = {"params": new_params_with_opt, OVERWRITE_WITH_GRADIENT: grads[OVERWRITE_WITH_GRADIENT]}
        else:
            new_params = new_params_with_opt
        return self.replace(step=self.step + 1, params=new_params, opt_state=new_opt_state, **replace)

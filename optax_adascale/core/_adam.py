"""AdaScale with Adam directions: the preconditioned-statistics hook (see the package README, "Adam")."""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax


def adam_preconditioner(b2: float = 0.999, eps: float = 1e-8, relative_floor: float = 1e-2) -> Callable[[Any], Any]:
    r"""``precondition=`` for :func:`optax_adascale.experimental.adascale`: statistics on Adam-preconditioned gradients.

    Returns ``inner_state -> P`` with ``P = 1/(\sqrt{v̂} + ε)``, ``v̂ = ν/(1 − β₂^t)``
    read from the ``optax.scale_by_adam`` state inside ``inner`` — the second
    moment of the *previous* update (the statistics are taken before this
    update's ``inner`` runs, as AdaptDL's ``AdamScale`` does). Before the first
    update (``t = 0``) ``P = 1``. ``v̂`` is floored at ``relative_floor`` times
    its leaf's mean: a coordinate whose past gradients were (near) zero —
    a rare token's embedding row — would otherwise get ``P ≈ 1/ε`` and one
    such sample would dominate the moving averages for the rest of the run
    (the gain pinned at ``S``). The floor bounds ``P`` at ``1/√floor`` (10× by
    default) of the leaf's typical value. The samples become ``P ⊙ g_i``: the noise is
    measured in the geometry in which Adam steps. Cost: one more read of ``ν``
    for each of the two squared norms (``‖P ⊙ g_i‖²`` and ``‖P ⊙ ḡ‖²``).

    Args:
      b2: Adam's ``β₂`` (as given to ``optax.scale_by_adam``).
      eps: Adam's ``ε``.
      relative_floor: floor of ``v̂`` relative to its leaf's mean (0 disables it).

    Returns:
      A function of ``inner``'s state.

    Examples:
      >>> import jax.numpy as jnp, optax, optax_adascale
      >>> from optax_adascale import experimental
      >>> tx = experimental.adascale(optax.scale_by_adam(), 1e-3, accumulation_steps=2,
      ...                            precondition=experimental.adam_preconditioner())
      >>> state = tx.init(jnp.zeros(2))
      >>> for g in (jnp.array([1.0, 0.0]), jnp.array([0.0, 1.0])):
      ...     _, state = tx.update(g, state)
      >>> optax_adascale.metrics(state)["gain"]
      Array(2., dtype=float32)
    """

    def precondition(inner_state: Any) -> Any:
        adam = optax.tree.get(
            inner_state, "ScaleByAdamState", filtering=lambda _, v: isinstance(v, optax.ScaleByAdamState)
        )
        if adam is None:
            raise ValueError(
                "adam_preconditioner: inner has no optax.scale_by_adam state to read the second "
                "moment from; use it with inner=optax.scale_by_adam() (or a chain containing it)"
            )
        started = adam.count > 0
        # Adam's own bias correction (optax.tree.bias_correction), guarded for t = 0.
        v_hat = optax.tree.bias_correction(adam.nu, b2, jnp.maximum(adam.count, 1))

        def leaf(v):
            v = v.astype(jnp.float32)
            v = jnp.maximum(v, relative_floor * jnp.mean(v)) if v.size else v
            return jnp.where(started, 1.0 / (jnp.sqrt(v) + eps), 1.0)

        return jax.tree.map(leaf, v_hat)

    return precondition

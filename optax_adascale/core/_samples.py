"""This call's gradient samples: where each replica's squared sample norms come from.

From the gradients themselves (one sample per replica, optionally preconditioned), or from statistics computed
outside the optimizer (``microbatch_stats``: micro-batches, the GSPMD drop-in, FSDP probes).
"""

from typing import Any

import jax

from optax_adascale.core import _norms
from optax_adascale.core._microbatch import MicrobatchStats

Array = jax.Array


def fsdp_statistics(microbatch_stats: Any, accumulation_steps: int) -> bool:
    """Whether the statistics are FSDP probes' (the gradients are already reduce-scattered rows)."""
    if microbatch_stats is not None and not isinstance(microbatch_stats, MicrobatchStats):
        raise TypeError(
            "microbatch_stats must be a MicrobatchStats (from value_and_grad, or the gradient of fsdp_probes), "
            f"got {type(microbatch_stats).__name__}"
        )
    if microbatch_stats is None or not microbatch_stats.fsdp:
        return False
    if accumulation_steps != 1 or microbatch_stats.num_microbatches != 1:
        raise ValueError(
            "FSDP statistics (fsdp_probes) work with one sample per replica per update: "
            f"got accumulation_steps={accumulation_steps}; use more data-parallel replicas"
        )
    return True


def preconditioner(precondition: Any, inner_state: Any, grads: Any, microbatch_stats: Any) -> list[Array] | None:
    """The per-leaf multipliers ``P`` of the statistics (``precondition(inner_state)``), or ``None``."""
    if precondition is None:
        return None
    if microbatch_stats is not None:
        raise ValueError(
            "precondition needs the gradients themselves: it cannot be combined with microbatch_stats "
            "(use accumulation_steps or more replicas)"
        )
    weights = precondition(inner_state)
    if weights is None:
        return None
    try:
        return jax.tree.structure(grads).flatten_up_to(weights)
    except (ValueError, TypeError) as err:
        raise ValueError("precondition must return multipliers shaped like the params") from err


def local_sq_norms(
    grads: Any, microbatch_stats: MicrobatchStats | None, weights: list[Array] | None = None
) -> tuple[list[Array], int]:
    """This replica's per-leaf mean squared sample norm (of ``P ⊙ g`` with weights), and its number of samples.

    ``microbatch_stats`` has been type-checked by :func:`fsdp_statistics`.
    """
    treedef = jax.tree.structure(grads)
    if microbatch_stats is None:
        leaves = jax.tree.leaves(grads)
        if weights is not None:
            leaves = [g * w for g, w in zip(leaves, weights, strict=True)]
        return [_norms.leaf_sq_norm(g) for g in leaves], 1
    try:
        leaves = treedef.flatten_up_to(microbatch_stats.sq_norms)
    except (ValueError, TypeError) as err:
        raise ValueError("microbatch_stats.sq_norms must have the structure of the gradients") from err
    return leaves, microbatch_stats.num_microbatches


def given_mean_sq_norms(grads: Any, microbatch_stats: MicrobatchStats | None) -> list[Array] | None:
    """``‖ḡ‖²`` per leaf where the samples were taken (the GSPMD drop-in's ``mean_sq_norms``), or ``None``."""
    if microbatch_stats is None or microbatch_stats.mean_sq_norms is None:
        return None
    try:
        return jax.tree.structure(grads).flatten_up_to(microbatch_stats.mean_sq_norms)
    except (ValueError, TypeError) as err:
        raise ValueError("microbatch_stats.mean_sq_norms must have the structure of the gradients") from err

"""AdaScale SGD as a pure-functional optax gradient transformation for JAX data parallelism.

Johnson, Agrawal, Gu, Guestrin, "AdaScale SGD: A User-Friendly Algorithm for
Distributed Training", ICML 2020, https://arxiv.org/abs/2007.05105.
"""

from optax_adascale import scaling_rules
from optax_adascale._adascale import (
    AdaScaleState,
    adascale,
    adascale_sgd,
    get_adascale_state,
    metrics,
    replicate_buffers,
    scale_invariant_steps,
    state_axes,
    state_partition_specs,
    transfer_state,
)
from optax_adascale._collect import MicrobatchStats, value_and_microbatch_grad

__version__ = "0.1.0"

__all__ = (
    "AdaScaleState",
    "MicrobatchStats",
    "adascale",
    "adascale_sgd",
    "get_adascale_state",
    "metrics",
    "replicate_buffers",
    "scaling_rules",
    "scale_invariant_steps",
    "state_axes",
    "state_partition_specs",
    "transfer_state",
    "value_and_microbatch_grad",
)

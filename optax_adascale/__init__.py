"""AdaScale SGD as a pure-functional optax gradient transformation for JAX data parallelism.

Johnson, Agrawal, Gu, Guestrin, "AdaScale SGD: A User-Friendly Algorithm for
Distributed Training", ICML 2020, https://arxiv.org/abs/2007.05105.
"""

from optax_adascale import goodput, scaling_rules
from optax_adascale._adam import adam_preconditioner
from optax_adascale._adascale import AdaScaleState, adascale
from optax_adascale._alias import adascale_adamw, adascale_sgd
from optax_adascale._fsdp import fsdp_gather, fsdp_probes, fsdp_shard, fsdp_unshard
from optax_adascale._microbatch import MicrobatchStats, value_and_microbatch_grad
from optax_adascale._state import (
    done,
    get_adascale_state,
    metrics,
    noise_scale,
    replicate_buffers,
    scale_invariant_steps,
    state_axes,
    state_partition_specs,
    transfer_state,
)
from optax_adascale._zero import ShardedInnerState, clip_by_global_norm, elementwise

__version__ = "0.2.0.dev0"

__all__ = (
    "AdaScaleState",
    "MicrobatchStats",
    "ShardedInnerState",
    "adam_preconditioner",
    "adascale",
    "adascale_adamw",
    "adascale_sgd",
    "clip_by_global_norm",
    "done",
    "elementwise",
    "fsdp_gather",
    "fsdp_probes",
    "fsdp_shard",
    "fsdp_unshard",
    "get_adascale_state",
    "goodput",
    "metrics",
    "noise_scale",
    "replicate_buffers",
    "scaling_rules",
    "scale_invariant_steps",
    "state_axes",
    "state_partition_specs",
    "transfer_state",
    "value_and_microbatch_grad",
)

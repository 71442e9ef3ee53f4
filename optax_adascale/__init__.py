"""AdaScale SGD as a pure-functional optax gradient transformation for JAX data parallelism.

Johnson, Agrawal, Gu, Guestrin, "AdaScale SGD: A User-Friendly Algorithm for
Distributed Training", ICML 2020, https://arxiv.org/abs/2007.05105.
"""

import sys as _sys

from optax_adascale import experimental
from optax_adascale._alias import adascale_adamw, adascale_sgd
from optax_adascale._factories import adascale
from optax_adascale._placement import replicate_buffers, state_axes, state_partition_specs, transfer_state
from optax_adascale._state import (
    batch_plan,
    done,
    get_adascale_state,
    metrics,
    scale_advice,
    scale_invariant_steps,
)
from optax_adascale.core._adascale import AdaScaleState
from optax_adascale.core._clock import BaseSteps, scale_by_adam, trace
from optax_adascale.core._estimator import Estimator
from optax_adascale.core._microbatch import value_and_microbatch_grad as value_and_microbatch_grad  # deprecated
from optax_adascale.core._ramp import BatchRamp, RampInputs, RampState
from optax_adascale.core._samples import MicrobatchStats
from optax_adascale.gspmd import value_and_grad
from optax_adascale.sharding._fsdp import fsdp_gather, fsdp_probes, fsdp_shard, fsdp_unshard
from optax_adascale.sharding._stand_in import elementwise
from optax_adascale.sharding._zero import ShardedInnerState, clip_by_global_norm
from optax_adascale.tools import goodput, scaling_rules
from optax_adascale.tools._averages import base_step_average
from optax_adascale.tools._noise import NoiseScaleState, noise_scale_monitor

# The public modules keep their paths: ``import optax_adascale.goodput`` is the tools wing's module.
_sys.modules[__name__ + ".goodput"] = goodput
_sys.modules[__name__ + ".scaling_rules"] = scaling_rules

__version__ = "0.5.0"

__all__ = (
    "AdaScaleState",
    "BaseSteps",
    "BatchRamp",
    "Estimator",
    "MicrobatchStats",
    "NoiseScaleState",
    "RampInputs",
    "RampState",
    "ShardedInnerState",
    "adascale",
    "adascale_adamw",
    "adascale_sgd",
    "base_step_average",
    "batch_plan",
    "clip_by_global_norm",
    "done",
    "elementwise",
    "experimental",
    "fsdp_gather",
    "fsdp_probes",
    "fsdp_shard",
    "fsdp_unshard",
    "get_adascale_state",
    "goodput",
    "metrics",
    "noise_scale_monitor",
    "replicate_buffers",
    "scale_advice",
    "scale_by_adam",
    "scale_invariant_steps",
    "scaling_rules",
    "state_axes",
    "state_partition_specs",
    "trace",
    "transfer_state",
    "value_and_grad",
)

# Deprecated (warns; not in __all__): value_and_microbatch_grad -> value_and_grad(loss_fn, num_microbatches=k).

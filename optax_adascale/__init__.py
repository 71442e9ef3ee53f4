"""AdaScale SGD as a pure-functional optax gradient transformation for JAX data parallelism.

Johnson, Agrawal, Gu, Guestrin, "AdaScale SGD: A User-Friendly Algorithm for
Distributed Training", ICML 2020, https://arxiv.org/abs/2007.05105.
"""

from optax_adascale._adascale import AdaScaleState
from optax_adascale._adascale import adascale
from optax_adascale._adascale import adascale_sgd
from optax_adascale._adascale import get_adascale_state
from optax_adascale._adascale import metrics
from optax_adascale._adascale import replicate_buffers
from optax_adascale._adascale import scale_invariant_steps
from optax_adascale._adascale import state_axes
from optax_adascale._adascale import state_partition_specs
from optax_adascale._adascale import transfer_state
from optax_adascale._collect import MicrobatchStats
from optax_adascale._collect import value_and_microbatch_grad

__version__ = "0.1.0"

__all__ = (
    "AdaScaleState",
    "MicrobatchStats",
    "adascale",
    "adascale_sgd",
    "get_adascale_state",
    "metrics",
    "replicate_buffers",
    "scale_invariant_steps",
    "state_axes",
    "state_partition_specs",
    "transfer_state",
    "value_and_microbatch_grad",
)

"""The drop-in for ``jax.value_and_grad`` in a ``jax.jit`` step over the global batch (MaxText, Levanter, Flax lm1b)."""

from optax_adascale.gspmd._drop_in import value_and_grad

__all__ = ("value_and_grad",)

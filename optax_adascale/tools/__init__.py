"""Tools around AdaScale: the noise-scale monitor for any optimizer, the goodput advisor (``optax_adascale.goodput``)
and the fixed scaling rules (``optax_adascale.scaling_rules``)."""

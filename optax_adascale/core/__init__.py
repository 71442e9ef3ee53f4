"""The core transformation: the estimator, the options, one update in named steps, accumulation, the samples and
their collection over named axes, parameter groups, norms, and reading the state. Internal: the public names are
``optax_adascale.__all__``."""

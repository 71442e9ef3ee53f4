"""The public API: pinned names, docstrings, and no Flax import at the top level."""

import inspect
import subprocess
import sys

import optax

import optax_adascale

PINNED = ("adascale", "adascale_sgd", "AdaScaleState", "get_adascale_state", "scale_invariant_steps", "metrics")


def test_pinned_names_are_exported():
    assert set(PINNED) <= set(optax_adascale.__all__)


def test_every_public_name_has_a_docstring():
    for name in optax_adascale.__all__:
        obj = getattr(optax_adascale, name)
        assert inspect.getdoc(obj), name
    for name in optax_adascale.scaling_rules.__all__:
        assert inspect.getdoc(getattr(optax_adascale.scaling_rules, name)), name


def test_factories_take_explicit_keywords_only_after_the_optimizer_arguments():
    for fn in (optax_adascale.adascale, optax_adascale.adascale_sgd):
        params = inspect.signature(fn).parameters.values()
        assert not any(p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL) for p in params), fn.__name__
    keywords = {"axis_name", "accumulation_steps", "scale", "smoothing", "eps", "param_labels"}
    assert keywords <= set(inspect.signature(optax_adascale.adascale).parameters)
    assert isinstance(optax_adascale.adascale_sgd(0.1), optax.GradientTransformationExtraArgs)


def test_metrics_keys_are_pinned():
    m = optax_adascale.metrics(optax_adascale.adascale_sgd(0.1).init({"w": 0.0}))
    assert set(m) == {"gain", "scale_invariant_steps", "grad_sqr", "grad_var", "learning_rate", "scale",
                      "skipped_steps"}


def test_importing_the_package_does_not_import_flax():
    code = "import sys, optax_adascale; assert 'flax' not in sys.modules, 'flax imported'"
    subprocess.run([sys.executable, "-c", code], check=True)

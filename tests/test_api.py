"""The public API: pinned names, docstrings, and no Flax import at the top level."""

import inspect
import subprocess
import sys

import optax
import pytest

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
    keywords = {
        "axis_name",
        "accumulation_steps",
        "scale",
        "smoothing",
        "eps",
        "param_labels",
        "shard_optimizer_state",
        "delayed_gain",
    }
    for fn in (optax_adascale.adascale, optax_adascale.adascale_sgd):
        params = inspect.signature(fn).parameters
        assert keywords <= set(params), fn.__name__
        assert all(params[k].kind is inspect.Parameter.KEYWORD_ONLY for k in keywords), fn.__name__
    positional = list(inspect.signature(optax_adascale.adascale_sgd).parameters)[:4]
    assert positional == ["learning_rate", "momentum", "nesterov", "weight_decay"]
    assert isinstance(optax_adascale.adascale_sgd(0.1), optax.GradientTransformationExtraArgs)


ADASCALE_OPTIONS = {  # the main factory's options and their defaults: every other factory spells them so
    name: param.default
    for name, param in inspect.signature(optax_adascale.adascale).parameters.items()
    if param.kind is inspect.Parameter.KEYWORD_ONLY
}


@pytest.mark.parametrize(
    "factory",
    [optax_adascale.adascale_sgd, optax_adascale.adascale_adamw, optax_adascale.experimental.adascale],
    ids=["adascale_sgd", "adascale_adamw", "experimental.adascale"],
)
def test_every_factory_spells_each_adascale_option_one_way(factory):
    # The one exception: adascale_adamw's `eps` is Adam's ε, so AdaScale's floor is `variance_eps` there.
    renamed = {"variance_eps": "eps"} if factory is optax_adascale.adascale_adamw else {}
    params = inspect.signature(factory).parameters
    own = {"nesterov"} if factory is optax_adascale.adascale_adamw else set()  # optax.adamw's keyword-only one
    for name, param in params.items():
        option = renamed.get(name, name)
        if param.kind is not inspect.Parameter.KEYWORD_ONLY or name in own:
            continue
        if option in ADASCALE_OPTIONS:
            assert param.default == ADASCALE_OPTIONS[option], (factory.__name__, name)
        else:  # only the experiments may add options, and only in optax_adascale.experimental
            assert factory is optax_adascale.experimental.adascale, (factory.__name__, name)
            assert name in {"averaging", "gain_exponent", "precondition", "memory_fraction"}, name
    experiments = {"averaging", "gain_exponent", "precondition", "memory_fraction"}
    assert not ({"variance_eps", "fsdp_sq_norms"} | experiments) & set(ADASCALE_OPTIONS)


def test_value_and_grad_has_the_pinned_keywords_and_update_takes_one_statistics_keyword():
    params = inspect.signature(optax_adascale.value_and_grad).parameters
    assert list(params)[:5] == ["loss_fn", "data_axes", "num_microbatches", "has_aux", "mesh"]
    assert [params[k].default for k in ("data_axes", "num_microbatches", "has_aux", "mesh")] == [None, 1, False, None]
    update = optax_adascale.adascale_sgd(0.1).update
    keywords = {n for n, p in inspect.signature(update).parameters.items() if p.kind is p.KEYWORD_ONLY}
    assert keywords == {"microbatch_stats"}


def test_learning_rate_is_annotated_as_optax_scalar_or_schedule():
    # optax's own harness runs its schedule test only for this exact annotation object.
    for fn in (optax_adascale.adascale, optax_adascale.adascale_sgd):
        assert inspect.signature(fn).parameters["learning_rate"].annotation is optax.ScalarOrSchedule


PINNED_METRICS = {"gain", "scale_invariant_steps", "grad_sqr", "grad_var", "learning_rate", "scale", "skipped_steps"}
DOCUMENTED_METRICS = {"base_learning_rate", "floored_steps", "noise_scale"}


def test_metrics_keys_are_the_pinned_ones_plus_documented_additions():
    m = optax_adascale.metrics(optax_adascale.adascale_sgd(0.1).init({"w": 0.0}))
    assert PINNED_METRICS <= set(m)
    assert set(m) - PINNED_METRICS <= DOCUMENTED_METRICS
    doc = inspect.getdoc(optax_adascale.metrics)
    assert all(f"``{key}``" in doc for key in set(m))


@pytest.mark.slow  # starts an interpreter
def test_importing_the_package_does_not_import_flax():
    code = "import sys, optax_adascale; assert 'flax' not in sys.modules, 'flax imported'"
    subprocess.run([sys.executable, "-c", code], check=True)

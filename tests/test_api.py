"""The public API: pinned names, docstrings, and no Flax import at the top level."""

import inspect
import re
import subprocess
import sys

import jax.numpy as jnp
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


ADASCALE_OPTIONS = {  # the main factory's options and their defaults: every other factory spells them so
    name: param.default
    for name, param in inspect.signature(optax_adascale.adascale).parameters.items()
    if param.kind is inspect.Parameter.KEYWORD_ONLY
}
MOST_SET = ("axis_name", "accumulation_steps", "scale", "estimator")  # the aliases' explicit AdaScale options


def test_adascale_takes_at_most_nine_explicit_keywords_and_catches_only_0_2_spellings():
    params = inspect.signature(optax_adascale.adascale).parameters
    assert list(params)[:2] == ["inner", "learning_rate"]
    assert len(ADASCALE_OPTIONS) <= 9 and set(MOST_SET) <= set(ADASCALE_OPTIONS)
    assert [p.kind for p in params.values()][-1] is inspect.Parameter.VAR_KEYWORD
    with pytest.raises(TypeError, match="unexpected keyword argument 'smoothings'"):
        optax_adascale.adascale(optax.identity(), 0.1, smoothings=0.9)


@pytest.mark.parametrize(
    "factory, own",
    [
        (optax_adascale.adascale_sgd, ["learning_rate", "momentum", "nesterov", "weight_decay"]),
        (
            optax_adascale.adascale_adamw,
            ["learning_rate", "b1", "b2", "eps", "eps_root", "mu_dtype", "weight_decay", "mask", "nesterov"],
        ),
    ],
    ids=["adascale_sgd", "adascale_adamw"],
)
def test_aliases_take_their_optimizers_keywords_plus_four_adascale_options_and_the_clock(factory, own):
    params = inspect.signature(factory).parameters
    named = [n for n, p in params.items() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    assert named == own + list(MOST_SET) + ["clock"]  # DESIGN §2's pinned signatures
    assert params["clock"].default is None and params["clock"].kind is inspect.Parameter.KEYWORD_ONLY
    assert all(params[k].default == ADASCALE_OPTIONS[k] for k in MOST_SET)
    # Every other option of adascale reaches it through **options.
    tx = factory(0.1, axis_name="i", param_labels={"w": "a"}, delayed_gain=True, shard_optimizer_state=None)
    assert isinstance(tx, optax.GradientTransformationExtraArgs)
    with pytest.raises(TypeError, match="unexpected keyword argument 'momentun'"):
        factory(0.1, momentun=0.9)
    # The clock is a keyword of its own, also through inject_hyperparams (a string: static by itself).
    # Two orthogonal micro-batches (estimated gain 2, ḡ = (0.5, 0.5)). SGD's default τ clock is guarded: the first
    # update's gain is min(2, 1.1·max(1, 1)) = 1.1 and its buffer holds 1.1 base steps, (1 − 0.9^1.1)/(1 − 0.9)·ḡ, so
    # its step is 1.1·0.1·(1 − 0.9^1.1)/0.1·0.5 ≈ 0.0602; the update clock applies the gain 2 to a buffer of one step,
    # 2·0.1·0.5 = 0.1. Adam has no guard: √2·0.1 against 2·0.1 (its direction is ±1 per coordinate).
    sgd = factory is optax_adascale.adascale_sgd
    sgd_tau = 1.1 * 0.1 * (1 - 0.9**1.1) / (1 - 0.9) * 0.5
    expected = {"tau": sgd_tau if sgd else 0.1 * 2**0.5, "update": 0.1 if sgd else 0.2}
    for clock, step in expected.items():
        keywords = dict(momentum=0.9, weight_decay=0.0) if sgd else dict(weight_decay=0.0)
        injected = optax.inject_hyperparams(factory, static_args=("accumulation_steps",))(
            learning_rate=0.1, accumulation_steps=2, clock=clock, **keywords
        )
        state = injected.init(jnp.zeros(2))
        _, state = injected.update(jnp.array([1.0, 0.0]), state, jnp.zeros(2))
        updates, _ = injected.update(jnp.array([0.0, 1.0]), state, jnp.zeros(2))
        assert jnp.allclose(updates, -step, rtol=1e-5), (clock, updates)
    with pytest.raises(ValueError, match="clock"):
        factory(0.1, clock="steps")


@pytest.mark.parametrize(
    "name, value, spelled",
    [
        ("smoothing", 0.99, "Estimator(smoothing=0.99, unbiased_sqr=False)"),
        ("horizon", 50.0, "Estimator(horizon=50.0, unbiased_sqr=False)"),
        ("unbiased_sqr", True, "Estimator(unbiased_sqr=True)"),
        ("eps", 1e-5, "Estimator(eps=1e-05)"),
    ],
)
def test_the_0_2_estimator_keywords_work_and_warn_with_the_new_spelling(name, value, spelled):
    for factory in (optax_adascale.adascale_sgd, lambda lr, **kw: optax_adascale.adascale(optax.identity(), lr, **kw)):
        with pytest.warns(DeprecationWarning, match=re.escape(f"estimator=optax_adascale.{spelled}")):
            factory(0.1, **{name: value})
    with pytest.raises(ValueError, match="estimator= only"):
        optax_adascale.adascale_sgd(0.1, estimator="fairscale", **{name: value})


def test_inject_hyperparams_works_with_the_explicit_keywords_static_and_options_passed_through():
    inject = optax.inject_hyperparams(optax_adascale.adascale_sgd, static_args=("learning_rate", "accumulation_steps"))
    tx = inject(
        learning_rate=optax.linear_schedule(0.1, 0.0, 10),
        momentum=0.9,
        accumulation_steps=2,
        param_labels={"w": "a"},
        estimator="fairscale",
    )
    state = tx.init({"w": jnp.zeros(2)})
    assert float(state.hyperparams["momentum"]) == pytest.approx(0.9)
    assert optax_adascale.get_adascale_state(state).group_gains.keys() == {"a"}


def test_value_and_grad_has_the_pinned_keywords_and_update_takes_one_statistics_keyword():
    params = inspect.signature(optax_adascale.value_and_grad).parameters
    assert list(params)[:6] == ["loss_fn", "data_axes", "num_microbatches", "has_aux", "mesh", "param_specs"]
    pinned = ("data_axes", "num_microbatches", "has_aux", "mesh", "param_specs")
    assert [params[k].default for k in pinned] == [None, 1, False, None, None]
    assert all(params[k].kind is inspect.Parameter.KEYWORD_ONLY for k in list(params)[1:])
    update = optax_adascale.adascale_sgd(0.1).update
    keywords = {n for n, p in inspect.signature(update).parameters.items() if p.kind is p.KEYWORD_ONLY}
    assert keywords == {"microbatch_stats"}


def test_learning_rate_is_annotated_as_optax_scalar_or_schedule():
    # optax's own harness runs its schedule test only for this exact annotation object.
    for fn in (optax_adascale.adascale, optax_adascale.adascale_sgd):
        assert inspect.signature(fn).parameters["learning_rate"].annotation is optax.ScalarOrSchedule


PINNED_METRICS = {"gain", "scale_invariant_steps", "grad_sqr", "grad_var", "learning_rate", "scale", "skipped_steps"}
DOCUMENTED_METRICS = {
    "base_learning_rate",
    "curvature",
    "estimated_gain",
    "gain_limit",
    "floored_steps",
    "noise_scale",
    "noise_scale_measured",
    "skipped_nonfinite_steps",
    "skipped_negative_lr_steps",
    "skipped_altered_grads_steps",
}


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

"""The fixed rules of ``benchmarks/large_batch/engine.py`` against ``optax_adascale.scaling_rules``."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks.large_batch import engine
from optax_adascale import scaling_rules

T, PEAK = 1000, 0.3
UNIT = optax.piecewise_constant_schedule(1.0, {500: 0.1, 750: 0.1})  # the scaling tasks' step decay
BASE = optax.piecewise_constant_schedule(PEAK, {500: 0.1, 750: 0.1})
TIMES = np.arange(0, 400, 7)


def _ours_and_reference(cases):
    """``[(rule, S, N, reference schedule)]`` → (ours, reference), rows per case, at every t of TIMES.

    One compiled call; the rule index, N and the peak are traced, as in the compiled runs."""

    @jax.jit
    def both(t, indices, ns, peak):
        ours = [engine.rule_schedule(UNIT, i, c[1], T, n, peak)(t) for i, n, c in zip(indices, ns, cases, strict=True)]
        return jnp.stack(ours), jnp.stack([c[3](t) for c in cases])

    indices = [jnp.int32(engine.RULES.index(c[0])) for c in cases]
    ns = [jnp.int32(c[2]) for c in cases]
    ours, want = both(TIMES, indices, ns, jnp.float32(PEAK))
    return np.asarray(ours), np.asarray(want)


def test_rules_match_scaling_rules():
    cases = [
        # stretched: LSW+ of the package
        ("LSW", 8, 333, scaling_rules.stretched_linear_warmup(BASE, 8, T, 333)),
        # N = T/S (S divides T): the base schedule at S base steps per iteration, as the paper's rules
        ("LSW", 4, 250, scaling_rules.linear_warmup(BASE, 4, T)),
        ("sqrt", 4, 250, scaling_rules.square_root(BASE, 4)),
        ("id", 4, 250, lambda t: BASE(4 * t)),
        ("id", 4, 1000, scaling_rules.identity(BASE)),
    ]
    ours, want = _ours_and_reference(cases)
    np.testing.assert_allclose(ours, want, rtol=1e-6)


def test_sqrt_with_warmup_ramps_from_the_base_rate_to_sqrt_s():
    # N = 400: the warm-up takes 5.5 % = 22 iterations; base steps t·T/N stay before the decay at 500.
    ramp = lambda t: PEAK * 4 * jnp.where(t < 22, 0.25 + 0.75 * t / 22, 1.0)  # noqa: E731
    ours, want = _ours_and_reference([("sqrtW", 16, 400, ramp)])
    np.testing.assert_allclose(ours[0][TIMES < 200], want[0][TIMES < 200], rtol=1e-6)
    assert np.isclose(ours[0][0], PEAK)  # c(0) = 1: the base rate

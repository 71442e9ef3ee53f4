"""The README's code stays true: its training loop runs to the budget, its one-device recipe scales.

The blocks are found by what they define (``T_SI`` and ``opt_state``; ``one_device_step``), not by their
position or the headings around them, so the README can be reorganised freely.
"""

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def python_block(defining: str) -> str:
    """The first ```python block of the README that contains ``defining``."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    found = [b for b in blocks if defining in b]
    if not found:
        pytest.fail(f"README.md has no ```python block containing {defining!r}; update tests/test_readme.py")
    return found[0]


def test_readme_usage_example_trains_until_the_budget(capsys):
    code = python_block("T_SI")
    namespace: dict = {}
    exec(compile(code, str(README), "exec"), namespace)  # noqa: S102 - our own documentation
    import optax_adascale

    m = optax_adascale.metrics(namespace["opt_state"])
    assert float(m["scale_invariant_steps"]) >= namespace["T_SI"]
    assert 1.0 <= float(m["gain"]) <= namespace["mesh"].size
    assert float(m["scale"]) == namespace["mesh"].size
    # Fewer iterations than base steps: the gain exceeded 1 somewhere.
    assert int(optax_adascale.get_adascale_state(namespace["opt_state"]).count) < namespace["T_SI"]
    assert "gain" in capsys.readouterr().out


def test_readme_one_device_block_scales_with_micro_batches():
    namespace: dict = {}
    # The imports and loss_fn of the usage example (everything before its mesh), then the one-device block.
    exec(compile(python_block("def loss_fn").split("mesh =")[0], str(README), "exec"), namespace)  # noqa: S102
    namespace["schedule"] = namespace["optax"].exponential_decay(0.05, transition_steps=200, decay_rate=0.5)
    exec(compile(python_block("def one_device_step"), str(README), "exec"), namespace)  # noqa: S102
    import jax.numpy as jnp
    import numpy as np

    import optax_adascale

    tx, step = namespace["tx"], namespace["one_device_step"]
    params = {"w": jnp.zeros((4, 1)), "b": jnp.zeros(1)}
    opt_state, rng = tx.init(params), np.random.default_rng(0)
    for _ in range(20):
        x = rng.normal(size=(8 * 32, 4)).astype(np.float32)
        params, opt_state = step(params, opt_state, x, x.sum(1, keepdims=True) + rng.normal(size=(len(x), 1)))
    m = optax_adascale.metrics(opt_state)
    assert float(m["scale"]) == 8.0
    assert 1.0 < float(m["gain"]) <= 8.0

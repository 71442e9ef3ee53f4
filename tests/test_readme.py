"""The README stays true: its usage example runs, and it opens with the two commands."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_opens_with_the_main_job_and_the_test_command():
    first_block = re.search(r"```bash\n(.*?)```", README.read_text(), re.S).group(1).splitlines()
    assert first_block == [
        'pip install -e ".[examples]" && python examples/train_mnist1d.py',
        'pip install -e ".[test]" && pytest',
    ]


def test_readme_usage_example_trains_until_the_budget(capsys):
    text = README.read_text()
    usage = text[text.index("## Usage") :]
    code = re.search(r"```python\n(.*?)```", usage, re.S).group(1)
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
    text = README.read_text()
    usage = text[text.index("## Usage") :]
    first, second = re.findall(r"```python\n(.*?)```", usage, re.S)[:2]
    namespace: dict = {}
    exec(compile(first.split("mesh =")[0], str(README), "exec"), namespace)  # noqa: S102 - imports, loss_fn
    namespace["schedule"] = namespace["optax"].exponential_decay(0.05, transition_steps=200, decay_rate=0.5)
    exec(compile(second, str(README), "exec"), namespace)  # noqa: S102
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

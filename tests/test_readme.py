"""The README stays true: its usage example runs, and it opens with the two commands."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_opens_with_a_command_for_the_main_job_and_one_for_the_tests():
    # Not a pin of the text: the first block installs and runs the flagship, then installs and runs pytest.
    main_job, tests = re.search(r"```bash\n(.*?)```", README.read_text(), re.S).group(1).splitlines()
    assert main_job.startswith("pip install") and "examples/train_mnist1d.py" in main_job
    assert tests.startswith("pip install") and tests.endswith("pytest")


def test_readmes_test_command_installs_the_versions_ci_last_verified():
    """The test command takes constraints.txt, whose newest JAX is the one the drop-in's warning names as tested
    (optax_adascale._compat.NEWEST_TESTED_JAX), and whose Python 3.11 pins are the oldest JAX the package claims."""
    from optax_adascale import _compat

    tests = re.search(r"```bash\n(.*?)```", README.read_text(), re.S).group(1).splitlines()[1]
    assert "-c constraints.txt" in tests
    pins = {}
    for line in (README.parent / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            requirement, _, marker = line.partition(";")
            name, version = requirement.strip().split("==")
            pins[(name, marker.strip())] = version
    newest = ".".join(map(str, _compat.NEWEST_TESTED_JAX))
    assert pins[("jax", 'python_version >= "3.12"')] == pins[("jaxlib", 'python_version >= "3.12"')] == newest
    oldest = pins[("jax", 'python_version < "3.12"')]
    assert f'"jax>={oldest}' in (README.parent / "pyproject.toml").read_text()


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


def test_readme_gspmd_block_takes_each_data_shard_as_a_sample():
    import optax_adascale

    text = README.read_text()
    usage = text[text.index("## Usage") :]
    first, second = re.findall(r"```python\n(.*?)```", usage, re.S)[:2]
    namespace: dict = {}
    exec(compile(first.split("tx =")[0], str(README), "exec"), namespace)  # noqa: S102 - imports, loss_fn, mesh
    exec(compile(second, str(README), "exec"), namespace)  # noqa: S102
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh, tx, step = namespace["mesh"], namespace["tx"], namespace["gspmd_step"]
    params = {"w": jnp.zeros((4, 1)), "b": jnp.zeros(1)}
    opt_state, rng = tx.init(params), np.random.default_rng(0)
    with jax.set_mesh(mesh):
        for _ in range(20):
            x = rng.normal(size=(32 * mesh.size, 4)).astype(np.float32)
            y = x.sum(1, keepdims=True) + rng.normal(size=(len(x), 1)).astype(np.float32)
            x, y = jax.device_put((x, y), NamedSharding(mesh, P("data")))
            params, opt_state = step(params, opt_state, x, y)
    m = optax_adascale.metrics(opt_state)
    assert float(m["scale"]) == mesh.size
    assert 1.0 < float(m["gain"]) <= mesh.size


def test_readme_says_how_long_its_pytest_takes_as_contributing_measured_it():
    text = " ".join(README.read_text().split())
    contributing = " ".join((README.parent / "CONTRIBUTING.md").read_text().split())
    said = re.search(r"slow tests included .*?about (\d+) minutes on (\d+) idle CPU cores", text)
    measured = re.search(r"The whole suite takes about (\d+) minutes on (\d+) CPU cores", contributing)
    assert said and measured
    assert said.groups() == measured.groups()


def test_readme_states_the_flagships_spread_and_its_table_lies_inside_it():
    text = README.read_text()
    table = dict(re.findall(r"^\s*(8|32)\s+\d+\s+(\d+)\s", text, re.M))
    flat = " ".join(text.split())
    spread = re.search(r"S = 8 in (\d+)–(\d+) iterations and S = 32 in (\d+)–(\d+)", flat)
    assert table.keys() == {"8", "32"} and spread
    lo8, hi8, lo32, hi32 = map(int, spread.groups())
    assert lo8 <= int(table["8"]) <= hi8 and lo32 <= int(table["32"]) <= hi32
    getting_started = " ".join((README.parent / "docs" / "getting_started.md").read_text().split())
    assert spread.group(0) in getting_started  # the same words on the docs' first page


def test_the_five_lines_by_hand_are_adascale_sgds_update():
    """README's "The maths in five lines", run by hand in NumPy (float64) on 4 replicas of a small least-squares
    problem with weight decay: every update, gain and τ of ``adascale_sgd(lr, momentum=β, weight_decay=λ)``'s
    default. The learning rate keeps the stability cap far above the estimated gain (its own tests are
    ``tests/core/test_clock.py``'s closed forms), and the metrics say so."""
    import jax
    import numpy as np

    import optax_adascale

    n, lr, beta, lam, updates = 4, 0.001, 0.9, 0.01, 6
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 8, 3))
    y = x @ np.array([1.0, -2.0, 0.5]) + rng.normal(size=(n, 8))
    grad = lambda w, i: 2 * x[i].T @ (x[i] @ w - y[i]) / len(y[i])  # noqa: E731 - replica i's mean gradient
    tx = optax_adascale.adascale_sgd(lr, momentum=beta, weight_decay=lam, axis_name="i")
    step = jax.jit(
        jax.vmap(lambda g, s, p: tx.update(g, s, p), in_axes=(0, None, None), out_axes=(None, None), axis_name="i")
    )
    w = w_ours = np.zeros(3)
    state = tx.init(np.float32(w_ours))
    m, tau, prev = np.zeros(3), 0.0, 1.0
    var_m = sqr_m = weight = 0.0
    for _ in range(updates):
        g = np.stack([grad(w, i) for i in range(n)])
        g_bar = g.mean(0)
        a, b = np.mean(np.sum(g**2, axis=1)), np.sum(g_bar**2)  # 1.
        var = max(n / (n - 1) * (a - b), 1e-6)  # 2. (S = n)
        sqr = max(b - var / n, 0.0)
        theta = np.exp(-prev / max(0.05 * tau, 4 * prev))  # 3.
        var_m, sqr_m = theta * var_m + (1 - theta) * var, theta * sqr_m + (1 - theta) * sqr
        weight = theta * weight + (1 - theta)
        v, q = var_m / weight, sqr_m / weight
        gain_hat = min(max((v + q) / (v / n + q), 1.0), n)  # 4.
        r = min(gain_hat, 1.1 * max(prev, 1.0))
        m = beta**r * m + (1 - beta**r) / (1 - beta) * (g_bar + lam * w)  # 5.
        update, tau, prev = -r * lr * m, tau + r, r
        ours, state = step(np.float32(g), state, np.float32(w))
        metrics = optax_adascale.metrics(state)
        assert float(metrics["gain_limit"]) > 10 * float(metrics["estimated_gain"])  # the cap did not bind
        np.testing.assert_allclose(float(metrics["gain"]), r, rtol=2e-5)
        np.testing.assert_allclose(np.asarray(ours), update, rtol=1e-4, atol=1e-7)
        np.testing.assert_allclose(float(metrics["scale_invariant_steps"]), tau, rtol=1e-5)
        w = w + update
    assert prev > 1.2  # the gain grew: lines 2-4 were exercised

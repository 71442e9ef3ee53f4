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

"""Test configuration: 8 fake CPU devices, set before JAX initialises its backends."""

import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")

# One persistent compilation cache for the whole session, shared by the xdist workers and the example and
# benchmark subprocesses (they inherit the environment): many tests compile the same programs, and on 2 CPU
# cores compilation is most of the suite's time. It starts empty every session (results never depend on an
# earlier run) and is removed at the end; a cache directory the user set is left alone.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="optax-adascale-tests-jax-cache-")
    os.environ["OPTAX_ADASCALE_TESTS_OWN_JAX_CACHE"] = os.environ["JAX_COMPILATION_CACHE_DIR"]
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


import pytest  # noqa: E402


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Make ``--dist loadgroup`` honour ``xdist_group`` on pytest >= 9.

    pytest-xdist (3.8) tags a grouped test by assigning ``item._nodeid``, which pytest 9 no longer reads (node
    ids live in ``item._id``), so the groups were silently ignored and shared runs were redone on every worker.
    """
    if not getattr(config.option, "loadgroup", False):
        return
    try:
        from _pytest.nodeid import coerce_node_id
    except ImportError:  # pytest < 9: xdist's own hook works
        return
    for item in items:
        names = sorted(
            {str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers("xdist_group")}
        )
        if names and "@" not in item.nodeid:
            item._id = coerce_node_id(f"{item.nodeid}@{'_'.join(names)}")


def pytest_sessionfinish(session):
    """The controller (or a run without xdist) removes the cache directory it created."""
    own = os.environ.get("OPTAX_ADASCALE_TESTS_OWN_JAX_CACHE")
    if own and not hasattr(session.config, "workerinput"):
        shutil.rmtree(own, ignore_errors=True)

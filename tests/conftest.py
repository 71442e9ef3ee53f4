"""Test configuration: 8 fake CPU devices, set before JAX initialises its backends."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

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

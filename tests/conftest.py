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

# XLA:CPU code-generation options that halve the suite's compile time (measured: test_update.py 82 -> 48
# CPU-s, the benchmark and example smokes 193 -> 69): LLVM at -O0 and XLA's legacy loop emitters instead of its
# MLIR fusion emitters. Both act below the HLO: the programs (fusions, collectives, buffer assignment: what the
# HLO and memory tests read) are the ones a user compiles, only the machine code is less optimised. Results stay
# within every test's tolerance (exact-equality tests compare two programs compiled the same way). An option
# already named in XLA_FLAGS is left as given, e.g. ``XLA_FLAGS=--xla_backend_optimization_level=2 pytest``.
# XLA aborts the process on a flag it does not know (JAX 0.12 dropped the second), so each option is first tried
# in a throwaway interpreter, once per session (the xdist workers inherit the result through the environment).
_COMPILE_FAST = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")

# XLA:CPU runs each of the 8 fake devices on its own thread, and a collective (psum, all-gather) waits until all
# 8 have reached it: it logs "This thread has been waiting for `all reduce ...` for 20 seconds and may be stuck"
# after 20 s and aborts the process after 40 s ("Termination timeout ... exceeded", then "Fatal Python error:
# Aborted"). On 2 cores shared with other jobs a device's thread can be descheduled that long; these give it 60 s
# before the warning and 300 s before the abort (both flags exist in the XLA of JAX 0.10.2, 0.11.2 and 0.12).
COLLECTIVES_PATIENT = (
    "--xla_cpu_collective_call_warn_stuck_timeout_seconds=60",
    "--xla_cpu_collective_call_terminate_timeout_seconds=300",
)


if not os.environ.get("OPTAX_ADASCALE_TESTS_XLA_FLAGS_CHOSEN"):
    from benchmarks.harness import xla

    xla.add_flags(*COLLECTIVES_PATIENT, *_COMPILE_FAST)
    os.environ["OPTAX_ADASCALE_TESTS_XLA_FLAGS_CHOSEN"] = "1"

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


import pytest  # noqa: E402

# The studies' smoke runs and report rebuilds (tests/test_benchmarks.py) check that each study's script runs and
# writes its report. Measured on JAX 0.12 (issue 40, one process on the shared 2-core host under load ~8): the ten
# take 1372 s and 719 CPU-s, mostly compiling; the six heaviest (ramp 434 s, adam 262, scaling 135, gpu 133,
# leaves 115, fair_adam 93) are marked ``study_smoke``, and CI runs them on its oldest JAX only, setting
# OPTAX_ADASCALE_SKIP_STUDY_SMOKES=1 for the two newer ones (.ci/run); the four cheapest (34-61 s each) run on
# every JAX. A plain `pytest` runs them all.
SKIP_STUDY_SMOKES = os.environ.get("OPTAX_ADASCALE_SKIP_STUDY_SMOKES") == "1"


def pytest_runtest_setup(item):
    if SKIP_STUDY_SMOKES and item.get_closest_marker("study_smoke"):
        pytest.skip("a study's smoke run: CI runs these on its oldest JAX only (OPTAX_ADASCALE_SKIP_STUDY_SMOKES=1)")


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

"""``examples/datasets.py``: the one loader of each data set the examples and the benchmarks use."""

import hashlib
import re
from pathlib import Path

import numpy as np
import pytest

from examples import datasets

ROOT = Path(__file__).resolve().parents[1]


def test_mnist1d_is_generated_deterministically_as_float32_and_int32():
    a, b = datasets.mnist1d(500), datasets.mnist1d(500)
    assert set(a) == {"x", "y", "x_test", "y_test"}
    assert a["x"].shape == (400, 40) and a["x_test"].shape == (100, 40)  # mnist1d's 80/20 split
    assert a["x"].dtype == np.float32 and a["y"].dtype == np.int32
    assert set(np.unique(a["y"])) <= set(range(10))
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


def test_mnist1d_cache_returns_the_generated_arrays(tmp_path):
    fresh = datasets.mnist1d(300, cache_dir=tmp_path)
    assert (tmp_path / "mnist1d_300.npz").exists()
    cached = datasets.mnist1d(300, cache_dir=tmp_path)
    for k in fresh:
        assert cached[k].dtype == fresh[k].dtype
        np.testing.assert_array_equal(cached[k], fresh[k])


def test_digits_split_is_seeded_disjoint_and_scaled():
    d = datasets.digits(val_fraction=0.2, seed=0)
    assert len(d["x"]) + len(d["x_test"]) == 1797 and len(d["x_test"]) == 1797 // 5
    assert d["x"].dtype == np.float32 and 0.0 <= d["x"].min() and d["x"].max() <= 1.0
    rows = lambda x: {r.tobytes() for r in x}  # noqa: E731
    assert len(rows(d["x_test"]) & rows(d["x"])) < 10  # different images (a few duplicates exist in the data)
    other = datasets.digits(val_fraction=0.2, seed=1)
    assert not np.array_equal(other["y_test"], d["y_test"])


def test_stdlib_source_describes_the_bytes_it_returns():
    text, info = datasets.stdlib_source()
    assert info["bytes"] == len(text) > 1_000_000
    assert info["sha256"] == hashlib.sha256(text).hexdigest()[:16]
    assert info["files"] > 100 and info["corpus"].endswith("/*.py")
    assert b"def " in text[:200_000]


@pytest.mark.parametrize(
    "pattern",
    [r"make_dataset\(", r"load_digits\(", r"Path\(sysconfig\.get_paths\(\)"],
    ids=["mnist1d", "digits", "stdlib_source"],
)
def test_each_loader_exists_once_in_the_examples_and_benchmarks(pattern):
    files = sorted([*ROOT.glob("examples/**/*.py"), *ROOT.glob("benchmarks/**/*.py")])
    hits = [f.relative_to(ROOT).as_posix() for f in files if re.search(pattern, f.read_text())]
    assert hits == ["examples/datasets.py"]


def test_no_script_edits_sys_path():
    files = sorted([*ROOT.glob("examples/**/*.py"), *ROOT.glob("benchmarks/**/*.py")])
    assert [f.name for f in files if "sys.path.insert" in f.read_text() or "sys.path.append" in f.read_text()] == []

"""The data sets of the examples and the benchmarks: one loader each, nothing downloaded.

* :func:`mnist1d`: MNIST-1D (Greydanus, 2020) generated locally with ``mnist1d.data.make_dataset``
  and the package's default arguments (seed 42): 40 features, 10 classes, an 80/20 split.
* :func:`digits`: scikit-learn's bundled 8×8 digits, scaled to [0, 1], a seeded 80/20 split.
* :func:`stdlib_source`: the Python standard library's top-level ``*.py`` files, sorted and
  concatenated as bytes: a text corpus that is the same on every run of the same Python version.

An example imports it as a sibling module (``import datasets``: ``python examples/x.py`` puts
``examples/`` first on ``sys.path``); the benchmarks, run from the repository root, as
``from examples import datasets``.
"""

from __future__ import annotations

import hashlib
import sys
import sysconfig
from pathlib import Path

import numpy as np

Arrays = dict[str, np.ndarray]
_KEYS = ("x", "y", "x_test", "y_test")


def _as_arrays(x, y, x_test, y_test) -> Arrays:
    """Inputs as float32, labels as int32."""
    arrays = dict(zip(_KEYS, (x, y, x_test, y_test), strict=True))
    return {k: np.asarray(v, np.int32 if k.startswith("y") else np.float32) for k, v in arrays.items()}


def mnist1d(num_samples: int = 10_000, cache_dir: Path | None = None) -> Arrays:
    """MNIST-1D with ``num_samples`` sequences: ``{"x", "y", "x_test", "y_test"}``, float32 / int32.

    Generated with ``mnist1d.data.make_dataset`` (never its downloader), deterministic for a given
    ``num_samples``. With ``cache_dir`` the arrays are kept there as ``mnist1d_<num_samples>.npz``.
    """
    path = None if cache_dir is None else Path(cache_dir) / f"mnist1d_{num_samples}.npz"
    if path is not None and path.exists():
        with np.load(path) as data:
            return _as_arrays(*(data[k] for k in _KEYS))
    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()
    args.num_samples = num_samples
    data = make_dataset(args)
    arrays = _as_arrays(*(data[k] for k in _KEYS))
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez(path, **arrays)
    return arrays


def digits(val_fraction: float = 0.2, seed: int = 0, num_val: int | None = None) -> Arrays:
    """scikit-learn's 8×8 digits (1,797 images, 64 features in [0, 1]): ``{"x", "y", "x_test", "y_test"}``.

    The held-out part is ``num_val`` images (default ``int(1797 · val_fraction)``) chosen by ``default_rng(seed)``.
    """
    from sklearn.datasets import load_digits

    data = load_digits()
    x, y = data.data / 16.0, data.target
    perm = np.random.default_rng(seed).permutation(len(x))
    n_val = int(len(x) * val_fraction) if num_val is None else num_val
    val, train = perm[:n_val], perm[n_val:]
    return _as_arrays(x[train], y[train], x[val], y[val])


def stdlib_source() -> tuple[bytes, dict]:
    """The standard library's top-level ``*.py`` files, sorted and concatenated, and a description of them.

    The description holds ``corpus`` (the glob), ``files``, ``bytes``, ``sha256`` (first 16
    hex digits) and ``python`` (the version: the corpus changes with it).
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    text = b"".join(f.read_bytes() for f in files)
    info = {
        "corpus": f"{root}/*.py",
        "files": len(files),
        "bytes": len(text),
        "sha256": hashlib.sha256(text).hexdigest()[:16],
        "python": sys.version.split()[0],
    }
    return text, info


def byte_corpus(val_fraction: float = 0.05) -> tuple[np.ndarray, np.ndarray, dict]:
    """:func:`stdlib_source` as bytes: the first 95 % for training, the last 5 % for validation."""
    text, info = stdlib_source()
    data = np.frombuffer(text, dtype=np.uint8)
    split = int(len(data) * (1 - val_fraction))
    return data[:split], data[split:], info


def sample_windows(data: np.ndarray, count: int, length: int, rng: np.random.Generator) -> np.ndarray:
    """``count`` random windows of ``length + 1`` bytes (inputs and next-byte targets), int32."""
    starts = rng.integers(0, len(data) - length - 1, size=count)
    return data[starts[:, None] + np.arange(length + 1)].astype(np.int32)


def validation_windows(data: np.ndarray, count: int, length: int) -> np.ndarray:
    """Up to ``count`` contiguous, non-overlapping windows of ``length + 1`` bytes from the start of ``data``."""
    n = min(count, (len(data) - 1) // length)
    starts = np.arange(n) * length
    return data[starts[:, None] + np.arange(length + 1)].astype(np.int32)

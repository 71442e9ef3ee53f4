"""Sections of ``benchmarks/RESULTS.md``: each benchmark rewrites its own, keeping hand-written readings.

A section lives between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->``; inside it, a reading lives
between ``<!-- NAME-reading:start -->`` and ``<!-- NAME-reading:end -->`` and survives regeneration.
"""

from __future__ import annotations

from pathlib import Path

HEADER = """# Benchmark results

Each program, its command and its numbers. Timings are ratios against a baseline run side by side in the
same process; absolute times from this 2-core CPU are not headline figures.
"""


def _markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


def kept_reading(path: Path, name: str) -> str:
    """The reading block of section ``name`` in ``path``, or a placeholder block."""
    start, end = _markers(f"{name}-reading")
    if path.exists():
        text = path.read_text()
        if start in text and end in text:
            return text[text.index(start) : text.index(end) + len(end)]
    return f"{start}\n_(No reading written for these results yet.)_\n{end}"


def write_section(path: Path, name: str, body: str) -> Path:
    """Replace (or append) section ``name`` of ``path`` with ``body``."""
    start, end = _markers(name)
    text = path.read_text() if path.exists() else HEADER
    block = f"{start}\n{body.rstrip()}\n{end}"
    if start in text and end in text:
        text = text[: text.index(start)] + block + text[text.index(end) + len(end) :]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path

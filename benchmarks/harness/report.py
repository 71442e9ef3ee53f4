"""A study's results section in its README.md: rewritten by the study, the hand-written reading kept.

A section lives between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->``; inside it, a reading lives
between ``<!-- NAME-reading:start -->`` and ``<!-- NAME-reading:end -->`` and survives regeneration.
Text outside the section (the README's introduction) is left alone.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

HEADER = """# Benchmark results

Timings are ratios against a baseline run side by side in the same process; absolute times from a
shared CPU are not headline figures.
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


def relative(path: Path | str, results: Path) -> str:
    """``path`` as a link relative to the folder of the results file."""
    return os.path.relpath(path, Path(results).parent)


def command_line(study: str, argv: list[str] | None) -> str:
    """The command that ran ``study`` with ``argv`` (``sys.argv[1:]`` if ``None``), as a user types it."""
    args = sys.argv[1:] if argv is None else argv
    return " ".join(["python -m", f"benchmarks.{study}", *args])

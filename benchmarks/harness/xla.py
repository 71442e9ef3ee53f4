"""XLA:CPU options (faster compilation, patient collectives), added only where this XLA knows them.

XLA aborts the process on a flag it does not know (JAX 0.12's XLA dropped ``--xla_cpu_use_fusion_emitters``),
and it reads ``XLA_FLAGS`` once, when the backend starts: each option is first tried in a throwaway interpreter.
"""

from __future__ import annotations

import os
import subprocess
import sys


def _refused(flags: str) -> list[str] | None:
    """``None`` if an interpreter with ``XLA_FLAGS=flags`` starts a CPU backend and runs, else the options its XLA
    named as unknown (empty if it failed otherwise)."""
    code = "import jax, jax.numpy as jnp; jnp.zeros(1).block_until_ready()"
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    if proc.returncode == 0:
        return None
    for line in proc.stderr.splitlines():
        if "Unknown flags in XLA_FLAGS:" in line:
            return line.split("Unknown flags in XLA_FLAGS:", 1)[1].split()
    return []


def accepts(flags: str) -> bool:
    """Whether an interpreter with ``XLA_FLAGS=flags`` starts a CPU backend and runs."""
    return _refused(flags) is None


def add_flags(*options: str) -> str:
    """Append each option to ``XLA_FLAGS`` unless it is named there already or this XLA refuses it; the result.

    One interpreter tries them all at once; the options its XLA names as unknown are dropped and the rest tried
    again (each alone only if XLA failed without naming them)."""
    flags = os.environ.get("XLA_FLAGS", "")
    new = [option for option in options if option.split("=")[0] not in flags]
    refused = _refused(" ".join([flags, *new]).strip()) if new else None
    if refused:
        new = [option for option in new if option not in refused]
        refused = _refused(" ".join([flags, *new]).strip()) if new else None
    if refused is None:
        flags = " ".join([flags, *new]).strip()
    else:
        for option in new:
            if accepts(f"{flags} {option}".strip()):
                flags = f"{flags} {option}".strip()
    os.environ["XLA_FLAGS"] = flags
    return flags

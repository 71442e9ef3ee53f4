"""XLA:CPU options that speed up compilation, added only where this XLA knows them.

XLA aborts the process on a flag it does not know (JAX 0.12's XLA dropped ``--xla_cpu_use_fusion_emitters``),
and it reads ``XLA_FLAGS`` once, when the backend starts: each option is first tried in a throwaway interpreter.
"""

from __future__ import annotations

import os
import subprocess
import sys


def accepts(flags: str) -> bool:
    """Whether an interpreter with ``XLA_FLAGS=flags`` starts a CPU backend and runs."""
    code = "import jax, jax.numpy as jnp; jnp.zeros(1).block_until_ready()"
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=120).returncode == 0


def add_flags(*options: str) -> str:
    """Append each option to ``XLA_FLAGS`` unless it is named there already or this XLA refuses it; the result."""
    flags = os.environ.get("XLA_FLAGS", "")
    for option in options:
        if option.split("=")[0] not in flags and accepts(f"{flags} {option}".strip()):
            flags = f"{flags} {option}".strip()
    os.environ["XLA_FLAGS"] = flags
    return flags

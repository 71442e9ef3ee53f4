#!/usr/bin/env bash
# MaxText 0.2.5 with AdaScale, on CPU, in one command:
#   bash integrations/maxtext/run.sh [--steps 120] [--only "explicit, scan" ...]
# Makes its own Python 3.12 venv (MaxText 0.2.5 needs JAX >= 0.11), installs MaxText 0.2.5 (its wheel declares
# no dependencies: they are listed here), this package, applies train_step.patch to the installed train.py
# (13 changed lines), and runs every case of cases.py: results.json and the tables on stdout.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
VENV=${MAXTEXT_VENV:-$HERE/.venv}
if [ ! -x "$VENV/bin/python" ]; then
  PYENV_VERSION=${PYENV_VERSION:-3.12.1} python3 -m venv "$VENV"
fi
PY=$VENV/bin/python
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q maxtext==0.2.5 "jax>=0.11" flax optax orbax-checkpoint \
  pathwaysutils omegaconf jinja2 aqtp qwix tokamax huggingface-hub transformers grain drjax pillow tiktoken \
  sentencepiece sympy ml-collections
"$PY" -m pip install -q --no-deps -e "$ROOT"
SITE=$("$PY" -c 'import maxtext, os; print(os.path.dirname(os.path.dirname(maxtext.__file__)))')
if ! grep -q adascale_maxtext "$SITE/maxtext/trainers/pre_train/train.py"; then
  patch -d "$SITE" -p1 < "$HERE/train_step.patch"
fi
cd "$HERE"
exec "$PY" cases.py "$@"

#!/usr/bin/env bash
# MaxText 0.2.5 with AdaScale, on CPU, in one command:
#   bash integrations/maxtext/run.sh [--steps 120] [--only "explicit, scan" ...]
#   bash integrations/maxtext/run.sh --ramp --steps 1200     # the batch-ramp table (issue 34)
# Makes its own Python 3.12 venv (MaxText 0.2.5 needs JAX >= 0.11), installs MaxText 0.2.5 (its wheel declares
# no dependencies: they are listed here), this package, applies train_step.patch to the installed train.py
# (17 changed lines), and runs every case of cases.py: results.json and the tables on stdout.
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
TRAIN=$SITE/maxtext/trainers/pre_train/train.py
if ! patch -R --dry-run -s -f -d "$SITE" -p1 < "$HERE/train_step.patch" > /dev/null 2>&1; then
  if grep -q adascale_maxtext "$TRAIN"; then  # an earlier version of the patch: back to MaxText's own train.py
    if [ -f "$TRAIN.orig" ]; then cp "$TRAIN.orig" "$TRAIN"
    else "$PY" -m pip install -q --force-reinstall --no-deps maxtext==0.2.5; fi
  fi
  patch -b -d "$SITE" -p1 < "$HERE/train_step.patch"  # -b: MaxText's own file kept as train.py.orig
fi
cd "$HERE"
exec "$PY" cases.py "$@"

#!/usr/bin/env bash
# Creates .venv (if missing) and installs dptorch with its test and example extras.
# torch==2.13.0 is installed first: it is a CPU wheel; an unpinned torch would pull a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q "torch==2.13.0"
# editable install: re-run pip only when pyproject.toml changed or a dependency is missing
STAMP=.venv/.dptorch-install-stamp
WANT=$(cksum < pyproject.toml)
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ] \
    || ! .venv/bin/python -c "import dptorch, sklearn, tqdm, matplotlib, pytest, hypothesis, transformers, dp_accounting" 2>/dev/null; then
  .venv/bin/python -m pip install -q -e ".[test,examples]"
  echo "$WANT" > "$STAMP"
fi

#!/usr/bin/env bash
# Installs Opacus 1.6.0 into .opacus-env, a separate environment for tests/compat's behaviour
# tests (they run the same snippet under Opacus and dptorch, in subprocesses). --no-deps: torch,
# numpy and scipy come from the interpreter running it, never a torch wheel from PyPI (an
# unpinned torch is a multi-GB CUDA build). A few seconds; skipped when already there.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -f .opacus-env/opacus/__init__.py ]; then
  exit 0
fi
.venv/bin/python -m pip install -q --no-deps --target .opacus-env "opacus==1.6.0" "opt-einsum>=3.3" \
  || { echo "opacus_env.sh: could not install opacus==1.6.0; tests/compat behaviour tests will skip" >&2; rm -rf .opacus-env; }

#!/usr/bin/env bash
# One command: set up the environment on a fresh machine, then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/opacus_env.sh  # Opacus 1.6 in a separate environment, for tests/compat
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec .venv/bin/python -m pytest -p no:cacheprovider "$@"

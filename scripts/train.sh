#!/usr/bin/env bash
# One command: set up the environment, then train a DP classifier on scikit-learn's digits.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/dptorch train-digits "$@"

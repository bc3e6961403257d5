#!/usr/bin/env bash
# Set up if needed, then run the whole test suite (multi-process tests launch real mpirun jobs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q --durations=30 "$@"  # the 30 slowest tests are listed at the end

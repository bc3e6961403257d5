#!/usr/bin/env bash
# Create .venv and install nanotron-recover with everything its runs and tests need.
# torch is installed first, alone, as the CPU build (2.13.0), so no multi-GB CUDA build is pulled in by a
# dependency. Where the CPU wheel is not on pip's path, set TORCH_INDEX_URL to a CPU wheel index.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)
quiet() { "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }; return "${PIPESTATUS[0]}"; }
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "[setup] installing torch 2.13.0 (CPU build)"
  if [ -n "${TORCH_INDEX_URL:-}" ]; then
    quiet "${PIP[@]}" torch==2.13.0 --index-url "$TORCH_INDEX_URL"
  else
    quiet "${PIP[@]}" torch==2.13.0
  fi
fi
if ! .venv/bin/python -c "import nanotron_recover, pytest, pytest_timeout, hypothesis" 2>/dev/null; then
  echo "[setup] installing nanotron-recover and its dependencies"
  quiet "${PIP[@]}" -e ".[test,peers]"   # peers: torchft for benchmarks/vs_torchft.py (where its wheel exists)
  .venv/bin/python -c "import nanotron_recover, mpi4py, datatrove, wandb, pytest, pytest_timeout, hypothesis" \
    || { echo "[setup] install failed" >&2; exit 1; }
fi
.venv/bin/python -c "import torch, nanotron_recover; print(f'[setup] ok: torch {torch.__version__}, nanotron-recover {nanotron_recover.__version__}')"

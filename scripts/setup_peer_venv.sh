#!/usr/bin/env bash
# Create .venv-peer: the newest torchft beside the torch it needs, apart from the project's environment, for
# benchmarks/vs_torchft.py --peer-python .venv-peer/bin/python. torchft's 0.3 line and torchft-nightly rebuild
# their process groups in place through torch >= 2.14's reconfigurable gloo groups; the project stays on torch
# 2.13 (nanotron 0.4). The registry's torch 2.14.1 wheel carries the CUDA libraries (it runs on CPU): ~5.4 GB on
# disk, a few minutes to install. TORCHFT overrides the peer (default torchft-nightly==2026.10.26).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCHFT=${TORCHFT:-torchft-nightly==2026.10.26}
if [ ! -x .venv-peer/bin/python ]; then
  "$PYTHON" -m venv .venv-peer
fi
quiet() { "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }; return "${PIPESTATUS[0]}"; }
if ! .venv-peer/bin/python -c "import torchft" 2>/dev/null; then
  echo "[setup-peer] installing torch 2.14.1 and $TORCHFT into .venv-peer"
  quiet .venv-peer/bin/python -m pip install -q --disable-pip-version-check "torch==2.14.1" "$TORCHFT" numpy
fi
.venv-peer/bin/python - <<'PY'
import importlib.metadata as md
import torch, torchft  # noqa: F401
names = [d.metadata["Name"] for d in md.distributions() if d.metadata["Name"].lower().startswith("torchft")]
in_place = hasattr(torch.distributed.ProcessGroup, "reconfigure")  # torch >= 2.14: groups rebuilt in place
print(f"[setup-peer] ok: torch {torch.__version__}, {names[0]} {md.version(names[0])}, "
      f"in-place reconfigurable groups: {in_place}")
PY
du -sh .venv-peer | sed 's/^/[setup-peer] disk: /'

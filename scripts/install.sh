#!/usr/bin/env bash
# Installs fxpar (editable) and what it needs, without ever replacing an installed torch.
#   bash scripts/install.sh          # the package
#   bash scripts/install.sh --test   # the package and the test tools
# A machine without torch gets torch 2.13.0 (this index serves the CPU build; on a GPU machine
# with the public index, install your CUDA build first and this script keeps it).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if "$PY" -c "import torch" 2>/dev/null; then
  echo "fxpar install: keeping torch $("$PY" -c 'import torch; print(torch.__version__)')"
else
  echo "fxpar install: no torch found, installing torch==2.13.0"
  "$PY" -m pip install --quiet "torch==2.13.0"
fi
extra=""
[ "${1:-}" = "--test" ] && extra="[test]"
"$PY" -m pip install --quiet -e ".${extra}"
"$PY" -c "import fxpar, torch; print(f'fxpar {fxpar.__version__} installed (torch {torch.__version__})')"

#!/usr/bin/env bash
# Create (or reuse) radixkv's main virtual environment at $REPO/.venv and install radixkv into it.
#
# torch is installed first and pinned (torch==2.13.0: on a CPU machine that is the CPU wheel), so that
# installing radixkv never pulls a CUDA build of torch. Extra pip arguments: RADIXKV_EXTRAS (default
# "all"). Prints the venv's python path on the last line.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$REPO/.venv"
PY="${PYTHON:-python3}"
EXTRAS="${RADIXKV_EXTRAS:-all}"
TORCH_VERSION="${RADIXKV_TORCH_VERSION:-2.13.0}"
log() { echo "[setup] $*" >&2; }

if [[ ! -x "$VENV/bin/python" ]]; then
  log "creating $VENV"
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)
CONSTRAINT="$VENV/.torch-constraint.txt"
echo "torch==$TORCH_VERSION" > "$CONSTRAINT"
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
  log "installing torch==$TORCH_VERSION"
  "${PIP[@]}" "torch==$TORCH_VERSION"
fi
log "installing radixkv[$EXTRAS] (editable)"
"${PIP[@]}" -c "$CONSTRAINT" -e "$REPO[$EXTRAS]"
echo "$VENV/bin/python"

#!/usr/bin/env bash
# Create (idempotently) the vLLM 0.33.0 CPU test environment at $REPO/.envs/vllm.
#
#   bash scripts/setup_vllm_env.sh            # create or update; prints the env's python path last
#   .envs/vllm/bin/python -m pytest tests/vllm -q
#
# What it installs, in this order (the order matters: see docs/vllm.md "Test environment"):
#   1. torch==2.13.0, the CPU build (resolved from the machine's local wheel cache / find-links);
#      the script fails if the result is a CUDA build or if any nvidia-* wheel got in;
#   2. the pinned pure-Python requirements in scripts/vllm-cpu-requirements.txt;
#   3. vllm==0.33.0 and xgrammar==0.2.8 with --no-deps (their metadata pulls CUDA torch and triton);
#      vLLM's compiled extensions are deleted (CPU scheduler/connector code never loads them);
#   4. radixkv itself, editable, with its [test,redis] extras, constrained so torch stays 2.13.0.
# Steps 1-3 are skipped when a marker holding this script's and the requirements' hash is present;
# step 4 is skipped when pyproject.toml has not changed since the last run. A second run takes ~1 s.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ENV_DIR="$REPO/.envs/vllm"
PYTHON="${PYTHON:-python3.11}"
REQS="$REPO/scripts/vllm-cpu-requirements.txt"
VLLM_VERSION="0.33.0"
TORCH_VERSION="2.13.0"

hash_of() { cat "$@" | sha256sum | cut -c1-16; }
BASE_HASH="$(hash_of "${BASH_SOURCE[0]}" "$REQS")"
PKG_HASH="$(hash_of "$REPO/pyproject.toml")"
BASE_MARKER="$ENV_DIR/.radixkv-base-$BASE_HASH"
PKG_MARKER="$ENV_DIR/.radixkv-pkg-$BASE_HASH-$PKG_HASH"

log() { printf '[setup_vllm_env] %s\n' "$*" >&2; }

# pip, minus expected noise: the machine's index mirrors lack most projects ("is ignored"), and vLLM's
# metadata lists CUDA-only requirements that are deliberately not installed here (see docs/vllm.md §6).
quiet_pip() {
  "$ENV_DIR/bin/python" -m pip install --disable-pip-version-check -q "$@" 2>&1 | {
    grep -v -e 'is ignored: it is neither a file nor a directory' \
      -e "^vllm [0-9.]* requires " -e "pip's dependency resolver does not currently" || true
  } >&2
}

if [[ ! -f "$BASE_MARKER" ]]; then
  if [[ -d "$ENV_DIR" ]]; then
    log "environment out of date (no $(basename "$BASE_MARKER")); recreating $ENV_DIR"
    rm -rf "$ENV_DIR"
  fi
  command -v "$PYTHON" >/dev/null || { log "$PYTHON not found; set PYTHON=/path/to/python3.11"; exit 1; }
  mkdir -p "$REPO/.envs"
  "$PYTHON" -m venv "$ENV_DIR"
  TORCH_PIN="$ENV_DIR/.torch-constraint.txt"
  echo "torch==$TORCH_VERSION" >"$TORCH_PIN"

  log "1/4 torch==$TORCH_VERSION (CPU build)"
  quiet_pip "torch==$TORCH_VERSION" -c "$TORCH_PIN"
  "$ENV_DIR/bin/python" - <<'EOF'
import torch, sys
if torch.version.cuda:
    sys.exit(f"torch {torch.__version__} is a CUDA build (cuda {torch.version.cuda}); the vLLM test env "
             "needs the CPU build: put torch-2.13.0+cpu on pip's find-links or index and rerun")
EOF

  log "2/4 pinned requirements ($(grep -c '==' "$REQS") packages)"
  quiet_pip -r "$REQS" -c "$TORCH_PIN"

  log "3/4 vllm==$VLLM_VERSION and xgrammar==0.2.8 without dependencies"
  quiet_pip --no-deps "vllm==$VLLM_VERSION" "xgrammar==0.2.8"
  SITE="$("$ENV_DIR/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  if [[ "${RADIXKV_VLLM_KEEP_SO:-0}" != "1" ]]; then
    # ~0.9 GB of CUDA kernels the CPU scheduler/connector path never loads.
    find "$SITE/vllm" -name '*.so' -delete
    rm -f "$SITE/vllm/vllm-rs"
  fi
  touch "$BASE_MARKER"
fi

if [[ ! -f "$PKG_MARKER" ]]; then
  log "4/4 radixkv (editable, [test,redis])"
  quiet_pip -c "$ENV_DIR/.torch-constraint.txt" -c "$REQS" -e "$REPO[test,redis]"
  rm -f "$ENV_DIR"/.radixkv-pkg-*
  touch "$PKG_MARKER"
fi

# Cheap every-run checks: the CPU torch is still there and no CUDA wheel slipped in.
if "$ENV_DIR/bin/python" -m pip list --disable-pip-version-check 2>/dev/null | grep -qi '^nvidia'; then
  log "nvidia-* wheels found in $ENV_DIR: something pulled CUDA torch; delete $ENV_DIR and rerun"
  exit 1
fi
"$ENV_DIR/bin/python" -c "
import torch, importlib.metadata as md
assert not torch.version.cuda, torch.__version__
assert md.version('vllm') == '$VLLM_VERSION', md.version('vllm')
"
echo "$ENV_DIR/bin/python"

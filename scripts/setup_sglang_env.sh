#!/usr/bin/env bash
# Create (or reuse) the SGLang 0.5.23 test environment at $REPO/.envs/sglang (git-ignored).
#
# SGLang is installed with --no-deps plus the short list of small packages its L2<->L3 storage path
# imports (docs: shared research note "sglang-integration" §6). torch stays the CPU build 2.13.0 in
# every pip call (a constraints file), so nothing pulls a CUDA torch or nvidia-* wheels; the script
# fails if any nvidia-* package shows up. torchvision is replaced by a test-only import stub
# (tests/_stubs, put on sys.path by tests/sglang/conftest.py): its PyPI wheels are CUDA-linked.
#
# Idempotent and fast when done: a marker file records this script's hash; a second run with the
# same script and a working env only checks the imports (about a second).
#
# Usage: bash scripts/setup_sglang_env.sh        (env: PYTHON=python3.11 to pick the interpreter)
# The last line on stdout is the env's python (progress goes to stderr), so callers can do
#   SGL_PY="$(bash scripts/setup_sglang_env.sh | tail -n 1)"
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ENV_DIR="$REPO/.envs/sglang"
PY="${PYTHON:-python3}"
MARKER="$ENV_DIR/.radixkv-setup-complete"
SCRIPT_HASH="$(sha256sum "${BASH_SOURCE[0]}" | cut -c1-16)"
SGLANG_VERSION="0.5.23"
TORCH_VERSION="2.13.0"

env_ok() {
  [[ -x "$ENV_DIR/bin/python" ]] || return 1
  PYTHONPATH="$REPO/tests/_stubs" "$ENV_DIR/bin/python" - <<PYEOF >/dev/null 2>&1
import importlib.metadata as md, sys
assert md.version("sglang") == "$SGLANG_VERSION", md.version("sglang")
assert md.version("torch").split("+")[0] == "$TORCH_VERSION", md.version("torch")
import torch, radixkv, redis, pytest, ninja
import sglang.srt.mem_cache.hicache_storage
import sglang.srt.managers.cache_controller
import sglang.srt.mem_cache.storage.backend_factory
PYEOF
}

if [[ -f "$MARKER" && "$(cat "$MARKER")" == "$SCRIPT_HASH" ]] && env_ok; then
  echo "setup_sglang_env: $ENV_DIR is ready (sglang $SGLANG_VERSION, torch $TORCH_VERSION cpu)" >&2
  echo "$ENV_DIR/bin/python"
  exit 0
fi

echo "setup_sglang_env: building $ENV_DIR" >&2
rm -f "$MARKER"
[[ -x "$ENV_DIR/bin/python" ]] || "$PY" -m venv "$ENV_DIR"
PIP=("$ENV_DIR/bin/python" -m pip --disable-pip-version-check -q)
pip_install() { "${PIP[@]}" install "$@" 1>&2; }  # stdout carries only the final python path
CONSTRAINTS="$ENV_DIR/constraints-cpu.txt"
echo "torch==$TORCH_VERSION" >"$CONSTRAINTS"

pip_install -c "$CONSTRAINTS" "torch==$TORCH_VERSION"
pip_install --no-deps "sglang==$SGLANG_VERSION"
# What sglang's storage path imports (sglang/__init__, srt.utils.common, srt.configs, the
# controller's schedule_batch -> openai protocol), nothing more. Pins follow sglang 0.5.23's metadata.
pip_install -c "$CONSTRAINTS" \
  numpy orjson psutil pybase64 requests packaging pillow starlette msgspec pydantic pyzmq \
  tqdm IPython aiohttp dill gguf partial_json_parser \
  "transformers==5.19.0" "apache-tvm-ffi==0.1.11" "sentencepiece==0.2.1" \
  "compressed-tensors==0.18.0" "openai==2.8.0" ninja
# radixkv itself (editable) with its test and Redis extras; this brings real triton.
pip_install -c "$CONSTRAINTS" -e "$REPO[test,redis]"

if "$ENV_DIR/bin/python" -m pip list 2>/dev/null | grep -i nvidia >&2; then
  echo "setup_sglang_env: ERROR: nvidia-* wheels were installed into $ENV_DIR (a CUDA torch crept in);" \
       "remove $ENV_DIR and check the constraints" >&2
  exit 1
fi
if ! env_ok; then
  echo "setup_sglang_env: ERROR: the environment does not import sglang's storage path;" \
       "run: PYTHONPATH=$REPO/tests/_stubs $ENV_DIR/bin/python -c 'import sglang.srt.managers.cache_controller'" >&2
  exit 1
fi
# SGLang's page hash is a JIT-built C++ extension (g++, OpenSSL headers, ninja): build it once here,
# into the env, so test runs do not pay ~35 s for it. tests/sglang/conftest.py points
# TORCH_EXTENSIONS_DIR at the same folder.
if [[ ! -f /usr/include/openssl/sha.h ]] || ! command -v g++ >/dev/null; then
  echo "setup_sglang_env: installing g++ and libssl-dev for SGLang's native page hash" >&2
  apt-get install -y -q g++ libssl-dev >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q g++ libssl-dev >/dev/null; }
fi
TORCH_EXTENSIONS_DIR="$ENV_DIR/torch_extensions" PYTHONPATH="$REPO/tests/_stubs" "$ENV_DIR/bin/python" -W ignore -c \
  "from sglang.srt.mem_cache.utils import get_hash_str; assert len(get_hash_str([1, 2], None, page_size=2)) == 1" 1>&2
echo "$SCRIPT_HASH" >"$MARKER"
echo "setup_sglang_env: done ($ENV_DIR)" >&2
echo "$ENV_DIR/bin/python"

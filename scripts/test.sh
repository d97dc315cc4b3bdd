#!/usr/bin/env bash
# Set up everything the test suite needs on a fresh Debian machine, then run the whole suite:
#   1. redis-server (Debian package) for the Redis tier tests (they start their own servers), and gcc
#      for radixkv's optional C helpers if the machine has no C compiler;
#   2. the main environment .venv (CPU torch, radixkv[all]) -> tests/ without the engine folders;
#   3. the SGLang 0.5.23 environment .envs/sglang -> tests/sglang  (engines pin conflicting packages,
#   4. the vLLM 0.33.0 environment .envs/vllm     -> tests/vllm     so each gets its own venv).
# Prints one closing line "tests: N passed, N failed, N skipped" over all runs; exits non-zero if any
# test failed or any run could not start.
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
OUT="$REPO/.test-results"
rm -rf "$OUT" && mkdir -p "$OUT"
status=0
log() { echo "[test] $*" >&2; }

if ! command -v redis-server >/dev/null 2>&1 || ! command -v redis-cli >/dev/null 2>&1; then
  log "installing redis-server from Debian's packages"
  SUDO=""; [[ $(id -u) -eq 0 ]] || SUDO="sudo"
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server >/dev/null \
    || { log "could not install redis-server"; status=1; }
fi
# The tests start their own servers; a system service is not needed (and may hold port 6379).
if ! command -v gcc >/dev/null 2>&1; then
  # radixkv's optional C helpers (setup.py) build at install; tests/test_native.py checks they did.
  log "installing gcc from Debian's packages"
  SUDO=""; [[ $(id -u) -eq 0 ]] || SUDO="sudo"
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq gcc >/dev/null \
    || { log "could not install gcc"; status=1; }
fi

MAIN_PY="$(bash scripts/setup.sh | tail -n 1)" || { log "main environment setup failed"; exit 1; }
SGL_PY="$REPO/.envs/sglang/bin/python"
VLLM_PY="$REPO/.envs/vllm/bin/python"
bash scripts/setup_sglang_env.sh >&2 || { log "SGLang environment setup failed"; status=1; SGL_PY=""; }
bash scripts/setup_vllm_env.sh >&2 || { log "vLLM environment setup failed"; status=1; VLLM_PY=""; }

run() {  # run NAME PYTHON PYTEST-ARGS...
  local name="$1" py="$2"; shift 2
  log "pytest ($name)"
  "$py" -m pytest -p no:cacheprovider --junitxml="$OUT/$name.xml" "$@"
  local rc=$?
  # 5 = no tests collected; anything else non-zero is a failure.
  if [[ $rc -ne 0 && $rc -ne 5 ]]; then status=1; fi
}

run main "$MAIN_PY" tests --ignore=tests/sglang --ignore=tests/vllm -q
[[ -n "$SGL_PY" ]] && run sglang "$SGL_PY" tests/sglang -q
[[ -n "$VLLM_PY" ]] && run vllm "$VLLM_PY" tests/vllm -q
# Kernel cross-checks against each engine's own KV views and host pools.
[[ -n "$SGL_PY" ]] && run sglang-kernels "$SGL_PY" tests/kernels/test_kernels_engines.py -m sglang -q
[[ -n "$VLLM_PY" ]] && run vllm-kernels "$VLLM_PY" tests/kernels/test_kernels_engines.py -m vllm -q

"$MAIN_PY" - "$OUT" <<'PYEOF' || status=1
import sys, pathlib, xml.etree.ElementTree as ET
tot = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.xml")):
    for suite in ET.parse(f).getroot().iter("testsuite"):
        for k in tot:
            tot[k] += int(suite.get(k, 0))
        print(f"  {f.stem}: {suite.get('tests')} tests, {suite.get('failures')} failures, "
              f"{suite.get('errors')} errors, {suite.get('skipped')} skipped")
failed = tot["failures"] + tot["errors"]
passed = tot["tests"] - failed - tot["skipped"]
print(f"tests: {passed} passed, {failed} failed, {tot['skipped']} skipped")
sys.exit(1 if failed or tot["tests"] == 0 else 0)
PYEOF
exit $status

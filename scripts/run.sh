#!/usr/bin/env bash
# The main job on its embedded default: set up radixkv, then run the offline eviction simulator on
# its default synthetic workload (prints the hit-rate table). Extra arguments go to `radixkv sim`.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$(bash "$REPO/scripts/setup.sh" | tail -n 1)"
exec "$PY" -m radixkv.cli sim "$@"

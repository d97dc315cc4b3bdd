"""Whether the pinned vLLM is importable here (no vLLM import)."""

from __future__ import annotations

import importlib.metadata
import importlib.util

VLLM_VERSION = "0.33.0"


def _vllm_version() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return None
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return None


HAVE_VLLM = _vllm_version() == VLLM_VERSION
SKIP_REASON = (
    f"needs vllm=={VLLM_VERSION} (found {_vllm_version()}): run `bash scripts/setup_vllm_env.sh` and "
    "`.envs/vllm/bin/python -m pytest tests/vllm`"
)

"""Reports, as one skip, that the vLLM connector tests need the vLLM test environment."""

from __future__ import annotations

import pytest
from vllm_env import HAVE_VLLM, SKIP_REASON

pytestmark = pytest.mark.vllm


@pytest.mark.skipif(not HAVE_VLLM, reason=SKIP_REASON)
def test_vllm_version_pinned() -> None:
    import vllm

    assert vllm.__version__.startswith("0.33.0"), vllm.__version__

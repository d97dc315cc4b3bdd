"""tests/vllm: run inside the vLLM test environment (scripts/setup_vllm_env.sh, .envs/vllm).

Elsewhere (the main suite runs without vLLM) every module here except test_vllm_available.py is left
uncollected, and that one reports a single skip naming the command that runs them.
"""

from __future__ import annotations

import pytest
from vllm_env import HAVE_VLLM

collect_ignore_glob = (
    []
    if HAVE_VLLM
    else ["test_connector*.py", "test_worker*.py", "test_options*.py", "vllm_harness.py"]
)


@pytest.fixture
def model_dir(tmp_path):
    from vllm_harness import make_model_dir

    return make_model_dir(tmp_path / "opt-tiny")


@pytest.fixture(autouse=True)
def _close_engines():
    yield
    if HAVE_VLLM:
        from vllm_harness import OPEN_ENGINES

        while OPEN_ENGINES:
            OPEN_ENGINES.pop().close()

"""SGLang 0.5.23 integration tests: run inside the SGLang env (scripts/setup_sglang_env.sh).

Without an importable ``sglang`` (the main suite in .venv) every test module here is skipped by
its own ``pytest.importorskip`` and nothing SGLang-specific happens. With it, this conftest:

* puts the test-only import stubs (tests/_stubs) on ``sys.path`` for packages SGLang imports but
  never uses on the storage path, only when the real package is absent (GPU runners have them);
* points TORCH_EXTENSIONS_DIR at the env's prebuilt native page-hash extension;
* sets SGLang's parallel runtime context (one rank) that HiCacheController needs outside a server.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from pathlib import Path

import pytest

_STUBS = Path(__file__).resolve().parents[1] / "_stubs"



def _have_sglang() -> bool:
    # Not find_spec("sglang"): with pytest's rootdir on sys.path this very folder (tests/sglang, no
    # __init__.py) is a namespace package named "sglang". The real one has sglang.srt.
    try:
        return importlib.util.find_spec("sglang.srt") is not None
    except (ImportError, ValueError):
        return False


HAVE_SGLANG = _have_sglang()

if HAVE_SGLANG:
    if importlib.util.find_spec("torchvision") is None and str(_STUBS) not in sys.path:
        sys.path.append(str(_STUBS))
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))


@pytest.fixture(scope="session", autouse=True)
def sglang_parallel_context():
    """One-rank parallel context (TP=PP=DCP=1), as a launched server would publish it."""
    if not HAVE_SGLANG:
        yield None
        return
    from radixkv.adapters.sglang_cpu import set_parallel_context

    set_parallel_context()
    # SGLang logs every prefetch miss at WARNING; keep test output readable.
    logging.getLogger("sglang").setLevel(logging.ERROR)
    yield None


@pytest.fixture(autouse=True)
def sglang_host_memory_budget():
    """A fixed host-memory budget for the pools a test builds (a few MiB each). SGLang otherwise
    checks every pool against the machine's available memory minus a 10 GiB reserve, so on a 24 GiB
    machine under load (a CI runner, parallel jobs) a test's tiny pool was refused ("Not enough host
    memory available ... -0.98 GB free"): a failure of the machine, not of the code under test."""
    if not HAVE_SGLANG:
        yield None
        return
    try:
        from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    except ImportError:  # another SGLang layout: keep its own check
        yield None
        return
    with host_memory_budget_scope(16 << 30):
        yield None


@pytest.fixture
def rank():
    """Switch SGLang's parallel context to another TP rank for one harness; restore rank 0 after."""
    from radixkv.adapters.sglang_cpu import set_parallel_context

    def use(tp_rank: int, tp_size: int) -> None:
        set_parallel_context(tp_rank=tp_rank, tp_size=tp_size)

    yield use
    set_parallel_context()

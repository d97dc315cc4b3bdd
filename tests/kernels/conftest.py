"""Kernel tests: run the Triton kernels through the interpreter on CPU.

TRITON_INTERPRET=1 is set per test (not process-wide), because with it set the launchers route
*every* CPU call through the slow interpreter, which would slow other suites sharing the pytest
process. The launchers build the interpreted kernel lazily, so the import order of triton does not
matter.
"""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _triton_interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")

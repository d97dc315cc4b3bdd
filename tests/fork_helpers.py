"""Helpers of the fork tests: run a check in a forked child with a deadline, and make and compare
bytes without torch kernels (torch's OpenMP pool does not survive a fork; that hang is torch's)."""

from __future__ import annotations

import os
import time
import traceback
from typing import Callable

import numpy as np
import pytest
import torch


def in_child(fn: Callable[[], object], deadline_s: float = 30.0) -> None:
    """Run ``fn`` in a forked child; fail if it raises, returns False or does not finish in time."""
    pid = os.fork()
    if pid == 0:  # child: never return into pytest
        import faulthandler

        faulthandler.dump_traceback_later(deadline_s - 5, exit=True)  # where it hangs, if it does
        code = 1
        try:
            code = 0 if fn() else 3
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0, "the child failed (its traceback is above)"
            return
        time.sleep(0.02)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail(f"the forked child hung for {deadline_s}s")


def numpy_bytes(value: int, n: int) -> torch.Tensor:
    """``n`` bytes of ``value``, made by numpy (no torch kernel)."""
    return torch.from_numpy(np.full(n, value, dtype=np.uint8))


def same_bytes(outs, data) -> bool:
    return all(np.array_equal(o.numpy(), d.numpy()) for o, d in zip(outs, data))

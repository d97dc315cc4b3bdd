"""Benchmark scripts: ``python -m radixkv.bench NAME``. Never collected as tests."""

from __future__ import annotations

import argparse
import math
import os
import platform


def build_line() -> str:
    """Which build of the tree and policies this run times (results differ by ~1.2-1.6x)."""
    from radixkv import compiled

    if compiled.active():
        return "tree and policies: compiled (mypyc)"
    return f"tree and policies: Python ({compiled.reason()})"


def machine_line() -> str:
    """The machine a run timed: CPU model, CPUs, load. Rates move by up to ~2x between the VMs these
    benchmarks ran on (docs/benchmarks.md), so every table should say where it came from."""
    model = None
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None)
    except OSError:  # not Linux
        pass
    if not model:  # platform.processor() runs `uname -p` on Linux: asked only without /proc/cpuinfo
        model = platform.processor() or platform.machine() or "unknown CPU"
    try:
        load = f", load avg {os.getloadavg()[0]:.1f}"
    except OSError:  # pragma: no cover - platforms without getloadavg
        load = ""
    return f"machine: {model}, {os.cpu_count()} cpus{load}"


def positive_int(text: str) -> int:
    """argparse ``type=`` for counts (reps, batch, threads): an int >= 1, else a one-line usage error."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be a whole number >= 1")
    return value


def positive_list(text: str, kind: type = int) -> list:
    """A comma-separated list of numbers > 0 (``"1,8,32"``), as ``type=`` of a list option."""
    out = []
    for part in text.split(","):
        try:
            value = kind(part.strip())
        except ValueError:
            value = 0
        if not 0 < value < math.inf:
            where = f" in {text!r}" if "," in text else ""
            raise argparse.ArgumentTypeError(f"{part.strip()!r}{where} must be a number > 0 "
                                             "(comma-separated, e.g. 1,8,32)")
        out.append(value)
    return out

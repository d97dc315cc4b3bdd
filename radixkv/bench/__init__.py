"""Benchmark scripts: ``python -m radixkv.bench NAME``. Never collected as tests."""

from __future__ import annotations


def build_line() -> str:
    """Which build of the tree and policies this run times (results differ by ~1.2-1.6x)."""
    from radixkv import compiled

    if compiled.active():
        return "tree and policies: compiled (mypyc)"
    return f"tree and policies: Python ({compiled.reason()})"

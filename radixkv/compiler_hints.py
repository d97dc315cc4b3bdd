"""Hints for the mypyc build of the tree and policies (see :mod:`radixkv.compiled`).

``mypyc_attr`` comes from ``mypy_extensions`` when it is installed (the compiler needs it, at build
time); without it the decorator does nothing, which is all the Python build needs from it.
"""

from __future__ import annotations

try:
    from mypy_extensions import mypyc_attr
except ImportError:  # pragma: no cover - a runtime without mypy_extensions runs the Python build

    def mypyc_attr(*_args: object, **_kwargs: object):  # type: ignore[no-redef,misc]
        return lambda cls: cls


__all__ = ["mypyc_attr"]

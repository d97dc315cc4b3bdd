"""Which build of the tree and its policies runs: compiled by mypyc, or their Python source.

``setup.py`` compiles the modules listed in ``radixkv/_compiled.json`` with mypyc from their own
source (the same code, run as C: the simulator and the runtime both get it), and records each
source's SHA-256 there. CPython's import system prefers an extension module to a ``.py`` file, so
a build left behind after its source changed (an edit, a ``git pull`` without a reinstall) would run
old code. :func:`install` is called once by ``radixkv/__init__.py``, before any of these modules is
imported: unless every listed source still has its recorded digest, every compiled module of the
build is an extension file, and ``RADIXKV_COMPILED`` is not ``0``, it puts a finder first on
``sys.meta_path`` that imports the ``.py`` sources of all of them (all or none: compiled modules
call each other directly in C, so a mix would hold two copies of a class).

A stale build warns once (reinstall: ``pip install -e .``); a missing one (no compiler, no mypyc,
``RADIXKV_COMPILE=0`` at install) is silent: the Python modules are the reference implementation.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import json
import os
import sys
import warnings
from pathlib import Path
from types import ModuleType
from typing import Sequence

__all__ = ["active", "decide", "install", "modules", "reason"]

_HERE = Path(__file__).resolve().parent
_STAMP = _HERE / "_compiled.json"

_active = False
_reason = "not installed yet"
_modules: tuple[str, ...] = ()


def active() -> bool:
    """True when the compiled tree and policies are the ones imported."""
    return _active


def reason() -> str:
    """Why the Python sources run instead ('' while the compiled build is active)."""
    return _reason


def modules() -> tuple[str, ...]:
    """Names of the modules the build compiles (empty without a build)."""
    return _modules


class _SourceFinder:
    """Imports the listed modules from their ``.py`` files, ahead of any extension module."""

    def __init__(self, names: Sequence[str]) -> None:
        self._names = frozenset(names)

    def find_spec(self, fullname: str, path: object = None, target: ModuleType | None = None):
        if fullname not in self._names:
            return None
        return importlib.util.spec_from_file_location(fullname, _source_path(fullname))


def _source_path(module: str) -> Path:
    return _HERE.joinpath(*module.split(".")[1:]).with_suffix(".py")


def _extension_exists(module: str) -> bool:
    base = _HERE.joinpath(*module.split(".")[1:])
    return any(base.with_name(base.name + suffix).is_file()
               for suffix in importlib.machinery.EXTENSION_SUFFIXES)


def _built_modules() -> list[str]:
    """Modules of this package that have both an extension file and a ``.py`` source."""
    out = []
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        for ext in _HERE.glob("*" + suffix):
            stem = ext.name[: -len(suffix)]
            if ext.with_name(stem + ".py").is_file():
                out.append(f"radixkv.{stem}")
    return sorted(out)


def decide(stamp: dict, environ: dict[str, str]) -> str:
    """'' when the build recorded in ``stamp`` may run, else the reason it may not."""
    names = list(stamp.get("modules", {}))
    if environ.get("RADIXKV_COMPILED", "1") == "0":
        return "switched off by RADIXKV_COMPILED=0"
    for name in [*names, stamp.get("group", "")]:
        if not name.startswith("radixkv.") or not _extension_exists(
            name if name in names else name + "__mypyc"
        ):
            return f"{name} was not compiled (the C build failed?)"
    for name, digest in stamp["modules"].items():
        try:
            now = hashlib.sha256(_source_path(name).read_bytes()).hexdigest()
        except OSError as exc:
            return f"cannot read the source of {name}: {exc}"
        if now != digest:
            return f"{_source_path(name).name} changed since it was compiled"
    return ""


def install() -> None:
    """Choose the build once per process (see the module docstring). Idempotent."""
    global _active, _reason, _modules
    if _active or any(isinstance(f, _SourceFinder) for f in sys.meta_path):
        return
    stamp: dict = {}
    try:
        stamp = json.loads(_STAMP.read_text())
    except FileNotFoundError:
        why = "no compiled build (mypyc or a C compiler was missing at install)"
    except (OSError, ValueError) as exc:
        why = f"unreadable {_STAMP.name}: {exc}"
    else:
        valid = isinstance(stamp, dict) and isinstance(stamp.get("modules"), dict)
        why = decide(stamp, dict(os.environ)) if valid else f"malformed {_STAMP.name}"
        stamp = stamp if valid else {}
    # Leftover extension files of an older build count too (a reinstall that could not compile).
    _modules = names = tuple(dict.fromkeys([*stamp.get("modules", {}), *_built_modules()]))
    if not why:
        _active, _reason = True, ""
        return
    _reason = why
    if names:
        sys.meta_path.insert(0, _SourceFinder(names))
    if "changed since" in why or "not compiled" in why:
        warnings.warn(f"radixkv: running the tree and policies as Python: {why}; rebuild with "
                      "`pip install -e .` (or set RADIXKV_COMPILED=0 to silence this)", stacklevel=2)

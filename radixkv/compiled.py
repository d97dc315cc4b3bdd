"""Which build of the tree and its policies runs: compiled by mypyc, or their Python source.

``setup.py`` compiles a few modules (the tree and the eviction policies) with mypyc from their own
source: the same code, run as C, so the simulator and the runtime keep sharing one implementation.
CPython's import system prefers an extension module to a ``.py`` file, so a build left behind after
its source changed (an edit, a ``git pull`` without a reinstall, a build for another Python sharing
the source tree) would run old code. So each build records, per extension suffix (one per Python
ABI), the SHA-256 of every source it compiled and of every file it produced, in
``radixkv/_compiled.json``.

:func:`install` is called once by ``radixkv/__init__.py``, before any of these modules is imported.
The build runs only when ``RADIXKV_COMPILED`` is not ``0`` and this Python's build is recorded with
every source and every produced file unchanged, and no other module of the package has an extension
file. Otherwise a finder put first on ``sys.meta_path`` imports the ``.py`` sources of all of them
(all or none: compiled modules call each other directly in C, so a mix would hold two copies of a
class). A stale build warns once; a missing one (no compiler, no mypyc, ``RADIXKV_COMPILE=0`` at
install) is silent: the Python modules are the reference implementation.
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
from typing import Any, Mapping, Sequence

__all__ = ["STAMP_FORMAT", "active", "decide", "install", "modules", "reason"]

STAMP_FORMAT = 2
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
    """Names of the modules that have a compiled build (recorded or left on disk)."""
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


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _built_modules(here: Path = _HERE) -> list[str]:
    """Modules of this package with an extension file (any suffix) beside their ``.py`` source."""
    out = set()
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        for ext in here.glob("*" + suffix):
            stem = ext.name[: -len(suffix)]
            if "." not in stem and ext.with_name(stem + ".py").is_file():
                out.add(f"radixkv.{stem}")
    return sorted(out)


def _switched_off(environ: Mapping[str, str]) -> bool:
    # Read as RADIXKV_NATIVE reads its switch: "false" ran the compiled build before.
    return environ.get("RADIXKV_COMPILED", "1").strip().lower() in ("0", "false", "no", "off")


def decide(stamp: dict[str, Any], environ: dict[str, str], here: Path = _HERE) -> str:
    """'' when this Python's build recorded in ``stamp`` may run, else the reason it may not."""
    if _switched_off(environ):
        return "switched off by RADIXKV_COMPILED=0"
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]  # the one the importer tries first
    build = stamp.get("builds", {}).get(suffix) if stamp.get("format") == STAMP_FORMAT else None
    if not isinstance(build, dict) or not build.get("sources") or not build.get("files"):
        return f"no complete build for this Python ({suffix}) is recorded"
    sources, files = build["sources"], build["files"]
    extra = sorted(set(_built_modules(here)) - set(sources))
    if extra:
        return f"{', '.join(extra)} has an extension file this build did not make (a leftover)"
    for name, digest in sources.items():
        try:
            now = _sha256(here.joinpath(*name.split(".")[1:]).with_suffix(".py"))
        except OSError as exc:
            return f"cannot read the source of {name}: {exc}"
        if now != digest:
            return f"{name.split('.')[-1]}.py changed since it was compiled"
        if name.split(".")[-1] + suffix not in files:
            return f"{name} was not compiled for this Python"
    for filename, digest in files.items():
        try:
            now = _sha256(here / filename)
        except OSError:
            return f"{filename} is missing (the build did not finish?)"
        if now != digest:
            return f"{filename} changed since it was built (another build over this one?)"
    return ""


def install() -> None:
    """Choose the build once per process (see the module docstring). Idempotent."""
    global _active, _reason, _modules
    if _active or any(isinstance(f, _SourceFinder) for f in sys.meta_path):
        return
    stamp: dict[str, Any] = {}
    try:
        loaded = json.loads(_STAMP.read_text())
    except FileNotFoundError:
        why = "no compiled build (RADIXKV_COMPILE=0, or no mypyc or C compiler, at install)"
    except (OSError, ValueError) as exc:
        why = f"unreadable {_STAMP.name}: {exc}"
    else:
        stamp = loaded if isinstance(loaded, dict) else {}
        why = decide(stamp, dict(os.environ))
    if _switched_off(os.environ):  # the reason even where no build is recorded
        why = "switched off by RADIXKV_COMPILED=0"
    recorded = [m for b in stamp.get("builds", {}).values() if isinstance(b, dict)
                for m in b.get("sources", {})] if isinstance(stamp.get("builds"), dict) else []
    built = _built_modules()
    _modules = names = tuple(dict.fromkeys([*recorded, *built]))
    if not why:
        _active, _reason = True, ""
        return
    if built and why.startswith("no compiled build"):
        why = "extension files without a build record (a build that did not finish?)"
    _reason = why
    if names:
        sys.meta_path.insert(0, _SourceFinder(names))
    if built and "RADIXKV_COMPILED=0" not in why:
        warnings.warn(f"radixkv: the tree and policies run as Python: {why}; reinstall radixkv to "
                      "rebuild them (`pip install -e .` in a source checkout), or set "
                      "RADIXKV_COMPILED=0 to silence this", stacklevel=3)

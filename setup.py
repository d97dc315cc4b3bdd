"""Only the optional compiled parts live here; everything else is in pyproject.toml.

* ``radixkv._native``: a plain C library (loaded with ctypes by :mod:`radixkv.native`, not imported): a
  streaming (non-temporal) bulk copy and the success path of a disk-tier chunk read.
* The tree and its eviction policies (:data:`COMPILED`), compiled with mypyc from their own Python
  source: the same code, run as C. The runtime and the simulator both get it.

Both are optional: without a C compiler, or if mypyc cannot build, the install still succeeds and
radixkv runs the same operations in Python (tests/test_native.py and tests/test_compiled.py check
which one it got). ``RADIXKV_COMPILE=0`` skips the mypyc build (and removes the compiled files an
earlier build left in the output folder, so they are neither packed nor imported as this build's).

A complete build records itself in ``radixkv/_compiled.json`` beside the built files, under its
extension suffix (one per Python ABI): the SHA-256 of each compiled source and of each file produced.
At import, :mod:`radixkv.compiled` uses the compiled modules only while all of them still match, so
an edited or pulled source without a reinstall runs as Python, never as stale C.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
# The hot modules of the tree and its policies (the simulator's inner loop, the store's every call).
COMPILED = [
    "radixkv/tree.py",
    "radixkv/tree_nodes.py",
    "radixkv/tree_joins.py",
    "radixkv/tree_eviction.py",
    "radixkv/tree_results.py",
    "radixkv/pins.py",
    "radixkv/policy_base.py",
    "radixkv/linked_order.py",
    "radixkv/policies.py",
    "radixkv/policy_fifo.py",
    "radixkv/policy_heap.py",
    "radixkv/policy_oddsref.py",
    "radixkv/policy_opt.py",
    "radixkv/ghosts.py",
    "radixkv/prio_heap.py",
    "radixkv/replay_loop.py",
]
_MODULES = {path[:-3].replace("/", "."): path for path in COMPILED}  # module name -> source
STAMP_NAME = "_compiled.json"
STAMP_FORMAT = 2  # radixkv.compiled.STAMP_FORMAT
GROUP = "radixkv._core"  # the shared library of the compiled group: radixkv/_core__mypyc.*.so


def _native() -> Extension:
    return Extension("radixkv._native",
                     sources=["radixkv/csrc/abi.c", "radixkv/csrc/streamcopy.c", "radixkv/csrc/chunkio.c"],
                     extra_compile_args=["-O2"], optional=True)


_SOURCE_DIGESTS: dict[str, str] = {}  # of the sources mypyc compiled, taken before it read them
# setup.py commands that only describe the package: pip runs several per install, mypyc need not.
_METADATA_ONLY = {"egg_info", "dist_info", "sdist", "check", "clean"}


def _builds_extensions() -> bool:
    words = [a for a in sys.argv[1:] if not a.startswith("-") and os.sep not in a and not os.path.exists(a)]
    return not words or not set(words) <= _METADATA_ONLY


def _compiled() -> list[Extension]:
    if os.environ.get("RADIXKV_COMPILE", "1") == "0" or not _builds_extensions():
        return []
    try:
        from mypyc.build import mypycify
    except ImportError:
        print("radixkv: mypyc is not installed; the tree and policies run as Python", file=sys.stderr)
        return []
    # Digests first: an edit while mypyc and the C compiler run must not be recorded as built.
    _SOURCE_DIGESTS.update({name: _sha256(HERE / path) for name, path in _MODULES.items()})
    cwd = os.getcwd()
    os.chdir(HERE)  # mypyc names modules by their paths
    try:
        exts = mypycify(COMPILED, opt_level="3", group_name=GROUP)
    except (Exception, SystemExit) as exc:  # a type error makes mypycify exit
        print(f"radixkv: mypyc could not compile the tree ({exc!r}); it runs as Python", file=sys.stderr)
        return []
    finally:
        os.chdir(cwd)
    for ext in exts:
        ext.optional = True  # a C compile failure leaves the Python modules (BuildExt sees it)
    return exts


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class BuildExt(build_ext):
    """build_ext that records this Python's mypyc build in ``radixkv/_compiled.json`` (beside the
    built files): the digests of the sources compiled and of every file produced, under the
    extension suffix. Only when every module of the group built (or was up to date); a failed
    build's entry is removed, so radixkv.compiled runs the Python source instead."""

    def run(self) -> None:
        self._failed: set[str] = set()
        group = [e.name for e in self.extensions if e.name == GROUP + "__mypyc" or e.name in _MODULES]
        stamp = Path(self.get_ext_fullpath(GROUP + "__mypyc")).with_name(STAMP_NAME)
        suffix = sysconfig.get_config_var("EXT_SUFFIX")
        if group:
            self._record(stamp, suffix, None)  # until this build is known to be complete
        else:
            self._remove_compiled_tree(stamp, suffix)
        super().run()
        if not group:
            return
        paths = [Path(self.get_ext_fullpath(name)) for name in group]
        if all(p.is_file() for p in paths) and not self._failed & set(group) and _SOURCE_DIGESTS:
            self._record(stamp, suffix, {"group": GROUP, "sources": dict(_SOURCE_DIGESTS),
                                         "files": {p.name: _sha256(p) for p in paths}})
        else:
            self._remove_compiled_tree(stamp, suffix)
            print("radixkv: the compiled tree did not build; it runs as Python", file=sys.stderr)

    def _remove_compiled_tree(self, stamp: Path, suffix: str) -> None:
        """This build made no complete compiled tree (``RADIXKV_COMPILE=0``, no mypyc, mypyc or the C
        compiler failed): remove this Python's compiled files and record from the output folder.
        They are an earlier build's (pip builds in the source tree and keeps its ``build/``; ``-e``
        builds in place) or part of this failed one, and would otherwise be packed into the wheel,
        or stay imported, as if this build had made them."""
        names = [GROUP + "__mypyc", *_MODULES]
        stale = [p for p in (Path(self.get_ext_fullpath(name)) for name in names) if p.is_file()]
        for path in stale:
            path.unlink()
        if stamp.is_file():
            self._record(stamp, suffix, None)
        if stale:
            print(f"radixkv: removed {len(stale)} compiled files of the tree from {stale[0].parent}, "
                  "not a complete build of this source: the tree and policies run as Python", file=sys.stderr)

    @staticmethod
    def _record(stamp: Path, suffix: str, build: dict | None) -> None:
        try:
            data = json.loads(stamp.read_text())
        except (OSError, ValueError):
            data = {}
        if not isinstance(data, dict) or data.get("format") != STAMP_FORMAT:
            data = {}
        builds = data.get("builds") if isinstance(data.get("builds"), dict) else {}
        if build is None:
            builds.pop(suffix, None)
        else:
            builds[suffix] = build
        stamp.write_text(json.dumps({"format": STAMP_FORMAT, "builds": builds}, indent=1) + "\n")

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception:
            self._failed.add(ext.name)  # optional: build_ext reports it and goes on
            raise


setup(ext_modules=[_native(), *_compiled()], cmdclass={"build_ext": BuildExt})

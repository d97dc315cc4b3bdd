"""Only the optional compiled parts live here; everything else is in pyproject.toml.

* ``radixkv._native``: a plain C library (loaded with ctypes by :mod:`radixkv.native`, not imported): a
  streaming (non-temporal) bulk copy and the success path of a disk-tier chunk read.
* The tree and its eviction policies (:data:`COMPILED`), compiled with mypyc from their own Python
  source: the same code, run as C. The runtime and the simulator both get it.

Both are optional: without a C compiler, or if mypyc cannot build, the install still succeeds and
radixkv runs the same operations in Python (tests/test_native.py and tests/test_compiled.py check
which one it got). ``RADIXKV_COMPILE=0`` skips the mypyc build.

A build of every compiled module writes ``radixkv/_compiled.json`` beside them: the SHA-256 of each
compiled source. At import,
:mod:`radixkv.compiled` uses the compiled modules only while every source still has that digest,
so an edited or pulled source without a reinstall runs as Python, never as stale C.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
# The hot modules of the tree and its policies (the simulator's inner loop, the store's every call).
COMPILED = [
    "radixkv/tree.py",
    "radixkv/tree_results.py",
    "radixkv/pins.py",
    "radixkv/policies.py",
    "radixkv/policy_fifo.py",
    "radixkv/policy_heap.py",
    "radixkv/policy_oddsref.py",
]
_MODULES = {path[:-3].replace("/", "."): path for path in COMPILED}  # module name -> source
STAMP_NAME = "_compiled.json"
GROUP = "radixkv._core"  # the shared library of the compiled group: radixkv/_core__mypyc.*.so


def _native() -> Extension:
    return Extension("radixkv._native",
                     sources=["radixkv/csrc/abi.c", "radixkv/csrc/streamcopy.c", "radixkv/csrc/chunkio.c"],
                     extra_compile_args=["-O2"], optional=True)


def _compiled() -> list[Extension]:
    if os.environ.get("RADIXKV_COMPILE", "1") == "0":
        return []
    try:
        from mypyc.build import mypycify
    except ImportError:
        print("radixkv: mypyc is not installed; the tree and policies run as Python", file=sys.stderr)
        return []
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


class BuildExt(build_ext):
    """build_ext that writes ``radixkv/_compiled.json`` beside the built modules only when every
    module of the mypyc group built (or was up to date), and removes an older one first."""

    def run(self) -> None:
        self._failed: set[str] = set()
        group = [e.name for e in self.extensions if e.name == GROUP + "__mypyc" or e.name in _MODULES]
        stamp = Path(self.get_ext_fullpath(GROUP + "__mypyc")).with_name(STAMP_NAME)
        stamp.unlink(missing_ok=True)
        super().run()
        built = all(Path(self.get_ext_fullpath(name)).is_file() for name in group)
        if group and built and not self._failed & set(group):
            digests = {name: hashlib.sha256((HERE / path).read_bytes()).hexdigest()
                       for name, path in _MODULES.items()}
            stamp.write_text(json.dumps({"group": GROUP, "modules": digests}, indent=1) + "\n")
        elif group:
            print("radixkv: the compiled tree did not build; it runs as Python", file=sys.stderr)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception:
            self._failed.add(ext.name)  # optional: build_ext reports it and goes on
            raise


setup(ext_modules=[_native(), *_compiled()], cmdclass={"build_ext": BuildExt})

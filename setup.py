"""Only the optional C helpers live here; everything else is in pyproject.toml.

``radixkv._native`` is a plain C library (loaded with ctypes by :mod:`radixkv.native`, not imported):
a streaming (non-temporal) bulk copy and the success path of a disk-tier chunk read. ``optional=True``:
without a C compiler the install still succeeds and radixkv runs the same operations in Python
(tests/test_native.py checks which one it got).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("radixkv._native",
                  sources=["radixkv/csrc/abi.c", "radixkv/csrc/streamcopy.c", "radixkv/csrc/chunkio.c"],
                  extra_compile_args=["-O2"], optional=True),
    ]
)

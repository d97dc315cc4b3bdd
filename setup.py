"""Only the optional C helper lives here; everything else is in pyproject.toml.

``radixkv._streamcopy`` is a plain C library (loaded with ctypes by radixkv.hostcopy, not imported):
a non-temporal bulk copy. ``optional=True``: without a C compiler the install still succeeds and
radixkv.hostcopy falls back to glibc's memmove (tests/test_hostcopy.py checks which one it got).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("radixkv._streamcopy", sources=["radixkv/_streamcopy.c"], extra_compile_args=["-O2"],
                  optional=True),
    ]
)

"""Test-only stand-in for ``torchvision`` (see tests/_stubs/README.md).

SGLang's model-config package imports torchvision at module top for vision models; the L2<->L3
storage path never calls into it. Every attribute and every ``torchvision.*`` submodule resolves to a
permissive placeholder that fails loudly if it is ever *called*, so a test that accidentally
depends on real torchvision behaviour errors instead of passing silently.
"""

from __future__ import annotations

import sys

from torchvision._permissive import PermissiveModule, install_finder

__version__ = "0.0.0"  # transformers parses this and stays on its PIL code paths

install_finder("torchvision")


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return PermissiveModule.placeholder(f"torchvision.{name}")


sys.modules.setdefault("torchvision.__stub__", sys.modules[__name__])

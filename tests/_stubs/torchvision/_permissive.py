"""Permissive placeholders for the torchvision stub: importable, attribute-able, never callable."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types


class _Placeholder:
    """Any attribute is another placeholder; calling one raises with the dotted name."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, item: str) -> "_Placeholder":
        if item.startswith("__"):
            raise AttributeError(item)
        return _Placeholder(f"{self._name}.{item}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(
            f"{self._name} was called, but torchvision is only a test import stub here "
            "(tests/_stubs); install a CPU torchvision build matching torch to use it"
        )

    def __mro_entries__(self, bases):  # allows `class X(torchvision.something.Base)` at import time
        return (object,)

    def __repr__(self) -> str:
        return f"<torchvision stub {self._name}>"


class PermissiveModule(types.ModuleType):
    """A module whose missing attributes are placeholders."""

    def __getattr__(self, item: str):
        if item.startswith("__"):
            raise AttributeError(item)
        return _Placeholder(f"{self.__name__}.{item}")

    @staticmethod
    def placeholder(name: str) -> _Placeholder:
        return _Placeholder(name)


class _Loader(importlib.abc.Loader):
    def create_module(self, spec):
        module = PermissiveModule(spec.name)
        module.__path__ = []  # a package, so deeper submodules import too
        return module

    def exec_module(self, module) -> None:
        return None


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, root: str) -> None:
        self._root = root

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith(self._root + "."):
            return None
        return importlib.machinery.ModuleSpec(fullname, _Loader(), is_package=True)


def install_finder(root: str) -> None:
    """Make every ``root.*`` submodule importable as a permissive module (last resort)."""
    if not any(isinstance(f, _Finder) and f._root == root for f in sys.meta_path):
        sys.meta_path.append(_Finder(root))

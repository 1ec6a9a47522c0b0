"""Import-only stand-in for torchvision in the SGLang engine venv.

PyPI's torchvision wheel needs CUDA torch; sglang.srt.configs imports it
unconditionally but never calls it on the paths kvfs tests. Every attribute
and submodule resolves to a dummy; calling one raises. This is not a
distribution, so transformers still sees torchvision as absent.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

__version__ = "0.0.0+kvfs-stub"


class _Dummy:
    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> _Dummy:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Dummy(f"{self._name}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self._name}: torchvision is an import-only stand-in here")

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[type, ...]:
        return (object,)


class _StubModule(types.ModuleType):
    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Dummy(f"{self.__name__}.{attr}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        return _StubModule(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__path__ = []  # type: ignore[attr-defined]


sys.meta_path.insert(0, _Finder())
sys.modules[__name__].__class__ = _StubModule

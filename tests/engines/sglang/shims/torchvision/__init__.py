"""Import-only stand-in for torchvision, used by the SGLang adapter tests only.

Why: PyPI's torchvision wheels for torch 2.13 are linked against CUDA torch; with the CPU
build of torch their C ops fail to load (``operator torchvision::nms does not exist``) and
``import torchvision`` raises. sglang 0.5.23 imports ``torchvision.transforms`` at module
level only for multimodal image preprocessing (``sglang.srt.multimodal.internvl_utils``,
``sglang.srt.configs.deepseek_ocr``, reached through ``sglang.srt.configs``), and
``transformers`` imports ``torchvision.io`` for its video/image processors once it sees a
torchvision. KV transfer never calls any of them.

Every ``torchvision.*`` submodule resolves to a stub whose attributes are callables that
raise when called, so a test that reached image code by mistake fails loudly.
"""

from __future__ import annotations

import enum
import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+import-shim"
__path__: list[str] = []


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def _unavailable(qualname: str):
    def call(*args, **kwargs):
        raise RuntimeError(f"{qualname} called on the import-only torchvision stand-in")
    call.__qualname__ = qualname
    return call


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        if name == "InterpolationMode":
            return InterpolationMode
        return _unavailable(f"{self.__name__}.{name}")


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


if not any(isinstance(f, _StubFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _StubFinder())


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _unavailable(f"torchvision.{name}")

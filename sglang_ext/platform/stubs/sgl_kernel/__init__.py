"""Import-only stand-in for ``sgl_kernel`` on hosts without CUDA.

SGLang imports sgl_kernel ops at module level even when the CPU engine never calls them. The real
wheel cannot load without libcuda, so this package satisfies the imports; any call raises an error
naming the op, so a CPU path that does need a CUDA kernel fails loudly instead of silently.
"""

import importlib.abc
import importlib.machinery
import sys
import types

IS_STAND_IN = True
__version__ = "0.0.0+sglang_ext.stand_in"


class MissingKernelError(RuntimeError):
    pass


class _MissingOp:
    """A name imported from sgl_kernel; calling it (or anything reached through it) raises."""

    def __init__(self, qualname: str):
        self._qualname = qualname

    def __call__(self, *args, **kwargs):
        raise MissingKernelError(
            f"sgl_kernel op '{self._qualname}' was called, but this host has no CUDA and only the "
            "sglang_ext import stand-in for sgl_kernel is installed"
        )

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _MissingOp(f"{self._qualname}.{name}")

    def __repr__(self):
        return f"<missing sgl_kernel op {self._qualname}>"


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _MissingOp(f"{self.__name__}.{name}")


class _SubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves every ``sgl_kernel.<sub>`` import as a stub package."""

    def find_spec(self, fullname, path, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _MissingOp(f"{__name__}.{name}")


if not any(isinstance(finder, _SubmoduleFinder) for finder in sys.meta_path):
    sys.meta_path.append(_SubmoduleFinder())

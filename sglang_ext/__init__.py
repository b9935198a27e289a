"""sglang_ext: KV-cache policies that run inside the SGLang serving engine."""

import importlib.util
import sys
from pathlib import Path

__version__ = "0.1.0"

# The install maps the checkout's top-level policies/, kernels/ and server/ in as subpackages of
# sglang_ext (pyproject's package-dir). A checkout put on sys.path (a GPU host's PYTHONPATH, the
# working directory) imports the same way: the last finder maps them where nothing else did.
_CHECKOUT = Path(__file__).resolve().parent.parent
_SUBPACKAGES = {
    f"{__name__}.{name}": _CHECKOUT / name
    for name in ("policies", "kernels", "server")
    if (_CHECKOUT / "pyproject.toml").is_file() and (_CHECKOUT / name / "__init__.py").is_file()
}


class _CheckoutSubpackages:
    @staticmethod
    def find_spec(fullname, path=None, target=None):
        folder = _SUBPACKAGES.get(fullname)
        if folder is None:
            return None
        return importlib.util.spec_from_file_location(
            fullname, folder / "__init__.py", submodule_search_locations=[str(folder)]
        )


if _SUBPACKAGES and _CheckoutSubpackages not in sys.meta_path:
    sys.meta_path.append(_CheckoutSubpackages)

"""Stand-in for ``sgl_kernel`` inside an SGLang server that runs on the CPU.

PyPI's sglang-kernel wheel only carries CUDA builds of its operator library, and importing the real
package loads that library (and the CUDA runtime) at once, which fails on a machine without a GPU
driver. SGLang imports a few pure-Python names from ``sgl_kernel`` even on its CPU path, so the
import itself has to work. This package, found first on ``PYTHONPATH``, becomes ``sgl_kernel``:

* its submodules are the real ones (``__path__`` points at the installed package);
* the two loaders of native code in the real ``load_utils`` are swapped for ones that load nothing;
* the real ``__init__.py`` then runs in this module's namespace, so every Python-level name exists;
* any other name resolves to a placeholder that raises ``NotImplementedError`` when called.

No ``torch.ops.sgl_kernel`` operator gets registered, so SGLang's checks for CPU kernels (AMX) come
out false and it uses its ``forward_native`` torch implementations with the ``torch_native``
attention backend. Nothing here is a kernel; it only lets the pure-torch path start.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

_HERE = Path(__file__).resolve().parent


def _real_package() -> Path:
    """The installed sgl_kernel's folder: the first one on sys.path that is not this stand-in."""
    others = [entry for entry in sys.path if Path(entry or os.curdir).resolve() != _HERE.parent]
    spec = importlib.machinery.PathFinder.find_spec(__name__, others)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "the CPU stand-in for sgl_kernel wraps the installed package, but sglang-kernel is not "
            "installed in this interpreter (pip install sglang installs it)"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _loads_nothing(*_args: Any, **_kwargs: Any) -> None:
    return None


def _missing(name: str) -> Callable[..., NoReturn]:
    def unavailable(*_args: Any, **_kwargs: Any) -> NoReturn:
        raise NotImplementedError(
            f"sgl_kernel.{name} is a native kernel, and this CPU stand-in has none; "
            "the SGLang server should have taken its torch-native path here"
        )

    unavailable.__name__ = unavailable.__qualname__ = name
    return unavailable


_REAL = _real_package()
__path__ = [str(_REAL)]  # submodules (elementwise, kvcacheio, ...) come from the real package
__file__ = str(_HERE / "__init__.py")

_load_utils = importlib.import_module(f"{__name__}.load_utils")
_load_utils._load_architecture_specific_ops = _loads_nothing  # would load the CUDA common_ops library
_load_utils._preload_cuda_library = _loads_nothing  # would dlopen libcudart

exec(compile((_REAL / "__init__.py").read_bytes(), str(_REAL / "__init__.py"), "exec"), globals())


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    placeholder = _missing(name)
    globals()[name] = placeholder
    return placeholder

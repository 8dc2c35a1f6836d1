"""What an SGLang server needs to run with ``--device cpu`` on a machine without a GPU.

This folder holds a stand-in ``sgl_kernel`` package. It is put first on the ``PYTHONPATH`` of an
SGLang server process launched with device cpu (see ``environment.cpu_environment``), so that
SGLang's imports of ``sgl_kernel`` succeed without loading the CUDA-only kernel library that PyPI's
sglang-kernel wheel ships; SGLang then takes its plain-torch code paths. Nothing in tandem imports
the stand-in in-process: it only ever runs inside SGLang's own interpreter.
"""

from __future__ import annotations

from pathlib import Path

SHIM_DIR = Path(__file__).resolve().parent
"""The folder to put first on PYTHONPATH: it contains the stand-in ``sgl_kernel`` package."""

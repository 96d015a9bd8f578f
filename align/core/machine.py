"""What this machine has, asked without torch (the orchestrator's side must stay torch-free)."""

from __future__ import annotations

import glob
import os


def has_gpu() -> bool:
    """Whether this machine has a GPU (torch-free: the device nodes the drivers create, /dev/nvidia<N> for NVIDIA,
    /dev/kfd for AMD ROCm)."""
    return bool(glob.glob("/dev/nvidia[0-9]*")) or os.path.exists("/dev/kfd")

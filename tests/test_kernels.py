"""Kernel settings of the TRL-trained stages (align/runtime/trl.py `liger_on`, the `liger` and `torch_compile`
settings): Liger's Triton kernels only where they can run (auto: a CUDA device with liger-kernel installed), `on`
refused with the fix where they cannot (at validate without the package, in the stage without CUDA), and what was
resolved is what the trainer gets and what the manifest records."""

from __future__ import annotations

import json
from importlib.util import find_spec
import pytest
import torch

from conftest import TINY, run_align

from align.runtime.context import StageError
from align.runtime.trl import liger_on

CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # a device object needs no GPU
INSTALLED = find_spec("liger_kernel") is not None


def test_liger_auto_is_on_only_on_cuda_with_the_package(monkeypatch):
    import importlib.util

    assert liger_on("auto", CPU) is False and liger_on("off", CUDA) is False
    real = importlib.util.find_spec
    for installed in (False, True):
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *a, _i=installed: object() if name == "liger_kernel" and _i else
                            (None if name == "liger_kernel" else real(name, *a)))
        assert liger_on("auto", CUDA) is installed
        assert liger_on("auto", CPU) is False
    assert liger_on("on", CUDA) is True  # installed (the last patch)
    with pytest.raises(StageError, match=r"liger: on.*CUDA GPU.*device cpu.*liger: auto"):
        liger_on("on", CPU)


def test_validate_refuses_liger_on_without_the_package(workdir):
    p = run_align("validate", "pipelines/default.yaml", "sft.liger=on", cwd=workdir)
    if INSTALLED:  # a machine with liger-kernel: validate has nothing to refuse (the stage checks for CUDA)
        assert p.returncode == 0, p.stderr
    else:
        assert p.returncode == 2 and "liger: on" in p.stderr and "pip install liger-kernel" in p.stderr, p.stderr
        assert "Traceback" not in p.stderr
    p = run_align("validate", "pipelines/default.yaml", "sft.liger=off", "ppo.generation.fast=on", cwd=workdir)
    assert p.returncode == 0, p.stderr  # YAML reads an unquoted on/off as a boolean: taken as the word
    p = run_align("validate", "pipelines/default.yaml", "sft.liger=sometimes", cwd=workdir)
    assert p.returncode == 2 and "sft.liger" in p.stderr and "auto, on, off" in p.stderr, p.stderr


def test_the_stage_records_the_kernels_it_trained_with(workdir):
    """On this CPU, liger auto resolves to off, and the manifest says so (a GPU run's says on, with the package)."""
    p = run_align("run", "pipelines/default.yaml", "--only", "sft", "tracking.wandb=disabled", *TINY,
                  "sft.max_steps=2", "sft.save_steps=2", "sft.logging_steps=1", cwd=workdir)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    m = json.loads((workdir / "runs" / "default" / "main" / "sft" / "manifest.json").read_text())
    assert m["kernels"]["liger"] is False

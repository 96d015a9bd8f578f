"""The memory and disk preflight of `align run`: before anything is launched, stages whose per-GPU estimate exceeds
the GPU memory are refused (align/orchestrator/estimate.py), and a run directory short of disk is warned of
(align/orchestrator/disk.py)."""

from __future__ import annotations

from pathlib import Path

from align.config import PipelineConfig
from align.core.errors import PipelineError
from align.orchestrator.disk import disk_peak, disk_problem
from align.orchestrator.estimate import EstimateError, dtype_bytes, estimate_pipeline, too_big
from align.orchestrator.hardware import Hardware
from align.orchestrator.helper import HelperError
from align.orchestrator.plan import StagePlan


def memory_preflight(cfg: PipelineConfig, source: str | Path, plans: list[StagePlan], names: set[str],
                     num_processes: int | None, hw: Hardware, ignore: bool) -> None:
    """Refuse, before anything is launched, stages whose per-GPU estimate exceeds the GPU memory (align/orchestrator/estimate.py).
    Skipped when no GPU is present or declared, or when the base model's config cannot be read here."""
    if not names or not hw.gpu_memory:
        return
    try:
        estimates = estimate_pipeline(cfg, source, hw, num_processes, plans, launched=True)  # as launch_command
    except (EstimateError, HelperError) as exc:  # a crash of the shape helper (a model's own code) skips it too
        print(f"[align] memory preflight skipped: {(str(exc).strip() or repr(exc)).splitlines()[-1]}", flush=True)
        return
    disk = disk_problem(cfg, disk_peak(cfg, estimates, dtype_bytes(cfg.dtype, True, cfg.precision), names), cfg.runs_dir)
    if disk:  # an estimate of checkpoints that may never all be written (a short stage saves none): a warning
        print(f"[align] warning: disk: {disk}", flush=True)
    problems = too_big(estimates, hw, names)
    if not problems:
        return
    if ignore:
        for line in problems:
            print(f"[align] warning (--ignore-memory-check): {line}", flush=True)
        return
    raise PipelineError("memory preflight: " + "\n  ".join(problems) + "\n  (see `align estimate`; "
                        "--ignore-memory-check launches anyway)")

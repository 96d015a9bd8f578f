"""The disk a run directory needs at its peak, before anything is launched: `align estimate` prints it, and `align
run`'s preflight warns when the run directory's filesystem has less free. Arithmetic from the memory estimate's
parameter counts (align/orchestrator/estimate.py), not measured:

* a trained stage's checkpoint holds its trained parameters (the adapters alone with LoRA) at 12 bytes each (fp32
  master weights and two Adam moments under DeepSpeed; fp32 weights and the moments outside it), plus copies of the
  weights in their dtype as the checkpoint's writer keeps them (`state_bytes_per_param`: in bf16 16 bytes a
  parameter for a TRL stage under ZeRO-1/2, 12 for PPO under ZeRO-3). `save_total_limit` of them are kept, and one
  more is on disk while the newest is written before the oldest goes; fewer where the stage says it writes fewer
  (`checkpoints_written`: PPO saves every `save_every` iterations but never at its last);
* its published model: the trained models it publishes (not PPO's value model) in the weights' dtype (the adapters
  alone for LoRA without merge);
* a completed stage's checkpoints stay unless `keep_checkpoints: false`;
* a stage that publishes the base model untrained (`pretrained`): the base's parameters in the weights' dtype.

The peak is the largest, over the stages in run order, of every earlier stage's model and kept checkpoints plus this
stage's checkpoints while it trains and its model."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from align.config import PipelineConfig
from align.config.contract import POLICY, TrainedStage
from align.orchestrator.memory import enabled_lora


@dataclass(frozen=True)
class DiskPeak:
    bytes: int
    stage: str  # the stage during which the peak falls
    checkpoints: int  # of it: checkpoints (that stage's while it trains, and earlier ones kept)
    models: int  # of it: published models


def state_bytes_per_param(weight_bytes: int, mode: str = "ddp", trainer: bool = False) -> int:
    """A checkpoint's bytes per trained parameter. Outside DeepSpeed: 12 (fp32 weights and two Adam moments) plus
    a 16-bit model file where the weights are 16-bit. Under DeepSpeed: 12 of optimiser state (fp32 master weights
    and two moments, zero_pp_rank_*_optim_states.pt), plus under ZeRO-1/2 DeepSpeed's module copy in the weights'
    dtype (mp_rank_00_model_states.pt; under ZeRO-3 it holds placeholders of the partitions), plus a Trainer's
    model file in the weights' dtype (`trainer`: the TRL stages' model.safetensors, gathered under ZeRO-3; PPO's
    accelerate save_state writes none). As found on this CPU (2026-11-29), a 2-process ZeRO-2 GRPO checkpoint of
    SmolLM2-135M in fp32: model.safetensors 651 MB, mp_rank_00_model_states.pt 538 MB, optimiser states 2 x 807 MB."""
    if mode == "ddp":
        return 12 + (weight_bytes if weight_bytes < 4 else 0)
    module = weight_bytes if mode in ("zero1", "zero2", "zero2_offload") else 0
    return 12 + module + (weight_bytes if trainer else 0)


def base_params(estimates: list) -> int:
    """The base model's parameters as a language model: an LM any stage holds, else the reward model's (its scalar
    head swapped for an untied LM head: a tied one counts once more, an over-estimate), else 0."""
    shapes = [h.shape for e in estimates for h in e.held]
    lm = next((s.params for s in shapes if not s.scalar), None)
    scalar = next((s for s in shapes if s.scalar), None)
    return lm if lm is not None else scalar.params - scalar.hidden + scalar.vocab * scalar.hidden if scalar else 0


def disk_peak(cfg: PipelineConfig, estimates: list, weight_bytes: int, only: set[str] | None = None) -> DiskPeak | None:
    """The run directory's peak over `estimates` (StageEstimate, in run order; `only`: of these stages, the base's
    size read from all); None when nothing trains or is written whole (a pretrained stage's copy of the base)."""
    done_models = done_checkpoints = 0
    peak: DiskPeak | None = None
    base = base_params(estimates)
    for e in (e for e in estimates if only is None or e.name in only):
        stage = cfg.stages[e.name]
        trained = [h for h in e.held if h.trained]
        if not trained:
            if stage.PRODUCES == POLICY and stage.starts_from_base() and base:  # the base published whole
                done_models += base * weight_bytes
                at = DiskPeak(done_models + done_checkpoints, e.name, done_checkpoints, done_models)
                peak = at if peak is None or at.bytes > peak.bytes else peak
            continue
        per_param = state_bytes_per_param(weight_bytes, e.mode, isinstance(stage, TrainedStage))
        states = sum(e.trained_params.get(h.role, h.shape.params) for h in trained) * per_param
        keep = getattr(stage, "save_total_limit", 1)
        written = getattr(stage, "checkpoints_written", lambda: None)()  # None: as many as it may (a TRL stage's
        copies = keep + 1 if written is None else min(written, keep + 1)  # steps are not known before its data is)
        keep = min(keep, copies)
        lora = enabled_lora(stage)
        unmerged = lora is not None and not lora.merge
        model = sum((e.trained_params[h.role] * 4 if unmerged else h.shape.params * weight_bytes)
                    for h in trained if h.role != "value")
        at = DiskPeak(done_models + done_checkpoints + states * copies + model, e.name,
                      done_checkpoints + states * copies, done_models + model)
        peak = at if peak is None or at.bytes > peak.bytes else peak
        done_models += model
        done_checkpoints += states * keep if cfg.keep_checkpoints else 0
    return peak


def free_bytes(runs_dir: str | Path) -> int:
    """Free space on the filesystem that holds (or will hold) `runs_dir`."""
    path = Path(runs_dir).resolve()
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def gb(n: float) -> str:
    """Bytes as GB (1e9) for people: whole GB from 100 up, three significant digits below (0.05 GB is not 0)."""
    return f"{n / 1e9:,.0f}" if n >= 100e9 else f"{n / 1e9:.3g}" if n >= 1e6 or not n else "<0.001"


def disk_problem(cfg: PipelineConfig, peak: DiskPeak | None, runs_dir: str | Path) -> str | None:
    """What to say when the run directory's filesystem has less free space than the peak (None: it has enough)."""
    if peak is None:
        return None
    free = free_bytes(runs_dir)
    if peak.bytes <= free:
        return None
    fixes = ["free space or point runs_dir elsewhere", "lower save_total_limit"]
    if cfg.keep_checkpoints:
        fixes.insert(1, "set keep_checkpoints: false")
    return (f"the run directory needs ~{gb(peak.bytes)} GB at its peak (during stage '{peak.stage}': "
            f"checkpoints {gb(peak.checkpoints)} GB, models {gb(peak.models)} GB) but {runs_dir} has "
            f"{gb(free)} GB free; " + ", ".join(fixes))

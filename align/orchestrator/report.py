"""`align report <run-dir>`: rebuild the evaluation report of an existing run without retraining.

Reads the run's pipeline.json (resolved config and the pipeline file it came from), checks that every
policy, reference and reward model the evaluate stage needs is a completed, loadable `model/`, and reruns
only the evaluate stage(s).
"""

from __future__ import annotations

import json
from pathlib import Path

from align.config import parse_pipeline
from align.config.contract import POLICY, REPORT, REWARD_MODEL
from align.core.errors import PipelineError
from align.core.rundir import PIPELINE, read_manifest, record_problem
from align.orchestrator.commands import recorded_run, resume_as
from align.orchestrator.runner import run
from align.core.schema import is_plain_name

_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
# A LoRA stage publishes its adapter alone (align/modeling/models.py ADAPTER_BASE names what it was trained on).
_ADAPTER = ("adapter_config.json", "align_adapter.json")
_ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")


def _complete(model: Path) -> bool:
    """A whole model (config + weights) or a published adapter (its config, its base record, its weights)."""
    if (model / "config.json").is_file() and any((model / w).is_file() for w in _WEIGHTS):
        return True
    return all((model / f).is_file() for f in _ADAPTER) and any((model / w).is_file() for w in _ADAPTER_WEIGHTS)


def check_model_dir(run_dir: Path, stage: str) -> None:
    """Refuse (with the fix) when a stage's model/ is missing, incomplete, or its stage did not complete."""
    manifest = read_manifest(run_dir / stage) or {}
    model = run_dir / stage / "model"
    status = manifest.get("status", "no manifest")
    if status != "completed":
        raise PipelineError(f"{run_dir / stage}: stage '{stage}' is {status!r}, not completed; rerun the "
                            "pipeline to finish it before building a report")
    if not _complete(model):
        raise PipelineError(f"{model}: missing or incomplete (neither a model's config.json and weights nor a LoRA "
                            f"adapter's adapter_config.json, {_ADAPTER[1]} and weights); rerun the pipeline with "
                            f"--from {stage}")


def rebuild(run_dir: str | Path) -> Path:
    """Re-evaluate the run in `run_dir` and write its report there: the directory given is the one read and
    written (a copied or renamed run never touches the run it was copied from)."""
    run_dir = Path(run_dir).resolve()
    info_path = run_dir / PIPELINE
    if not info_path.is_file():
        raise PipelineError(f"{run_dir}: not a run directory (no pipeline.json)")
    try:
        info = json.loads(info_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PipelineError(f"{info_path}: cannot be read as JSON ({exc})") from None
    problem = record_problem(info) or (None if isinstance(info.get("config"), dict) else "no `config` mapping")
    if problem:
        raise PipelineError(f"{info_path}: not a pipeline manifest ({problem}); delete it and rerun `align run`, "
                            "which writes it anew")
    source = info.get("source")
    if not source or not Path(source).is_file():
        raise PipelineError(f"{run_dir}: the pipeline file this run came from ({source}) is gone; put it (and the data "
                            "cards beside it) back there to rebuild the report: its settings and relative paths are "
                            "read from it")
    cfg = parse_pipeline(info["config"], source)
    if is_plain_name(run_dir.name):
        cfg.run_id = run_dir.name  # what this directory is called now, for its pipeline.json
    evaluations = [n for n, st in cfg.stages.items() if st.PRODUCES == REPORT]
    if not evaluations:
        raise PipelineError(f"{run_dir}: the pipeline has no evaluate stage")
    for name in evaluations:
        st = cfg.stages[name]  # every model it reads: its policy and reward-model inputs
        models = st.references(POLICY) + st.references(REWARD_MODEL)
        for stage in dict.fromkeys(models):
            check_model_dir(run_dir, stage)
    with resume_as(recorded_run(info.get("resume"), source, run_dir.name)):  # hints rerun this run, not `main`
        for name in evaluations:
            run(cfg, source, only=name, force=True, trust_completed_inputs=True, run_dir=run_dir)
    return run_dir / "report"

"""The pipeline runner: stage graph, validation, fingerprints, skipping, launching.

Each stage runs as its own `accelerate launch -m align.cli stage <spec.json>` process with the stage's
accelerate config. A stage is skipped when its manifest says `completed` with the same fingerprint:
sha256 of its resolved config, the fingerprints of its inputs, the content of its data cards and data
files, and the code version. Changing one stage's config therefore reruns it and everything downstream.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from align.config import (STAGE_REFERENCE_FIELDS, PipelineConfig, ConfigError, StageBase, to_dict)
from align.data.cards import DataCardError, LoadedSplit, load_card, load_split
from align.fsutil import atomic_write_json
from align.stages.base import MANIFEST, is_complete, read_manifest
from align.tracking import scrub

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_DIR = PACKAGE_DIR.parent
# Fields that hold a data card path (relative to the pipeline file) unless they name a stage.
CARD_FIELDS = ("data", "prompts")
# Fields that never change a stage's result: left out of its fingerprint.
NON_SEMANTIC = ("logging_steps", "save_steps", "save_every", "sample_every", "accelerate")


class PipelineError(ValueError):
    """The pipeline cannot run as configured, or a stage failed."""


@dataclass
class StagePlan:
    name: str
    cfg: StageBase
    deps: list[str]
    cards: dict[str, Path] = field(default_factory=dict)  # field name -> absolute card path
    fingerprint: str = ""
    card_hashes: dict[str, str] = field(default_factory=dict)


# --------------------------------------------------------------------------------------------- graph
def _refs(value: Any) -> list[str]:
    return value if isinstance(value, list) else [value] if isinstance(value, str) else []


def stage_dependencies(name: str, cfg: StageBase, stages: dict[str, StageBase], source: str) -> list[str]:
    """Stages this stage reads from; a required reference to a missing stage is an error."""
    deps: list[str] = []
    for fld, required in STAGE_REFERENCE_FIELDS[cfg.type].items():
        for ref in _refs(getattr(cfg, fld)):
            if ref in stages:
                if ref == name:
                    raise PipelineError(f"{source}: stages.{name}.{fld}: a stage cannot depend on itself")
                deps.append(ref)
            elif required:
                hint = difflib.get_close_matches(ref, list(stages), n=1)
                raise PipelineError(
                    f"{source}: stages.{name}.{fld}: '{ref}' is not a stage of this pipeline"
                    + (f"; did you mean '{hint[0]}'?" if hint else f" (stages: {', '.join(stages)})"))
    return list(dict.fromkeys(deps))


def topological_order(deps: dict[str, list[str]], source: str) -> list[str]:
    """Stages in dependency order (ties keep file order); a cycle is an error that names it."""
    order: list[str] = []
    state: dict[str, int] = {}  # 1 = visiting, 2 = done

    def visit(node: str, path: list[str]) -> None:
        if state.get(node) == 2:
            return
        if state.get(node) == 1:
            cycle = path[path.index(node):] + [node]
            raise PipelineError(f"{source}: dependency cycle: {' -> '.join(cycle)}")
        state[node] = 1
        for d in deps[node]:
            visit(d, path + [node])
        state[node] = 2
        order.append(node)

    for n in deps:
        visit(n, [])
    return order


def descendants(start: str, deps: dict[str, list[str]]) -> set[str]:
    out = {start}
    changed = True
    while changed:
        changed = False
        for n, ds in deps.items():
            if n not in out and out & set(ds):
                out.add(n)
                changed = True
    return out


# --------------------------------------------------------------------------------------------- plan
def code_version() -> str:
    h = hashlib.sha256()
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        h.update(path.relative_to(PACKAGE_DIR).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _fingerprint(plan: StagePlan, cfg: PipelineConfig, inputs: dict[str, str], code: str) -> str:
    stage = {k: v for k, v in to_dict(plan.cfg).items() if k not in NON_SEMANTIC}
    base = {}
    if getattr(plan.cfg, "model", None) == "base":
        base = {"base_model": cfg.base_model, "tokenizer": cfg.tokenizer, "builtin": to_dict(cfg.builtin)}
    blob = {"stage": stage, "base": base, "seed": plan.cfg.seed if plan.cfg.seed is not None else cfg.seed,
            "dtype": cfg.dtype, "inputs": inputs, "cards": plan.card_hashes, "code": code}
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:20]


def resolve_model_paths(cfg: PipelineConfig, source: str | Path) -> dict[str, str | None]:
    """base_model / tokenizer that name local paths are relative to the pipeline file (like data cards);
    anything else is a hub id and passes through. A value that looks like a path but is missing is an error."""
    base_dir = Path(source).resolve().parent
    out: dict[str, str | None] = {}
    for key in ("base_model", "tokenizer"):
        value = getattr(cfg, key)
        if not value or value.startswith("builtin:"):
            out[key] = value
            continue
        local = base_dir / value
        if local.exists():
            out[key] = str(local.resolve())
        elif value.startswith((".", "/", "~")):
            raise PipelineError(f"{source}: {key}: local path '{value}' not found (looked for {local})")
        else:
            out[key] = value  # a hub id: loaded by transformers when the stage runs
    return out


def build_plan(cfg: PipelineConfig, source: str | Path) -> list[StagePlan]:
    """Resolve references and card paths, order the graph, fingerprint every stage. Fast: no training."""
    source = str(source)
    base_dir = Path(source).resolve().parent
    if cfg.base_model.startswith("builtin:"):
        kind = cfg.base_model.split(":", 1)[1]
        if kind != "tiny-llama":
            raise PipelineError(f"{source}: base_model '{cfg.base_model}': unknown builtin; use builtin:tiny-llama")
    resolve_model_paths(cfg, source)
    plans: dict[str, StagePlan] = {}
    for name, st in cfg.stages.items():
        plan = StagePlan(name, st, stage_dependencies(name, st, cfg.stages, source))
        for fld in CARD_FIELDS:
            value = getattr(st, fld, None)
            if value is None or value in cfg.stages:
                continue
            if not value:
                raise PipelineError(f"{source}: stages.{name}.{fld}: required (a data card path"
                                    + (" or a stage name)" if fld == "data" else ")"))
            card = (base_dir / value).resolve()
            if not card.is_file():
                hint = difflib.get_close_matches(value, list(cfg.stages), n=1)
                raise PipelineError(f"{source}: stages.{name}.{fld}: '{value}' is neither a stage nor a data card "
                                    f"file (looked for {card})" + (f"; did you mean stage '{hint[0]}'?" if hint else ""))
            plan.cards[fld] = card
        plans[name] = plan
    order = topological_order({n: p.deps for n, p in plans.items()}, source)
    code = code_version()
    for name in order:
        plan = plans[name]
        try:
            plan.card_hashes = {fld: load_card(p).content_hash() for fld, p in plan.cards.items()}
        except DataCardError as exc:
            raise PipelineError(f"{source}: stages.{name}: {exc}") from None
        plan.fingerprint = _fingerprint(plan, cfg, {d: plans[d].fingerprint for d in plan.deps}, code)
    return [plans[n] for n in order]


# --------------------------------------------------------------------------------------------- validate
def validate(cfg: PipelineConfig, source: str | Path, plans: list[StagePlan] | None = None,
             verbose: bool = True) -> list[StagePlan]:
    """Everything that can be checked without training: graph, cards and their data, stage settings."""
    from align.stages.checks import check_stage

    plans = plans or build_plan(cfg, source)
    cache: dict[tuple[str, str], LoadedSplit] = {}

    def split_of(card: Path, split: str) -> LoadedSplit:
        key = (str(card), split)
        if key not in cache:
            try:
                cache[key] = load_split(card, split)
            except DataCardError as exc:
                raise PipelineError(str(exc)) from None
        return cache[key]

    for plan in plans:
        for fld, card in plan.cards.items():
            data = split_of(card, getattr(plan.cfg, "split", "train"))
            if verbose:
                dropped = ", ".join(f"{n} {why}" for why, n in data.dropped.items()) or "none dropped"
                print(f"  {plan.name}.{fld}: {card.name} split '{data.split}': {len(data.rows)} rows ({dropped})")
        try:
            check_stage(plan, cfg, split_of)
        except (ConfigError, ValueError) as exc:
            raise PipelineError(f"{source}: stages.{plan.name}: {exc}") from None
    _check_eval_overlap(plans, split_of, str(source))
    return plans


def _check_eval_overlap(plans: list[StagePlan], split_of, source: str) -> None:
    """Evaluation prompts must not appear among any stage's training prompts."""
    trained: dict[str, set[str]] = {}
    for plan in plans:
        if plan.cfg.type in ("sft", "preferences", "ppo"):
            for card in plan.cards.values():
                trained[plan.name] = {r["prompt"] for r in split_of(card, plan.cfg.split).rows if "prompt" in r}
    for plan in plans:
        if plan.cfg.type != "evaluate" or "prompts" not in plan.cards:
            continue
        held_out = {r["prompt"] for r in split_of(plan.cards["prompts"], plan.cfg.split).rows}
        for name, prompts in trained.items():
            overlap = held_out & prompts
            if overlap:
                example = sorted(overlap)[0]
                raise PipelineError(
                    f"{source}: stages.{plan.name}: {len(overlap)} evaluation prompts (split '{plan.cfg.split}') "
                    f"also occur in the training prompts of stage '{name}', e.g. {example!r}. Evaluate on a "
                    "split no stage trains on.")


# --------------------------------------------------------------------------------------------- run
def run_dir_of(cfg: PipelineConfig) -> Path:
    return Path(cfg.runs_dir) / cfg.name / cfg.run_id


def accelerate_config(name: str, source: str | Path) -> Path:
    for candidate in (Path(name), Path(source).resolve().parent / "accelerate" / f"{name}.yaml",
                      REPO_DIR / "pipelines" / "accelerate" / f"{name}.yaml"):
        if candidate.is_file():
            return candidate.resolve()
    raise PipelineError(f"accelerate config '{name}' not found (pipelines/accelerate/{name}.yaml or a path)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_command(plan: StagePlan, spec: Path, source: str | Path, num_processes: int | None) -> list[str]:
    cmd = [sys.executable, "-m", "accelerate.commands.launch",
           "--config_file", str(accelerate_config(plan.cfg.accelerate, source))]
    # The pipeline-wide --num-processes (one per GPU, from launch.sh) applies to distributed configs only:
    # a stage on `cpu` stays one process unless the stage itself asks for more.
    n = plan.cfg.num_processes or (num_processes if plan.cfg.accelerate != "cpu" else None)
    if n:
        cmd += ["--num_processes", str(n)]
    # No `--cpu` flag: accelerate then ignores a DeepSpeed config and runs one plain process. cpu.yaml says
    # use_cpu itself, and DeepSpeed picks its CPU accelerator (gloo) when no GPU is present.
    cmd += ["--main_process_port", str(_free_port()), "-m", "align.cli", "stage", str(spec)]
    return cmd


def _stream(cmd: list[str], log_path: Path, env: dict[str, str]) -> int:
    """Run `cmd`, copying its output to the terminal and to `log_path` as it comes (progress bars too)."""
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        assert proc.stdout is not None
        try:
            for chunk in iter(lambda: proc.stdout.read1(4096), b""):  # type: ignore[union-attr]
                sys.stdout.buffer.write(chunk)
                sys.stdout.flush()
                log.write(chunk)
            return proc.wait()
        except BaseException:
            proc.kill()
            proc.wait()
            raise


def run(cfg: PipelineConfig, source: str | Path, only: str | None = None, from_stage: str | None = None,
        force: bool = False, num_processes: int | None = None, trust_completed_inputs: bool = False) -> Path:
    """Validate, then run every stage that is not already complete with the same fingerprint.

    `trust_completed_inputs` accepts inputs that completed under another fingerprint (e.g. an older code
    version): used by `align report`, which only re-evaluates existing models."""
    t0 = time.time()
    for flag, value in (("--only", only), ("--from", from_stage)):
        if value and value not in cfg.stages:
            hint = difflib.get_close_matches(value, list(cfg.stages), n=1)
            raise PipelineError(f"{flag} {value}: no such stage" + (f"; did you mean '{hint[0]}'?" if hint else ""))
    print(f"[align] validating {source}", flush=True)
    plans = validate(cfg, source)
    deps = {p.name: p.deps for p in plans}
    selected = {only} if only else descendants(from_stage, deps) if from_stage else set(deps)
    forced = selected if (force or from_stage) else set()
    run_dir = run_dir_of(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    pipeline_info = {k: v for k, v in to_dict(cfg).items() if k != "stages"}
    pipeline_info.update(resolve_model_paths(cfg, source))
    code = code_version()
    git = _git_commit()
    statuses: dict[str, str] = {}
    for i, plan in enumerate(plans, start=1):
        stage_dir = run_dir / plan.name
        header = f"[align] stage {i}/{len(plans)} {plan.name} ({plan.cfg.type})"
        if plan.name not in selected:
            statuses[plan.name] = "not selected"
            continue
        if plan.name not in forced and is_complete(stage_dir, plan.fingerprint):
            print(f"{header}: up to date (fingerprint {plan.fingerprint}), skipped", flush=True)
            statuses[plan.name] = "skipped"
            continue
        for d in plan.deps:
            expected = None if trust_completed_inputs else next(p.fingerprint for p in plans if p.name == d)
            if not is_complete(run_dir / d, expected):
                raise PipelineError(f"stage '{plan.name}' needs stage '{d}' completed in {run_dir / d} with the "
                                    "current config; run the pipeline without --only first")
        stage_dir.mkdir(parents=True, exist_ok=True)
        spec = {
            "stage_name": plan.name, "stage_dir": str(stage_dir.resolve()), "fingerprint": plan.fingerprint,
            "stage": _resolved_stage(plan), "pipeline": pipeline_info,
            "inputs": {d: str((run_dir / d).resolve()) for d in plan.deps},
            "input_fingerprints": {d: (read_manifest(run_dir / d) or {}).get("fingerprint") for d in plan.deps},
            "data_cards": {fld: {"path": str(p), "sha256": plan.card_hashes[fld]} for fld, p in plan.cards.items()},
            "code_version": code, "git_commit": git,
        }
        spec_path = stage_dir / "spec.json"
        atomic_write_json(spec_path, scrub(spec))
        print(f"{header}: running (fingerprint {plan.fingerprint})", flush=True)
        t_stage = time.time()
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
        rc = _stream(launch_command(plan, spec_path, source, num_processes), stage_dir / "stage.log", env)
        if rc != 0 or not is_complete(stage_dir, plan.fingerprint):
            m = read_manifest(stage_dir) or {}
            statuses[plan.name] = "failed"
            _write_pipeline_manifest(run_dir, cfg, plans, statuses, source)
            raise PipelineError(f"stage '{plan.name}' failed (exit code {rc}): {m.get('error', 'see the log')}\n"
                                f"  log: {stage_dir / 'stage.log'}\n  manifest: {stage_dir / MANIFEST}")
        statuses[plan.name] = "completed"
        print(f"{header}: done in {time.time() - t_stage:.0f}s", flush=True)
    _write_pipeline_manifest(run_dir, cfg, plans, statuses, source)
    report = run_dir / "report" / "report.md"
    if report.is_file():
        table = report.read_text().split("\n\n")[1]  # the headline table follows the title
        print(f"[align] headline ({report}):\n{table}", flush=True)
    print(f"[align] pipeline {cfg.name} finished in {time.time() - t0:.0f}s: {run_dir}", flush=True)
    return run_dir


def _resolved_stage(plan: StagePlan) -> dict[str, Any]:
    d = to_dict(plan.cfg)
    for fld, path in plan.cards.items():
        d[fld] = str(path)
    return d


def _write_pipeline_manifest(run_dir: Path, cfg: PipelineConfig, plans: list[StagePlan],
                             statuses: dict[str, str], source: str | Path) -> None:
    atomic_write_json(run_dir / "pipeline.json", scrub({
        "pipeline": cfg.name, "run_id": cfg.run_id, "source": str(Path(source).resolve()), "config": to_dict(cfg),
        "stages": [{"name": p.name, "type": p.cfg.type, "deps": p.deps, "fingerprint": p.fingerprint,
                    "status": (read_manifest(run_dir / p.name) or {}).get("status", "not run"),
                    "this_invocation": statuses.get(p.name, "not run")} for p in plans],
        "updated_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}))


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_DIR, capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None

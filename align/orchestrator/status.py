"""`align status <run-dir>`: one row per stage of a run directory, read from what is on disk (pipeline.json and
each stage's manifest.json), with whether the stage is still up to date with its pipeline file and code."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from align.config import load_pipeline, parse_pipeline, stage_types
from align.orchestrator.commands import recorded_run, rerun_from, without_only
from align.orchestrator.plan import build_plan
from align.orchestrator.runlock import runner_state
from align.core.errors import PipelineError
from align.core.schema import is_plain_name
from align.core.rundir import (PIPELINE, Manifest, PipelineRecord, headline, is_complete, moved_inputs,
                               manifest_time, outputs_problem, read_manifest, record_problem)


def _duration(manifest: Manifest) -> str:
    start, end = manifest_time(manifest.get("started_at")), manifest_time(manifest.get("ended_at"))
    if start is None or end is None:
        return "-"
    seconds = int(end - start)
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def _headline(kind: str, manifest: Manifest) -> str:
    cls = stage_types().get(kind)
    return headline(manifest, cls.HEADLINE if cls else ()) or "-"


_VALUED = {"--only", "--from", "--run-id", "--num-processes", "--nodes", "--node-rank", "--master-addr",
           "--master-port", "--rdzv-timeout"}  # `align run` flags that take a value (align/cli.py)


def recorded_overrides(command: object) -> list[str] | None:
    """The dotted overrides of a recorded `align run` command (None when there is none to read them from)."""
    if not isinstance(command, str) or not command.startswith("align run "):
        return None
    words, out, skip, pipeline = shlex.split(command)[2:], [], False, None  # after `align run`
    for w in words:
        if skip:
            skip = False
        elif w in _VALUED:
            skip = True
        elif not w.startswith("-") and pipeline is None:  # the pipeline file, whatever its name holds (lr=1e-5.yaml)
            pipeline = w
        elif not w.startswith("-") and "=" in w:
            out.append(w)
    return out


def current_fingerprints(info: PipelineRecord) -> dict[str, str] | str:
    """Each stage's fingerprint under today's pipeline file (with the run's own overrides) and code; or why there
    is none: the file is gone, or no longer plans (it names a card that is gone, say)."""
    source = info.get("source")
    if not source or not Path(source).is_file():
        return "pipeline file gone"
    overrides = recorded_overrides(info.get("resume"))
    try:
        if overrides is None:  # a record from before align kept the command: the config it recorded
            cfg = parse_pipeline(json.loads(json.dumps(info["config"])), source)
        else:
            cfg = load_pipeline(source, overrides)
        return {p.name: p.fingerprint for p in build_plan(cfg, source)}
    except (ValueError, KeyError) as exc:
        return f"{Path(source).name} no longer plans: {str(exc).splitlines()[0][:80]}"


def _record(run_dir: Path) -> PipelineRecord:
    """The run directory's pipeline.json, or a one-line error naming it."""
    info_path = run_dir / PIPELINE
    try:
        info: PipelineRecord = json.loads(info_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise PipelineError(f"{run_dir}: not a readable run directory ({info_path}: {exc}); give the path "
                            "runs/<pipeline>/<run-id> that `align run` printed") from None
    problem = record_problem(info)
    if problem:
        raise PipelineError(f"{info_path}: not a pipeline manifest ({problem}); delete it and rerun `align run`, "
                            "which writes it anew")
    return info


def status_table(run_dir: str | Path) -> str:
    run_dir = Path(run_dir)
    info = _record(run_dir)
    now = current_fingerprints(info)
    lines = [f"{run_dir}: pipeline {info.get('pipeline')}, run {info.get('run_id')}, last updated "
             f"{info.get('updated_at', '?')}", "",
             "| stage | type | state | fingerprint | attempts | duration | headline |", "|---|---|---|---|---|---|---|"]
    damaged: list[str] = []
    gone = runner_state(run_dir)
    source = info.get("source", "PIPELINE.yaml")  # the command as the run was typed (--run-id, overrides), if known
    here = run_dir.resolve().name  # a copied or renamed run: its hints name this directory, not the original
    typed = recorded_run(info.get("resume"), source, here if is_plain_name(here) else info.get("run_id"))
    for st in info["stages"]:
        name, kind = st["name"], st["type"]
        m = read_manifest(run_dir / name) or {}
        state = m.get("status", "not run")
        if state == "completed" and not is_complete(run_dir / name):
            state = "completed, output missing"
        if state == "completed":
            problem = outputs_problem(run_dir / name)
            if problem:
                damaged.append(f"{name}: {problem}; rerun it: {rerun_from(source, name, typed)}")
                state = "completed, output damaged (see below)"
        if state == "running" and gone:  # the run's command, less an --only that names another stage
            state = f"interrupted (its runner {gone} before the stage ended); resume: {without_only(typed, name)}"
        if state == "failed" and m.get("error"):
            state = f"failed: {str(m['error'])[:60]}"
        fp = m.get("fingerprint")
        match = "-" if not fp else (f"unknown ({now})" if isinstance(now, str) else "current" if now.get(name) == fp
                                    else "stale (config, data or code changed)")
        moved = moved_inputs(run_dir, name)
        if match == "current" and moved:  # made from an earlier publication of an input: the runner reruns it
            match = f"stale (input '{moved[0]}' republished since)"
        lines.append(f"| {name} | {kind} | {state} | {match} | {m.get('attempts', 0)} | {_duration(m)} | "
                     f"{_headline(kind, m)} |")
    if damaged:
        lines += ["", "Damaged outputs (their files are not what the stage published):", *damaged]
    return "\n".join(lines)


def verify(run_dir: str | Path) -> tuple[str, bool]:
    """`align verify <run-dir>`: read and hash every file every completed stage published and compare it with what
    its manifest recorded (what `align run` and `align status` skip for files whose size, times and inode are
    unchanged). Returns the report and whether everything is intact."""
    run_dir = Path(run_dir)
    info = _record(run_dir)
    lines, ok = [f"{run_dir}: every published file read and hashed", "", "| stage | outputs | verdict |", "|---|---|---|"], True
    for st in info["stages"]:
        name = st["name"]
        m = read_manifest(run_dir / name) or {}
        if m.get("status") != "completed":
            lines.append(f"| {name} | - | {m.get('status', 'not run')} |")
            continue
        problem = outputs_problem(run_dir / name, full=True)
        ok = ok and problem is None
        files = sum(len((d or {}).get("files") or {}) for d in (m.get("output_digests") or {}).values())
        lines.append(f"| {name} | {files} files | {'intact' if problem is None else 'DAMAGED: ' + problem} |")
    return "\n".join(lines), ok

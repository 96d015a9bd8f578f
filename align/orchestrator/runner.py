"""`align run`: select the stages, lock the run directory, skip what is up to date, write each stage's spec,
launch it, and keep the run's pipeline.json.

A stage is skipped when it is complete (align/core/rundir.py) with the same fingerprint (align/orchestrator/plan.py) and was
trained from the outputs its inputs have now. Validation (align/orchestrator/validate.py) and the memory preflight
(align/orchestrator/estimate.py) run before anything is launched.
"""

from __future__ import annotations

import difflib
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from align.orchestrator import warm
from align.config import PipelineConfig, to_dict
from align.core.console import stream_stage, tail, verbose
from align.core.errors import INTERRUPTED, Interrupted, PipelineError, Terminated, interrupt_cause, recorded_failure
from align.orchestrator.hardware import hardware
from align.core.fsutil import atomic_write_json
from align.orchestrator.inputs import resolve_model_paths
from align.orchestrator.launch import (MultiNode, is_distributed, launch_command, one_plain_process, placement_problem,
                                      stage_env, world_change)
from align.orchestrator.multinode import agreed_run, follow_stage, mark_ended, mark_started, node_plans
from align.orchestrator.plan import REPO_DIR, StagePlan, code_version, descendants, run_dir_of
from align.core.rundir import (MANIFEST, PIPELINE, SPEC, STAGE_LOCK, PipelineRecord, StageSpec, headline, is_complete,
                               manifest_time, moved_inputs, output_digests, outputs_problem, read_manifest,
                               stage_in_use, write_manifest)
from align.orchestrator.commands import (children_peak_rss, exit_meaning, other_source, rerun_from, resume_command,
                                        run_command)
from align.orchestrator.preflight import memory_preflight
from align.orchestrator.runlock import RunLock, RunLockedError
from align.config.sweeps import by_stage
from align.core.tracking import scrub
from align.orchestrator.validate import check_environment, validate
from align.data.hub import RUN_REVISIONS_ENV


def result_line(plan: StagePlan, stage_dir: Path) -> str:
    """The stage's headline final metrics (declared by its config class), for the console."""
    return headline(read_manifest(stage_dir), type(plan.cfg).HEADLINE)


def run(cfg: PipelineConfig, source: str | Path, only: str | None = None, from_stage: str | None = None,
        force: bool = False, num_processes: int | None = None, trust_completed_inputs: bool = False,
        ignore_memory_check: bool = False, multi: MultiNode | None = None, run_dir: Path | None = None) -> Path:
    """`_run` with the run's own record of the hub commits it resolves first (align/data/hub.py: read before align's
    cache by this process and its stage processes; as it was before, after)."""
    run_dir = Path(run_dir) if run_dir is not None else run_dir_of(cfg)
    before = os.environ.get(RUN_REVISIONS_ENV)
    os.environ[RUN_REVISIONS_ENV] = str(run_dir.resolve() / "hub-revisions.json")
    try:
        return _run(cfg, source, only, from_stage, force, num_processes, trust_completed_inputs, ignore_memory_check,
                    multi, run_dir)
    finally:
        if before is None:
            os.environ.pop(RUN_REVISIONS_ENV, None)
        else:
            os.environ[RUN_REVISIONS_ENV] = before


def _run(cfg: PipelineConfig, source: str | Path, only: str | None, from_stage: str | None, force: bool,
         num_processes: int | None, trust_completed_inputs: bool, ignore_memory_check: bool, multi: MultiNode | None,
         run_dir: Path) -> Path:
    """Validate, then run every stage that is not up to date: completed with the same fingerprint, from the
    very outputs (publications) of its inputs that exist now. Node 0 holds the run directory's lock
    (align/orchestrator/runlock.py) throughout; `run_dir` (default runs/<name>/<run_id>) is what `align report DIR` uses.

    `trust_completed_inputs` accepts inputs that completed under another fingerprint (e.g. an older code
    version): used by `align report`, which only re-evaluates existing models.

    Multi-node (`multi.nodes` > 1): every machine runs this with its own node rank against the same run
    directory on a shared filesystem. Node 0 writes everything (specs, manifests, outputs); other nodes only
    launch their share of each distributed stage, skip stages that run on one process (node 0 runs them), and
    wait for node 0 to record each stage before moving on."""
    t0 = time.time()
    multi = multi or MultiNode()
    multi.check()
    swept = by_stage(cfg.variants)  # `--only X` / `--from X` of a swept stage X mean all of its variants
    if only is not None and from_stage is not None:
        raise PipelineError(f"--only {only} and --from {from_stage} together: --only runs one stage, --from a stage "
                            "and everything after it; give one of them")
    if num_processes is not None and num_processes < 1:
        raise PipelineError(f"--num-processes {num_processes}: must be at least 1 (leave it out to use each stage's "
                            "accelerate config)")
    _check_stage_flags(cfg, swept, only, from_stage)
    print(f"[align] validating {source}", flush=True)
    plans = validate(cfg, source)
    deps = {p.name: p.deps for p in plans}
    if only:
        selected = set(swept.get(only, [only]))
    elif from_stage:
        selected = set().union(*(descendants(s, deps) for s in swept.get(from_stage, [from_stage])))
    else:
        selected = set(deps)
    forced = selected if (force or from_stage) else set()
    stale = [p.name for p in plans if p.name in selected and (p.name in forced or not up_to_date(p, run_dir, source))]
    to_run = selected & set().union(*(descendants(n, deps) for n in stale))  # and what reruns once they republish
    check_environment(plans, to_run, source)  # a hub token: only for the stages this command runs
    for plan in (p for p in plans if p.name in to_run):  # before any stage trains: an input this command does not
        _check_inputs(plan, plans, run_dir, source, trust_completed_inputs, to_run)  # produce, made under others
    _check_directories(run_dir, to_run)
    hw = hardware(cfg, nodes=multi.nodes)  # asks nvidia-smi once, for both checks
    memory_preflight(cfg, source, plans, to_run, num_processes, hw, ignore_memory_check)
    gpus = hw.gpus_per_node if hw.detected else 0  # the GPUs present (the pipeline's `hardware:` is not)
    for problem in filter(None, (placement_problem(p, source, num_processes, gpus) for p in plans if p.name in to_run)):
        raise PipelineError(f"{source}: {problem}")
    if not multi.is_main:
        return _run_stages(cfg, source, plans, selected, forced, run_dir, num_processes, trust_completed_inputs,
                           multi, t0)
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        with RunLock(run_dir) as lock:
            for note in filter(None, (lock.note, other_source(run_dir, source))):
                print(f"[align] {note}", flush=True)
            return _run_stages(cfg, source, plans, selected, forced, run_dir, num_processes,
                               trust_completed_inputs, multi, t0)
    except RunLockedError as exc:
        raise PipelineError(str(exc)) from None


def _check_stage_flags(cfg: PipelineConfig, swept: dict, only: str | None, from_stage: str | None) -> None:
    """--only and --from name a stage of the pipeline (or a swept stage, meaning all of its variants)."""
    for flag, value in (("--only", only), ("--from", from_stage)):
        if value is not None and value not in cfg.stages and value not in swept:
            names = [*cfg.stages, *swept]
            hint = difflib.get_close_matches(value, names, n=1)
            raise PipelineError(f"{flag} {value or repr(value)}: no such stage" + (f"; did you mean '{hint[0]}'?" if hint else "")
                                + f" (stages: {', '.join(names)})")


def _check_directories(run_dir: Path, to_run: set[str]) -> None:
    """A file where the run's or a stage's directory belongs is named before anything runs (not by the OS's "File
    exists" at that stage's turn, after the stages before it trained)."""
    for path in [run_dir, *(run_dir / n for n in sorted(to_run))]:
        if path.exists() and not path.is_dir():
            raise PipelineError(f"{path} is a file where align keeps the {'run' if path == run_dir else 'stage'}'s "
                                "directory: move it away (or delete it), then run again")


def up_to_date(plan: StagePlan, run_dir: Path, source: str | Path = "PIPELINE.yaml") -> bool:
    """Completed with this fingerprint, and trained from the outputs its inputs have now: each input's
    output_digests (a publication id + whole-file digests, align/core/fsutil.py) equal what the stage recorded.
    Before a stage is skipped as up to date, its own outputs and its inputs' are checked on disk against their
    manifests: a changed, truncated or missing file is a PipelineError naming it and the fix. (A whole output
    directory that is gone makes its stage incomplete instead: it reruns, and so does what consumed it.)"""
    stage_dir = run_dir / plan.name
    if not is_complete(stage_dir, plan.fingerprint):
        return False
    if moved_inputs(run_dir, plan.name, plan.deps) or not all(is_complete(run_dir / d) for d in plan.deps):
        return False  # an input was retrained, or its output is gone (it reruns first, or --only refuses)
    for name in (plan.name, *plan.deps):
        check_outputs(run_dir, name, source)
    return True


def check_outputs(run_dir: Path, name: str, source: str | Path) -> None:
    """Refuse a completed stage whose published output on disk is not what its manifest recorded."""
    problem = outputs_problem((run_dir / name).resolve())
    if problem:
        raise PipelineError(f"stage '{name}' completed, but {problem}: nothing may load or skip over it. Rerun it "
                            f"and what depends on it: `{rerun_from(source, name)}`")


def _run_stages(cfg: PipelineConfig, source: str | Path, plans: list[StagePlan], selected: set[str],
                forced: set[str], run_dir: Path, num_processes: int | None, trust: bool, multi: MultiNode,
                t0: float) -> Path:
    with agreed_run(run_dir, multi, node_plans(plans, selected, forced)) as token:  # every node's, multi-node
        return _stages(cfg, source, plans, selected, forced, run_dir, num_processes, trust, multi, t0, token)


def _stages(cfg: PipelineConfig, source: str | Path, plans: list[StagePlan], selected: set[str], forced: set[str],
            run_dir: Path, num_processes: int | None, trust_completed_inputs: bool, multi: MultiNode, t0: float,
            token: str | None) -> Path:
    pipeline_info = {**{k: v for k, v in to_dict(cfg).items() if k != "stages"}, **resolve_model_paths(cfg, source)}
    code, git = code_version(), _git_commit()
    statuses: dict[str, str] = {}
    recorded = False  # pipeline.json: this config's record, once a stage of it launches
    # Two or more one-process stages to run: start the warm server now (it imports while the runner goes on),
    # and fork those stages from it (align/orchestrator/warm.py). For a single stage it would only add its start.
    plain = [p for p in plans if p.name in selected and (p.name in forced or not is_complete(run_dir / p.name,
             p.fingerprint)) and one_plain_process(p, source, num_processes)]
    if warm_start := multi.is_main and len(plain) >= 2 and warm.enabled():
        warm.start(stage_env())
    for i, plan in enumerate(plans, start=1):
        stage_dir = run_dir / plan.name
        header = f"[align] stage {i}/{len(plans)} {plan.name} ({plan.cfg.type})"
        if plan.name not in selected:
            statuses[plan.name] = "not selected"
            continue
        if plan.name not in forced and up_to_date(plan, run_dir, source):
            print(f"{header}: up to date (fingerprint {plan.fingerprint}), skipped"
                  f"{world_change(plan, run_dir, source, num_processes, multi.nodes)}", flush=True)
            statuses[plan.name] = "skipped"
            continue
        _check_inputs(plan, plans, run_dir, source, trust_completed_inputs)
        if not multi.is_main:
            follow_stage(plan, stage_dir, header, source, num_processes, multi, token)
            statuses[plan.name] = "completed"
            continue
        if not recorded:  # at the first launch (`align status` reads a run that dies in it), never at a refusal
            _write_pipeline_manifest(run_dir, cfg, plans, statuses, source)  # (`align report` rebuilds from it)
            recorded = True
        spec_path = _write_spec(plan, run_dir, pipeline_info, code, git, token)
        print(f"{header}: running (fingerprint {plan.fingerprint})", flush=True)
        t_stage = time.time()
        peak_before = children_peak_rss()
        try:
            cmd = launch_command(plan, spec_path, source, num_processes, multi)
            rc = stream_stage(lambda: warm.start_stage(cmd, stage_env(), warm_start, str(stage_dir)),  # noqa: B023 (called here)
                              stage_dir / "stage.log", plan.name)
        except KeyboardInterrupt as exc:
            _mark_interrupted(stage_dir, interrupt_cause(exc), token=token)
            statuses[plan.name] = "interrupted"
            _write_pipeline_manifest(run_dir, cfg, plans, statuses, source)
            how = "stopped by SIGTERM" if isinstance(exc, Terminated) else "interrupted"
            raise Interrupted(f"{how} during stage {i}/{len(plans)} '{plan.name}'; what earlier stages published "
                              f"is kept. Resume with: {_again(plan.name, forced, stage_dir, source)} (the stage restarts from "
                              f"its last checkpoint, if it saved one)\n  log: {stage_dir / 'stage.log'}",
                              isinstance(exc, Terminated)) from None
        if not _completed(rc, plan, stage_dir, header, token, t_stage):
            statuses[plan.name] = "failed"
            _write_pipeline_manifest(run_dir, cfg, plans, statuses, source)
            raise _stage_failed(plan, stage_dir, rc, peak_before, source, multi)
        statuses[plan.name] = "completed"
        result = result_line(plan, stage_dir)
        print(f"{header}: done in {time.time() - t_stage:.0f}s" + (f": {result}" if result else ""), flush=True)
    return _finish(cfg, source, plans, selected, run_dir, statuses, multi, t0)


def _completed(rc: int, plan: StagePlan, stage_dir: Path, header: str, token: str | None, t_stage: float) -> bool:
    """Whether the stage completed (its manifest says so, with this fingerprint), whatever its exit code: a process
    stopped or failing in its teardown (removing checkpoints, the process group's last barrier) is warned of. One
    that did not is marked failed, with another process's error where one recorded it (the main one killed)."""
    if is_complete(stage_dir, plan.fingerprint) and (rc == 0 or _started_since(stage_dir, t_stage)):
        if rc != 0:
            print(f"{header}: warning: its process exited with code {rc} after the stage completed (see "
                  f"{stage_dir / 'stage.log'}); its outputs stand", flush=True)
        return True
    other = recorded_failure(stage_dir, since=t_stage - 60)
    _mark_interrupted(stage_dir, f"the stage process exited with code {rc}" + (f"; {other}" if other else ""),
                      "failed", token)
    return False


def _started_since(stage_dir: Path, t: float) -> bool:
    """Whether the stage's manifest is of an attempt started at `t` or later (not a forced rerun's earlier run)."""
    started = manifest_time((read_manifest(stage_dir) or {}).get("started_at"))
    return started is not None and started >= int(t)


def _again(name: str, forced: set[str], stage_dir: Path, source: str | Path) -> str:
    """How to resume after a stop during stage `name`: the command as typed, less --force and --from, except for a
    forced stage stopped before it began, which still reads `completed` (its earlier run): rerun it by name."""
    return rerun_from(source, name) if name in forced and is_complete(stage_dir) else resume_command(source)


def _check_inputs(plan: StagePlan, plans: list[StagePlan], run_dir: Path, source: str | Path,
                  trust_completed_inputs: bool, produced: set[str] = frozenset()) -> None:
    """Every input (but those this run `produced` first) is complete (with the current fingerprint, unless trusted)
    and its outputs are what it published."""
    for d in (d for d in plan.deps if d not in produced):
        expected = None if trust_completed_inputs else next(p.fingerprint for p in plans if p.name == d)
        if not is_complete(run_dir / d, expected):
            raise PipelineError(f"stage '{plan.name}' needs stage '{d}' completed in {run_dir / d} with the "
                                "current config (this command's files and overrides), which this command does not "
                                f"run: give it the overrides '{d}' was trained with, or run it too: "
                                f"`{rerun_from(source, d)}`")
        check_outputs(run_dir, d, source)  # what the stage will load is what `d` published
        stale = None if trust_completed_inputs else _stale_below(d, {p.name: p for p in plans}, run_dir)
        if stale:  # `d` (or a stage it was made from) was made from an input republished since
            raise PipelineError(f"stage '{plan.name}' needs stage '{d}', but '{stale[0]}' was made from an earlier "
                                f"publication of '{stale[1]}' (republished since); rerun from there first: "
                                f"`{rerun_from(source, stale[0])}`")


def _stale_below(name: str, plans: dict[str, StagePlan], run_dir: Path) -> tuple[str, str] | None:
    """(stage, input) for the first stage at or below `name` made from an output its input no longer publishes."""
    if moved := moved_inputs(run_dir, name, plans[name].deps):
        return name, moved[0]
    for d in plans[name].deps:
        if below := _stale_below(d, plans, run_dir):
            return below


def _write_spec(plan: StagePlan, run_dir: Path, pipeline_info: dict[str, Any], code: str, git: str | None,
                token: str | None = None) -> Path:
    """The stage's spec.json: its resolved config, its inputs with their fingerprints and output digests, its data
    cards' hashes, the chat template and the code version (align/core/rundir.py StageSpec); then, in a multi-node
    run (`token`: `handshake`'s), the mark by which workers tell this run's attempt from an earlier run's."""
    stage_dir = run_dir / plan.name
    stage_dir.mkdir(parents=True, exist_ok=True)
    if stage_in_use(stage_dir):  # a SIGKILLed runner's stage processes, still recording or still training
        raise PipelineError(f"stage '{plan.name}' is still being run by a process of an earlier attempt (it holds "
                            f"{stage_dir / STAGE_LOCK}; `fuser -v` names it): wait for it to end, or stop it, then "
                            f"run again")
    spec = StageSpec(
        stage_name=plan.name, stage_dir=str(stage_dir.resolve()), fingerprint=plan.fingerprint,
        stage=_resolved_stage(plan), pipeline=pipeline_info,
        inputs={d: str((run_dir / d).resolve()) for d in plan.deps},
        input_fingerprints={d: (read_manifest(run_dir / d) or {}).get("fingerprint") for d in plan.deps},
        input_digests={d: output_digests(run_dir / d) for d in plan.deps},
        data_cards={fld: {"path": str(p), "sha256": plan.card_hashes[fld]} for fld, p in plan.cards.items()},
        chat_template=plan.chat_template.as_dict() if plan.chat_template else None,
        code_version=code, git_commit=git)
    spec_path = stage_dir / SPEC
    for debris in stage_dir.glob(f".{SPEC}.tmp-*"):  # a runner SIGKILLed mid-write (this one holds the lock)
        debris.unlink(missing_ok=True)
    spec.write(spec_path)
    mark_started(stage_dir, token)
    return spec_path


def _stage_failed(plan: StagePlan, stage_dir: Path, rc: int, peak_before, source: str | Path,
                  multi: MultiNode) -> PipelineError:
    """The error of a stage that failed or was killed: its own error from the manifest, what its exit code means,
    a multi-node hint, the log's last lines, where the log and manifest are."""
    m = read_manifest(stage_dir) or {}
    hint = (f"\n  multi-node: if the log shows a rendezvous timeout, a node did not join "
            f"{multi.master_addr}:{multi.master_port} within --rdzv-timeout {multi.rdzv_timeout}s; node R's ranks "
            f"log to {stage_dir / 'stage.node<R>.log'}" if multi.nodes > 1 and is_distributed(plan.cfg, source) else "")
    meaning = exit_meaning(rc, peak_before, source)
    if meaning:  # the stage could not say it (it was killed): its log gets the runner's reading
        with open(stage_dir / "stage.log", "a", encoding="utf-8") as log:
            log.write(f"[align] runner: the stage exited with code {rc}:{meaning}\n")
    hint += meaning
    last = "" if verbose() else f"\n  last lines of the log:\n{tail(stage_dir / 'stage.log')}"
    return PipelineError(f"stage '{plan.name}' failed (exit code {rc}): {m.get('error', 'see the log')}{hint}"
                         f"{last}\n  log: {stage_dir / 'stage.log'}\n  manifest: {stage_dir / MANIFEST}")


def _finish(cfg: PipelineConfig, source: str | Path, plans: list[StagePlan], selected: set[str], run_dir: Path,
            statuses: dict[str, str], multi: MultiNode, t0: float) -> Path:
    """The pipeline's manifest, each selected stage's own summary (a report's headline table), the run's time."""
    if not multi.is_main:
        print(f"[align] node {multi.node_rank}: pipeline {cfg.name} finished in {time.time() - t0:.0f}s", flush=True)
        return run_dir
    if set(statuses.values()) - {"skipped", "not selected"} or not (run_dir / PIPELINE).is_file():  # a command
        _write_pipeline_manifest(run_dir, cfg, plans, statuses, source)  # that ran nothing keeps the run's record
    for plan in plans:
        summary = (read_manifest(run_dir / plan.name) or {}).get("summary")
        if plan.name in selected and isinstance(summary, str) and summary:
            print(f"[align] headline of {plan.name} ({run_dir / plan.name / MANIFEST}):\n{summary}", flush=True)
    print(f"[align] pipeline {cfg.name} finished in {time.time() - t0:.0f}s: {run_dir}", flush=True)
    return run_dir


def _mark_interrupted(stage_dir: Path, cause: str = INTERRUPTED, status: str = "interrupted",
                      token: str | None = None) -> None:
    """A stage killed before it could record the interrupt (or its failure) itself still says so (not `running`);
    a multi-node run's workers are told (`token`: multinode.mark_ended), with the stage's own error where it gave
    one."""
    if (m := read_manifest(stage_dir)) and m.get("status") == "running":
        m.update(status=status, error=cause, ended_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
        write_manifest(stage_dir, m)
    mark_ended(stage_dir, token, f"{status} on node 0: {m.get('error') if m and m.get('status') == status else cause}")


def _resolved_stage(plan: StagePlan) -> dict[str, Any]:
    """The stage's settings as its process reads them: card paths and other files named relative to the pipeline
    made absolute (the stage process does not know where the pipeline file is)."""
    d = to_dict(plan.cfg)
    for fld, path in plan.cards.items():
        d[fld] = str(path)
    for key, path in plan.files.items():  # dotted, list items by index: pairwise.0.template
        *parents, last = key.split(".")
        node: Any = d
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        node[int(last) if isinstance(node, list) else last] = str(path)
    return d


def _write_pipeline_manifest(run_dir: Path, cfg: PipelineConfig, plans: list[StagePlan],
                             statuses: dict[str, str], source: str | Path) -> None:
    record: PipelineRecord = {
        "pipeline": cfg.name, "run_id": cfg.run_id, "source": str(Path(source).resolve()), "config": to_dict(cfg),
        "resume": run_command(run_dir, source, cfg.run_id),  # as typed (--run-id, overrides): status prints it
        "stages": [{"name": p.name, "type": p.cfg.type, "deps": p.deps, "fingerprint": p.fingerprint,
                    "status": (read_manifest(run_dir / p.name) or {}).get("status", "not run"),
                    "this_invocation": statuses.get(p.name, "not run")} for p in plans],
        "updated_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    atomic_write_json(run_dir / PIPELINE, scrub(record))


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_DIR, capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None

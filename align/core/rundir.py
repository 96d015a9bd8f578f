"""The on-disk contract between the runner and the stage processes: spec.json in, manifest.json out.

    runs/<pipeline>/<run-id>/
        pipeline.json            PipelineRecord: the resolved config, the source file, one row per stage
        .align.lock              while a runner holds the directory (align/orchestrator/runlock.py)
        <stage>/spec.json        StageSpec: written by the runner, read by the stage process
        <stage>/manifest.json    Manifest: by the stage's main process (or the runner: one that died running)
        <stage>/model/ | data/   the published output (report/ sits beside the stages, at ../report)
        <stage>/checkpoints/     resumable state; never a sign of completion (see `is_complete`)

The one completeness rule is `is_complete`: the manifest says `completed` (with this fingerprint) and every
output it lists exists. The checkpoint markers (a Trainer checkpoint's `trainer_state.json` and `DURABLE`, PPO's
`COMPLETE` file: align/core/checkpoints.py) say only that one *checkpoint* was fully written and may be resumed from.

No torch here: the runner, `align status` and `align report` import this module.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

from align.core.fsutil import atomic_write_json, output_problem
from align.core.tracking import json_ready, scrub

SPEC = "spec.json"
MANIFEST = "manifest.json"
PIPELINE = "pipeline.json"
TIME_FORMAT = "%Y-%m-%dT%H:%M:%S%z"  # a manifest's started_at and ended_at


def manifest_time(value: Any) -> float | None:
    """A manifest time (TIME_FORMAT) as a Unix time; None when absent or not one."""
    from datetime import datetime

    try:
        return datetime.strptime(value, TIME_FORMAT).timestamp()
    except (TypeError, ValueError):
        return None


STATUSES = ("running", "completed", "failed", "interrupted")  # interrupted: Ctrl-C or SIGTERM, resumable


class ManifestError(ValueError):
    """A manifest.json that cannot be read or is not a manifest; the message names it and the fix."""


@dataclass
class StageSpec:
    """What the runner tells one stage process (spec.json); every process of the launch reads it."""

    stage_name: str
    """The stage's name in the pipeline (also its directory name)."""
    stage_dir: str
    """Absolute path of the stage's directory."""
    fingerprint: str
    """The stage's fingerprint (align/orchestrator/plan.py): checkpoints and manifests of another one are not resumed."""
    stage: dict[str, Any]
    """The stage config as plain JSON (`to_dict`), data card fields resolved to absolute paths."""
    pipeline: dict[str, Any]
    """Pipeline-level settings (no `stages`), with base_model / tokenizer resolved."""
    inputs: dict[str, str] = field(default_factory=dict)
    """Upstream stage name -> its absolute stage directory."""
    input_fingerprints: dict[str, str | None] = field(default_factory=dict)
    """Upstream stage name -> the fingerprint its manifest recorded."""
    input_digests: dict[str, Any] = field(default_factory=dict)
    """Upstream stage name -> the output digests (align/core/fsutil.py) of what this stage consumes."""
    data_cards: dict[str, Any] = field(default_factory=dict)
    """Card field -> {path, sha256}."""
    chat_template: dict[str, Any] | None = None
    """The pipeline's chat template as planned (align/templates/ ChatTemplate): every stage reads it here."""
    code_version: str = ""
    """Hash of align's source (part of the fingerprint)."""
    git_commit: str | None = None
    """The repository's commit, when it is a git checkout."""

    @classmethod
    def read(cls, path: str | Path) -> StageSpec:
        return cls.parse(json.loads(Path(path).read_text(encoding="utf-8")), path)

    @classmethod
    def parse(cls, raw: Any, path: str | Path) -> StageSpec:
        """A spec from its JSON form; a missing key is a ValueError that names the file."""
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: not a stage spec (a JSON {type(raw).__name__})")
        names = {f.name for f in dataclasses.fields(cls)}
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in raw
                   and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        if missing:
            raise ValueError(f"{path}: not a stage spec (missing {', '.join(missing)})")
        return cls(**{k: v for k, v in raw.items() if k in names})

    def write(self, path: str | Path) -> None:
        atomic_write_json(path, scrub(dataclasses.asdict(self)))


class Manifest(TypedDict, total=False):
    """A stage's manifest.json (align/runtime/context.py writes it; stages may add their own keys)."""

    stage: str
    type: str
    status: str  # one of STATUSES
    fingerprint: str
    config: dict[str, Any]
    inputs: dict[str, dict[str, Any]]  # name -> {path, fingerprint}
    input_digests: dict[str, Any]
    data_cards: dict[str, Any]
    code_version: str
    git_commit: str | None
    packages: dict[str, str]
    started_at: str
    ended_at: str
    attempts: int
    world_size: int
    distributed_type: str
    zero_stage: int | None
    process: dict[str, Any]  # the main process: {pid, host, start: "warm" (forked, align/orchestrator/warm.py) or "fresh"}
    final_metrics: dict[str, Any]
    outputs: list[str]  # relative to the stage directory
    output_digests: dict[str, dict[str, Any]]  # output name -> {content, publication, files: {name: [size, sha256]}}
    wandb: dict[str, Any]
    error: str
    traceback: str


class PipelineRecord(TypedDict, total=False):
    """runs/<pipeline>/<run-id>/pipeline.json, rewritten by the runner after every invocation."""

    pipeline: str
    run_id: str
    source: str
    config: dict[str, Any]
    stages: list[dict[str, Any]]  # {name, type, deps, fingerprint, status, this_invocation}
    resume: str  # the command that resumes the run, as typed (--run-id, overrides; less --force and --from)
    updated_at: str


def record_problem(info: Any) -> str | None:
    """What makes a parsed pipeline.json unusable (None: every field `align status`, `verify` and `report` read has
    its type): a mapping whose `stages` lists mappings with a plain-name `name` and a text `type`, and whose
    `config`, `pipeline`, `run_id` and `source`, where present, are a mapping and text."""
    from align.core.schema import is_plain_name

    if not isinstance(info, dict) or not isinstance(info.get("stages"), list):
        return "no list of stages"
    for i, st in enumerate(info["stages"]):
        if not isinstance(st, dict) or not is_plain_name(st.get("name")) or not isinstance(st.get("type"), str):
            return f"stage entry {i} has no plain-name `name` and text `type` ({str(st)[:80]})"
    if not isinstance(info.get("config", {}), dict):
        return f"`config` is not a mapping (it holds {type(info['config']).__name__} data)"
    bad = [k for k in ("pipeline", "run_id", "source", "resume") if k in info and not isinstance(info[k], str)]
    if bad:
        return f"`{bad[0]}` is not text"
    try:  # `align status` and the printed rerun commands read its overrides
        shlex.split(info.get("resume") or "")
    except ValueError as exc:
        return f"`resume` is not a command line ({exc}: {info['resume'][:80]})"
    return None


def read_manifest(stage_dir: str | Path) -> Manifest | None:
    """The stage's manifest, or None when there is none. A manifest that exists but cannot be read or is not
    a JSON object is an error (not "missing": that would silently retrain over what it describes)."""
    path = Path(stage_dir) / MANIFEST
    if not path.is_file():
        return None
    try:
        m = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ManifestError(f"{path}: cannot be read as JSON ({type(exc).__name__}: {exc}); delete it to rerun "
                            "the stage") from None
    if not isinstance(m, dict) or not isinstance(m.get("status", ""), str):
        raise ManifestError(f"{path}: not a stage manifest (a JSON {type(m).__name__}, not an object with a "
                            "status); delete it to rerun the stage")
    problem = _shape_problem(m)
    if problem:
        raise ManifestError(f"{path}: {problem}, which align never writes (edited by hand?); delete the manifest to "
                            "rerun the stage")
    return m  # type: ignore[return-value]


def _shape_problem(m: dict) -> str | None:
    """The first field of a manifest whose type is not what align writes (readers index into these)."""
    for key, kind in (("final_metrics", dict), ("input_digests", dict), ("output_digests", dict),
                      ("fingerprint", str), ("attempts", int)):
        if m.get(key) is not None and not isinstance(m[key], kind):
            return f"field '{key}' is a {type(m[key]).__name__}, not a {kind.__name__}"
    outputs = m.get("outputs")
    if outputs is not None and not (isinstance(outputs, list) and all(isinstance(o, str) and o for o in outputs)):
        return f"field 'outputs' is {str(outputs)[:60]}, not a list of output names"
    for name, out in (m.get("output_digests") or {}).items():
        files = out.get("files") if isinstance(out, dict) else None
        if not isinstance(out, dict) or not isinstance(files, (dict, type(None))) or \
                not isinstance(out.get("stamps"), (dict, type(None))) or \
                not isinstance(out.get("publication"), (str, type(None))) or any(
                not (isinstance(f, list) and len(f) == 2 and isinstance(f[0], int) and isinstance(f[1], str))
                for f in (files or {}).values()):
            return (f"field 'output_digests.{name}' is not an output's digest ({{files: {{path: [size, sha256]}}, "
                    "stamps: {path: [...]}, publication: id})")
    return None


def write_manifest(stage_dir: str | Path, manifest: Manifest) -> None:
    """Non-finite final metrics (an evaluation's NaN win rate) as strings, as metrics.jsonl has them: a bare NaN
    is not JSON, and every reader but Python's refuses the file."""
    atomic_write_json(Path(stage_dir) / MANIFEST, json_ready(scrub(dict(manifest))))


def is_complete(stage_dir: str | Path, fingerprint: str | None = None) -> bool:
    """A stage is done when its manifest says completed (with this fingerprint) and lists the outputs it published
    (every stage type publishes one at least: a manifest edited to "completed" without them is not done), and they
    exist."""
    m = read_manifest(stage_dir)
    if not m or m.get("status") != "completed" or (fingerprint and m.get("fingerprint") != fingerprint):
        return False
    outputs = m.get("outputs")
    if not outputs or not isinstance(outputs, list) or not all(isinstance(o, str) for o in outputs):
        return False
    return all((Path(stage_dir) / out).exists() for out in outputs)


def outputs_problem(stage_dir: str | Path, full: bool = False) -> str | None:
    """What is wrong with a completed stage's published outputs on disk against its manifest's whole-file
    digests (align/core/fsutil.py `output_problem`): a missing, truncated or changed file, named. None: intact.
    Files whose stamp is unchanged are not read unless `full` (`align verify`)."""
    m = read_manifest(stage_dir) or {}
    digests = m.get("output_digests") or {}
    for out in m.get("outputs", []):
        problem = output_problem(Path(stage_dir) / out, digests.get(out), full=full)
        if problem:
            return problem
    return None


def output_digests(stage_dir: str | Path) -> Any:
    """The digests of a stage's published outputs, as its manifest recorded them (None when there are none)."""
    return (read_manifest(stage_dir) or {}).get("output_digests")


def moved_inputs(run_dir: str | Path, name: str, deps: Any = None) -> list[str]:
    """The inputs of stage `name` (`deps`, or those its manifest recorded) whose published outputs are not the
    ones it was made from: its manifest's input_digests against each input's output_digests now. The one
    comparison behind "up to date", `--only`'s stale-input refusal and `align status`'s "stale (input ...)"."""
    recorded = (read_manifest(Path(run_dir) / name) or {}).get("input_digests") or {}
    return [d for d in (recorded if deps is None else deps) if recorded.get(d) != output_digests(Path(run_dir) / d)]


def headline(manifest: Manifest | None, keys: tuple[str, ...]) -> str:
    """A stage's headline final metrics, `key value, ...`, for the keys its config class names (HEADLINE); a
    trained stage with none of them (DPO, KTO, a reward model run without an eval split) shows its training loss."""
    final = (manifest or {}).get("final_metrics") or {}
    if keys and not any(final.get(k) is not None for k in keys):
        keys = ("train/loss_final_avg",)
    return ", ".join(f"{k} {final[k]:.4g}" if isinstance(final[k], float) else f"{k} {final[k]}"
                     for k in keys if final.get(k) is not None)


STAGE_LOCK = ".stage.lock"
_HELD: list[int] = []  # this process's shared lock on its stage (kept open for the process's life)


def hold_stage(stage_dir: str | Path) -> None:
    """Every process of a stage attempt holds a shared flock on `<stage>/.stage.lock` until it ends (the dataloader
    workers it forks inherit it): the kernel drops it however the process dies. A runner killed with SIGKILL frees
    the run's lock at once while its stage's processes are still recording their interruption (or a launcher's
    workers, in sessions of their own, still train); `stage_in_use` keeps the next runner from starting the stage
    again meanwhile. Where the filesystem has no flock, nothing is held (the run's lock alone guards)."""
    fd = stage_lock_fd(stage_dir)
    if fd is not None:
        _HELD.append(fd)


def stage_lock_fd(stage_dir: str | Path) -> int | None:
    """A descriptor (close-on-exec) holding a shared flock on the stage's lock, or None where there is no flock. The
    runner takes one before it starts a stage and passes it to the process it starts (`warm.start_stage`): the stage
    is held from its first instant, not only once its imports are done and it calls `hold_stage` (seconds, or tens
    of seconds through `accelerate launch` on a GPU node)."""
    import fcntl
    import os
    import time

    try:
        fd = os.open(Path(stage_dir) / STAGE_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError:
        return None
    for _ in range(50):  # a runner's probe (stage_in_use) holds it exclusively for an instant
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            time.sleep(0.02)
        except OSError:  # no flock on this filesystem
            break
    os.close(fd)
    return None


def stage_in_use(stage_dir: str | Path, wait_s: float = 30.0) -> bool:
    """Whether a process of an earlier attempt of the stage still lives (holds `hold_stage`'s lock), after waiting
    up to `wait_s` for it to end (an interrupted stage records its interruption, then exits)."""
    import fcntl
    import os
    import time

    try:
        fd = os.open(Path(stage_dir) / STAGE_LOCK, os.O_RDWR | os.O_CLOEXEC)
    except OSError:  # never started (or no such directory): nobody holds it
        return False
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return False  # closing the descriptor below drops the lock
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    return True
                time.sleep(0.2)
            except OSError:  # no flock on this filesystem
                return False
    finally:
        os.close(fd)

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
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from align.config import PipelineConfig, ConfigError, StageBase, to_dict
from align.data.cards import (DataCardError, DataUnavailableError, LoadedSplit, hub_reachable, load_card,
                              load_split)
from align.console import stream_stage, tail, verbose
from align.fsutil import atomic_write_json
from align.inputs import check_model_inputs, resolve_model_paths
from align.runlock import RunLock, RunLockedError
from align.stages.base import MANIFEST, is_complete, read_manifest
from align.tracking import scrub

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_DIR = PACKAGE_DIR.parent
# Fields that hold a data card path (relative to the pipeline file) unless they name a stage.
CARD_FIELDS = ("data", "prompts")
# Fields that never change a stage's result: left out of its fingerprint.
NON_SEMANTIC = ("logging_steps", "save_steps", "save_every", "sample_every", "accelerate", "max_truncated_fraction")


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
    if isinstance(value, dict):  # a weighted judge mapping: its keys
        return list(value)
    return value if isinstance(value, list) else [value] if isinstance(value, str) else []


def stage_dependencies(name: str, cfg: StageBase, stages: dict[str, StageBase], source: str) -> list[str]:
    """Stages this stage reads from. A reference must name a stage that produces what the field needs (its
    role, declared on the config class): a policy input a policy stage, a reward input a reward stage, data a
    data stage; a required reference to a missing stage is an error."""
    deps: list[str] = []
    for fld, (role, required) in type(cfg).INPUTS.items():
        for ref in _refs(getattr(cfg, fld)):
            if ref in stages:
                if ref == name:
                    raise PipelineError(f"{source}: stages.{name}.{fld}: a stage cannot depend on itself")
                _check_role(name, fld, role, ref, stages, source)
                deps.append(ref)
            elif required:
                hint = difflib.get_close_matches(ref, list(stages), n=1)
                raise PipelineError(
                    f"{source}: stages.{name}.{fld}: '{ref}' is not a stage of this pipeline"
                    + (f"; did you mean '{hint[0]}'?" if hint else f" (stages: {', '.join(stages)})"))
    return list(dict.fromkeys(deps))


def _check_role(name: str, fld: str, role: str, ref: str, stages: dict[str, StageBase], source: str) -> None:
    """`ref` must produce `role` (judge fields: a reward stage; align/judges.py checks the Python judges)."""
    want = "reward" if role == "judge" else role
    produced = type(stages[ref]).PRODUCES
    if produced == want:
        return
    fits = [n for n, st in stages.items() if type(st).PRODUCES == want and n != name]
    raise PipelineError(
        f"{source}: stages.{name}.{fld}: '{ref}' is a {stages[ref].type} stage, which produces {_ROLE[produced]}; "
        f"{fld} needs {_ROLE[want]}: use " + (" or ".join(fits) if fits else f"(no such stage in this pipeline)")
        + (", or a Python judge such as vader" if role == "judge" else ""))


_ROLE = {"policy": "a policy", "reward": "a reward model", "data": "preference pairs", "report": "a report"}


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
                loaded = load_card(card)
                if loaded.format == "hub" and not hub_reachable():
                    raise DataUnavailableError(str(card))
                cache[key] = load_split(loaded, split)
            except DataUnavailableError:
                # A hub dataset this machine cannot reach (e.g. an offline login node): the card is checked,
                # its rows are checked when the stage starts on a machine that can fetch them.
                cache[key] = LoadedSplit(loaded, split, [], Counter(), 0, available=False)
            except DataCardError as exc:
                raise PipelineError(str(exc)) from None
        return cache[key]

    for note in check_model_inputs(cfg, source):
        if verbose:
            print(f"  warning: {note}")
    for plan in plans:
        check_accelerate(plan, source)
        for fld, card in plan.cards.items():
            data = split_of(card, getattr(plan.cfg, "split", "train"))
            _check_card_rows(plan, fld, card, data, split_of, str(source))
            if verbose and not data.available:
                print(f"  {plan.name}.{fld}: {card.name}: warning: hub dataset {data.card.source.get('hub')} not "
                      "reachable from here; its rows are checked when the stage starts")
            elif verbose:
                dropped = ", ".join(f"{n} {why}" for why, n in data.dropped.items()) or "none dropped"
                print(f"  {plan.name}.{fld}: {card.name} split '{data.split}': {len(data.rows)} rows ({dropped})")
        try:
            check_stage(plan, cfg, split_of)
        except (ConfigError, ValueError) as exc:
            raise PipelineError(f"{source}: stages.{plan.name}: {exc}") from None
    _check_eval_overlap(plans, split_of, str(source))
    from align.stages.checks import check_response_lengths

    mismatches = check_response_lengths(cfg)
    if mismatches:
        raise PipelineError(f"{source}: " + "\n".join(mismatches))
    _check_lengths(cfg, plans, split_of, str(source), verbose)
    return plans


def check_accelerate(plan: StagePlan, source: str | Path) -> None:
    """The stage's accelerate config exists and is one (checked here, not when the stage launches)."""
    where = f"{source}: stages.{plan.name}.accelerate"
    try:
        path = accelerate_config(plan.cfg.accelerate, source)
    except PipelineError as exc:
        raise PipelineError(f"{where}: {exc}") from None
    try:
        raw = yaml_load(path)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise PipelineError(f"{where}: {path} is not a readable YAML file ({type(exc).__name__})") from None
    if not isinstance(raw, dict) or str(raw.get("distributed_type", "")).upper() not in ACCELERATE_TYPES:
        raise PipelineError(f"{where}: {path} is not an accelerate config (it needs `distributed_type:` one of "
                            f"{', '.join(ACCELERATE_TYPES)}); name one of pipelines/accelerate/*.yaml")


ACCELERATE_TYPES = ("NO", "MULTI_GPU", "MULTI_CPU", "DEEPSPEED", "FSDP")


def _check_card_rows(plan: StagePlan, fld: str, card: Path, data: LoadedSplit, split_of, source: str) -> None:
    """Preference cards need held-out pairs; prompt cards need prompts that are not all empty."""
    if not data.available:
        return
    where = f"{source}: stages.{plan.name}.{fld}"
    if plan.cfg.type in ("reward", "dpo") and fld == "data":
        held_out = split_of(card, "test")
        if held_out.available and not held_out.rows:
            raise PipelineError(f"{where}: {card.name} has no held-out pairs (split 'test')")
    if fld == "prompts" and not any(str(r.get("prompt", "")).strip() for r in data.rows):
        raise PipelineError(f"{where}: every one of the {len(data.rows)} prompts of {card.name} split "
                            f"'{data.split}' is empty; a policy would be sampled from nothing")


LENGTH_KINDS = ("sft", "reward", "dpo")  # the stages align/lengths.py measures


def _check_lengths(cfg: PipelineConfig, plans: list[StagePlan], split_of, source: str, verbose: bool) -> None:
    """Over-long examples per trained stage whose data is a card, when the tokenizer can be loaded here.

    Every stage repeats the check at its start (the only place it can run when the tokenizer is trained by
    the first stage, or the hub is unreachable), so skipping it here never lets a bad run train."""
    from align.lengths import LengthError, enforce, measure
    from align.models import ModelError, is_builtin, load_tokenizer

    data = {p.name: split_of(p.cards["data"], getattr(p.cfg, "split", "train"))
            for p in plans if p.cfg.type in LENGTH_KINDS and "data" in p.cards}
    todo = [p for p in plans if p.name in data and data[p.name].available]
    if not todo:
        return
    paths = resolve_model_paths(cfg, source)
    name = paths["tokenizer"] or (None if is_builtin(str(paths["base_model"])) else paths["base_model"])
    if name is None:
        if verbose:
            print("  length check: at stage start (the builtin model's tokenizer is trained by the first stage)")
        return
    try:
        chat = any(data[p.name].card.produces == "messages" for p in todo)
        tokenizer = load_tokenizer(name, cfg.trust_remote_code, needs_chat_template=chat)
    except ModelError as exc:
        raise PipelineError(f"{source}: tokenizer: {exc}") from None
    except (OSError, ValueError) as exc:
        if verbose:
            print(f"  length check: at stage start (tokenizer '{name}' not loadable here: {type(exc).__name__})")
        return
    for plan in todo:
        rows = data[plan.name].rows
        rows = rows[: plan.cfg.max_train_examples] if plan.cfg.max_train_examples else rows
        report = measure(plan.name, plan.cfg.type, rows, tokenizer, plan.cfg.max_length)
        if verbose:
            print(f"  length check {report.summary()}")
        try:
            enforce(report, plan.cfg.max_truncated_fraction)
        except LengthError as exc:
            raise PipelineError(f"{source}: {exc}") from None


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


@dataclass
class MultiNode:
    """Where this `align run` sits in a multi-node job (one runner per machine; see launch.sh)."""

    nodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int = 29500
    rdzv_timeout: int = 600

    def check(self) -> None:
        if self.nodes < 1:
            raise PipelineError(f"--nodes {self.nodes}: must be >= 1")
        if not 0 <= self.node_rank < self.nodes:
            raise PipelineError(f"--node-rank {self.node_rank}: must be in 0..{self.nodes - 1} for --nodes {self.nodes}")
        if self.nodes > 1 and not self.master_addr:
            raise PipelineError("--nodes > 1 needs --master-addr (the address of node 0; launch.sh sets it from "
                                "SLURM_JOB_NODELIST under SLURM)")
        if self.rdzv_timeout < 1:
            raise PipelineError(f"--rdzv-timeout {self.rdzv_timeout}: must be >= 1 second")

    @property
    def is_main(self) -> bool:
        return self.node_rank == 0


def is_distributed(plan: StagePlan) -> bool:
    return plan.cfg.accelerate != "cpu"


def launch_command(plan: StagePlan, spec: Path, source: str | Path, num_processes: int | None,
                   multi: MultiNode | None = None) -> list[str]:
    config = accelerate_config(plan.cfg.accelerate, source)
    # The pipeline-wide --num-processes (one per GPU, from launch.sh) applies to distributed configs only:
    # a stage on `cpu` stays one process unless the stage itself asks for more.
    n = plan.cfg.num_processes or (num_processes if is_distributed(plan) else None)
    multi = multi or MultiNode()
    raw = yaml_load(config) or {}
    if str(raw.get("distributed_type", "NO")).upper() == "NO" and (n or raw.get("num_processes", 1)) == 1:
        # One plain process: accelerate launch would only add ~2.6 s of imports (measured) before starting it.
        return [sys.executable, "-m", "align.cli", "stage", str(spec)]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
    if multi.nodes > 1 and is_distributed(plan):
        per_node = n or int(raw.get("num_processes", 1))
        # accelerate counts processes over all machines; torchrun (DeepSpeed's `standard` multi-node launcher,
        # no ssh/pdsh needed) starts per_node of them here and meets the others at the master's port.
        cmd += ["--num_processes", str(per_node * multi.nodes), "--num_machines", str(multi.nodes),
                "--machine_rank", str(multi.node_rank), "--main_process_ip", str(multi.master_addr),
                "--main_process_port", str(multi.master_port), "--rdzv_backend", "static",
                "--rdzv_conf", f"timeout={multi.rdzv_timeout}", "--max_restarts", "0"]
        if raw.get("distributed_type") == "DEEPSPEED":
            cmd += ["--deepspeed_multinode_launcher", "standard"]
    else:
        if n:
            cmd += ["--num_processes", str(n)]
        cmd += ["--main_process_port", str(_free_port())]
    # No `--cpu` flag: accelerate then ignores a DeepSpeed config and runs one plain process. cpu.yaml says
    # use_cpu itself, and DeepSpeed picks its CPU accelerator (gloo) when no GPU is present.
    cmd += ["-m", "align.cli", "stage", str(spec)]
    return cmd


def yaml_load(path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def wait_for_master(multi: MultiNode, stage: str) -> None:
    """Worker nodes: wait until node 0 listens on the rendezvous port, or fail with the host and port after the
    timeout (instead of the silent hang of a rendezvous that never completes)."""
    deadline = time.time() + multi.rdzv_timeout
    last = ""
    while time.time() < deadline:
        try:
            with socket.create_connection((str(multi.master_addr), multi.master_port),
                                          timeout=min(5.0, max(0.1, deadline - time.time()))):
                return
        except OSError as exc:
            last = f"{type(exc).__name__}: {exc}"
            time.sleep(min(1.0, max(0.0, deadline - time.time())))
    raise PipelineError(
        f"node {multi.node_rank}: rendezvous for stage '{stage}' timed out after {multi.rdzv_timeout}s: the master "
        f"node {multi.master_addr}:{multi.master_port} could not be reached ({last}). Check --master-addr / "
        "--master-port (under SLURM: the first host of SLURM_JOB_NODELIST), that node 0 is running, and that the "
        "port is open between the nodes; --rdzv-timeout sets the wait.")


def wait_for_stage(stage_dir: Path, fingerprint: str, name: str, timeout: float | None) -> None:
    """Worker nodes: wait until node 0 has recorded the stage as completed (or failed)."""
    t0 = time.time()
    while not is_complete(stage_dir, fingerprint):
        m = read_manifest(stage_dir) or {}
        if m.get("fingerprint") == fingerprint and m.get("status") == "failed":
            raise PipelineError(f"stage '{name}' failed on node 0: {m.get('error', 'see its log')}")
        if timeout is not None and time.time() - t0 > timeout:
            raise PipelineError(f"stage '{name}': node 0 did not record it as completed within {timeout:.0f}s "
                                f"({stage_dir / MANIFEST})")
        time.sleep(1.0)


def _stage_env() -> dict[str, str]:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    if not verbose():
        env["TQDM_DISABLE"] = "1"  # library bars off; the runner draws one bar per stage (align/console.py)
    return env


def result_line(plan: StagePlan, stage_dir: Path) -> str:
    """The stage's headline final metrics (declared by its config class), for the console and `align status`."""
    final = (read_manifest(stage_dir) or {}).get("final_metrics") or {}
    shown = [f"{k} {final[k]:.4g}" if isinstance(final[k], float) else f"{k} {final[k]}"
             for k in type(plan.cfg).HEADLINE if final.get(k) is not None]
    return ", ".join(shown)


def run(cfg: PipelineConfig, source: str | Path, only: str | None = None, from_stage: str | None = None,
        force: bool = False, num_processes: int | None = None, trust_completed_inputs: bool = False,
        ignore_memory_check: bool = False, multi: MultiNode | None = None, run_dir: Path | None = None) -> Path:
    """Validate, then run every stage that is not up to date: completed with the same fingerprint, from the
    very outputs (publications) of its inputs that exist now. Node 0 holds the run directory's lock
    (align/runlock.py) throughout; `run_dir` (default runs/<name>/<run_id>) is what `align report DIR` uses.

    `trust_completed_inputs` accepts inputs that completed under another fingerprint (e.g. an older code
    version): used by `align report`, which only re-evaluates existing models.

    Multi-node (`multi.nodes` > 1): every machine runs this with its own node rank against the same run
    directory on a shared filesystem. Node 0 writes everything (specs, manifests, outputs); other nodes only
    launch their share of each distributed stage, skip stages that run on one process (node 0 runs them), and
    wait for node 0 to record each stage before moving on."""
    t0 = time.time()
    multi = multi or MultiNode()
    multi.check()
    for flag, value in (("--only", only), ("--from", from_stage)):
        if value and value not in cfg.stages:
            hint = difflib.get_close_matches(value, list(cfg.stages), n=1)
            raise PipelineError(f"{flag} {value}: no such stage" + (f"; did you mean '{hint[0]}'?" if hint else ""))
    print(f"[align] validating {source}", flush=True)
    plans = validate(cfg, source)
    deps = {p.name: p.deps for p in plans}
    selected = {only} if only else descendants(from_stage, deps) if from_stage else set(deps)
    forced = selected if (force or from_stage) else set()
    run_dir = Path(run_dir) if run_dir is not None else run_dir_of(cfg)
    to_run = [p.name for p in plans if p.name in selected and (p.name in forced or not up_to_date(p, run_dir))]
    memory_preflight(cfg, source, plans, set(to_run), num_processes, multi, ignore_memory_check)
    if not multi.is_main:
        return _run_stages(cfg, source, plans, selected, forced, run_dir, num_processes, trust_completed_inputs,
                           multi, t0)
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        with RunLock(run_dir) as lock:
            if lock.note:
                print(f"[align] {lock.note}", flush=True)
            return _run_stages(cfg, source, plans, selected, forced, run_dir, num_processes,
                               trust_completed_inputs, multi, t0)
    except RunLockedError as exc:
        raise PipelineError(str(exc)) from None


def up_to_date(plan: StagePlan, run_dir: Path) -> bool:
    """Completed with this fingerprint, and trained from the outputs its inputs have now: each input's
    output_digests (a publication id + content digest, align/fsutil.py) equal what the stage recorded."""
    stage_dir = run_dir / plan.name
    if not is_complete(stage_dir, plan.fingerprint):
        return False
    recorded = (read_manifest(stage_dir) or {}).get("input_digests") or {}
    return all(recorded.get(d) == _output_digests(run_dir / d) for d in plan.deps)


def _output_digests(stage_dir: Path) -> Any:
    return (read_manifest(stage_dir) or {}).get("output_digests")


def _run_stages(cfg: PipelineConfig, source: str | Path, plans: list[StagePlan], selected: set[str],
                forced: set[str], run_dir: Path, num_processes: int | None, trust_completed_inputs: bool,
                multi: MultiNode, t0: float) -> Path:
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
        if plan.name not in forced and up_to_date(plan, run_dir):
            print(f"{header}: up to date (fingerprint {plan.fingerprint}), skipped", flush=True)
            statuses[plan.name] = "skipped"
            continue
        for d in plan.deps:
            expected = None if trust_completed_inputs else next(p.fingerprint for p in plans if p.name == d)
            if not is_complete(run_dir / d, expected):
                raise PipelineError(f"stage '{plan.name}' needs stage '{d}' completed in {run_dir / d} with the "
                                    "current config; run the pipeline without --only first")
        if not multi.is_main:
            _follow_stage(plan, stage_dir, header, source, num_processes, multi)
            statuses[plan.name] = "completed"
            continue
        stage_dir.mkdir(parents=True, exist_ok=True)
        spec = {
            "stage_name": plan.name, "stage_dir": str(stage_dir.resolve()), "fingerprint": plan.fingerprint,
            "stage": _resolved_stage(plan), "pipeline": pipeline_info,
            "inputs": {d: str((run_dir / d).resolve()) for d in plan.deps},
            "input_fingerprints": {d: (read_manifest(run_dir / d) or {}).get("fingerprint") for d in plan.deps},
            "input_digests": {d: _output_digests(run_dir / d) for d in plan.deps},
            "data_cards": {fld: {"path": str(p), "sha256": plan.card_hashes[fld]} for fld, p in plan.cards.items()},
            "code_version": code, "git_commit": git,
        }
        spec_path = stage_dir / "spec.json"
        atomic_write_json(spec_path, scrub(spec))
        print(f"{header}: running (fingerprint {plan.fingerprint})", flush=True)
        t_stage = time.time()
        rc = stream_stage(launch_command(plan, spec_path, source, num_processes, multi), stage_dir / "stage.log",
                          _stage_env(), plan.name)
        if rc != 0 or not is_complete(stage_dir, plan.fingerprint):
            m = read_manifest(stage_dir) or {}
            statuses[plan.name] = "failed"
            _write_pipeline_manifest(run_dir, cfg, plans, statuses, source)
            hint = (f"\n  multi-node: if the log shows a rendezvous timeout, a node did not join "
                    f"{multi.master_addr}:{multi.master_port} within --rdzv-timeout {multi.rdzv_timeout}s"
                    if multi.nodes > 1 and is_distributed(plan) else "")
            last = "" if verbose() else f"\n  last lines of the log:\n{tail(stage_dir / 'stage.log')}"
            raise PipelineError(f"stage '{plan.name}' failed (exit code {rc}): {m.get('error', 'see the log')}{hint}"
                                f"{last}\n  log: {stage_dir / 'stage.log'}\n  manifest: {stage_dir / MANIFEST}")
        statuses[plan.name] = "completed"
        result = result_line(plan, stage_dir)
        print(f"{header}: done in {time.time() - t_stage:.0f}s" + (f": {result}" if result else ""), flush=True)
    if not multi.is_main:
        print(f"[align] node {multi.node_rank}: pipeline {cfg.name} finished in {time.time() - t0:.0f}s", flush=True)
        return run_dir
    _write_pipeline_manifest(run_dir, cfg, plans, statuses, source)
    report = run_dir / "report" / "report.md"
    if report.is_file():
        table = report.read_text().split("\n\n")[1]  # the headline table follows the title
        print(f"[align] headline ({report}):\n{table}", flush=True)
    print(f"[align] pipeline {cfg.name} finished in {time.time() - t0:.0f}s: {run_dir}", flush=True)
    return run_dir


def _follow_stage(plan: StagePlan, stage_dir: Path, header: str, source: str | Path, num_processes: int | None,
                  multi: MultiNode) -> None:
    """A worker node's part of one stage: launch its processes for a distributed stage (reading the spec node 0
    wrote), or wait while node 0 runs a one-process stage. Writes nothing under the run directory."""
    import tempfile

    if not is_distributed(plan):
        print(f"{header}: runs on node 0 only ({plan.cfg.accelerate}); waiting for it", flush=True)
        wait_for_stage(stage_dir, plan.fingerprint, plan.name, None)
        return
    wait_for_master(multi, plan.name)
    spec_path = stage_dir / "spec.json"
    t_wait = time.time()
    while not (spec_path.is_file() and json.loads(spec_path.read_text()).get("fingerprint") == plan.fingerprint):
        if time.time() - t_wait > multi.rdzv_timeout:
            raise PipelineError(f"node {multi.node_rank}: node 0 ({multi.master_addr}:{multi.master_port}) did not "
                                f"start stage '{plan.name}' within {multi.rdzv_timeout}s (no {spec_path} with "
                                f"fingerprint {plan.fingerprint}); is the run directory on a filesystem all nodes share?")
        time.sleep(0.5)
    print(f"{header}: running on node {multi.node_rank} of {multi.nodes}", flush=True)
    log = Path(tempfile.gettempdir()) / f"align-{plan.name}-node{multi.node_rank}.log"
    rc = stream_stage(launch_command(plan, spec_path, source, num_processes, multi), log, _stage_env(), plan.name)
    if rc != 0:
        raise PipelineError(f"stage '{plan.name}' failed on node {multi.node_rank} (exit code {rc}); log: {log}")
    wait_for_stage(stage_dir, plan.fingerprint, plan.name, multi.rdzv_timeout)


def memory_preflight(cfg: PipelineConfig, source: str | Path, plans: list[StagePlan], names: set[str],
                     num_processes: int | None, multi: MultiNode, ignore: bool) -> None:
    """Refuse, before anything is launched, stages whose per-GPU estimate exceeds the GPU memory (align/estimate.py).
    Skipped when no GPU is present or declared, or when the base model's config cannot be read here."""
    from align.estimate import EstimateError, estimate_pipeline, hardware, too_big

    if not names:
        return
    hw = hardware(cfg, nodes=multi.nodes)
    if not hw.gpu_memory:
        return
    try:
        estimates = estimate_pipeline(cfg, source, hw, num_processes, plans)
    except EstimateError as exc:
        print(f"[align] memory preflight skipped: {exc}", flush=True)
        return
    problems = too_big(estimates, hw, names)
    if not problems:
        return
    if ignore:
        for line in problems:
            print(f"[align] warning (--ignore-memory-check): {line}", flush=True)
        return
    raise PipelineError("memory preflight: " + "\n  ".join(problems) + "\n  (see `align estimate`; "
                        "--ignore-memory-check launches anyway)")


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

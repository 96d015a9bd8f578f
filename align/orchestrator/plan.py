"""The pipeline as a graph: stage references resolved by role, data cards found, a topological order, and
each stage's fingerprint.

A stage's fingerprint is sha256 of its resolved config (minus settings that never change a result), the
fingerprints of its inputs, the content of its data cards, of the files its settings name and of a user's
`module:function` judges' modules, and the code version. Changing one stage's config (or editing its judge)
therefore reruns it and everything downstream. Fast: nothing is trained or loaded here.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib.util
import inspect
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from align import templates
from align.core.builtin import check_builtin, is_builtin
from align.core.errors import PipelineError
from align.core.fsutil import stamp
from align.config import PipelineConfig, StageBase, semantic, stage_types, to_dict
from align.config.contract import DATA, MODEL, POLICY, REWARD_MODEL, ROLES, refs
from align.data.cards import DataCardError, load_card
from align.judges import judge_source
from align.core.gguf import GGUFError
from align.orchestrator.inputs import resolve_model_paths
from align.templates import ChatTemplate

PACKAGE_DIR = Path(__file__).resolve().parent.parent  # align/
REPO_DIR = PACKAGE_DIR.parent


@dataclass
class StagePlan:
    name: str
    cfg: StageBase
    deps: list[str]
    cards: dict[str, Path] = field(default_factory=dict)  # field name -> absolute card path
    fingerprint: str = ""
    card_hashes: dict[str, str] = field(default_factory=dict)
    files: dict[str, Path] = field(default_factory=dict)  # setting (dotted) -> absolute path of a file it names
    judge_code: dict[str, Path] = field(default_factory=dict)  # a user's module:function judge -> its module's file
    chat_template: ChatTemplate | None = None  # the pipeline's, resolved once per plan (the same object for all)

    def installs_template(self, template_named: bool) -> bool:
        """Whether the stage installs the planned chat template on the base tokenizer (its config class's rule, over
        the forms its cards produce; `template_named`: the pipeline sets `chat_template`): what validation installs
        before counting lengths, and where LoRA must train the rows of tokens the template adds."""
        forms = {fld: load_card(card).produces for fld, card in self.cards.items()}
        return self.chat_template is not None and self.cfg.installs_chat_template(forms, template_named)


# --------------------------------------------------------------------------------------------- graph
def stage_dependencies(name: str, cfg: StageBase, stages: dict[str, StageBase], source: str) -> list[str]:
    """Stages this stage reads from. A reference must name a stage that produces what the field needs (its
    role, declared on the config class): a policy input a policy stage, a scoring input a stage that publishes a
    scalar model, data a data stage; a required reference to a missing stage is an error."""
    deps: list[str] = []
    for fld, (role, required) in type(cfg).INPUTS.items():
        for ref in refs(getattr(cfg, fld)):
            if ref in stages:
                if ref == name:
                    declared = getattr(type(cfg), "__dataclass_fields__", {}).get(fld)
                    default = declared is not None and declared.default == ref  # the type's default, not set
                    raise PipelineError(f"{source}: stages.{name}.{fld}: a stage cannot depend on itself"
                                        + (f" (a {cfg.type} stage's {fld} is '{ref}' unless set: set stages.{name}."
                                           f"{fld}, or rename the stage)" if default else ""))
                _check_role(name, fld, role, ref, stages, source)
                splits = getattr(stages[ref], "PAIR_SPLITS", None)  # the splits a data stage writes
                if role == DATA and splits is not None and (split := cfg.card_split(fld)) not in splits:
                    raise PipelineError(f"{source}: stages.{name}: reads split {split!r} of stage '{ref}' ({fld}), "
                                        f"which writes {list(splits)}; set stages.{name}.split to one of them")
                deps.append(ref)
            elif required:
                hint = difflib.get_close_matches(ref, list(stages), n=1)
                raise PipelineError(
                    f"{source}: stages.{name}.{fld}: '{ref}' is not a stage of this pipeline"
                    + (f"; did you mean '{hint[0]}'?" if hint else f" (stages: {', '.join(stages)})"))
    return list(dict.fromkeys(deps))


def _check_role(name: str, fld: str, role: str, ref: str, stages: dict[str, StageBase], source: str) -> None:
    """`ref` must produce `role` (judge fields: a scalar-model stage; align/judges/__init__.py checks the Python judges)."""
    want = REWARD_MODEL if role == "judge" else role
    accepted = (POLICY, REWARD_MODEL) if want == MODEL else (want,)
    produced = type(stages[ref]).PRODUCES
    if produced in accepted:
        return
    fits = [n for n, st in stages.items() if type(st).PRODUCES in accepted and n != name]
    raise PipelineError(
        f"{source}: stages.{name}.{fld}: '{ref}' is a {stages[ref].type} stage, which produces {ROLES[produced]}; "
        f"{fld} needs {ROLES[want]}: " + (f"use {' or '.join(fits)}" if fits else "no stage of this pipeline produces "
                                          f"{ROLES[want]}; add one")
        + (", or a Python judge such as vader" if role == "judge" else ""))


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
    """Hash of align's source, and of the config and stage modules of stage types defined outside align/."""
    h = hashlib.sha256()
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        h.update(path.relative_to(PACKAGE_DIR).as_posix().encode())
        h.update(path.read_bytes())
    for kind, cls in sorted(stage_types().items()):
        if cls.__module__.split(".")[0] != "align":
            spec = importlib.util.find_spec(cls.stage_module())
            for path in (inspect.getsourcefile(cls), spec.origin if spec else None):
                if path:
                    h.update(f"{kind}:{Path(path).name}".encode())
                    h.update(Path(path).read_bytes())
    return h.hexdigest()[:16]


def _blanked(stage: dict[str, Any], unread: dict[str, str]) -> dict[str, Any]:
    """A stage's settings with those it leaves unread (dotted keys; run-wide ones too: a stage that computes
    nothing reads no seed) set to None."""
    for key in unread:
        *groups, leaf = key.split(".")
        node = stage
        for part in groups:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and leaf in node:
            node[leaf] = None
    return stage


def _fingerprint(plan: StagePlan, cfg: PipelineConfig, inputs: dict[str, str], code: str,
                 hub_tokenizer: str | None = None, base_files: dict[str, Path] | None = None) -> str:
    unread = plan.cfg.unread_settings()  # e.g. kl.kp under a fixed coefficient, epochs under max_steps: any value,
    stage = _blanked(semantic(plan.cfg), unread)  # one result (a sweep over one of them is refused as twins)
    base = {}
    if plan.cfg.starts_from_base():
        base = {"base_model": cfg.base_model, "tokenizer": cfg.tokenizer, "builtin": to_dict(cfg.builtin)}
        ct = plan.chat_template
        if ct is not None and hub_tokenizer:  # chat_template null and a hub tokenizer: its own template (align's
            # default where it ships none) is read at plan time only once cached, so it is named by the tokenizer's
            # id: a plan made before the tokenizer was cached and one made after fingerprint alike
            base["chat_template"] = f"own:{hub_tokenizer}"
        elif ct is not None and ct.text is not None:  # its content and masking: editing the .jinja file (or a local
            base["chat_template"] = ct.digest  # tokenizer's) reruns the stage that installs it
            if ct.masking != "markers":
                base["chat_template_masking"] = [ct.masking, ct.training_text and templates.text_digest(ct.training_text)]
    files = {key: stamp(path) for key, path in plan.files.items()}  # editing the file reruns the stage
    if plan.cfg.starts_from_base():  # new weights (or a new conversion of a packaged model) at the same path too
        files.update({k: stamp(p) for k, p in (base_files or {}).items()})
    run_with = {"seed": plan.cfg.seed if plan.cfg.seed is not None else cfg.seed, "dtype": cfg.dtype,
                "precision": cfg.precision, "attn_implementation": cfg.attn_implementation}
    blob = {"stage": stage, "base": base, **{k: None if k in unread else v for k, v in run_with.items()},
            "inputs": inputs, "cards": plan.card_hashes, "code": code}
    if files:
        blob["files"] = files
    if plan.judge_code:  # editing a user's judge rescores: the stage reruns
        blob["judge_code"] = {name: stamp(path) for name, path in plan.judge_code.items()}
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:20]


def build_plan(cfg: PipelineConfig, source: str | Path) -> list[StagePlan]:
    """Resolve references and card paths, order the graph, fingerprint every stage. Fast: no training."""
    source = str(source)
    base_dir = Path(source).resolve().parent
    try:
        check_builtin(cfg.base_model)
    except ValueError as exc:
        raise PipelineError(f"{source}: {exc}") from None
    paths = resolve_model_paths(cfg, source)
    tokenizer = paths["tokenizer"] or (None if is_builtin(str(paths["base_model"])) else paths["base_model"])
    hub_tokenizer = tokenizer if tokenizer and cfg.chat_template is None and not Path(tokenizer).exists() else None
    try:  # the one place the pipeline's chat_template is resolved: every stage reads it from its spec
        chat_template = templates.resolve(cfg.chat_template, source, tokenizer)
    except GGUFError as exc:
        raise PipelineError(f"{source}: base_model: {exc}") from None
    plans: dict[str, StagePlan] = {}
    for name, st in cfg.stages.items():
        plan = StagePlan(name, st, stage_dependencies(name, st, cfg.stages, source), chat_template=chat_template)
        for fld in type(st).CARDS:  # the class declares which of its fields hold data card paths
            value = getattr(st, fld)
            if value is None or value in cfg.stages:
                continue
            if not value:
                raise PipelineError(f"{source}: stages.{name}.{fld}: required (a data card path"
                                    + (" or a stage name)" if fld in type(st).INPUTS else ")"))
            card = (base_dir / value).resolve()
            if not card.is_file():
                hint = difflib.get_close_matches(value, list(cfg.stages), n=1)
                raise PipelineError(f"{source}: stages.{name}.{fld}: '{value}' is neither a stage nor a data card "
                                    f"file (looked for {card})" + (f"; did you mean stage '{hint[0]}'?" if hint else ""))
            plan.cards[fld] = card
        plan.files = {key: (base_dir / value).resolve() for key, value in st.relative_files().items()}
        plan.files.update({key: (base_dir / Path(value).expanduser()).resolve() for key, value in
                           st.local_models().items() if (base_dir / Path(value).expanduser()).exists()})  # a hub id
        # passes through
        plan.judge_code = {n: f for n in st.references("judge") if (f := judge_source(n)) is not None}
        plans[name] = plan
    order = topological_order({n: p.deps for n, p in plans.items()}, source)
    code = code_version()
    base_files = {k: Path(p) for k, p in paths.items() if p and not is_builtin(str(p)) and Path(p).exists()}
    for name in order:
        plan = plans[name]
        try:
            plan.card_hashes = {fld: load_card(p).content_hash() for fld, p in plan.cards.items()}
        except DataCardError as exc:
            raise PipelineError(f"{source}: stages.{name}: {exc}") from None
        plan.fingerprint = _fingerprint(plan, cfg, {d: plans[d].fingerprint for d in plan.deps}, code, hub_tokenizer,
                                        base_files)
    return [plans[n] for n in order]


def run_dir_of(cfg: PipelineConfig) -> Path:
    """runs/<name>/<run_id> (relative to the working directory, as the pipeline's runs_dir says)."""
    return Path(cfg.runs_dir) / cfg.name / cfg.run_id

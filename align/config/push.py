"""The `push` stage type: upload a stage's published model to the Hugging Face hub, as a run's final step
(align/stages/push.py)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from align.config.contract import MODEL, POLICY, REWARD_MODEL, CheckContext, StageBase, refs
from align.core.builtin import is_builtin
from align.core.packaged import SCHEME as PACKAGED
from align.data.hub import hub_offline

_PART = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?")  # the hub's rules (huggingface_hub)
_REF = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_./-]{0,199}")  # a branch name (git check-ref-format, simplified)


def repo_problem(repo: str) -> str | None:
    """Why `repo` is not a hub repository id the hub accepts (None: it is): `org/name`, each part 1 to 96 letters,
    digits, `-`, `_` or `.`, starting with a letter or digit and not ending in `-` or `.`, no `--` or `..`, and a
    name not ending in `.git`."""
    parts = repo.split("/")
    if len(parts) != 2 or not all(_PART.fullmatch(p) for p in parts):
        return "name it org/name: letters, digits, '-', '_' or '.', each part 1 to 96 characters, not starting with "\
               "'-', '_' or '.' nor ending with '-' or '.'"
    if "--" in repo or ".." in repo:
        return "the hub refuses '--' and '..' in a repository id"
    if parts[1].endswith(".git"):
        return "a repository name cannot end in .git"
    return None


def token_problem(variable: str) -> str | None:
    """Why the hub token in environment variable `variable` cannot be used (never its value), or None."""
    value = os.environ.get(variable, "")
    if not value:
        return (f"the variable {variable} is not set (or empty); export it with a hub token that may write to the "
                "repository (the token is read when the stage runs and never written anywhere)")
    if any(ch.isspace() or ord(ch) < 32 or ord(ch) == 127 for ch in value):
        return (f"the value of {variable} holds whitespace or control characters (a key file saved with CRLF line ends "
                f"leaves a trailing \\r); export it again without them, e.g. export {variable}=$(tr -d '\\r\\n' < FILE)")
    return None


def _on_the_hub(base: str, ctx: CheckContext) -> bool:
    """Whether base_model names a hub repository (not a builtin, packaged, .gguf or local model)."""
    local = (ctx.base_dir / Path(base).expanduser()).exists() or base.lower().endswith(".gguf")
    return not (local or is_builtin(base) or base.startswith(PACKAGED))


def base_copy(source: StageBase, stages: dict[str, StageBase]) -> str | None:
    """The stage whose model/ `source` trains, when that is base_model republished unchanged (a pretrained stage's
    copy: its `REPUBLISHES_BASE`), or None."""
    named = [r for fld, (role, _) in source.INPUTS.items() if role == POLICY for r in refs(getattr(source, fld))]
    return next((r for r in named if getattr(stages.get(r), "REPUBLISHES_BASE", False)), None)


def adapters_alone(source: StageBase | None) -> bool:
    """Whether `source` publishes its LoRA adapters alone (LoRA on, `lora.merge` off)."""
    lora = getattr(source, "lora", None)
    return lora is not None and lora.enabled and not lora.merge


def on_base(source: StageBase, stages: dict[str, StageBase]) -> bool:
    """Whether `source`'s LoRA adapters are adapters of base_model: it trains the base itself or a copy of it."""
    return source.starts_from_base() or base_copy(source, stages) is not None


@dataclass
class PushStage(StageBase):
    """Upload `model`'s published model/ (weights, config, tokenizer) to a hub repository."""

    TYPE: ClassVar[str] = "push"
    PRODUCES: ClassVar[str] = "receipt"  # pushed/receipt.json: what was uploaded where; no other stage reads it
    HEADLINE: ClassVar[tuple[str, ...]] = ("push/files", "push/bytes")
    INPUTS: ClassVar[dict[str, tuple[str, bool]]] = {"model": (MODEL, True)}
    WORK: ClassVar[str] = "push/files"

    model: str = "ppo"
    """The stage whose model/ is uploaded (a policy or a reward model)."""
    repo: str = ""
    """The hub repository, `org/name` (created when it does not exist)."""
    private: bool = True
    """Create the repository private. An existing repository keeps its visibility: a public one is refused unless
    this is false (the weights would be public)."""
    revision: str = "main"
    """The branch to commit to."""
    token_env: str = "HF_TOKEN"
    """The environment variable that holds a hub token with write access (its name only: the token is read when the
    stage runs and never written to the run directory, W&B or the console)."""
    commit_message: str = ""
    """The commit message (empty: `align: <pipeline>/<run> stage <model>, fingerprint ...`)."""

    def check(self, ctx: CheckContext) -> None:
        if problem := repo_problem(self.repo):
            raise ValueError(f"repo: {self.repo!r} is not a hub repository id: {problem}; e.g. my-org/llama3-8b-ppo")
        for fld in ("base_model", "tokenizer", "base_model_config"):  # hub ids are case-insensitive
            if str(getattr(ctx.pipeline, fld, None) or "").strip().lower() == self.repo.lower():
                raise ValueError(f"repo: {self.repo!r} is the pipeline's {fld}: the push would replace its files with "
                                 f"stage '{self.model}''s (adapters alone: delete its weights), and every later run "
                                 f"that loads it would start from them; push to a repository of its own, e.g. "
                                 f"{self.repo}-{self.model}")
        source = ctx.pipeline.stages.get(self.model)
        base = ctx.pipeline.base_model  # a builtin model is built, not loaded: its stage publishes merged weights
        if adapters_alone(source) and on_base(source, ctx.pipeline.stages) and not is_builtin(base) and \
                not _on_the_hub(base, ctx):
            raise ValueError(f"model: stage '{self.model}' publishes LoRA adapters alone, on base_model "
                             f"{ctx.pipeline.base_model!r}, which is not on the hub: the pushed repository would name "
                             f"a base only this machine has; set stages.{self.model}.lora.merge: true to push whole "
                             "weights")
        if not _REF.fullmatch(self.revision) or ".." in self.revision or self.revision.endswith((".lock", "/", ".")):
            raise ValueError(f"revision: {self.revision!r} is not a branch name git accepts; name an existing branch "
                             "of the repository, e.g. main")
        if self.token_env.lower().startswith(("hf_", "hf-")) and len(self.token_env) > 20 and \
                not self.token_env.isupper():  # tokens are mixed case; HF_TOKEN_ACME_WRITE is a variable's name
            raise ValueError("token_env: this looks like a token, not the name of the variable that holds one (its "
                             "value is not repeated here); never write a token in a pipeline file: export it, and "
                             "name the variable, e.g. token_env: HF_TOKEN")
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", self.token_env):
            raise ValueError("token_env: not an environment variable name (its value is not repeated here, in case it "
                             "is a token); name the variable that holds the token, e.g. token_env: HF_TOKEN")

    def environment_problem(self) -> str | None:
        if hub_offline():  # as huggingface_hub reads it: the push would fail after every stage before it
            return ("offline mode is on (HF_HUB_OFFLINE, or TRANSFORMERS_OFFLINE where HF_HUB_OFFLINE is unset): the "
                    "hub cannot be reached to push to; unset it for this run, or leave the push out of this run "
                    "(the override `stages.<push stage>=null`)")
        problem = token_problem(self.token_env)
        return f"token_env: {problem}" if problem else None

    def pipeline_problems(self, name: str, stages: dict[str, StageBase]) -> list[str]:
        out = []
        same = [n for n, st in stages.items() if n != name and isinstance(st, PushStage)
                and (st.repo.lower(), st.revision) == (self.repo.lower(), self.revision)]
        if same and list(stages).index(same[0]) < list(stages).index(name):
            out.append(f"stages.{name}: pushes to {self.repo}@{self.revision} as stage '{same[0]}' does: the later "
                       "commit replaces the other's files; give each its own repo or revision")
        source = stages.get(self.model)
        if adapters_alone(source) and source.PRODUCES == REWARD_MODEL and not source.starts_from_base():
            out.append(f"stages.{name}: stage '{self.model}' publishes a reward model's LoRA adapters alone: loaded on "
                       "the hub's base model they would lack the scoring head's settings (one label, the pad token "
                       f"the score is read at), which only align records; set stages.{self.model}.lora.merge: true "
                       "to push whole weights")
        elif adapters_alone(source) and not on_base(source, stages):
            out.append(f"stages.{name}: stage '{self.model}' publishes LoRA adapters alone, on a model that exists "
                       f"only in this run: the pushed repository could not be loaded; set "
                       f"stages.{self.model}.lora.merge: true to push whole weights")
        return out

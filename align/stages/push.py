"""Push stage: upload a stage's published model/ to a Hugging Face hub repository (huggingface_hub's HfApi: create
the repository and branch if needed, upload the whole folder, delete an earlier model's files it lacks). The token
is read from the environment variable the stage names, used, and never written; the stage publishes a receipt
(repository, revision, commit, files, deleted files) in pushed/receipt.json."""

from __future__ import annotations

import fnmatch
import glob
import json
import os
import shutil
from pathlib import Path
from typing import Any

from align.config import stage_types
from align.config.push import PushStage, token_problem
from align.core.rundir import SPEC, StageSpec, read_manifest
from align.core.tracking import scrub
from align.runtime.context import StageContext, StageError

OUTPUTS = ["pushed"]


# Not uploaded: the Trainer's pickled TrainingArguments (TRL-trained stages save it into model/; it records this
# machine's paths, and the hub flags pickles).
LEFT_OUT = ("training_args.bin",)
# huggingface_hub matches ignore_patterns against the whole relative path: a bare name leaves out the top-level file
# only, so each name is also given under any folder.
IGNORED = [*LEFT_OUT, *(f"*/{name}" for name in LEFT_OUT)]
# What a model/ is made of (weights, configs, adapters, tokenizer files, align's adapter record): the files at the
# repository's top level matching these, and not in this model/, are an earlier model's and are deleted. Anything
# else a user put there (README.md, LICENSE, images/, GGUF quantisations) is left alone.
MODEL_FILES = ("config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json", "*.bin",
               "*.bin.index.json", "adapter_config.json", "tokenizer*", "special_tokens_map.json", "added_tokens.json",
               "vocab.json", "vocab.txt", "merges.txt", "chat_template.jinja", "chat_template.json", "align_adapter.json")


def stale_files(there: list[str], files: list[str]) -> list[str]:
    """The repository's files (`there`) that an earlier model left and this one (`files`) lacks: model files at its
    top level only (MODEL_FILES)."""
    return sorted(f for f in set(there) - set(files)
                  if "/" not in f and any(fnmatch.fnmatchcase(f, pattern) for pattern in MODEL_FILES))


def hub_folder(folder: Path, run_dir: Path, base_model: str, scratch: Path) -> tuple[Path, str | None]:
    """model/ as the hub should receive it, and the base it was renamed to (None: as it is). LoRA adapters trained on
    a pretrained stage's copy of base_model (the same weights) name that copy, a path in this run, as their base: in
    adapter_config.json (peft's base_model_name_or_path), align_adapter.json and the model card peft wrote (README.md,
    whose `base_model` the hub checks). A pushed repository naming it could not be loaded anywhere else, and the hub
    refuses the card. Such a folder is staged naming base_model instead, at the hub snapshot the copy was made from
    (its manifest's record); adapters trained on a hub base itself are staged pinned at the snapshot they trained on
    (align_adapter.json's record), so peft loads them on that base and not on whatever the hub's main is later. The
    copy is found in `run_dir` by its stage's name, so a run directory moved since still pushes; adapters naming any
    other local path are refused."""
    from align.modeling.models import ADAPTER_BASE, adapter_base  # heavy (torch): stage processes only

    record = adapter_base(folder)
    named = Path(record["base_model"]) if record is not None else None
    if named is None:  # whole weights (lora.merge)
        return folder, None
    if not named.is_absolute():  # adapters of a hub base
        revision = record.get("base_model_revision")
        return (_staged(folder, scratch, record, str(named), None, revision) if revision else folder), None
    copy_dir = run_dir / named.parent.name  # the stage directory of the copy, in this run wherever it now lies
    if named.name != "model" or not republishes_base(copy_dir):
        raise StageError(f"{folder / ADAPTER_BASE}: the adapters name {named} as their base, a path on this machine "
                         "and not a pretrained stage's copy of the base model in this run: the pushed repository "
                         f"could not be loaded; set lora.merge: true on the stage that trained them and rerun it")
    revision = (read_manifest(copy_dir) or {}).get("base_model_revision")
    return _staged(folder, scratch, record, base_model, str(named), revision), base_model


def _staged(folder: Path, scratch: Path, record: dict[str, Any], base: str, local: str | None,
            revision: str | None) -> Path:
    """`folder` in `scratch` with its adapters naming `base` (in place of the `local` path, where one is named) at the
    hub snapshot `revision`: the files that say so rewritten, every other file hard-linked (copied across file
    systems)."""
    from align.modeling.models import ADAPTER_BASE  # heavy (torch): stage processes only

    shutil.rmtree(scratch, ignore_errors=True)
    shutil.copytree(folder, scratch, copy_function=_link_or_copy)
    config = {**json.loads((folder / "adapter_config.json").read_text(encoding="utf-8")),
              "base_model_name_or_path": base}
    if revision:
        config["revision"] = revision  # peft loads the base at it
    rewritten = {"adapter_config.json": json.dumps(config, indent=2) + "\n",
                 ADAPTER_BASE: json.dumps({**record, "base_model": base}) + "\n"}
    if local is not None and (folder / "README.md").is_file():
        rewritten["README.md"] = card_naming((folder / "README.md").read_text(encoding="utf-8"), local, base)
    for name, text in rewritten.items():
        (scratch / name).unlink()  # a hard link: writing through it would change the run's own model/
        (scratch / name).write_text(text, encoding="utf-8")
    return scratch


def card_naming(text: str, path: str, base_model: str) -> str:
    """peft's model card with `base_model` in place of the local `path` it names: its metadata (`base_model`, the tag
    `base_model:adapter:<path>`, which the hub checks) parsed and rewritten, since YAML may wrap or quote a long
    path; the body's mentions replaced as text."""
    from huggingface_hub import ModelCard  # light: only when pushing

    card = ModelCard(text.replace(path, base_model), ignore_metadata_errors=True)
    if card.data.base_model is not None:
        card.data.base_model = base_model
    if card.data.tags:
        card.data.tags = [f"base_model:adapter:{base_model}" if str(t).startswith("base_model:adapter:") else t
                          for t in card.data.tags]
    return str(card)


def republishes_base(stage_dir: Path) -> bool:
    """Whether the stage in `stage_dir` (its spec's type) publishes the base model unchanged (`REPUBLISHES_BASE`)."""
    try:
        kind = StageSpec.read(stage_dir / SPEC).stage.get("type")
    except (OSError, ValueError, KeyError):
        return False
    return bool(getattr(stage_types().get(kind), "REPUBLISHES_BASE", False))


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another file system, or one without hard links
        shutil.copy2(src, dst)


def upload(folder: Path, cfg: PushStage, token: str, message: str, api: Any = None) -> dict[str, Any]:
    """Create the repository (and the branch) if needed and upload `folder` to it (huggingface_hub may split a large
    upload into several commits), deleting the model files an earlier push left there which this model does not have
    (`stale_files`): a stale adapter_config.json beside new whole weights makes transformers load the old base +
    adapter instead. A README.md already there is kept (peft writes a boilerplate card beside adapters). The receipt
    (no token in it) names what was sent and deleted."""
    from huggingface_hub import HfApi  # light: only when pushing
    from huggingface_hub.utils import filter_repo_objects

    api = api if api is not None else HfApi(token=token)
    api.create_repo(cfg.repo, repo_type="model", private=cfg.private, exist_ok=True)
    if cfg.private and api.repo_info(cfg.repo, repo_type="model").private is False:  # create_repo keeps an existing
        # repository's visibility; refused before anything is written there (a branch made first stayed behind)
        raise StageError(f"{cfg.repo} exists and is public, and private is true: the weights would be public. "
                         "Make the repository private on the hub, or set private: false to publish them there")
    if cfg.revision != "main":  # upload_folder commits only to a branch that exists
        api.create_branch(cfg.repo, repo_type="model", branch=cfg.revision, exist_ok=True)
    info = api.repo_info(cfg.repo, repo_type="model", revision=cfg.revision)
    # The branch's commit now: the files listed are at it, and the commit is made on it (parent_commit) or refused
    # when another push moved the branch since, whose files this one's deletions did not see.
    there = api.list_repo_files(cfg.repo, repo_type="model", revision=info.sha or cfg.revision)
    # a model card is sent to a repository without one: a card there (a user's, or an earlier push's) is kept
    ignored = [*IGNORED, "README.md"] if "README.md" in there else IGNORED
    # what upload_folder sends: the same filter, so the receipt names exactly that
    files = sorted(filter_repo_objects([p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()],
                                       ignore_patterns=ignored))
    stale = stale_files(there, files)
    try:
        commit = api.upload_folder(folder_path=str(folder), repo_id=cfg.repo, repo_type="model", revision=cfg.revision,
                                   commit_message=message, ignore_patterns=ignored, parent_commit=info.sha,
                                   delete_patterns=[glob.escape(f) for f in stale] or None)
    except Exception as exc:
        if getattr(getattr(exc, "response", None), "status_code", None) != 412:  # the hub's answer to a moved parent
            raise
        raise StageError(f"{cfg.repo}@{cfg.revision} moved past commit {info.sha} while this push was being "
                         "prepared (another push committed first); nothing was committed. Rerun the push stage, "
                         "and give each pipeline pushing there its own repo or revision") from None
    return {"repo": cfg.repo, "revision": cfg.revision, "parent_commit": info.sha, "private": info.private,
            "commit": getattr(commit, "oid", None), "url": str(getattr(commit, "commit_url", "") or ""),
            "files": files, "deleted": stale, "bytes": sum((folder / f).stat().st_size for f in files)}


def model_card(repo: str, pipeline: str, base_model: str, stage_dir: Path) -> str:
    """A model card for a repository that has none (whole weights: peft writes one beside adapters): the base model
    (in the metadata the hub reads, where it is a hub id, never a path on this machine), the stage and pipeline that
    trained it, and its headline final metrics from the stage's manifest."""
    try:
        kind = StageSpec.read(stage_dir / SPEC).stage.get("type", "?")
    except (OSError, ValueError, KeyError, AttributeError):  # a run directory from before align kept specs
        kind = "?"
    final = (read_manifest(stage_dir) or {}).get("final_metrics") or {}
    keys = getattr(stage_types().get(kind), "HEADLINE", ())
    hub_id = not base_model.startswith(("builtin:", "packaged:")) and not Path(base_model).expanduser().exists() \
        and not base_model.startswith(("/", ".", "~")) and base_model.count("/") <= 1 and bool(base_model)
    tags = "[align]" if kind == "?" else f"[align, {kind}]"
    meta = ([f"base_model: {base_model}"] if hub_id else []) + ["library_name: transformers", f"tags: {tags}"]
    rows = [f"| {k} | {final[k]:.4g} |" for k in keys if isinstance(final.get(k), (int, float))]
    return "\n".join(["---", *meta, "---", "", f"# {repo}", "",
                      f"Trained by align's `{kind}` stage `{stage_dir.name}` of the pipeline `{pipeline}`, from "
                      + (f"[{base_model}](https://huggingface.co/{base_model})." if hub_id else "its base model."),
                      "The licences of the base model and of the data it was trained on apply to it.",
                      *(["", "| metric | value |", "|---|---|", *rows] if rows else []), ""])


def with_card(folder: Path, scratch: Path, card: str) -> Path:
    """`folder` as sent, with a model card (README.md) where it has none: staged in `scratch` (every file hard-linked,
    the published model/ left as it is). upload() sends it only to a repository without a card."""
    if (folder / "README.md").is_file():
        return folder
    if folder != scratch:
        shutil.rmtree(scratch, ignore_errors=True)
        shutil.copytree(folder, scratch, copy_function=_link_or_copy)
    (scratch / "README.md").write_text(card, encoding="utf-8")
    return scratch


def run(ctx: StageContext) -> dict[str, Any]:
    cfg: PushStage = ctx.cfg  # type: ignore[assignment]
    problem = token_problem(cfg.token_env)
    if problem:  # checked by `align validate` too; the environment of the stage may differ from the planner's
        raise StageError(f"stage '{ctx.name}': token_env: {problem}")
    folder = ctx.input_dir(cfg.model) / "model"
    scratch, renamed = ctx.dir / ".hub_folder", None
    message = cfg.commit_message or (f"align: {ctx.pipeline.name}/{ctx.pipeline.run_id} stage {cfg.model}, "
                                     f"fingerprint {ctx.spec.input_fingerprints.get(cfg.model, '?')}")
    receipt: dict[str, Any] = {}
    token = os.environ[cfg.token_env]
    if ctx.is_main:
        try:
            sent, renamed = hub_folder(folder, ctx.run_dir, ctx.pipeline.base_model, scratch)
            sent = with_card(sent, scratch, model_card(cfg.repo, ctx.pipeline.name, ctx.pipeline.base_model,
                                                       ctx.input_dir(cfg.model)))
            receipt = upload(sent, cfg, token, message)
        except StageError as exc:
            raise StageError(f"stage '{ctx.name}': {exc}") from None
        except Exception as exc:  # network, permissions, a missing revision: one line, never the token
            raise StageError(f"stage '{ctx.name}': pushing {folder} to {cfg.repo} (revision {cfg.revision}) failed: "
                             f"{scrub(str(exc).splitlines()[0] if str(exc) else type(exc).__name__, (token,))}") from None
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        if renamed:
            receipt["adapter_base"] = renamed
        gone = f"; deleted an earlier model's {', '.join(receipt['deleted'])}" if receipt["deleted"] else ""
        gone += f"; the adapters name {renamed} as their base" if renamed else ""
        seen = {True: "private", False: "public"}.get(receipt["private"], "visibility unknown")
        print(f"[align] {ctx.name}: pushed {len(receipt['files'])} files to {cfg.repo}@{cfg.revision} ({seen}) "
              f"({receipt['url'] or receipt['commit']}){gone}", flush=True)

    def write(path: Path) -> None:
        if ctx.is_main:
            (path / "receipt.json").write_text(json.dumps(scrub(receipt, (token,)), indent=2) + "\n")

    ctx.publish("pushed", write)
    return {"push/files": len(receipt.get("files", [])), "push/bytes": receipt.get("bytes", 0)}

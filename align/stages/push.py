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

from align.config.push import PushStage, base_copy, token_problem
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


def hub_folder(folder: Path, copy: Path, base_model: str, scratch: Path) -> tuple[Path, str | None]:
    """model/ as the hub should receive it, and the base it was renamed to (None: as it is). LoRA adapters trained on
    a pretrained stage's copy of base_model (`copy`, that stage's model/, the same weights) name that copy, a path in
    this run, as their base in adapter_config.json (peft's base_model_name_or_path) and align_adapter.json: a pushed
    repository naming it could not be loaded anywhere else. Such a folder is staged in `scratch` naming base_model
    instead: those two files rewritten, every other file hard-linked (copied across file systems)."""
    from align.modeling.models import ADAPTER_BASE, adapter_base  # heavy (torch): stage processes only

    record = adapter_base(folder)
    if record is None:  # whole weights (lora.merge): nothing names the copy
        return folder, None
    if Path(record["base_model"]).resolve() != copy.resolve():
        raise StageError(f"{folder / ADAPTER_BASE}: the adapters name {record['base_model']} as their base, not this "
                         f"run's copy of {base_model} ({copy}) that the stage trained: the run directory was moved or "
                         "edited; rerun the stage (align run --force)")
    shutil.rmtree(scratch, ignore_errors=True)
    shutil.copytree(folder, scratch, copy_function=_link_or_copy)
    config = json.loads((folder / "adapter_config.json").read_text(encoding="utf-8"))
    for name, data in (("adapter_config.json", {**config, "base_model_name_or_path": base_model}),
                       (ADAPTER_BASE, {**record, "base_model": base_model})):
        (scratch / name).unlink()  # a hard link: writing through it would change the run's own model/
        (scratch / name).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    return scratch, base_model


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another file system, or one without hard links
        shutil.copy2(src, dst)


def upload(folder: Path, cfg: PushStage, token: str, message: str, api: Any = None) -> dict[str, Any]:
    """Create the repository (and the branch) if needed and upload `folder` to it (huggingface_hub may split a large
    upload into several commits), deleting the model files an earlier push left there which this model does not have
    (`stale_files`): a stale adapter_config.json beside new whole weights makes transformers load the old base +
    adapter instead. The receipt (no token in it) names both."""
    from huggingface_hub import HfApi  # light: only when pushing
    from huggingface_hub.utils import filter_repo_objects

    api = api if api is not None else HfApi(token=token)
    api.create_repo(cfg.repo, repo_type="model", private=cfg.private, exist_ok=True)
    if cfg.revision != "main":  # upload_folder commits only to a branch that exists
        api.create_branch(cfg.repo, repo_type="model", branch=cfg.revision, exist_ok=True)
    # what upload_folder sends: the same filter, so the receipt names exactly that
    files = sorted(filter_repo_objects([p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()],
                                       ignore_patterns=IGNORED))
    there = api.list_repo_files(cfg.repo, repo_type="model", revision=cfg.revision)
    stale = stale_files(there, files)
    info = api.upload_folder(folder_path=str(folder), repo_id=cfg.repo, repo_type="model", revision=cfg.revision,
                             commit_message=message, ignore_patterns=IGNORED,
                             delete_patterns=[glob.escape(f) for f in stale] or None)
    return {"repo": cfg.repo, "revision": cfg.revision, "commit": getattr(info, "oid", None),
            "url": str(getattr(info, "commit_url", "") or ""), "files": files, "deleted": stale,
            "bytes": sum((folder / f).stat().st_size for f in files)}


def run(ctx: StageContext) -> dict[str, Any]:
    cfg: PushStage = ctx.cfg  # type: ignore[assignment]
    problem = token_problem(cfg.token_env)
    if problem:  # checked by `align validate` too; the environment of the stage may differ from the planner's
        raise StageError(f"stage '{ctx.name}': token_env: {problem}")
    folder = ctx.input_dir(cfg.model) / "model"
    copy, scratch = base_copy(ctx.pipeline.stages[cfg.model], ctx.pipeline.stages), ctx.dir / ".hub_folder"
    renamed = None
    if copy is not None and ctx.is_main:  # the copy's stage directory sits beside the source's in this run
        folder, renamed = hub_folder(folder, ctx.input_dir(cfg.model).parent / copy / "model",
                                     ctx.pipeline.base_model, scratch)
    message = cfg.commit_message or (f"align: {ctx.pipeline.name}/{ctx.pipeline.run_id} stage {cfg.model}, "
                                     f"fingerprint {ctx.spec.input_fingerprints.get(cfg.model, '?')}")
    receipt: dict[str, Any] = {}
    if ctx.is_main:
        try:
            receipt = upload(folder, cfg, os.environ[cfg.token_env], message)
        except Exception as exc:  # network, permissions, a missing revision: one line, never the token
            raise StageError(f"stage '{ctx.name}': pushing {folder} to {cfg.repo} (revision {cfg.revision}) failed: "
                             f"{scrub(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)}") from None
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        if renamed:
            receipt["adapter_base"] = renamed
        gone = f"; deleted an earlier model's {', '.join(receipt['deleted'])}" if receipt["deleted"] else ""
        gone += f"; the adapters name {renamed} as their base" if renamed else ""
        print(f"[align] {ctx.name}: pushed {len(receipt['files'])} files to {cfg.repo}@{cfg.revision} "
              f"({receipt['url'] or receipt['commit']}){gone}", flush=True)

    def write(path: Path) -> None:
        if ctx.is_main:
            (path / "receipt.json").write_text(json.dumps(scrub(receipt), indent=2) + "\n")

    ctx.publish("pushed", write)
    return {"push/files": len(receipt.get("files", [])), "push/bytes": receipt.get("bytes", 0)}

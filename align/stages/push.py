"""Push stage: upload a stage's published model/ to a Hugging Face hub repository (huggingface_hub's HfApi: create
the repository if needed, one commit of the whole folder). The token is read from the environment variable the
stage names, used, and never written; the stage publishes a receipt (repository, revision, commit, files) in
pushed/receipt.json."""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path
from typing import Any

from align.config.push import PushStage, token_problem
from align.core.tracking import scrub
from align.runtime.context import StageContext, StageError

OUTPUTS = ["pushed"]


# Not uploaded: the Trainer's pickled TrainingArguments (TRL-trained stages save it into model/; it records this
# machine's paths, and the hub flags pickles). Kept on the hub when absent here: its own card and attributes.
LEFT_OUT = ("training_args.bin",)
KEPT_REMOTE = ("README.md", ".gitattributes")


def upload(folder: Path, cfg: PushStage, token: str, message: str, api: Any = None) -> dict[str, Any]:
    """Create the repository (and the branch) if needed and commit `folder` to it, in one commit that also deletes
    the files an earlier push left there which this model does not have: a stale adapter_config.json beside new whole
    weights makes transformers load the old base + adapter instead. The receipt (no token in it) names both."""
    from huggingface_hub import HfApi  # light: only when pushing

    api = api if api is not None else HfApi(token=token)
    api.create_repo(cfg.repo, repo_type="model", private=cfg.private, exist_ok=True)
    if cfg.revision != "main":  # upload_folder commits only to a branch that exists
        api.create_branch(cfg.repo, repo_type="model", branch=cfg.revision, exist_ok=True)
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()
                   and p.name not in LEFT_OUT)
    there = api.list_repo_files(cfg.repo, repo_type="model", revision=cfg.revision)
    stale = sorted(set(there) - set(files) - set(KEPT_REMOTE))
    info = api.upload_folder(folder_path=str(folder), repo_id=cfg.repo, repo_type="model", revision=cfg.revision,
                             commit_message=message, ignore_patterns=list(LEFT_OUT),
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
    message = cfg.commit_message or (f"align: {ctx.pipeline.name}/{ctx.pipeline.run_id} stage {cfg.model}, "
                                     f"fingerprint {ctx.spec.input_fingerprints.get(cfg.model, '?')}")
    receipt: dict[str, Any] = {}
    if ctx.is_main:
        try:
            receipt = upload(folder, cfg, os.environ[cfg.token_env], message)
        except Exception as exc:  # network, permissions, a missing revision: one line, never the token
            raise StageError(f"stage '{ctx.name}': pushing {folder} to {cfg.repo} (revision {cfg.revision}) failed: "
                             f"{scrub(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)}") from None
        print(f"[align] {ctx.name}: pushed {len(receipt['files'])} files to {cfg.repo}@{cfg.revision} "
              f"({receipt['url'] or receipt['commit']})", flush=True)

    def write(path: Path) -> None:
        if ctx.is_main:
            (path / "receipt.json").write_text(json.dumps(scrub(receipt), indent=2) + "\n")

    ctx.publish("pushed", write)
    return {"push/files": len(receipt.get("files", [])), "push/bytes": receipt.get("bytes", 0)}

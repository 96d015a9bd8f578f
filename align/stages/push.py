"""Push stage: upload a stage's published model/ to a Hugging Face hub repository (huggingface_hub's HfApi: create
the repository if needed, one commit of the whole folder). The token is read from the environment variable the
stage names, used, and never written; the stage publishes a receipt (repository, revision, commit, files) in
pushed/receipt.json."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from align.config.push import PushStage, token_problem
from align.core.tracking import scrub
from align.runtime.context import StageContext, StageError

OUTPUTS = ["pushed"]


def upload(folder: Path, cfg: PushStage, token: str, message: str, api: Any = None) -> dict[str, Any]:
    """Create the repository (if needed) and commit `folder` to it; the receipt (no token in it)."""
    from huggingface_hub import HfApi  # light: only when pushing

    api = api if api is not None else HfApi(token=token)
    api.create_repo(cfg.repo, repo_type="model", private=cfg.private, exist_ok=True)
    info = api.upload_folder(folder_path=str(folder), repo_id=cfg.repo, repo_type="model", revision=cfg.revision,
                             commit_message=message)
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    return {"repo": cfg.repo, "revision": cfg.revision, "commit": getattr(info, "oid", None),
            "url": str(getattr(info, "commit_url", "") or ""), "files": files,
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

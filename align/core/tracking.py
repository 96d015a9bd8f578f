"""Metrics: every value goes to the stage's metrics.jsonl, and to W&B when it is enabled.

One W&B run per stage, grouped by pipeline run, job_type = stage type; a sweep variant's run is named after the
variant and carries its swept values in its config (`sweep`). Without an API key W&B runs in
offline mode (no prompt, no network); the run directory lands in `<stage>/wandb/` and can be synced later
with `wandb sync`. Only the main process logs. Secrets never reach W&B config or files.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from pathlib import Path
from typing import Any

SECRET_ENV = ("WANDB_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_API_TOKEN", "OPENAI_API_KEY")
# Keys that hold credentials (api_key, hf_token, auth_token, password, ...), not e.g. max_new_tokens or pad_token.
_SECRET_KEY = re.compile(r"(api[_-]?key|secret|passw(or)?d|^token$|(^|[_-])(hf|hub|auth|access|wandb|api|bearer)[_-]?token$)",
                         re.IGNORECASE)


# Environment variables whose values are treated as secrets besides SECRET_ENV: names that say so (OPENAI_API_KEY,
# MY_JUDGE_KEY, ..._TOKEN, ..._SECRET, ..._PASSWORD), such as a pairwise judge's `key_env`.
_SECRET_ENV_NAME = re.compile(r"(KEY|TOKEN|SECRET|PASSWORD|PASSWD)$", re.IGNORECASE)


def secret_values() -> list[str]:
    """The values of the environment's secrets (SECRET_ENV and variables named like one), longest first."""
    names = set(SECRET_ENV) | {k for k in os.environ if _SECRET_ENV_NAME.search(k)}
    return sorted({os.environ[k] for k in names if len(os.environ.get(k, "")) >= 8}, key=len, reverse=True)


def scrub(obj: Any) -> Any:
    """Drop secret-looking keys and replace any secret env value found inside strings."""
    secrets = secret_values()
    if isinstance(obj, dict):
        return {k: ("<redacted>" if _SECRET_KEY.search(str(k)) else scrub(v)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [scrub(v) for v in obj]
    if isinstance(obj, str):
        for s in secrets:
            obj = obj.replace(s, "<redacted>")
    return obj


def wandb_mode(setting: str) -> str | None:
    """Resolve the tracking.wandb setting to a wandb mode, or None when disabled. The user's own WANDB_MODE
    (offline / dryrun / disabled) wins over the pipeline's setting: a key in the environment never forces W&B
    online from a machine the user said has no network; WANDB_MODE=online only decides `auto`."""
    env = os.environ.get("WANDB_MODE", "").strip().lower()
    if setting == "disabled" or env == "disabled":
        return None
    if env in ("offline", "dryrun"):
        return "offline"
    if setting == "auto":
        return "online" if env == "online" or os.environ.get("WANDB_API_KEY") else "offline"
    return setting


def sweep_config(stage: str, variants: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """W&B config entries of a sweep variant (pipeline `variants`, align/config/sweeps.py): the swept values under
    `sweep` (W&B shows `sweep.beta`, for parallel-coordinates and grouping) and the swept stage's name."""
    variant = variants.get(stage)
    if not variant:
        return {}
    return {"sweep": dict(variant["values"]), "swept_stage": variant["stage"]}


def _clean(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN; keep it visible as a string
    return value


def json_ready(value: Any) -> Any:
    """`value` with every non-finite float inside it (dicts, lists) as a string ("nan", "inf"), as metrics.jsonl
    writes them: JSON has no NaN, and a file with a bare NaN is refused by every reader but Python's."""
    if isinstance(value, dict):
        return {k: json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(v) for v in value]
    return _clean(value)


class Tracker:
    """Writes metrics.jsonl and mirrors to W&B. Construct on every rank; only the main process writes."""

    def __init__(self, stage_dir: Path, *, main_process: bool, wandb_setting: str, project: str,
                 entity: str | None, group: str, name: str, job_type: str, config: dict[str, Any]):
        self.main = main_process
        self.path = Path(stage_dir) / "metrics.jsonl"
        self.run = None
        if not self.main:
            return
        mode = wandb_mode(wandb_setting)
        if mode is not None:
            import wandb  # optional and heavy: only when W&B is on

            os.environ.setdefault("WANDB_SILENT", "true")
            self.run = wandb.init(project=project, entity=entity, group=group, name=name, job_type=job_type,
                                  dir=str(stage_dir), mode=mode, config=scrub(config), reinit="finish_previous",
                                  settings=wandb.Settings(console="off", x_disable_stats=True))

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if not self.main or not metrics:
            return
        row = {"step": int(step), "time": round(time.time(), 3), **{k: _clean(v) for k, v in metrics.items()}}
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(row) + "\n")
        if self.run is not None:
            self.run.log({k: v for k, v in row.items() if k not in ("step", "time")}, step=int(step))

    def table(self, name: str, columns: list[str], rows: list[list[Any]], step: int) -> None:
        """A table of samples: to W&B as a wandb.Table, locally as `<name>.jsonl` beside metrics.jsonl."""
        if not self.main:
            return
        with open(self.path.parent / f"{name.replace('/', '_')}.jsonl", "a", encoding="utf-8") as fh:
            for r in rows:
                fh.write(json.dumps({"step": step, **dict(zip(columns, r))}) + "\n")
        if self.run is not None:
            import wandb  # optional and heavy: only when W&B is on

            self.run.log({name: wandb.Table(columns=columns, data=rows)}, step=int(step))

    def images(self, paths: dict[str, Path], step: int) -> None:
        """PNG files (already on disk) as W&B images."""
        if self.run is not None and paths:
            import wandb  # optional and heavy: only when W&B is on

            self.run.log({k: wandb.Image(str(v)) for k, v in paths.items() if Path(v).is_file()}, step=int(step))

    def summary(self, values: dict[str, Any]) -> None:
        if self.run is not None:
            for k, v in values.items():
                self.run.summary[k] = _clean(v)

    def finish(self) -> dict[str, Any]:
        """Close the W&B run; return its id/path/dir for the manifest."""
        if self.run is None:
            return {}
        info = {"id": self.run.id, "path": "/".join(p for p in (self.run.entity, self.run.project, self.run.id) if p),
                "dir": str(Path(self.run.dir).parent), "mode": self.run.settings.mode}
        self.run.finish()
        return info

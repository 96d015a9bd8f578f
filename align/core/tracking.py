"""Metrics: every value goes to the stage's metrics.jsonl, and to W&B when it is enabled.

One W&B run per stage, grouped by pipeline run, job_type = stage type; a sweep variant's run is named after the
variant and carries its swept values in its config (`sweep`). Without an API key W&B runs in
offline mode (no prompt, no network); the run directory lands in `<stage>/wandb/` and can be synced later
with `wandb sync`. A stage that cannot reach W&B online (no network on a compute node, a revoked key) logs offline
instead, and one that cannot start W&B at all logs locally only: tracking never fails a training run. A resumed
stage continues its W&B run, or starts one holding metrics.jsonl's rows where it logs steps again (Tracker._ensure);
a failed one ends its W&B run with exit code 1.
Only the main process logs. Secrets never reach W&B config or files.
"""

from __future__ import annotations

import json
import math
import netrc
import os
import re
import secrets
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from align.core.fsutil import atomic_write_text

SECRET_ENV = ("WANDB_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_API_TOKEN", "OPENAI_API_KEY")
# Keys that hold credentials (api_key, hf_token, auth_token, password, ...), not e.g. max_new_tokens or pad_token.
_SECRET_KEY = re.compile(r"(api[_-]?key|secret|passw(or)?d|^token$|(^|[_-])(hf|hub|auth|access|wandb|api|bearer)[_-]?token$)",
                         re.IGNORECASE)


# Environment variables whose values are treated as secrets besides SECRET_ENV: names that say so (OPENAI_API_KEY,
# MY_JUDGE_KEY, ..._TOKEN, ..._SECRET, ..._PASSWORD), such as a pairwise judge's `key_env`.
_SECRET_ENV_NAME = re.compile(r"(KEY|TOKEN|SECRET|PASSWORD|PASSWD)$", re.IGNORECASE)
# Credentials written into a URL: user:password@ before the host, and a query parameter named like a key.
# (user:password@ with a / in the password too; hf://org/name@rev and git+https://host/pkg@v1 are left alone)
_URL_USERINFO = re.compile(r"\b([a-z][a-z0-9+.-]*://)(?:[^\s/@:]+:[^\s@]+|[^/\s@]+)@", re.IGNORECASE)
_QUERY_SECRET = re.compile(r"([?&](?:api[_-]?key|key|token|access[_-]?token|secret|password|sig|signature|"
                           r"x-amz-signature|x-amz-credential|x-amz-security-token|x-goog-signature)=)[^&#\s]+",
                           re.IGNORECASE)


def secret_values() -> list[str]:
    """The values of the environment's secrets (SECRET_ENV and variables named like one), longest first."""
    names = set(SECRET_ENV) | {k for k in os.environ if _SECRET_ENV_NAME.search(k)}
    return sorted({os.environ[k] for k in names if len(os.environ.get(k, "")) >= 8}, key=len, reverse=True)


def scrub(obj: Any, also: tuple[str, ...] = ()) -> Any:
    """Drop secret-looking keys; in strings, replace any secret env value, each of `also` (e.g. a token read from a
    variable of any name), and a URL's credentials (user:password@, ?api_key=...)."""
    secrets = sorted({*secret_values(), *(s for s in also if len(s) >= 8)}, key=len, reverse=True)
    if isinstance(obj, dict):
        return {k: ("<redacted>" if _SECRET_KEY.search(str(k)) else scrub(v, also)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [scrub(v, also) for v in obj]
    if isinstance(obj, str):
        for s in secrets:
            obj = obj.replace(s, "<redacted>")
        obj = _QUERY_SECRET.sub(r"\1<redacted>", _URL_USERINFO.sub(r"\1<redacted>@", obj))
    return obj


# The values wandb itself accepts in WANDB_MODE (wandb.Settings.mode), as align reads them: any case, spaces around.
WANDB_MODES = ("online", "offline", "dryrun", "disabled", "run", "shared")


def wandb_env_problem() -> str | None:
    """Why the environment's WANDB_MODE would stop W&B from starting in every stage (wandb refuses what it does not
    know), or None; `align validate` and `align run` say it before any stage starts."""
    env = os.environ.get("WANDB_MODE", "")
    if env.strip() and env.strip().lower() not in WANDB_MODES:
        return (f"the environment variable WANDB_MODE is {env!r}, which W&B does not accept; set it to one of "
                f"{', '.join(WANDB_MODES[:4])} (or unset it and choose with tracking.wandb)")
    return None


def wandb_mode(setting: str) -> str | None:
    """Resolve the tracking.wandb setting to a wandb mode, or None when disabled. The user's own WANDB_MODE
    (offline / dryrun / disabled) wins over the pipeline's setting: a key in the environment never forces W&B
    online from a machine the user said has no network; WANDB_MODE=online only decides `auto`. WANDB_DISABLED
    (true / 1 / yes, the transformers convention) is WANDB_MODE=disabled."""
    env = os.environ.get("WANDB_MODE", "").strip().lower()
    off = os.environ.get("WANDB_DISABLED", "").strip().lower() in ("true", "1", "yes")
    if setting == "disabled" or env == "disabled" or off:
        return None
    if env in ("offline", "dryrun"):
        return "offline"
    if setting == "auto":
        return "online" if env == "online" or os.environ.get("WANDB_API_KEY") or logged_in() else "offline"
    return setting


def logged_in() -> bool:
    """Whether `wandb login` stored a key for the W&B host (WANDB_BASE_URL, else api.wandb.ai) in the netrc file
    wandb reads ($NETRC, else ~/.netrc or ~/_netrc): a user who logged in has no WANDB_API_KEY in the environment.
    The key itself is not read out."""
    host = urlsplit(os.environ.get("WANDB_BASE_URL", "").strip() or "https://api.wandb.ai").netloc
    found = [p for p in (Path("~/.netrc").expanduser(), Path("~/_netrc").expanduser()) if p.is_file()]
    path = Path(os.environ["NETRC"]).expanduser() if os.environ.get("NETRC") else (found or [None])[0]
    try:
        entry = netrc.netrc(str(path)).authenticators(host) if path is not None and host else None
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(entry and entry[2])


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


def _id_file(stage_dir: Path) -> Path:
    return Path(stage_dir) / "wandb" / "align_run_id"


def previous_run_id(stage_dir: Path) -> str | None:
    """The W&B run id the stage's last attempt used (`<stage>/wandb/align_run_id`), or None."""
    try:
        old = _id_file(stage_dir).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return old if re.fullmatch(r"[a-z0-9]{8,64}", old) else None


def new_run_id(stage_dir: Path) -> str:
    """A fresh W&B run id for this attempt of the stage, recorded for the next attempt."""
    new = secrets.token_hex(8)
    _id_file(stage_dir).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(_id_file(stage_dir), new + "\n")
    return new


def _logged_file(stage_dir: Path) -> Path:
    return Path(stage_dir) / "wandb" / "align_run_logged"


def logged_to(stage_dir: Path, run_id: str) -> float:
    """The highest step W&B run `run_id` was sent (`<stage>/wandb/align_run_logged`: "<id> <step>"), -inf when not
    recorded for it. metrics.jsonl cannot say: a resume trims it to its checkpoint, and an attempt killed before it
    logged leaves the trimmed file to the next, while the W&B run still holds the steps after the checkpoint."""
    try:
        rid, step = _logged_file(stage_dir).read_text(encoding="utf-8").split()
        return float(step) if rid == run_id else float("-inf")
    except (OSError, UnicodeDecodeError, ValueError):
        return float("-inf")


def _step_row(line: str) -> tuple[float, dict[str, Any]]:
    """A metrics.jsonl line's (step, row): step 0 for a row that names none; (inf, {}) for a torn line (a killed
    attempt's last) or one that is not a row."""
    try:
        row = json.loads(line)
        return float(row.get("step", 0)), row
    except (ValueError, AttributeError, TypeError):
        return float("inf"), {}


def _rows(path: Path) -> list[tuple[float, dict[str, Any]]]:
    """metrics.jsonl's (step, row) pairs, a torn line left out."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return []
    return [(step, row) for step, row in map(_step_row, lines) if math.isfinite(step)]


def metrics_rows(path: Path) -> int:
    """How many rows metrics.jsonl (or a table's file) holds now (0: none yet)."""
    try:
        return sum(1 for line in path.read_text(encoding="utf-8").splitlines() if line.strip())
    except (OSError, UnicodeDecodeError):
        return 0


def keep_metrics_until(path: Path, step: int, rows: int | None = None) -> None:
    """Drop metrics rows (or a table's) after `step`, and a torn line, atomically: a resumed stage never logs a step
    twice. `rows`: the rows there were when the checkpoint resumed from was saved (`metrics_rows`), kept and no
    more: rows logged at its very step after it was saved (the evaluation after a stage's last step) go too."""
    if not path.is_file():
        return
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    kept = [line for line in lines if _step_row(line)[0] <= step]
    kept = kept[:rows] if rows is not None else kept
    if len(kept) != len(lines):
        atomic_write_text(path, "".join(line + "\n" for line in kept))


def drop_torn_tail(path: Path) -> None:
    """Cut a metrics or table file after its last whole line (one a killed writer left half written), atomically."""
    try:
        data = path.read_bytes()
    except OSError:
        return
    if data and not data.endswith(b"\n"):
        atomic_write_text(path, data[:data.rfind(b"\n") + 1].decode("utf-8", "replace"))


OFFLINE_MARK = ".wandb_unreachable"
"""In the run directory: a stage found W&B unreachable online (its error), so stages that start within
OFFLINE_FOR_S of it log offline at once (a run resumed the next day tries online again)."""
OFFLINE_FOR_S = 3600.0


def _warn(message: str) -> None:
    print(f"[align] warning: {scrub(message)}", file=sys.stderr, flush=True)


class Tracker:
    """Writes metrics.jsonl and mirrors to W&B. Construct on every rank; only the main process writes."""

    def __init__(self, stage_dir: Path, *, main_process: bool, wandb_setting: str, project: str,
                 entity: str | None, group: str, name: str, job_type: str, config: dict[str, Any],
                 resume: bool = False):
        self.main = main_process
        self.path = Path(stage_dir) / "metrics.jsonl"
        self.run = None
        self.problem = ""  # why W&B is not logging although it was asked to (recorded in the manifest)
        self._kwargs: dict[str, Any] | None = None  # the W&B run to start at the first thing logged (main process)
        if not self.main:
            return
        for path in (self.path, *(self.path.parent / table_file(t) for t in TABLES)):
            drop_torn_tail(path)  # a killed attempt's half line: the next append would be glued onto it and lost
        self.mode = wandb_mode(wandb_setting)
        if self.mode is not None:
            if os.environ.get("WANDB_MODE"):  # wandb reads it too, and refuses "OFFLINE" or " offline"
                os.environ["WANDB_MODE"] = os.environ["WANDB_MODE"].strip().lower()
            os.environ.setdefault("WANDB_SILENT", "true")
            self._kwargs = dict(project=project, entity=entity, group=group, name=name, job_type=job_type,
                                dir=str(stage_dir), config=scrub(config))
            self._previous = previous_run_id(stage_dir) if resume else None
            self._logged = max(max((step for step, _ in _rows(self.path)), default=0),  # a record from before
                               logged_to(stage_dir, self._previous)) if self._previous else 0  # align kept one
        self._sent = float("-inf")  # the highest step this attempt's W&B run was sent

    def _ensure(self, step: int | None) -> None:
        """Start the W&B run at the first thing logged. An attempt that resumes past every step its predecessor
        logged continues that W&B run. One that logs a step again (resumed from a checkpoint before the kill, or
        from none) starts a new run, because W&B drops a step at or below the last it holds: the new run first
        gets metrics.jsonl's rows so far (the resumed ones, trimmed to the checkpoint), so it holds what
        metrics.jsonl holds, and its config names the run it replaces (`resumed_from`)."""
        if self._kwargs is None:
            return
        kwargs, self._kwargs = self._kwargs, None
        if self._previous and (step is None or step > self._logged):
            kwargs.update(id=self._previous, resume="allow")
            self.run = self._start(self.mode, kwargs)
            return
        kwargs["id"] = new_run_id(Path(kwargs["dir"]))
        if self._previous:
            kwargs["config"] = {**kwargs["config"], "resumed_from": self._previous}
        self.run = self._start(self.mode, kwargs)
        for at, row in _rows(self.path) if self.run is not None and self._previous else ():
            if step is None or at < step:
                self._send(_wandb_row(row), int(at))

    def _send(self, values: dict[str, Any], step: int) -> None:
        """Log to the W&B run, recording the highest step it holds (`logged_to`) for the attempt after a kill."""
        self.run.log(values, step=step)
        if step > self._sent:
            self._sent = step
            _logged_file(self.path.parent).parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(_logged_file(self.path.parent), f"{self.run.id} {step}\n")

    def _start(self, mode: str, kwargs: dict[str, Any]):
        import wandb  # optional and heavy: only when W&B is on

        settings = wandb.Settings(console="off", x_disable_stats=True)
        # An earlier stage of this run found W&B unreachable online: this one does not wait for it again (wandb's
        # own timeout is 90 s a stage); the run's later stages log offline too.
        gone = Path(kwargs["dir"]).parent / OFFLINE_MARK
        marked = mode == "online" and gone.is_file() and time.time() - gone.stat().st_mtime < OFFLINE_FOR_S
        try:
            if marked:
                raise ConnectionError(f"an earlier stage of this run could not reach it ({gone})")
            return wandb.init(mode=mode, reinit="finish_previous", settings=settings, **kwargs)
        except Exception as exc:  # wandb.Error (a revoked key, no network, a timeout), OSError, ...
            first = f"{type(exc).__name__}: {exc}"
        if mode == "online":
            _warn(f"W&B did not start online ({first}); this stage logs to W&B offline instead (`wandb sync` its "
                  "wandb/ directory later); set WANDB_MODE=offline to skip the attempt on machines without network")
            if not marked:  # only a real attempt marks (or re-marks) the run: the mark expires OFFLINE_FOR_S after it
                atomic_write_text(gone, scrub(first) + "\n")
            try:
                return wandb.init(mode="offline", reinit="finish_previous", settings=settings, **kwargs)
            except Exception as exc:
                first = f"{type(exc).__name__}: {exc}"
        self.problem = scrub(first)
        _warn(f"W&B did not start ({first}); this stage's metrics are written to metrics.jsonl only")
        return None

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if not self.main or not metrics:
            return
        row = {"step": int(step), "time": round(time.time(), 3), **{k: _clean(v) for k, v in metrics.items()}}
        self._ensure(int(step))
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(row) + "\n")
        if self.run is not None:
            self._send(_wandb_row(row), int(step))

    def table(self, name: str, columns: list[str], rows: list[list[Any]], step: int) -> None:
        """A table of samples: to W&B as a wandb.Table, locally as `<name>.jsonl` beside metrics.jsonl."""
        if not self.main:
            return
        self._ensure(int(step))
        with open(self.path.parent / table_file(name), "a", encoding="utf-8") as fh:
            for r in rows:
                fh.write(json.dumps(json_ready({"step": step, **dict(zip(columns, r))})) + "\n")
        if self.run is not None:
            import wandb  # optional and heavy: only when W&B is on

            self._send({name: wandb.Table(columns=columns, data=rows)}, int(step))

    def images(self, paths: dict[str, Path], step: int) -> None:
        """PNG files (already on disk) as W&B images."""
        if self.main and paths:
            self._ensure(int(step))
        if self.run is not None and paths:
            import wandb  # optional and heavy: only when W&B is on

            self._send({k: wandb.Image(str(v)) for k, v in paths.items() if Path(v).is_file()}, int(step))

    def summary(self, values: dict[str, Any]) -> None:
        if self.main:
            self._ensure(None)
        if self.run is not None:
            for k, v in values.items():
                self.run.summary[k] = _clean(v)

    def info(self) -> dict[str, Any]:
        """The W&B run's id/path/dir/mode for the manifest (or why W&B did not start)."""
        if self.run is None:
            return {"error": self.problem} if self.problem else {}
        return {"id": self.run.id, "path": "/".join(p for p in (self.run.entity, self.run.project, self.run.id) if p),
                "dir": str(Path(self.run.dir).parent), "mode": self.run.settings.mode}

    def finish(self, failed: bool = False) -> dict[str, Any]:
        """Close the W&B run (exit code 1 when the stage failed: W&B shows it failed, not finished); return info().
        A W&B that cannot close (the network went) is a warning: the stage's own result stands. A stage that failed
        before it logged anything still shows in W&B, as failed."""
        if failed and self.main:
            self._ensure(None)
        info = self.info()
        run, self.run = self.run, None
        if run is not None:
            try:
                run.finish(exit_code=1 if failed else 0)
            except Exception as exc:
                _warn(f"W&B run {info.get('id')} did not close cleanly ({type(exc).__name__}: {exc})")
        return info


# The tables stages write (Tracker.table): a stage's fresh attempt sets their files aside with metrics.jsonl's.
TABLES = ("samples", "report/headline")


def _wandb_row(row: dict[str, Any]) -> dict[str, Any]:
    """A metrics.jsonl row as W&B takes it: without step and time (W&B has its own), "nan" / "inf" as numbers."""
    return {k: float(v) if v in ("nan", "inf", "-inf") else v for k, v in row.items() if k not in ("step", "time")}


def table_file(name: str) -> str:
    """The local file of a Tracker table (beside metrics.jsonl): report/headline -> report_headline.jsonl."""
    return f"{name.replace('/', '_')}.jsonl"

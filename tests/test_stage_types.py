"""Adding a stage type touches no file under align/: the `echo` type (tests/stagetypes/, a config class and a
stage module) is found through ALIGN_STAGE_MODULES and runs through `align validate`, `align run` and
`align status` like a built-in one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STAGETYPES = Path(__file__).resolve().parent / "stagetypes"

PIPELINE = """\
name: echoes
tracking: {wandb: disabled}
stages:
  echo: {message: hi there, repeat: 3}
"""


def _align(*args: str, cwd: Path, with_echo: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(STAGETYPES), str(REPO), os.environ.get("PYTHONPATH", "")])}
    env.pop("ALIGN_STAGE_MODULES", None)
    if with_echo:
        env["ALIGN_STAGE_MODULES"] = "echo_config"
    return subprocess.run([sys.executable, "-m", "align.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def test_builtin_types_register_themselves():
    from align.config import stage_types

    types = stage_types()
    assert {"sft", "preferences", "reward", "dpo", "ppo", "evaluate"} <= set(types)
    for kind, cls in types.items():
        assert cls.TYPE == kind and cls.PRODUCES, kind  # every type declares what it publishes


def test_a_stage_type_from_outside_align_validates_runs_and_shows_in_status(tmp_path):
    (tmp_path / "echoes.yaml").write_text(PIPELINE)
    unknown = _align("validate", "echoes.yaml", cwd=tmp_path, with_echo=False)
    assert unknown.returncode == 2 and "unknown stage type 'echo'" in unknown.stderr

    valid = _align("validate", "echoes.yaml", cwd=tmp_path)
    assert valid.returncode == 0, valid.stdout + valid.stderr
    assert "echo" in valid.stdout and "valid (1 stage)" in valid.stdout

    ran = _align("run", "echoes.yaml", cwd=tmp_path)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    run_dir = tmp_path / "runs" / "echoes" / "main"
    published = json.loads((run_dir / "echo" / "data" / "echo.json").read_text())
    assert published["text"] == "hi there hi there hi there" and published["config"]["repeat"] == 3
    manifest = json.loads((run_dir / "echo" / "manifest.json").read_text())
    assert manifest["status"] == "completed" and manifest["type"] == "echo"
    final = manifest["final_metrics"]
    assert {k: v for k, v in final.items() if not k.startswith("perf/")} == {"echo/words": 6}
    assert final["perf/stage_seconds"] > 0 and "perf/peak_memory_gb" not in final  # timed by the runner; no GPU

    status = _align("status", str(run_dir), cwd=tmp_path)
    assert status.returncode == 0, status.stderr
    row = next(line for line in status.stdout.splitlines() if line.startswith("| echo |"))
    assert "| echo | echo | completed | current |" in row and "echo/words 6" in row

    again = _align("run", "echoes.yaml", cwd=tmp_path)
    assert again.returncode == 0 and "up to date" in again.stdout


def test_a_stage_type_checks_its_own_settings(tmp_path):
    (tmp_path / "echoes.yaml").write_text(PIPELINE.replace("message: hi there", "message: ' '"))
    refused = _align("validate", "echoes.yaml", cwd=tmp_path)
    assert refused.returncode == 2 and "stages.echo: message: empty" in refused.stderr
    (tmp_path / "echoes.yaml").write_text(PIPELINE.replace("repeat: 3", "repeat: 0"))
    refused = _align("validate", "echoes.yaml", cwd=tmp_path)
    assert refused.returncode == 2 and "stages.echo.repeat" in refused.stderr

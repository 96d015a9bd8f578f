"""Kill a stage mid-training (SIGKILL to the whole process group) and check the next run resumes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import REPO, TINY, align_cmd, run_align

pytestmark = pytest.mark.slow


def _wait_for_checkpoint(ckpts: Path, proc: subprocess.Popen, timeout: float = 240) -> int:
    """Block until a complete checkpoint exists; return its step."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        assert proc.poll() is None, "the stage finished before it could be killed; make it longer"
        done = [int(p.name.split("-")[1]) for p in ckpts.glob("checkpoint-*") if (p / "trainer_state.json").is_file()]
        if done:
            return max(done)
        time.sleep(0.1)
    raise AssertionError("no checkpoint appeared")


def test_sft_killed_mid_training_resumes_step_counter(workdir):
    args = ["run", "pipelines/default.yaml", "--run-id", "kill", "--only", "sft", "tracking.wandb=disabled", *TINY,
            "sft.max_steps=400", "sft.save_steps=20", "sft.logging_steps=10", "builtin.hidden_size=64"]
    stage = workdir / "runs" / "default" / "kill" / "sft"
    proc = subprocess.Popen(align_cmd(*args), cwd=workdir, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=os.environ.copy())
    try:
        killed_after = _wait_for_checkpoint(stage / "checkpoints", proc)
        time.sleep(0.5)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    manifest = json.loads((stage / "manifest.json").read_text())
    assert manifest["status"] == "running"  # a killed stage is never mistaken for a completed one
    assert not (stage / "model").exists()
    logged_before = [json.loads(x)["step"] for x in (stage / "metrics.jsonl").read_text().splitlines()]

    again = run_align(*args, cwd=workdir)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    manifest = json.loads((stage / "manifest.json").read_text())
    assert manifest["status"] == "completed" and manifest["attempts"] == 2
    assert manifest["resumed_from_step"] >= killed_after > 0
    assert manifest["global_step"] == 400
    assert "resuming from" in again.stdout
    steps = [json.loads(x)["step"] for x in (stage / "metrics.jsonl").read_text().splitlines()]
    resumed = steps[len(logged_before):]
    assert resumed and min(resumed) > manifest["resumed_from_step"]  # the counter continues, not restarts

    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(stage / "model")

"""Stages under `accelerate launch` with 2 CPU processes and DeepSpeed (gloo)."""

from __future__ import annotations

import json

import pytest

from conftest import TINY, run_align

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_sft_under_zero2_two_processes(workdir):
    proc = run_align("run", "pipelines/default.yaml", "--run-id", "z2", "--only", "sft", "tracking.wandb=disabled",
                     *TINY, "sft.accelerate=zero2", "sft.num_processes=2", cwd=workdir)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    stage = workdir / "runs" / "default" / "z2" / "sft"
    manifest = json.loads((stage / "manifest.json").read_text())
    assert manifest["status"] == "completed" and manifest["global_step"] == 30
    log = (stage / "stage.log").read_text()
    assert "DeepSpeed" in log or "deepspeed" in log
    # metrics written once (main process only): one row per logging step
    rows = [json.loads(x) for x in (stage / "metrics.jsonl").read_text().splitlines()]
    loss_steps = [r["step"] for r in rows if "train/loss" in r]
    assert loss_steps and len(loss_steps) == len(set(loss_steps))

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(stage / "model")  # consolidated, not ZeRO shards
    assert sum(p.numel() for p in model.parameters()) > 0

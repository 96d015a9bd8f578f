"""The real-data path end to end: HH-RLHF transcripts, the GPT-2 tokenizer (no pad token, no chat template),
every stage, on CPU (pipelines/hh_rlhf_tiny.yaml)."""

from __future__ import annotations

import json

import pytest

from conftest import run_align

pytestmark = pytest.mark.slow


def test_hh_pipeline_runs_with_the_gpt2_tokenizer(workdir):
    """sft, reward and dpo of pipelines/hh_rlhf_tiny.yaml: both HH cards (text transcripts) through the real
    50,257-token GPT-2 tokenizer, which has no pad token. Its ppo and evaluate stages are left out here (each
    stage process costs ~10 s of start-up on the CI machine): the same stages on HH conversations run in
    tests/test_smollm2.py, and on a tokenizer whose pad is its EOS (the gpt2 family) in tests/test_families_b.py."""
    import yaml

    from conftest import REPO

    raw = yaml.safe_load((REPO / "pipelines" / "hh_rlhf_tiny.yaml").read_text())
    raw["stages"] = {k: v for k, v in raw["stages"].items() if k in ("sft", "reward", "dpo")}
    raw["tokenizer"] = str(REPO / "tokenizers" / "gpt2")
    for stage in raw["stages"].values():
        stage["data"] = str((REPO / "pipelines" / stage["data"]).resolve())
    # half the shipped pipeline's steps (a test of the path; the 50,257-token head makes each step ~2-6 s here)
    raw["stages"]["sft"].update(max_steps=6, save_steps=6)
    raw["stages"]["reward"].update(max_steps=3, save_steps=3, logging_steps=1)
    raw["stages"]["dpo"].update(max_steps=3, save_steps=3, logging_steps=1)
    (workdir / "hh.yaml").write_text(yaml.safe_dump(raw))
    proc = run_align("run", "hh.yaml", "tracking.wandb=disabled", cwd=workdir)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = workdir / "runs" / "hh_rlhf_tiny" / "main"
    for stage in ("sft", "reward", "dpo"):
        assert json.loads((run / stage / "manifest.json").read_text())["status"] == "completed", stage
    assert "no pad token: using '<|endoftext|>' as pad (EOS" in (run / "sft" / "stage.log").read_text()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(run / "dpo" / "model")
    assert len(tok) == 50257 and tok.pad_token == "<|endoftext|>"
    model = AutoModelForCausalLM.from_pretrained(run / "dpo" / "model")
    assert model.config.vocab_size == 50257
    metrics = [json.loads(line) for line in (run / "reward" / "metrics.jsonl").read_text().splitlines()]
    held_out = [m for m in metrics if "eval/rewards/accuracy" in m]  # scored through the saved model/
    assert held_out and held_out[-1]["eval/pairs"] > 0 and 0 <= held_out[-1]["eval/rewards/accuracy"] <= 1


def test_nan_loss_stops_the_stage_and_keeps_the_last_good_checkpoint(workdir):
    """ALIGN_INJECT_NAN_AT_STEP=12 turns the loss reported at step 12 into NaN (the same path a real NaN takes):
    the stage must stop with the step number, mark itself failed, and keep the checkpoints written before."""
    from conftest import TINY

    proc = run_align("run", "pipelines/default.yaml", "--run-id", "nan", "--only", "sft", "tracking.wandb=disabled",
                     *TINY, "sft.max_steps=60", "sft.logging_steps=2", "sft.save_steps=4", cwd=workdir,
                     env={"ALIGN_INJECT_NAN_AT_STEP": "12"})
    assert proc.returncode == 2
    stage = workdir / "runs" / "default" / "nan" / "sft"
    manifest = json.loads((stage / "manifest.json").read_text())
    assert manifest["status"] == "failed"
    assert "NonFiniteLossError" in manifest["error"] and "at step" in manifest["error"]
    assert not (stage / "model").exists()
    assert "loss is nan at step 12" in manifest["error"]
    ckpts = sorted(int(p.name.split("-")[1]) for p in (stage / "checkpoints").glob("checkpoint-*"))
    assert ckpts == [4, 8]  # the last save before the bad step, nothing at or after it; save_total_limit 2 kept
    import torch
    from safetensors.torch import load_file

    weights = load_file(str(stage / "checkpoints" / f"checkpoint-{max(ckpts)}" / "model.safetensors"))
    assert all(torch.isfinite(w).all() for w in weights.values())

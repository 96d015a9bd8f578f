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


def test_a_nan_the_model_itself_computes_stops_the_trainer_before_it_saves(tmp_path):
    """transformers replaces a non-finite step loss with its running average (0.0 right after a log), so the stop on a
    NaN loss never fired on a real one: the NaN gradients trained on, later steps' losses read 0.0, and checkpoints
    of NaN weights replaced the good ones. (The test above injects the NaN after that filter.) align's own trainer
    arguments log the loss as it is: a batch that makes the loss NaN stops the stage at its step, before a save.
    The shuffle is the trainer's, seeded by the stage's seed (printed)."""
    import types

    import torch
    from torch import nn
    from transformers import Trainer, TrainingArguments

    from align.config.sft import SFTStage
    from align.runtime.context import NonFiniteLossError
    from align.runtime.trl import metrics_callback, trainer_kwargs

    seed = 3
    print("seed", seed)
    ctx = types.SimpleNamespace(name="sft", checkpoints=str(tmp_path / "ck"), seed=seed, log=lambda m, step: None,
                                progress=lambda *a, **k: None, note=lambda **k: None,
                                compute=types.SimpleNamespace(device=torch.device("cpu"), mixed_precision="no"))
    kwargs = trainer_kwargs(SFTStage(max_steps=10, logging_steps=1, save_steps=5, learning_rate=1e-3), ctx)
    args = TrainingArguments(**{k: v for k, v in kwargs.items() if k in TrainingArguments.__dataclass_fields__})

    class Poisoned(nn.Module):  # the fourth batch makes the loss NaN
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(4))

        def forward(self, x, poison):
            y = (self.w * x).sum(-1)
            return {"loss": (torch.where(poison.bool(), y * float("nan"), y) ** 2).mean()}

    rows = [{"x": torch.ones(4), "poison": torch.tensor(int(i == 3))} for i in range(10)]
    with pytest.raises(NonFiniteLossError, match=r"loss is nan at step \d+") as err:
        Trainer(model=Poisoned(), args=args, train_dataset=rows, callbacks=[metrics_callback(ctx)]).train()
    step = int(str(err.value).split("at step ")[1].split(";")[0])  # where the shuffled data put the poisoned row
    saved = [int(p.name.split("-")[1]) for p in (tmp_path / "ck").glob("checkpoint-*")]
    assert all(s < step for s in saved), (step, saved)  # nothing saved at or after it

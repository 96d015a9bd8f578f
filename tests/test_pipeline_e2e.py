"""The default pipeline end to end, at smoke size, through the CLI as a user runs it.

One module-scoped run serves several tests (each stage: parameters changed, loss fell; offline W&B; no
secrets on disk); then re-runs check skipping by fingerprint and downstream-only reruns.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO, TINY, run_align

pytestmark = pytest.mark.slow

FAKE_WANDB_KEY = "0123456789abcdef0123456789abcdef01234567"
FAKE_HF_TOKEN = "hf_DoNotLeakThisTokenAnywhere12345"
STAGES = ["sft", "preferences", "reward", "dpo", "evaluate"]


@pytest.fixture(scope="module")
def e2e(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    for name in ("pipelines", "data_cards"):
        (root / name).symlink_to(REPO / name)
    args = ["run", "pipelines/default.yaml", "--run-id", "e2e", "tracking.wandb=offline", *TINY]
    t0 = time.time()
    proc = run_align(*args, cwd=root, env={"WANDB_API_KEY": FAKE_WANDB_KEY, "HF_TOKEN": FAKE_HF_TOKEN})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {"root": root, "run": root / "runs" / "default" / "e2e", "args": args, "first": proc,
            "seconds": time.time() - t0}


def _manifest(run: Path, stage: str) -> dict:
    return json.loads((run / stage / "manifest.json").read_text())


def _metrics(run: Path, stage: str) -> list[dict]:
    return [json.loads(x) for x in (run / stage / "metrics.jsonl").read_text().splitlines()]


def _state(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def test_every_stage_completed_with_outputs(e2e):
    run = e2e["run"]
    for stage in STAGES:
        m = _manifest(run, stage)
        assert m["status"] == "completed" and m["fingerprint"]
        for out in m["outputs"]:
            assert (run / stage / out).exists()
    assert "[align] stage 1/5 sft (sft): running" in e2e["first"].stdout
    report = json.loads((run / "report" / "metrics.json").read_text())
    for key in ("eval/sft/vader/mean", "eval/dpo/vader/mean", "eval/dpo/kl", "eval/dpo/vader/win_rate",
                "eval/dpo/reward_model/win_rate", "eval/reward_model/accuracy"):
        assert key in report


def test_sft_learned_from_a_fresh_model(e2e):
    from transformers import AutoTokenizer

    from align.config import BuiltinModel
    from align.models import build_builtin

    run = e2e["run"]
    losses = [r["train/loss"] for r in _metrics(run, "sft") if "train/loss" in r]
    assert len(losses) >= 3 and losses[-1] < losses[0] - 0.5
    tok = AutoTokenizer.from_pretrained(run / "sft" / "model")
    size = BuiltinModel(vocab_size=512, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                        max_position_embeddings=96)
    initial = build_builtin(size, tok, seed=17).state_dict()
    trained = _state(run / "sft" / "model")
    changed = [k for k, v in trained.items() if not torch.equal(v, initial[k])]
    assert len(changed) == len(trained), "every parameter should have moved"


@pytest.mark.parametrize("stage", ["reward", "dpo"])
def test_stage_changed_parameters_of_its_sft_start(e2e, stage):
    run = e2e["run"]
    sft, after = _state(run / "sft" / "model"), _state(run / stage / "model")
    shared = [k for k in after if k in sft and after[k].shape == sft[k].shape]
    assert shared
    assert all(not torch.equal(after[k], sft[k]) for k in shared if "layers" in k)
    rows = _metrics(run, stage)
    assert any("train/loss" in r for r in rows)


def test_preference_pairs_are_ordered_by_the_judge(e2e):
    data = e2e["run"] / "preferences" / "data"
    pairs = [json.loads(x) for x in (data / "train.jsonl").read_text().splitlines()]
    assert pairs
    assert all(p["score_chosen"] - p["score_rejected"] >= 0.05 for p in pairs)
    m = _manifest(e2e["run"], "preferences")["final_metrics"]
    assert m["preferences/pairs_train"] + m["preferences/pairs_test"] + m["preferences/ties_dropped"] == 96


def test_offline_wandb_run_per_stage(e2e):
    for stage in STAGES:
        runs = list((e2e["run"] / stage / "wandb").glob("offline-run-*"))
        assert len(runs) == 1, stage
        assert any(f.suffix == ".wandb" and f.stat().st_size > 0 for f in runs[0].iterdir())
        assert _manifest(e2e["run"], stage)["wandb"]["mode"] == "offline"


def test_no_secret_written_anywhere(e2e):
    leaked = []
    for path in e2e["root"].joinpath("runs").rglob("*"):
        if path.is_file():
            blob = path.read_bytes()
            if FAKE_WANDB_KEY.encode() in blob or FAKE_HF_TOKEN.encode() in blob:
                leaked.append(str(path))
    assert leaked == []


def test_rerun_skips_everything_then_beta_reruns_only_downstream(e2e):
    run = e2e["run"]
    before = {s: _manifest(run, s)["attempts"] for s in STAGES}
    t0 = time.time()
    again = run_align(*e2e["args"], cwd=e2e["root"])
    assert again.returncode == 0, again.stderr[-2000:]
    assert time.time() - t0 < 60
    assert again.stdout.count("skipped") == 5 and "running" not in again.stdout
    assert {s: _manifest(run, s)["attempts"] for s in STAGES} == before

    changed = run_align(*e2e["args"], "dpo.beta=0.3", cwd=e2e["root"])
    assert changed.returncode == 0, changed.stderr[-2000:]
    ran = {s for s in STAGES if f"{s} ({s}): running" in changed.stdout}
    assert ran == {"dpo", "evaluate"}
    assert _manifest(run, "dpo")["config"]["beta"] == 0.3


@pytest.mark.parametrize("override, message", [
    ("sft.data=../data_cards/missing.yaml", "neither a stage nor a data card"),
    ("dpo.policy=sfft", "did you mean 'sft'"),
    ("sft.model=dpo", "dependency cycle"),
    ("dpo.bta=0.1", "did you mean 'beta'"),
    ("preferences.samples_per_prompt=1", "samples_per_prompt must be >= 2"),
])
def test_bad_input_fails_fast_and_keeps_completed_stages(e2e, override, message):
    run = e2e["run"]
    snapshot = {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()}
    t0 = time.time()
    proc = run_align(*e2e["args"], override, cwd=e2e["root"])
    assert proc.returncode == 2
    assert message in proc.stderr
    assert time.time() - t0 < 15
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()} == snapshot

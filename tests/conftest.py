"""Shared fixtures. Tests never touch the network: W&B runs offline, the hub is disabled."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Two pytest workers share 2 cores: one thread per process (tests and the stage processes they start), or
# OpenMP threads spin against each other and every process slows down many times over.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.pop("WANDB_API_KEY", None)  # offline mode, whatever the developer's shell holds

# The smallest sizes that still exercise every stage of pipelines/default.yaml (used by e2e and stage tests).
TINY = [
    "builtin.vocab_size=512", "builtin.hidden_size=32", "builtin.num_layers=2", "builtin.num_heads=2",
    "builtin.intermediate_size=64", "builtin.max_position_embeddings=96",
    "sft.max_steps=30", "sft.per_device_batch_size=16", "sft.logging_steps=5", "sft.save_steps=10",
    "sft.learning_rate=3e-3", "sft.max_truncated_fraction=0.1", "sft.max_train_examples=2000", "sft.eval_max_examples=64",
    "preferences.max_prompts=128", "preferences.samples_per_prompt=4", "preferences.min_margin=0.05",
    "preferences.generation.max_new_tokens=12",
    "reward.max_length=96", "dpo.max_length=96",  # the tiny model has 96 positions
    "reward.max_steps=8", "reward.logging_steps=2", "reward.save_steps=4", "reward.per_device_batch_size=8",
    "dpo.max_steps=8", "dpo.logging_steps=2", "dpo.save_steps=4", "dpo.per_device_batch_size=8",
    "ppo.iterations=4", "ppo.rollout_batch_size=16", "ppo.mini_batch_size=8", "ppo.save_every=2",
    "ppo.generation.max_new_tokens=12", "ppo.max_prompt_length=48",
    "evaluate.max_prompts=24", "evaluate.generation.max_new_tokens=12", "evaluate.bootstrap_samples=200",
]


# Test files by how long they keep a worker busy on the CI machine (seconds of one worker, measured 2026-11-25),
# longest first. xdist hands out whole files (`--dist loadfile`); by default it would order them by their number of
# tests, which put these few-test, long files last, where one worker ran them while the other sat idle.
LONGEST_FIRST = ["test_cluster_pipelines.py", "test_distributed.py", "test_vllm_ppo.py", "test_smollm2.py", "test_vllm_engine.py", "test_families_a.py", "test_families_b.py",
                 "test_pipeline_e2e.py", "test_crash.py", "test_pairwise.py", "test_benchmarks.py", "test_hostile.py",
                 "test_hh_pipeline.py", "test_grpo_rloo.py", "test_estimate.py", "test_integrity.py",
                 "test_sweeps.py", "test_orchestrator.py", "test_kto.py", "test_zero3_init.py",
                 "test_deepspeed_settings.py"]


@pytest.hookimpl(trylast=True)  # after pytest-randomly's shuffle, which it keeps within files and among the rest
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable


def align_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "align.cli", *args]


def run_align(*args: str, cwd: Path, timeout: int = 900, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the align CLI as a user would; output is captured for assertions."""
    return subprocess.run(align_cmd(*args), cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A scratch project root with the repo's pipelines/ and data_cards/ linked in (runs/ goes here)."""
    for name in ("pipelines", "data_cards"):
        (tmp_path / name).symlink_to(REPO / name)
    return tmp_path


def complete_checkpoints(ckpts: Path) -> list[int]:
    """Steps/iterations of complete checkpoints: Trainer's (trainer_state.json is written last) and PPO's
    (COMPLETE marker after the rename)."""
    out = []
    for p in ckpts.glob("checkpoint-*"):
        try:
            json.loads((p / "trainer_state.json").read_text())
            out.append(int(p.name.split("-")[1]))
        except (OSError, ValueError):
            pass
    out += [int(p.name.split("-")[1]) for p in ckpts.glob("iter-*") if (p / "COMPLETE").is_file()]
    return sorted(out)

"""Every trained stage under `accelerate launch` with 2 CPU processes and DeepSpeed ZeRO-2 and ZeRO-3 (gloo), each
with gradient accumulation 2, chained: sft (ZeRO-2) -> preferences -> reward (ZeRO-2) -> ppo (ZeRO-2 and ZeRO-3,
with and without LoRA) and dpo (ZeRO-2); sft, reward, dpo and evaluate under ZeRO-3 are in
tests/test_cluster_pipelines.py. Each downstream stage loads the consolidated checkpoint its upstream stage saved under ZeRO.
The 2-process ZeRO-2 SFT losses are compared with a 1-process run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import REPO, TINY, run_align

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

# Every trained stage with gradient accumulation 2 (the shipped DeepSpeed configs leave it to the stage).
ARGS = ["run", "pipelines/default.yaml", "--run-id", "zero", "tracking.wandb=disabled", *TINY,
        "sft.accelerate=zero2", "sft.num_processes=2", "sft.per_device_batch_size=4", "sft.gradient_accumulation_steps=2",
        "reward.accelerate=zero2", "reward.num_processes=2", "reward.per_device_batch_size=4",
        "reward.gradient_accumulation_steps=2", "ppo.rollout_batch_size=8", "ppo.mini_batch_size=4",
        "ppo.gradient_accumulation_steps=2", "ppo.accelerate=zero2", "ppo.num_processes=2",  # (each PPO test: its own)
        "dpo.gradient_accumulation_steps=2",
        "preferences.test_fraction=0.3"]  # held-out pairs for both reward processes to score


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    root = tmp_path_factory.mktemp("zero")
    for name in ("pipelines", "data_cards"):
        (root / name).symlink_to(REPO / name)
    for stage in ("sft", "preferences", "reward"):
        proc = run_align(*ARGS, "--only", stage, cwd=root)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return root, root / "runs" / "default" / "zero"


def _manifest(stage_dir: Path) -> dict:
    return json.loads((stage_dir / "manifest.json").read_text())


def _loads(model_dir: Path, kind: str) -> None:
    from align.modeling.models import load_causal_lm, load_scalar_model

    # consolidated weights (or a LoRA stage's adapter, merged into its base by align's loader), not ZeRO shards
    model = load_causal_lm(str(model_dir)) if kind == "lm" else load_scalar_model(str(model_dir), None)
    assert sum(p.numel() for p in model.parameters()) > 0
    assert not list(model_dir.glob("*zero*")) and not list(model_dir.glob("global_step*"))


def test_sft_zero2_and_reward_zero2_chain(chain):
    _, run = chain
    sft = _manifest(run / "sft")
    assert sft["status"] == "completed" and sft["global_step"] == 30
    assert (sft["world_size"], sft["distributed_type"], sft["zero_stage"]) == (2, "DEEPSPEED", 2)
    assert (_manifest(run / "reward")["world_size"], _manifest(run / "reward")["zero_stage"]) == (2, 2)
    # metrics written once (main process only)
    loss_steps = [json.loads(x)["step"] for x in (run / "sft" / "metrics.jsonl").read_text().splitlines()
                  if "train/loss" in x]
    assert loss_steps and len(loss_steps) == len(set(loss_steps))
    _loads(run / "sft" / "model", "lm")
    assert _manifest(run / "reward")["status"] == "completed"
    _loads(run / "reward" / "model", "cls")


def test_reward_held_out_accuracy_over_two_processes_is_every_pair_scored(chain):
    """The reward stage's held-out accuracy over 2 processes (each loads the saved model/ and scores a share of the
    pairs): it equals scoring every held-out pair in one process here (same model, same rule): pair count, accuracy
    and margin."""
    from align.judges.pointwise import RewardModelJudge, pairwise_accuracy

    _, run = chain
    final = _manifest(run / "reward")["final_metrics"]
    test = [json.loads(x) for x in (run / "preferences" / "data" / "test.jsonl").read_text().splitlines()]
    alone = pairwise_accuracy(RewardModelJudge.load("reward", str(run / "reward" / "model")), test)
    assert final["eval/pairs"] == len(test) > 1
    assert final["eval/rewards/accuracy"] == pytest.approx(alone["accuracy"], abs=1e-9)
    assert final["eval/rewards/margin"] == pytest.approx(alone["margin"], rel=1e-4, abs=1e-6)


def _losses(stage_dir: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (stage_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


def test_sft_zero2_two_processes_matches_one_process(chain):
    """Same seed, data and global batch (1 process x 16 vs 2 processes x 4 x accumulation 2, under ZeRO-2): the same
    samples form each optimiser step, and transformers averages the loss over all tokens of the step across
    processes and micro-batches, so the losses agree up to float reduction order. Tolerance: 1e-4 relative at every
    logged step."""
    root, run = chain
    single = run_align("run", "pipelines/default.yaml", "--run-id", "single", "--only", "sft",
                       "tracking.wandb=disabled", *TINY, cwd=root)
    assert single.returncode == 0, single.stdout[-3000:] + single.stderr[-3000:]
    one = _losses(root / "runs" / "default" / "single" / "sft")
    two = _losses(run / "sft")
    assert sorted(one) == sorted(two) == [5, 10, 15, 20, 25, 30]
    for step in one:
        assert two[step] == pytest.approx(one[step], rel=1e-4), (step, one[step], two[step])
    assert one[30] < one[5]  # and it trained


@pytest.mark.parametrize("zero", ["zero2"])  # ZeRO-3: the cluster pipelines' DPO (tests/test_cluster_pipelines.py)
def test_dpo_two_processes(chain, zero):
    root, run = chain
    proc = run_align(*ARGS, "--only", "dpo", "--force", f"dpo.accelerate={zero}", "dpo.num_processes=2",
                     "dpo.per_device_batch_size=2", cwd=root)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    m = _manifest(run / "dpo")
    assert m["status"] == "completed" and m["world_size"] == 2 and m["global_step"] == 8
    assert m["zero_stage"] == int(zero[-1])
    assert sorted(_losses(run / "dpo")) == [2, 4, 6, 8]
    _loads(run / "dpo" / "model", "lm")


@pytest.mark.parametrize("zero,lora", [("zero2", False), ("zero3", False), ("zero2", True), ("zero3", True),
                                       ("zero3", "shared")])
def test_ppo_two_processes(chain, zero, lora):
    """With LoRA too: adapters over sharded (ZeRO-3) or whole bases, the reference served by the policy's base;
    `shared`: LoRA with a value head on the policy's trunk (value_init: shared) instead of a value model.

    ZeRO-3 without LoRA also survives ranks that finish generating at different steps: rank 0's responses all
    end at their first token, rank 1's all run to the length limit (fault injection in align.stages.ppo). With
    DeepSpeed's ZeRO-3 hooks left on during generate(), rank 1's later decoding steps would wait forever for
    rank 0; the stage must complete (the subprocess has a timeout)."""
    root, run = chain
    extra = ["ppo.lora.enabled=true", "ppo.lora.target_modules=[q_proj,v_proj]"] if lora else []
    extra += ["ppo.value_init=shared"] if lora == "shared" else []
    uneven = zero == "zero3" and not lora
    env = {"ALIGN_TEST_EOS_FIRST_RANKS": "0", "ALIGN_TEST_EOS_NEVER_RANKS": "1"} if uneven else None
    proc = run_align(*ARGS, "--only", "ppo", "--force", f"ppo.accelerate={zero}", *extra, cwd=root, timeout=400,
                     env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    m = _manifest(run / "ppo")
    assert m["status"] == "completed" and m["final_metrics"]["ppo/iterations_run"] == 4
    assert m["world_size"] == 2 and m["zero_stage"] == int(zero[-1])
    h = json.loads((run / "sft" / "model" / "config.json").read_text())["hidden_size"]  # policy and value: one width
    stage3 = {"prefetch_bucket_size": int(0.9 * h * h), "param_persistence_threshold": 10 * h} if zero == "zero3" else {}
    assert m["deepspeed_buffers"] == {"reduce_bucket_size": h * h, **stage3}, (h, m["deepspeed_buffers"])
    rows = [json.loads(x) for x in (run / "ppo" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # written once, by the main process
    for r in rows:  # the update ran on both ranks' samples: the first ratio is 1, gradients clipped per model
        assert abs(r["policy/ratio_first"] - 1.0) < 1e-5 and r["policy/approx_kl_first"] < 1e-8
        assert r["policy/grad_norm"] > 0 and r["value/grad_norm"] > 0
        if uneven:  # half the global batch ended at once (1 token), half ran to 12 tokens without EOS
            assert r["rollout/eos_fraction"] == 0.5
            assert r["rollout/response_length"] == pytest.approx((1 + 12) / 2)
    assert m["reward_normalization"]["samples"] == 256  # 128 initial-policy rollouts on each process
    _loads(run / "ppo" / "model", "lm")

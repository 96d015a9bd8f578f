"""The grpo and rloo stage types (TRL's GRPOTrainer / RLOOTrainer) on a tiny SFT model.

One module-scoped SFT run feeds every stage. The judge is `letter_judge:count_e` (tests/judges/): the number of
letters `e` in a response, which a nearly untrained policy learns to raise within a dozen steps. RLOO runs on
one process; then each of GRPO and RLOO runs under ZeRO-2 with 2 processes, is SIGKILLed after its first
checkpoint and resumed to the end. Each run must change every parameter of the policy and raise the mean score of
its last three logged steps above that of its first three (seeded: the pipeline seed is printed).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from conftest import REPO, align_cmd, complete_checkpoints, run_align

SEED = 17
JUDGES = REPO / "tests" / "judges"
ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [str(JUDGES), os.environ.get("PYTHONPATH")]))}
ONLINE = {"policy": "sft", "reward": "letter_judge:count_e", "prompts": "data_cards/movie_review_snippets.yaml",
          "num_generations": 4, "per_device_batch_size": 16, "max_steps": 12, "learning_rate": 1.0e-2,
          "logging_steps": 1, "save_steps": 4, "max_length": 64, "generation": {"max_new_tokens": 12}}
PIPELINE = {
    "name": "online", "base_model": "builtin:tiny-llama", "seed": SEED,
    "builtin": {"vocab_size": 512, "hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64,
                "max_position_embeddings": 96},
    "stages": {
        "sft": {"data": "data_cards/movie_review_snippets.yaml", "learning_rate": 3.0e-3, "max_steps": 20,
                "per_device_batch_size": 16, "max_length": 96, "max_truncated_fraction": 0.1,
                "max_train_examples": 1000, "logging_steps": 5, "save_steps": 10, "eval_split": None},
        "rloo": {**ONLINE, "type": "rloo", "learning_rate": 2.0e-2},  # (1e-2 until the splits became per-prompt
        # hashes, 2026-11-29: on the new SFT model 12 steps at 1e-2 or 5e-3 ended below where they began)
        # 20 steps, so the kill after the first checkpoint (step 4) lands well before the end
        # under ZeRO-2 with gradient accumulation 2 (4 x 2 processes x 2 = 16 completions per step, as above)
        **{f"{kind}_zero2": {**ONLINE, "type": kind, "accelerate": "zero2", "num_processes": 2,
                             "per_device_batch_size": 4, "gradient_accumulation_steps": 2, "max_steps": 20}
           for kind in ("grpo", "rloo")},
        "grpo_flat": {**ONLINE, "type": "grpo", "reward": "letter_judge:constant", "max_steps": 2, "save_steps": 2},
        # 4 prompts a round: 2 steps an epoch, 3 epochs; twins: one runs whole, one is stopped and resumed
        **{f"grpo_epochs_{twin}": {**ONLINE, "type": "grpo", "reward": "letter_judge:logged_count_e",
                                   "max_train_examples": 8, "max_steps": 6, "save_steps": 1}
           for twin in ("whole", "stopped")},
        "grpo_reuse": {**ONLINE, "type": "grpo", "num_iterations": 2, "max_steps": 3, "save_steps": 2},
        "grpo_seven_tenths": {**ONLINE, "type": "grpo", "reward": "letter_judge:seven_tenths", "num_generations": 8,
                              "max_steps": 2, "save_steps": 2},
        "grpo_batch": {**ONLINE, "type": "grpo", "reward": "letter_judge:prompt_length", "scale_rewards": "batch",
                       "max_steps": 2, "save_steps": 2},
    },
}
ARGS = ["--run-id", "t", "tracking.wandb=disabled"]


@pytest.fixture(scope="module")
def upstream(tmp_path_factory):
    root = tmp_path_factory.mktemp("online")
    (root / "data_cards").symlink_to(REPO / "data_cards")
    (root / "online.yaml").write_text(yaml.safe_dump(PIPELINE))
    print(f"pipeline seed {SEED}")
    proc = run_align("run", "online.yaml", *ARGS, "--only", "sft", cwd=root, env=ENV)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return root, root / "runs" / "online" / "t"


def _manifest(stage_dir: Path) -> dict:
    return json.loads((stage_dir / "manifest.json").read_text())


def _rows(stage_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (stage_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]


def _check_trained(run: Path, stage: str, steps: int) -> dict:
    """Completed with `steps` steps, every policy tensor moved from the SFT model, the score rose."""
    from safetensors.torch import load_file

    m = _manifest(run / stage)
    assert m["status"] == "completed" and m["global_step"] == steps
    before, after = load_file(run / "sft" / "model" / "model.safetensors"), load_file(
        run / stage / "model" / "model.safetensors")
    assert before.keys() <= after.keys()  # a ZeRO-2 save also writes the tied lm_head.weight
    assert [k for k in before if before[k].equal(after[k])] == []  # every parameter changed
    scored = [r for r in _rows(run / stage) if "objective/scores" in r]
    assert [r["step"] for r in scored] == list(range(1, steps + 1))  # each step logged once, under align's names
    scores = [r["objective/scores"] for r in scored]
    first, last = sum(scores[:3]) / 3, sum(scores[-3:]) / 3
    print(f"{stage}: mean count of 'e' first 3 steps {first:.3f}, last 3 steps {last:.3f} (seed {SEED})")
    assert last > first + 0.5, scores
    assert scored[-1]["objective/kl_per_token"] > 0 and "objective/kl" not in scored[-1]  # measured against the reference
    assert "objective/scores/letter_judge:count_e" in scored[-1]  # TRL's per-judge score, under align's name
    assert m["final_metrics"]["objective/scores_last"] == scores[-1]
    return m


def test_rloo_raises_the_reward_and_changes_every_parameter(upstream):
    root, run = upstream
    proc = run_align("run", "online.yaml", *ARGS, "--only", "rloo", cwd=root, env=ENV)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    m = _check_trained(run, "rloo", 12)
    assert m["world_size"] == 1 and m["length_check"]["dropped"] == 0


def test_a_judge_that_scores_every_completion_alike_fails_the_stage_instead_of_publishing_the_start(upstream):
    """A constant judge (or a pass/fail one failing everything): every advantage 0, so no step moved the policy, yet
    GRPO "completed" with loss 0 and grad norm 0 and published the SFT weights as the trained policy."""
    root, run = upstream
    proc = run_align("run", "online.yaml", *ARGS, "--only", "grpo_flat", cwd=root, env=ENV)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert ("in all 2 logged steps every group of 4 completions got one score from letter_judge:constant "
            "(train/frac_reward_zero_std 1.0)") in out, out[-3000:]
    assert _manifest(run / "grpo_flat")["status"] == "failed" and not (run / "grpo_flat" / "model").exists()


@pytest.mark.parametrize("stage", ["grpo_batch", "grpo_seven_tenths"])
def test_groups_scored_alike_fail_the_stage_whatever_trls_zero_std_fraction_says(upstream, stage):
    """Probes of GRPO (2026-11-30): TRL's frac_reward_zero_std read 0.0 where every group's completions scored alike,
    and the stage published the SFT weights as trained: under scale_rewards: batch (the batch's spread: a judge
    scoring each prompt's completions alike, prompts apart), and for a constant 0.7 over groups of 8 (float32's mean
    leaves a std of ~6e-8, above isclose's atol, and advantages of ~6e-4: rounding noise trained). align reads
    each round's scores itself (train/frac_rounds_scored_apart)."""
    root, run = upstream
    proc = run_align("run", "online.yaml", *ARGS, "--only", stage, cwd=root, env=ENV)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "in every sampling round of all 2 logged steps every group of" in out, out[-3000:]
    assert _manifest(run / stage)["status"] == "failed" and not (run / stage / "model").exists()
    logged = [r for r in _rows(run / stage) if "train/loss" in r]
    assert {r["train/frac_reward_zero_std"] for r in logged} == {0.0}  # TRL's own figure: no help
    assert {r["train/frac_rounds_scored_apart"] for r in logged} == {0.0}


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_under_zero2_resumes_after_sigkill_and_raises_the_reward(upstream, kind):
    """Two processes under ZeRO-2, killed (SIGKILL, the whole process group) as soon as the first checkpoint is
    complete; the next `align run` resumes from exactly that checkpoint and finishes, each step logged once."""
    root, run = upstream
    stage = f"{kind}_zero2"
    stage_dir = run / stage
    t0 = time.time()
    proc = subprocess.Popen(align_cmd("run", "online.yaml", *ARGS, "--only", stage), cwd=root,
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, **ENV})
    try:
        while not complete_checkpoints(stage_dir / "checkpoints"):
            assert proc.poll() is None, f"{stage} exited before its first checkpoint"
            assert time.time() - t0 < 180, "no checkpoint within 180 s"
            time.sleep(0.02)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    # the killed attempt never looks completed (its stage processes, orphaned by the kill, may record their stop)
    assert _manifest(stage_dir)["status"] in ("running", "interrupted")
    assert not (stage_dir / "model").exists()
    at_kill = complete_checkpoints(stage_dir / "checkpoints")[-1]
    again = run_align("run", "online.yaml", *ARGS, "--only", stage, cwd=root, env=ENV)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    m = _check_trained(run, stage, 20)
    assert m["resumed_from_step"] == at_kill and m["attempts"] == 2
    assert (m["world_size"], m["distributed_type"], m["zero_stage"]) == (2, "DEEPSPEED", 2)


def test_the_one_reward_model_rule_on_trl_completions_and_on_rollouts(upstream):
    """The one rule (align/judges/pointwise.py): a reward model's head at the last real token of prompt ids +
    completion ids. Handed to TRL (GRPO, RLOO) as prompt texts and completion ids in batches of unequal lengths,
    and on the same sequences as a rollout (left-padded prompts, right-padded responses, EOS kept when sampled),
    it gives each sequence's score alone, unpadded, by the model's own forward."""
    import torch

    from align.modeling.generation import Rollout, scalar_outputs, tokenize_prompts
    from align.modeling.models import load_scalar_model, load_tokenizer
    from align.judges.pointwise import RewardModelJudge, build_judge

    _, run = upstream
    tok = load_tokenizer(str(run / "sft" / "model"))
    torch.manual_seed(SEED)  # the fresh scalar head
    rm = load_scalar_model(str(run / "sft" / "model"), tok.pad_token_id).eval()
    prompts = ["The film was", "A long and winding story about nothing at", "Oh"]
    completions = [tok("great fun")["input_ids"][-2:] + [tok.eos_token_id],  # ended by EOS
                   tok(" and then some more words")["input_ids"][-5:], [tok.eos_token_id]]
    q_ids, q_mask = tokenize_prompts(tok, prompts)
    width = max(map(len, completions))
    r_ids = torch.tensor([c + [tok.pad_token_id] * (width - len(c)) for c in completions])
    r_mask = torch.tensor([[1] * len(c) + [0] * (width - len(c)) for c in completions])
    rollout = Rollout(q_ids, q_mask, r_ids, r_mask, torch.tensor([True, False, True]))
    with torch.no_grad():
        alone = [rm(input_ids=torch.tensor([tok(p)["input_ids"] + c])).logits[0, 0].item()
                 for p, c in zip(prompts, completions)]
    judge = build_judge("reward", lambda n: RewardModelJudge(n, lambda i, m: scalar_outputs(rm, i, m), tok,
                                                             batch_size=2))
    (trl_fn,), weights = judge.trl_reward_functions()
    got = trl_fn(prompts=prompts, completions=["unused"] * 3, completion_ids=completions)
    assert weights == [1.0] and trl_fn.__name__ == "reward"  # TRL logs rewards/reward/mean
    assert got == pytest.approx(alone, abs=1e-5), (got, alone)
    assert judge.score_rollout(rollout, prompts, tok).tolist() == pytest.approx(alone, abs=1e-5)
    assert len(set(round(g, 4) for g in got)) == 3  # three different sequences, three different scores


def test_grpo_losses_still_exist_upstream():
    import dataclasses

    from trl import GRPOConfig

    from align.config.grpo import GRPO_LOSSES

    help_text = next(f for f in dataclasses.fields(GRPOConfig) if f.name == "loss_type").metadata["help"]
    assert all(f"'{loss}'" in help_text for loss in GRPO_LOSSES)


def test_grpo_on_an_engine_turns_on_trls_importance_sampling_correction_and_trl_still_reads_it():
    """GRPO through rollout_func: TRL weighs the loss by the trainer-over-engine importance ratio only under its
    `use_vllm` flag; align sets it (and a no-op for TRL's sync) where the correction is on, nothing where it is off.
    TRL 1.16's scoring reads exactly those names: if an upgrade renames them, this fails rather than the correction
    silently stopping."""
    import inspect
    from types import SimpleNamespace

    from trl import GRPOTrainer

    from align.stages.online_engine import correct_for_the_engine

    args = SimpleNamespace(vllm_importance_sampling_correction=True, vllm_importance_sampling_mode="sequence_mask",
                           vllm_importance_sampling_clip_min=None, vllm_importance_sampling_clip_max=3.0)
    whole = SimpleNamespace(top_k=None, top_p=1.0)
    trainer = SimpleNamespace(args=args, use_vllm=False)
    assert correct_for_the_engine(trainer, whole) == "sequence_mask (ratio bounds None, 3.0)"
    assert trainer.use_vllm and trainer._last_loaded_step == -1 and trainer.vllm_generation.sync_weights() is None
    off = SimpleNamespace(args=SimpleNamespace(vllm_importance_sampling_correction=False), use_vllm=False)
    assert correct_for_the_engine(off, whole) is None and off.use_vllm is False
    for truncated in (SimpleNamespace(top_k=50, top_p=1.0), SimpleNamespace(top_k=None, top_p=0.9)):
        # the engine's log-probs are of the truncated distribution: its ratios would all be below 1
        trainer = SimpleNamespace(args=args, use_vllm=False)
        assert correct_for_the_engine(trainer, truncated).startswith("off: top_k") and trainer.use_vllm is False
    scoring = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    assert "self.use_vllm and self.vllm_importance_sampling_correction" in scoring
    generate = inspect.getsource(GRPOTrainer._generate)  # where rollout_func is called
    assert "self.vllm_generation.sync_weights()" in generate and "self._last_loaded_step" in generate
    assert "self.use_vllm and self.vllm_importance_sampling_correction" in inspect.getsource(GRPOTrainer._compute_loss)


def _default_with(stage: dict, **evaluate) -> tuple:
    from align.config import parse_pipeline

    raw = yaml.safe_load((REPO / "pipelines" / "default.yaml").read_text())
    raw["stages"]["online"] = {"policy": "sft", "reward": "reward", "generation": {"max_new_tokens": 32},
                               "prompts": "../data_cards/movie_review_snippets.yaml", **stage}
    raw["stages"]["evaluate"].update(evaluate)
    return parse_pipeline(raw, "pipelines/default.yaml"), REPO / "pipelines" / "default.yaml"


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_validate_refuses_checkpoints_inside_a_generation_round(kind):
    """TRL counts generation rounds from 0 when it resumes: a checkpoint inside a round (steps_per_generation x
    num_iterations micro-steps spanning several optimiser steps) would regenerate and retrain that round's prompts.
    Refused with the multiple that works; on the shipped defaults every checkpoint falls between rounds."""
    from align.core.errors import PipelineError
    from align.orchestrator.validate import validate

    round_of = {"type": kind, "steps_per_generation": 4, "num_iterations": 2, "gradient_accumulation_steps": 2,
                "per_device_batch_size": 8, "num_generations": 4, "logging_steps": 1}
    cfg, source = _default_with({**round_of, "save_steps": 6})  # 12 micro-steps, rounds of 8
    with pytest.raises(PipelineError, match=r"stages\.online: save_steps \(6\) would put checkpoints inside a "
                                            r"generation round .* set save_steps to a multiple of 4"):
        validate(cfg, source, verbose=False)
    cfg, source = _default_with({**round_of, "save_steps": 8})  # 16 micro-steps: two whole rounds
    validate(cfg, source, verbose=False)
    # rounds of 3 micro-steps, windows of 2: an epoch of 3 rounds (9 micro-steps) ends with a window of one, and a
    # resume from step 6 sampled round 4 again and trained round 6 on one micro-batch of three (2026-12-01 probe)
    cfg, source = _default_with({**round_of, "steps_per_generation": 3, "num_iterations": 1, "save_steps": 3})
    with pytest.raises(PipelineError, match=r"stages\.online: steps_per_generation x num_iterations \(3 micro-steps a "
                                            r"round\) and gradient_accumulation_steps \(2\) divide neither"):
        validate(cfg, source, verbose=False)
    cfg, source = _default_with({**round_of, "steps_per_generation": 1, "num_iterations": 1, "save_steps": 3})
    validate(cfg, source, verbose=False)  # a window of two whole rounds: every step ends between rounds


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_validate_accepts_them_as_policies_and_checks_batches_and_lengths(kind):
    from align.core.errors import PipelineError
    from align.orchestrator.validate import validate

    cfg, source = _default_with({"type": kind}, policies=["sft", "ppo", "dpo", "online"])
    validate(cfg, source, verbose=False)  # evaluated beside PPO and DPO, scored by the reward stage
    cfg, source = _default_with({"type": kind, "per_device_batch_size": 6, "num_generations": 4})
    with pytest.raises(PipelineError, match=r"stages\.online: per_device_batch_size x processes x "
                                            r"gradient_accumulation_steps \(6 x 1 x 1 = 6 .*num_generations \(4\)"):
        validate(cfg, source, verbose=False)
    cfg, source = _default_with({"type": kind, "per_device_batch_size": 6, "num_generations": 4,
                                 "accelerate": "zero2", "num_processes": 2})
    validate(cfg, source, verbose=False)  # 6 x 2 = 12 completions: three whole groups of 4
    cfg, source = _default_with({"type": kind, "per_device_batch_size": 8, "num_generations": 4,
                                 "max_train_examples": 3, "accelerate": "zero2", "num_processes": 2})
    with pytest.raises(PipelineError, match=r"stages\.online: max_train_examples: 3 prompts, but one generation round "
                                            r"takes 4 .*raise max_train_examples to at least 4"):
        validate(cfg, source, verbose=False)  # it failed only as the stage started, the stages before it trained
    cfg, source = _default_with({"type": kind, "generation": {"max_new_tokens": 24}}, policies=["sft", "online"])
    with pytest.raises(PipelineError, match=r"response lengths differ: stages\.online\.generation\.max_new_tokens=24, "
                                            r"stages\.preferences\.generation\.max_new_tokens=32, "
                                            r"stages\.evaluate\.generation\.max_new_tokens=32"):
        validate(cfg, source, verbose=False)


def test_an_engine_that_returns_no_logprobs_of_its_own_is_refused_by_name():
    """TRL's rollout_func requires the engine's log-probs of its samples (and align checks them against the policy):
    an engine with its own copy that returns none stops the stage with an EngineError naming the engine and the fix,
    not a TypeError from slicing None."""
    from types import SimpleNamespace

    import torch

    from align.config.grpo import GRPOStage
    from align.engines import EngineError
    from align.modeling.generation import Rollout
    from align.stages.online_engine import EngineRollouts

    seed = 5
    print("seed", seed)
    g = torch.Generator().manual_seed(seed)

    class NoLogprobs:
        name, holds_own_weights, log_path = "nolp", True, None

        def sync_weights(self, model):
            return 0.0

        def generate_ids(self, q_ids, q_mask, gen, seed, greedy=False):
            resp = torch.randint(3, 60, (q_ids.size(0), 4), generator=g)
            return Rollout(q_ids, q_mask, resp, torch.ones_like(resp), torch.zeros(q_ids.size(0), dtype=torch.bool))

    ctx = SimpleNamespace(name="grpo", seed=seed, state=SimpleNamespace(process_index=0), note_engine=lambda *a, **k: None)
    cfg = GRPOStage(type="grpo", policy="sft", prompts="p.yaml")
    trainer = SimpleNamespace(accelerator=SimpleNamespace(unwrap_model=lambda m: m), model=torch.nn.Linear(2, 2),
                              state=SimpleNamespace(global_step=0))
    rollouts = EngineRollouts(ctx, cfg, NoLogprobs(), tokenizer=None)
    q = torch.randint(3, 60, (2, 5), generator=g)
    with pytest.raises(EngineError, match="'nolp' returned no log-probs.*generation.engine: hf"):
        rollouts.sample(q, torch.ones_like(q), trainer)


def test_grpo_from_an_sft_adapter_keeps_the_sft_policy_as_its_reference(tmp_path):
    """SFT with LoRA publishes its adapter alone (a loadable base: a tiny Llama saved here); GRPO (beta > 0, no LoRA
    of its own) loads it merged. It trained with no gradient at all (the merged model kept peft's frozen weights),
    and TRL builds the reference from the policy's config name, which was the base's: the KL pulled towards the
    model before SFT. Now the reference is the merged SFT policy, so the first step's KL (policy and reference still
    equal) is ~0 instead of SFT's distance from its base."""
    from families import build

    base, tok = build("llama", tmp_path / "llama")
    pipeline = {"name": "adapter_ref", "base_model": str(base), "tokenizer": str(tok), "seed": SEED,
                "tracking": {"wandb": "disabled"},
                "stages": {
                    "sft": {"data": f"{REPO}/data_cards/movie_review_snippets.yaml", "learning_rate": 2.0e-2,
                            "max_steps": 3, "per_device_batch_size": 4, "max_length": 128, "logging_steps": 1,
                            "max_train_examples": 64, "max_truncated_fraction": 1.0,
                            "save_steps": 3, "eval_split": None, "lora": {"enabled": True, "r": 8, "alpha": 16,
                                                                         "target_modules": ["q_proj", "v_proj"]}},
                    "grpo": {"type": "grpo", "policy": "sft", "reward": "length",  # vader: 0 on every sample
                             "prompts": f"{REPO}/data_cards/movie_review_snippets.yaml", "num_generations": 2,
                             "per_device_batch_size": 2, "max_steps": 1, "warmup_ratio": 0.0,  # one step: no warmup
                             "learning_rate": 1.0e-6, "beta": 0.05,
                             "logging_steps": 1, "save_steps": 100, "max_length": 128, "max_train_examples": 8,
                             "generation": {"max_new_tokens": 6}}}}
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(pipeline))
    print(f"pipeline seed {SEED}")
    proc = run_align("run", "p.yaml", cwd=tmp_path, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = tmp_path / "runs" / "adapter_ref" / "main"
    assert _manifest(run / "sft")["lora_published"] == "adapter"
    grpo = _manifest(run / "grpo")
    assert "an adapter merged into its base" in grpo["reference"] and not (run / "grpo" / "reference").exists()
    kl = [r["objective/kl_per_token"] for r in _rows(run / "grpo") if "objective/kl_per_token" in r]
    print("GRPO KL per logged step:", kl)
    assert len(kl) == 1 and abs(kl[0]) < 1e-4, kl


def test_a_run_resumed_mid_epoch_samples_the_prompts_of_one_never_stopped(upstream, tmp_path):
    """A probe of GRPO (2026-11-30): TRL's RepeatSampler draws each epoch's order from one generator seeded once, so
    a run resumed after its first epoch replayed epoch 0's order (some prompts trained twice in an epoch, others
    never). 8 prompts, 4 a round, 2 rounds an epoch: a run stopped at step 4 (a NaN injected) resumes from step 3's
    checkpoint (mid epoch 1) and samples steps 4-6 (epoch 1's end, epoch 2) as the run never stopped does."""
    root, run = upstream
    logs = {k: tmp_path / f"{k}.jsonl" for k in ("whole", "first", "resumed")}
    for stage, log, fault in (("whole", "whole", {}), ("stopped", "first", {"ALIGN_INJECT_NAN_AT_STEP": "4"}),
                              ("stopped", "resumed", {})):
        proc = run_align("run", "online.yaml", *ARGS, "--only", f"grpo_epochs_{stage}", cwd=root,
                         env={**ENV, "LETTER_JUDGE_LOG": str(logs[log]), **fault})
        assert (proc.returncode != 0) == bool(fault), proc.stdout[-3000:] + proc.stderr[-3000:]
    assert _manifest(run / "grpo_epochs_stopped")["attempts"] == 2
    rounds = {k: [json.loads(x) for x in p.read_text().splitlines()] for k, p in logs.items()}
    assert len(rounds["whole"]) == 6 and len(rounds["resumed"]) == 3, rounds
    for epoch in range(3):  # every epoch holds each of the 8 prompts once
        assert len({q for r in rounds["whole"][2 * epoch:2 * epoch + 2] for q in r}) == 8, rounds["whole"]
    assert rounds["first"][:3] == rounds["whole"][:3]
    assert rounds["resumed"] == rounds["whole"][3:], (rounds["resumed"], rounds["whole"])


def test_engine_rounds_are_seeded_by_their_step_so_a_resumed_run_samples_as_one_never_stopped():
    """A probe of GRPO/RLOO on vLLM (2026-11-30): the engine's per-round seed counted rounds from 0 at every attempt,
    so a resumed run replayed the first attempt's seeds. It is now the step's, the round's count at that step and
    the process's."""
    from types import SimpleNamespace

    from align.stages.online_engine import EngineRollouts

    def rollouts(rank):
        ctx = SimpleNamespace(seed=SEED, state=SimpleNamespace(process_index=rank))
        return EngineRollouts(ctx, None, None, None)

    steps = [0, 0, 1, 2, 2, 3, 4]  # the optimiser step at each round (two rounds at steps 0 and 2)
    never_stopped, resumed, other = rollouts(0), rollouts(0), rollouts(1)
    whole = [never_stopped.next_seed(s) for s in steps]
    assert [resumed.next_seed(s) for s in steps[3:]] == whole[3:]  # resumed at step 2's checkpoint
    assert len(set(whole)) == len(whole)
    assert not {other.next_seed(s) for s in steps} & set(whole)  # distinct per process


def test_tokens_trained_count_every_pass_over_a_round(upstream):
    """A probe of GRPO (2026-11-30): with num_iterations 2 each round's samples train twice, but TRL counts a round's
    tokens once, as it samples them: perf/train_tokens and perf/tokens_per_s read half the work. Counted per
    micro-batch now: 3 steps are round 1 twice and round 2 once (the run stops mid-round)."""
    root, run = upstream
    proc = run_align("run", "online.yaml", *ARGS, "--only", "grpo_reuse", cwd=root, env=ENV)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    sampled = {r["step"]: r["train/num_tokens"] for r in _rows(run / "grpo_reuse") if "train/num_tokens" in r}
    first, both = sampled[1], sampled[3]  # TRL's cumulative count of what it sampled: round 1, then rounds 1 and 2
    assert 2 not in sampled and first < both, sampled  # step 2 samples nothing: round 1's second pass
    final = _manifest(run / "grpo_reuse")["final_metrics"]
    assert final["perf/train_tokens"] == 2 * first + (both - first)


def test_a_resumed_run_starts_its_engine_with_another_seed():
    """A review (2026-11-30): vLLM takes no seed per request, only as it starts, and every attempt started it with
    the same one: a resumed GRPO, RLOO or PPO run sampled with its first attempt's random stream again. The start seed
    now also names the step (or iteration) the run resumes at."""
    from types import SimpleNamespace

    from align.config import Generation
    from align.engines import start_seed
    from align.stages import online_engine

    seeds = []

    def make_engine(gen, **kw):
        seeds.append(kw["seed"])
        return SimpleNamespace(close=lambda: None)

    for ckpt in (None, "/run/online/checkpoints/checkpoint-8"):
        ctx = SimpleNamespace(seed=SEED, state=SimpleNamespace(process_index=1, device="cpu"), dir=Path("/tmp"),
                              last_checkpoint=lambda c=ckpt: c, compute=SimpleNamespace(engine_dtype=lambda: "float32"),
                              note_engine=lambda engine: None)
        cfg = SimpleNamespace(generation=Generation(engine="vllm"), max_length=64, lora=SimpleNamespace(enabled=False))
        import align.engines as engines
        original, engines.make_engine = engines.make_engine, make_engine
        try:
            online_engine.open_engine(ctx, cfg, tokenizer=None, path="/model")
        finally:
            engines.make_engine = original
    assert seeds == [start_seed(SEED, 1, 0), start_seed(SEED, 1, 8)] and seeds[0] != seeds[1]
    assert start_seed(SEED, 0, 0) != start_seed(SEED, 1, 0) and start_seed(2 ** 31 - 1, 7, 10 ** 6) < 2 ** 31


def test_max_train_examples_counts_prompts_after_the_long_ones_are_dropped(monkeypatch):
    """It sliced the split's first prompts and then dropped those too long: 8 long ones first, a limit of 8, and the
    stage failed as it started with "0 usable prompts" (not naming the limit) though the split held plenty. Now the
    limit is taken after the drops, as every other stage takes it."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from align.config.grpo import GRPOStage
    from align.config.settings import Generation
    from align.stages import online_rl

    tok = AutoTokenizer.from_pretrained(REPO / "tokenizers" / "gpt2")
    prompts = [f"a long prompt number {i} " * 6 for i in range(8)] + [f"short {i}" for i in range(20)]
    monkeypatch.setattr(online_rl, "load_prompts", lambda *a, **k: list(prompts))
    ctx = SimpleNamespace(name="online", is_main=False, extra_manifest={}, state=SimpleNamespace(num_processes=1))
    cfg = GRPOStage(max_length=20, generation=Generation(max_new_tokens=12), max_train_examples=8,
                    max_truncated_fraction=0.5, per_device_batch_size=4, num_generations=4)
    kept = online_rl.training_prompts(ctx, cfg, tok)
    assert kept == prompts[8:16]
    assert ctx.extra_manifest["length_check"]["dropped"] == 8  # of the 16 read until the limit was filled
    prompts[:] = prompts[8:] + prompts[:8]  # the long ones after: the limit fills before them, none is dropped
    assert online_rl.training_prompts(ctx, cfg, tok) == prompts[:8]
    assert ctx.extra_manifest["length_check"]["dropped"] == 0


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_trl_builds_the_frozen_reference_in_the_dtype_align_gives_a_frozen_model(kind, tmp_path, monkeypatch, caplog):
    """TRL built GRPO's and RLOO's reference in the policy's dtype: fp32 for a policy trained whole outside DeepSpeed
    (one GPU, or DDP), so the reference took 4 bytes a parameter where `align estimate` counts 2 (~2.5 GB short at
    1.2B). The stage's own arguments (run() up to the model's loading, with a stand-in context whose frozen models
    are bf16 as on a GPU computing in bf16) now carry a frozen model's dtype, TRL builds the reference in it, and its
    warning that these arguments are ignored (they are not) is not shown. No reference (beta 0, or LoRA): none."""
    import logging
    from types import SimpleNamespace

    import torch
    import transformers as t
    from datasets import Dataset
    import trl

    from align.config.grpo import GRPOStage
    from align.config.settings import LoraSettings
    from align.stages import online_rl

    def built_args(cfg):
        seen = {}

        def capture(config_cls, cfg, ctx, drop=(), **extra):
            seen.update(extra)
            raise KeyboardInterrupt  # stop run() here: nothing past the arguments is needed
        monkeypatch.setattr(online_rl, "training_args", capture)
        monkeypatch.setattr(online_rl, "training_prompts", lambda *a: ["hi"])
        monkeypatch.setattr(online_rl, "reward_functions", lambda *a: ([], []))
        ctx = SimpleNamespace(cfg=cfg, input_model=lambda name: "policy", load_tokenizer=lambda path: None,
                              pipeline=SimpleNamespace(trust_remote_code=False),
                              weights_dtype=lambda frozen, lora=False: "bfloat16" if frozen else "float32")
        with pytest.raises(KeyboardInterrupt):
            online_rl.run(ctx, None, None)
        return seen

    reference = built_args(GRPOStage(beta=0.1))["model_init_kwargs"]
    assert reference == {"dtype": "bfloat16"}
    assert "model_init_kwargs" not in built_args(GRPOStage(beta=0.0))
    assert "model_init_kwargs" not in built_args(GRPOStage(beta=0.1, lora=LoraSettings(enabled=True)))

    torch.manual_seed(0)
    print("seed 0")
    cfg = t.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=2)
    t.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "policy")
    policy = t.AutoModelForCausalLM.from_pretrained(tmp_path / "policy", dtype=torch.float32)
    tok = t.AutoTokenizer.from_pretrained(REPO / "tokenizers" / "gpt2")
    tok.pad_token = tok.eos_token
    config_cls, trainer_cls = (trl.GRPOConfig, trl.GRPOTrainer) if kind == "grpo" else (trl.RLOOConfig, trl.RLOOTrainer)
    args = config_cls(output_dir=str(tmp_path / "out"), beta=0.1, per_device_train_batch_size=2, num_generations=2,
                      report_to=[], max_steps=1, use_cpu=True, bf16=False, model_init_kwargs=reference)
    with caplog.at_level(logging.WARNING), online_rl.quiet_init_warning(trainer_cls):
        trainer = trainer_cls(model=policy, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                              args=args, processing_class=tok, train_dataset=Dataset.from_list([{"prompt": "hi"}] * 4))
    assert policy.dtype == torch.float32 and trainer.ref_model.dtype == torch.bfloat16
    assert "will be ignored" not in caplog.text


def test_the_logged_log_prob_gap_is_the_windows_largest_and_the_summary_the_runs():
    """Each round's largest gap was appended to TRL's metric list, which TRL averages over the logging window: one
    round of 5 nats among nine of 0.001 was logged as ~0.5, and the summary had no run-wide figure."""
    from types import SimpleNamespace

    from align.stages.online_engine import GAP, keep_window_max, run_gap_max

    window: list[float] = []
    for gap in [0.001] * 4 + [5.0] + [0.001] * 4:
        keep_window_max(window, gap)
    assert sum(window) / len(window) == 5.0  # TRL's log(): the mean of the list
    rollouts = SimpleNamespace(gap_max=0.2)  # this attempt's rounds, after a resume
    assert run_gap_max(rollouts, [{GAP: 0.1}, {"loss": 1.0}, {GAP: 5.0}]) == 5.0  # a window before the resume
    assert run_gap_max(rollouts, [{GAP: 0.1}]) == 0.2


def test_trls_sampling_ends_at_the_tokenizers_eos_alone_as_every_other_sampler_of_align_does(tmp_path):
    """TRL ends a completion at every end id the policy's generation config declares (Llama-3.1-Instruct: three,
    Qwen2.5: two), where PPO, evaluate, preferences and the vllm engine stop at the tokenizer's EOS alone, and the
    reward models score a reply ending in it: GRPO on the hf engine sampled another distribution than on vllm. The
    trainer is built with the tokenizer's EOS alone; the model's own list is put back (its published config keeps it)."""
    from datasets import Dataset
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel
    from trl import GRPOConfig, GRPOTrainer

    from align.stages.online_rl import one_end_token

    tok = AutoTokenizer.from_pretrained(REPO / "tokenizers" / "gpt2")
    tok.pad_token = tok.eos_token
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=len(tok)))
    model.generation_config.eos_token_id = [tok.eos_token_id, 5, 7]  # an end-of-turn and an end-of-text besides
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=2,
                      max_completion_length=4, use_cpu=True, report_to=[], logging_steps=1)

    def build():
        return GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
                           processing_class=tok, train_dataset=Dataset.from_list([{"prompt": "a"}] * 4))

    assert build().eos_token_ids == [tok.eos_token_id, 5, 7]  # TRL's own rule
    with one_end_token(model, tok):
        trainer = build()
    assert trainer.eos_token_ids == [tok.eos_token_id] and trainer.generation_config.eos_token_id == [tok.eos_token_id]
    assert model.generation_config.eos_token_id == [tok.eos_token_id, 5, 7]


def test_a_schedule_whose_passes_fall_in_one_optimiser_step_is_refused_and_its_clip_is_unread():
    """num_iterations 2 with steps_per_generation x num_iterations dividing gradient_accumulation_steps passed: every
    pass over a round fell inside one optimiser step (TRL then keeps no old log-probs: the ratio is 1), costing twice
    the compute for mu = 1's update. On-policy (mu = 1, a round per optimiser step) the clip's settings are unread: a
    sweep over epsilon trained twins. zero3_gather reached no TRL setting (ds3_gather_for_generation now)."""
    from align.config import ConfigError, load_pipeline
    from align.config.grpo import GRPOStage
    from align.core.errors import PipelineError
    from align.orchestrator.plan import build_plan
    from align.orchestrator.validate import validate

    source = REPO / "pipelines" / "online_rl.yaml"
    cfg = load_pipeline(source, ["grpo.steps_per_generation=2", "grpo.num_iterations=2"])
    with pytest.raises(PipelineError, match=r"stages\.grpo: num_iterations: 2 with steps_per_generation x "
                                            r"num_iterations \(4 micro-steps a round\) dividing gradient_accumulation_"
                                            r"steps \(4\): every pass over a round falls inside one optimiser step"):
        validate(cfg, source, build_plan(cfg, source), verbose=False)
    on_policy = GRPOStage(gradient_accumulation_steps=4, num_iterations=1)
    assert {"epsilon", "epsilon_high"} <= set(on_policy.unread_settings())
    reused = GRPOStage(gradient_accumulation_steps=1, steps_per_generation=8, num_iterations=2)
    assert "epsilon" not in reused.unread_settings()  # two optimiser steps a round: the clip binds
    with pytest.raises(ConfigError, match=r"sweep\.epsilon: variants .* differ only in epsilon, which the stage does "
                                          r"not read \(every round is trained in the optimiser step it was sampled"):
        load_pipeline(source, ["grpo.num_iterations=1", "grpo.steps_per_generation=null",
                               "grpo.sweep={epsilon: [0.1, 0.3]}"])
    layers = GRPOStage()
    layers.generation.zero3_gather = "layers"
    assert GRPOStage().gathers_policy_for_generation() and not layers.gathers_policy_for_generation()


def test_a_judge_of_weight_zero_does_not_make_a_constant_reward_look_trained():
    """`reward: {reward: 0.0, vader: 1.0}` passes validate; when vader scored every group alike and the zero-weight
    reward model did not, the round counted as scored apart and the constant reward went unseen."""
    from align.stages.online_rl import round_apart

    rewards = {"vader": [0.5, 0.5, 0.2, 0.2], "reward": [0.1, 0.9, 0.3, 0.4]}
    assert not round_apart(rewards, {"vader": 1.0, "reward": 0.0}, group=2)
    assert round_apart(rewards, {"vader": 1.0, "reward": 0.5}, group=2)
    assert round_apart({"vader": [0.1, 0.9]}, {}, group=2)  # a name TRL gave that is not in the weights: counted

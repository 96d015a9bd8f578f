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
os.environ["NETRC"] = os.devnull  # nor a key `wandb login` stored (tracking.wandb: auto reads it)

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


# Test files by how long they keep a worker busy (seconds of one worker, measured 2026-11-26/27 on the 2-core AMD EPYC),
# longest first. xdist hands out whole files (`--dist loadfile`); by default it would order them by their number of
# tests, which put these few-test, long files last, where one worker ran them while the other sat idle.
LONGEST_FIRST = ["test_smollm2.py", "test_cluster_pipelines.py", "test_distributed.py", "test_vllm_ppo.py",
                 "test_shared_engine.py",
                 "test_vllm_online_rl.py", "test_vllm_engine.py", "test_multinode.py", "test_faults.py",
                 "test_benchmarks.py", "test_crash.py", "test_pipeline_e2e.py", "test_grpo_rloo.py",
                 "test_pairwise.py", "test_families_a.py", "test_hostile.py", "test_gguf.py", "test_estimate.py",
                 "test_families_b.py", "test_hh_pipeline.py", "test_integrity.py", "test_sweeps.py", "test_kto.py",
                 "test_chat.py", "test_orchestrator.py", "test_config.py", "test_deepspeed_settings.py",
                 "test_lengths.py", "test_zero3_init.py"]


# The long tier (marker `long`): end-to-end runs that repeat what the default tier covers at a larger size or more
# times over. `./launch.sh --tests` (what CI runs) leaves them out to stay under CI's 20 minutes on 2 cores;
# `./launch.sh --tests --full` runs everything (about 40 min of 2 workers on the 2-core AMD EPYC, 2026-11-26).
# A file name: all of its tests; a file name -> test names: those tests only.
LONG: dict[str, set[str] | None] = {
    "test_smollm2.py": None,            # SmolLM2-135M through every stage (a real model; ~550 s of one worker)
    "test_cluster_pipelines.py": None,  # both 8B shape-alike chains, every stage under 2-process ZeRO-3 (~480 s)
    "test_vllm_ppo.py": None,           # vLLM PPO killed and resumed: 1 and 2 processes, LoRA adapters alone (~880 s)
    "test_vllm_online_rl.py": None,     # GRPO and RLOO sampling through vLLM on SmolLM2 (~160 s)
    "test_shared_engine.py": {"test_zero3_ppo_with_both_processes_on_one_vllm_engine",  # (~200 s, ~14 GB: beside
                              # another worker's test it was OOM-killed once)
                              "test_grpo_under_zero2_with_both_processes_on_one_vllm_engine"},  # (~80 s alone, 217 s
    # beside the other worker in CI on 2026-11-29, which put CI at 21.5 min; the default tier keeps the shared engine's
    # protocol on stand-ins and one real vLLM engine synced and checked, test_vllm_engine)
    "test_benchmarks.py": None,         # every benchmark in its tiny mode (~630 s of one worker, ZeRO-3 sync included)
    "test_crash.py": None,              # SIGKILL loops through sft, reward, dpo, ppo (~215 s)
    "test_families_a.py": None, "test_families_b.py": None,  # every model family through a chain (~195 s)
    "test_hh_pipeline.py": None,        # the HH recipe on the GPT-2 tokenizer (~80 s)
    "test_distributed.py": None,        # sft -> reward, dpo and PPO chains under 2-process ZeRO-2/3 (~520 s); the
    # default tier keeps ZeRO-2 with accumulation (test_deepspeed_settings), partitioned loading (test_zero3_init),
    # ZeRO-2 clipping (test_ppo_update), GRPO/RLOO and KTO under ZeRO-2
    "test_estimate.py": {"test_align_estimate_shows_the_lora_and_qlora_saving_for_ppo_on_pythia_1b",
                         # (~25 s; CI at 3c0caef took 20.1 min on 2026-12-01's machine, so these four followed: the
                         # preflight's arithmetic stays in the default tier, as do ctrl-c's sibling SIGTERM, LoRA
                         # merged on every stage (test_lora_stages) and the hostile run's other reruns)
                         "test_run_refuses_a_stage_that_does_not_fit_unless_told_to_ignore"},
    "test_faults.py": {"test_ctrl_c_records_the_stage_as_interrupted_and_a_killed_stage_says_why"},  # (~30 s)
    "test_ppo_update.py": {"test_clipping_under_deepspeed_bf16_matches_one_process_without_gathering_a_gradient"},
    # (~50 s: the fp32 probe under ZeRO-1, 2 and 3 stays in the default tier)
    "test_hostile.py": {"test_deleting_an_upstream_model_reruns_it_and_every_dependant"},  # (~27 s)
    "test_vllm_engine.py": {"test_zero3_gathered_sync",  # 2-process ZeRO-3 syncs, merged and adapter (~175 s)
                            "test_lora_adapter_sync",  # a second engine, with vLLM's LoRA support (~45 s)
                            # engines of their own or memory accounting (~60, 60, 43, 25 s in CI on 2026-12-01, whose
                            # clean run took 22.5 min, and 20.6 min with these out, so the bucketed and bad syncs
                            # (~38, 86 s) followed; the default tier keeps the full and LoRA syncs on one engine)
                            "test_every_transport_in_turn_and_a_bucket_smaller_than_a_tensor",
                            "test_a_bad_sync_is_an_error_and_a_silent_engine_a_timeout",
                            "test_a_sync_leaves_no_cached_prefix_of_the_old_weights",
                            "test_an_engine_without_kept_weights_reloads_and_still_samples_the_policy",
                            "test_a_warm_in_place_sync_faults_no_fresh_memory_in",
                            "test_an_engine_that_packs_again_each_sync_keeps_the_memory_it_frees"},
    "test_pipeline_e2e.py": {"test_ppo_killed_mid_run_resumes_iteration_beta_and_statistics",  # (~70 s; the
    # default tier keeps SFT killed by SIGTERM and resumed, test_faults)
                             "test_a_third_engine_from_outside_align_samples_for_ppo_and_evaluate"},  # (~28 s)
    "test_lora.py": {"test_sft_lora_trains_the_rows_of_the_tokens_its_chat_template_adds",  # (2 x ~34 s)
                     "test_sft_lora_merges_into_a_plain_model"},  # (~38 s under ZeRO-3 on 2 processes, ~22 s on one)
    "test_pairwise.py": {"test_killed_mid_judging_the_rerun_asks_only_what_was_not_answered",  # (~50 s)
                         "test_evaluate_over_two_processes_asks_each_question_once"},  # (~32 s; 2026-12-01 CI time)
    "test_run_inputs.py": {"test_a_vision_language_model_is_checked_by_its_decoders_config"},  # (~22 s; likewise)
    "test_grpo_rloo.py": {"test_under_zero2_resumes_after_sigkill_and_raises_the_reward",  # (~120-260 s)
                          "test_a_run_resumed_mid_epoch_samples_the_prompts_of_one_never_stopped"},  # (~34 s)
    "test_gguf.py": {"test_align_model_converts_the_gguf_file_in_an_empty_cache",  # (CI's setup converts anyway)
                     "test_gguf_loads_as_the_converted_weights_and_saves"},  # (~34 s)
    "test_remote_code.py": {"test_a_trusted_remote_code_model_runs_through_every_stage_that_loads_it"},  # (~40 s of
    # one worker; CI at 92d7258 took 20.1 min; the default tier keeps the remote-code refusals at validate)
    "test_pretrained_stage.py": {"test_the_packaged_gguf_base_is_published_dequantised_with_its_stock_template"},
    "test_multinode.py": {"test_two_nodes_rendezvous_on_localhost_and_finish_a_stage"},  # (~145 s of one worker in
    # CI on 2026-11-26; the default tier keeps the unreachable master's timeout and launch.sh's SLURM arithmetic)
}


@pytest.hookimpl(trylast=True)  # after pytest-randomly's shuffle, which it keeps within files and among the rest
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable


def pytest_itemcollected(item: pytest.Item) -> None:
    """Mark the long tier as each test is collected (before `-m` deselects)."""
    names = LONG.get(item.path.name, ())
    if names is None or getattr(item, "originalname", item.name) in (names or ()):
        item.add_marker(pytest.mark.long)


def align_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "align.cli", *args]


def run_align(*args: str, cwd: Path, timeout: int = 900, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the align CLI as a user would; output is captured for assertions."""
    return subprocess.run(align_cmd(*args), cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def validate(capsys, *args: str) -> tuple[int, str]:
    """`align validate` in-process; returns (exit code, stdout + stderr)."""
    from align.cli import main as cli

    rc = cli(["validate", *args])
    cap = capsys.readouterr()
    return rc, cap.out + cap.err


def refused(out: str, rc: int, *needles: str) -> None:
    """A refusal as align gives one: exit code 2, no traceback, each of `needles` in what it said."""
    assert rc == 2, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    for n in needles:
        assert n in out, f"{n!r} not in:\n{out[-3000:]}"


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

"""The shipped 8B cluster pipelines, run as they are on this CPU: the pipeline files themselves, with `base_model`
pointed at a tiny random model of the same family (tests/shapealike.py: grouped-query attention, untied head, the
family's rope settings, tokenizer conventions and stock chat template) and the hub datasets read from local copies
in the hub's exact layout and schemas (ALIGN_HUB_MIRROR). Every stage runs under 2-process DeepSpeed ZeRO-3, the
trained ones with gradient accumulation 2; the sizes (steps, iterations, prompts) are command-line overrides.

A user's run and this one differ in `base_model` (and the hub being reachable): the cards, templates, data forms
(UltraFeedback's implicit-prompt conversations, HH as chat messages), DeepSpeed settings and stage code are the same.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import REPO, run_align

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SEED = 17
PIPELINES = {"llama3_8b_ultrafeedback": "llama3.1", "qwen25_7b_hh": "qwen2.5"}
TRAINED = ("sft", "reward", "ppo", "dpo")


def overrides(model: Path) -> list[str]:
    """The shipped file's sizes shrunk to seconds; every stage on 2 processes under ZeRO-3, accumulation 2."""
    out = [f"base_model={model}", "base_model_config=null", "tracking.wandb=disabled", f"seed={SEED}"]
    for stage in (*TRAINED, "evaluate"):
        out += [f"{stage}.accelerate=zero3", f"{stage}.num_processes=2"]
    for stage in TRAINED:
        out += [f"{stage}.gradient_accumulation_steps=2"]
    out += ["sft.max_steps=2", "sft.per_device_batch_size=2", "sft.logging_steps=1", "sft.save_steps=2",
            "sft.eval_max_examples=8",
            "reward.max_steps=2", "reward.per_device_batch_size=2", "reward.logging_steps=1", "reward.save_steps=2",
            "dpo.max_steps=2", "dpo.per_device_batch_size=1", "dpo.logging_steps=1", "dpo.save_steps=2",
            "dpo.learning_rate=1.0e-3",  # so the policies differ and the evaluation compares something
            "ppo.iterations=2", "ppo.rollout_batch_size=4", "ppo.mini_batch_size=1", "ppo.save_every=1",
            "ppo.sample_every=1", "ppo.reward_normalization_samples=8", "ppo.learning_rate=1.0e-3",
            "ppo.generation.max_new_tokens=8", "ppo.generation.batch_size=4", "ppo.kl.heldout_prompts=4",
            "evaluate.max_prompts=8", "evaluate.generation.max_new_tokens=8", "evaluate.generation.batch_size=2",
            "evaluate.bootstrap_samples=200"]
    return out


@pytest.fixture(scope="module", params=sorted(PIPELINES))
def cluster_run(request, tmp_path_factory):
    import shapealike

    name = request.param
    root = tmp_path_factory.mktemp(name)
    for link in ("pipelines", "data_cards"):
        (root / link).symlink_to(REPO / link)
    model = shapealike.build(PIPELINES[name], root / "model")
    env = {"ALIGN_HUB_MIRROR": str(shapealike.hub_mirror(root / "hub")), "HF_DATASETS_CACHE": str(root / "ds-cache")}
    print(f"seed {SEED}; {name} on a tiny {PIPELINES[name]} ({model})")
    args = overrides(model)
    proc = run_align("run", f"pipelines/{name}.yaml", *args, cwd=root, env=env, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return name, root, root / "runs" / name / "main", args, env


def _manifest(stage_dir: Path) -> dict:
    return json.loads((stage_dir / "manifest.json").read_text())


def test_every_stage_ran_under_two_process_zero3_with_accumulation_two(cluster_run):
    name, _, run, _, _ = cluster_run
    for stage in (*TRAINED, "evaluate"):
        m = _manifest(run / stage)
        assert m["status"] == "completed", (stage, m.get("error"))
        assert (m["world_size"], m["zero_stage"]) == (2, 3), stage
        # evaluate trains nothing: launched under the ZeRO-3 config, it never initialises DeepSpeed
        assert m["distributed_type"] == ("MULTI_CPU" if stage == "evaluate" else "DEEPSPEED"), stage
    for stage in ("sft", "reward", "dpo"):
        m = _manifest(run / stage)
        assert m["config"]["gradient_accumulation_steps"] == 2 and m["global_step"] == 2
        rows = [json.loads(line) for line in (run / stage / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows if "train/loss" in r] == [1, 2]  # two optimiser steps of 2 micro-batches
    h = json.loads((run / "sft" / "model" / "config.json").read_text())["hidden_size"]  # the family's width
    for stage in TRAINED:  # DeepSpeed's buffers as each trained engine took them
        assert _manifest(run / stage)["deepspeed_buffers"] == {
            "reduce_bucket_size": h * h, "prefetch_bucket_size": int(0.9 * h * h),
            "param_persistence_threshold": 10 * h}, stage
    ppo = _manifest(run / "ppo")
    assert ppo["final_metrics"]["ppo/iterations_run"] == 2 and ppo["config"]["gradient_accumulation_steps"] == 2


def test_trained_models_load_partitioned_under_zero3(cluster_run):
    """Models loaded after the stage's DeepSpeed config: each rank holds its share (deepspeed.zero.Init), never a
    whole copy; the evaluation (nothing trains) and the reward stage's held-out scoring load whole."""
    _, _, run, _, _ = cluster_run
    for stage in ("sft", "dpo", "ppo"):
        loads = _manifest(run / stage)["models_loaded"]
        assert loads and all(x["zero3_partitioned"] for x in loads), (stage, loads)
    reward = _manifest(run / "reward")["models_loaded"]
    assert reward[0]["zero3_partitioned"] and not reward[-1]["zero3_partitioned"]  # trained, then scored whole
    assert not any(x["zero3_partitioned"] for x in _manifest(run / "evaluate")["models_loaded"])


def test_published_models_are_the_family_with_its_template(cluster_run):
    from transformers import AutoConfig, AutoTokenizer

    name, _, run, _, _ = cluster_run
    for stage in ("sft", "ppo", "dpo"):
        cfg = AutoConfig.from_pretrained(run / stage / "model")
        assert cfg.num_key_value_heads == 2 and cfg.num_attention_heads == 4 and not cfg.tie_word_embeddings
        tok = AutoTokenizer.from_pretrained(run / stage / "model")
        marker = "Cutting Knowledge Date" if name.startswith("llama") else "You are Qwen"
        assert marker in tok.chat_template  # the stock template, kept (chat_template: null)
    rope = AutoConfig.from_pretrained(run / "sft" / "model").rope_scaling
    assert (rope["rope_type"], rope["rope_theta"]) == (("llama3", 500000.0) if name.startswith("llama")
                                                       else ("default", 1000000.0))


def test_the_implicit_prompt_conversations_and_chat_messages_were_trained_on(cluster_run):
    name, _, run, _, _ = cluster_run
    check = _manifest(run / "dpo")["length_check"]
    assert check["examples"] == 160 and check["fraction"] <= 0.05  # the mirror's train split, as published
    assert _manifest(run / "sft")["loss_on"] == "assistant turns"
    prompts = _manifest(run / "ppo")["length_check"]
    assert prompts["examples"] >= 150 and prompts["dropped"] <= 0.05 * prompts["examples"]  # distinct prompts


def test_evaluation_over_two_processes_equals_one_process(cluster_run):
    """The prompts are split over the ranks and the results gathered: the same report as one process at the same
    seed (win rates, CIs, KL, every sample)."""
    import shutil

    name, root, run, args, env = cluster_run

    two = json.loads((run / "report" / "metrics.json").read_text())
    samples_two = (run / "report" / "samples.jsonl").read_text()
    shutil.copytree(run, run.parent / "one")  # the same trained stages, in a run of its own (the fixture's stays)
    one_args = [a for a in args if not a.startswith("evaluate.num_processes") and not a.startswith("evaluate.accelerate")]
    proc = run_align("run", f"pipelines/{name}.yaml", *one_args, "evaluate.accelerate=cpu", "--only", "evaluate",
                     "--run-id", "one", cwd=root, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    single = run.parent / "one"
    assert _manifest(single / "evaluate")["world_size"] == 1
    one = json.loads((single / "report" / "metrics.json").read_text())
    drop = ("perf/", "eval/engine")
    keep = lambda m: {k: v for k, v in m.items() if not k.startswith(drop)}  # noqa: E731
    assert keep(one) == keep(two)
    assert (single / "report" / "samples.jsonl").read_text() == samples_two
    assert two["eval/prompts"] == 8 and 0.0 <= two["eval/dpo/reward_model/win_rate"] <= 1.0
    assert two["eval/dpo/kl"] != 0.0  # the policies differ, so the comparison compares something

"""The figures the GPU benchmark reports (benchmarks/gpu.py, align/runtime/trl.py's step timer), as pure functions:
a training stage's MFU is taken over its optimiser steps, not over the checkpoint it writes at the end or the first
step's kernel compilation; a scalar model's embedding is not counted as FLOPs; a GPU's peak is its own card's."""

from __future__ import annotations

import time
from importlib import util
from types import SimpleNamespace

from conftest import REPO


def _gpu():
    spec = util.spec_from_file_location("gpu_bench", REPO / "benchmarks" / "gpu.py")
    module = util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_step_timer_leaves_out_what_happens_between_steps():
    """transformers saves, evaluates and logs after on_step_end: a 1B checkpoint (~13 GB) written in a 6-second SFT
    made its MFU a third of what the steps ran at. The timer counts on_step_begin to on_step_end only, and the
    figure leaves out the first step (Liger's Triton compilation, autotuning)."""
    from align.runtime.trl import metrics_callback, step_metrics

    callback = metrics_callback(SimpleNamespace(name="sft"))
    state = SimpleNamespace(is_world_process_zero=False, global_step=0, max_steps=3)
    for work, between in ((0.15, 0.0), (0.05, 0.3), (0.05, 0.3)):  # a slow first step, then a "save" after each
        callback.on_step_begin(None, state, None)
        time.sleep(work)
        callback.on_step_end(None, state, None)
        time.sleep(between)
    assert len(callback.step_seconds) == 3 and all(s < 0.25 for s in callback.step_seconds), callback.step_seconds
    figures = step_metrics(callback.step_seconds)
    assert 0.05 <= figures["perf/step_seconds"] < 0.12 and figures["perf/first_step_seconds"] >= 0.15
    assert step_metrics([0.2]) == {}  # one step: nothing after the first to take a rate over


def test_training_mfu_is_over_the_steps_when_they_were_timed():
    gpu = _gpu()
    m = {"train/global_step": 10, "perf/train_seconds": 30.0, "perf/step_seconds": 1.5, "perf/train_tokens": 1.2e6}
    r = gpu.training_rates(m, flops_per_token=6e9)
    assert r["step_seconds"] == 1.5 and r["timed"] == "steps after the first"
    assert r["tokens_per_s"] == 1.2e6 / 15 and r["flops_per_s"] == 6e9 * 1.2e6 / 15
    old = gpu.training_rates({k: v for k, v in m.items() if k != "perf/step_seconds"}, 6e9)  # a manifest before it
    assert old["step_seconds"] == 3.0 and old["timed"] == "train runtime" and old["tokens_per_s"] == 1.2e6 / 30
    resumed = gpu.training_rates({"train/global_step": 10, "perf/step_seconds": 1.5}, 6e9)  # no honest token count
    assert resumed["tokens_per_s"] is None and resumed["flops_per_s"] is None


def test_flops_count_the_parameters_a_token_is_multiplied_by():
    gpu = _gpu()
    shape = SimpleNamespace(params=1_235_814_400, vocab=128_256, hidden=2_048)  # Llama-3.2-1B, its head tied
    assert gpu.matmul_params(shape, tied_head=True) == shape.params  # the embedding is the head's matmul
    assert gpu.matmul_params(shape, tied_head=False) == shape.params - 128_256 * 2_048  # a scalar model: a lookup


def test_the_peak_is_the_cards_own():
    gpu = _gpu()
    assert gpu.peak_tflops("NVIDIA H200") == 989.4 and gpu.peak_tflops("NVIDIA H100 80GB HBM3") == 989.4
    assert gpu.peak_tflops("NVIDIA H200 NVL") == 835.5 and gpu.peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert gpu.peak_tflops("NVIDIA GeForce RTX 4090") is None


def test_generation_seconds_are_the_engines_sampling_alone():
    """preferences' and evaluate's perf/generation_seconds (what their tokens/s and benchmarks/gpu.py's sampling MFU
    are over) held loading each policy, its weight sync, the log-prob passes and the judges' scoring. Sampling alone
    now: here an engine that takes 0.05 s a batch and a judge that takes 0.2 s."""
    import torch

    from align.config import Generation
    from align.modeling.generation import sample_texts

    class Rollout:
        def __init__(self, n):
            self.response_mask = torch.ones(n, 3)

        def texts(self, tokenizer):
            return ["ok"] * len(self.response_mask)

    class Engine:
        def generate(self, batch, gen, seed):
            time.sleep(0.05)
            return Rollout(len(batch))

    def tokenizer(prompts, add_special_tokens=True):
        return {"input_ids": [p.split() for p in prompts]}

    def slow_judge(rollout, prompts):
        time.sleep(0.2)
        return torch.zeros(len(prompts))

    counts: dict = {}
    sample_texts(Engine(), tokenizer, ["a b", "c", "d e f", "g"], Generation(batch_size=2), seed=0, counts=counts,
                 score=slow_judge)
    assert counts["generated_tokens"] == 12
    assert 0.1 <= counts["generation_seconds"] < 0.3, counts  # two batches of 0.05 s; the 0.4 s of judging not in it


def test_the_benchmark_runs_sft_and_dpo_before_reward_ppo_and_evaluate(tmp_path):
    """A 1B benchmark stopped at its deadline on a lent GPU (the proof's step (a)) keeps the stages it finished: DPO
    runs third, so SFT's and DPO's figures, the two the MFU goal names, come before the reward model's and PPO's."""
    import shutil

    from align.config import load_pipeline
    from align.orchestrator.plan import build_plan

    gpu = _gpu()
    base = tmp_path / "base"
    shutil.copytree(REPO / "tokenizers" / "gpt2", base)
    pipeline = gpu.pipeline_yaml(tmp_path, base, gpu.PROOF_SIZES, packed=True)
    order = [p.name for p in build_plan(load_pipeline(pipeline, []), pipeline)]
    assert order == ["sft", "preferences", "dpo", "reward", "ppo", "evaluate"], order

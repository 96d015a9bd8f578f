"""GRPO and RLOO sampling through the vLLM engine (`generation.engine: vllm`, align/stages/online_rl.py) on the
packaged SmolLM2-135M-Instruct in fp32 on CPU: GRPO through TRL's rollout_func with LoRA (the adapted layers synced
merged), RLOO through its sampling method with full fine-tuning. Each completes its steps, syncs the engine once per
optimiser step, and every round's engine log-probs equal the trained policy's within 1e-3: the engine sampled from
the weights being trained, not the starting ones.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from conftest import REPO, run_align

SEED = 23
ONLINE = {"policy": "sft", "reward": "vader", "prompts": f"{REPO}/data_cards/movie_review_snippets.yaml",
          "num_generations": 4, "per_device_batch_size": 8, "max_steps": 3, "learning_rate": 1.0e-4, "beta": 0.05,
          "logging_steps": 1, "save_steps": 100, "max_length": 64, "max_train_examples": 64,
          "generation": {"max_new_tokens": 10, "engine": "vllm"}}
PIPELINE = {
    "name": "vllm_online", "base_model": "packaged:smollm2", "seed": SEED, "tracking": {"wandb": "disabled"},
    "stages": {
        "sft": {"data": f"{REPO}/data_cards/movie_review_snippets.yaml", "learning_rate": 5.0e-5, "max_steps": 1, "warmup_ratio": 0.0,
                "per_device_batch_size": 4, "max_length": 48, "logging_steps": 1, "save_steps": 1, "eval_split": None},
        "grpo": {**ONLINE, "type": "grpo", "lora": {"enabled": True, "r": 8, "alpha": 16}},
        "rloo": {**ONLINE, "type": "rloo", "learning_rate": 1.0e-5},
    },
}


def test_grpo_and_rloo_sample_through_the_vllm_engine(tmp_path):
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(PIPELINE))
    print(f"pipeline seed {SEED}")
    proc = run_align("run", "p.yaml", cwd=tmp_path, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = tmp_path / "runs" / "vllm_online" / "main"
    for stage in ("grpo", "rloo"):
        m = json.loads((run / stage / "manifest.json").read_text())
        assert m["status"] == "completed" and m["global_step"] == 3, (stage, m["status"])
        assert m["engine"]["name"] == "vllm" and m["engine"]["weight_sync"] == "shared"
        rows = [json.loads(x) for x in (run / stage / "metrics.jsonl").read_text().splitlines() if x.strip()]
        gaps = [r["rollout/logprob_gap_max"] for r in rows if "rollout/logprob_gap_max" in r]
        print(stage, "log-prob gap per logged step:", gaps)
        assert len(gaps) == 3 and max(gaps) < 1e-3, gaps
        assert m["final_metrics"]["perf/sync_seconds"] > 0
        assert m["final_metrics"]["perf/syncs"] == len(gaps), m["final_metrics"]  # one a round: no round skipped one
        ratios = [r["sampling/importance_sampling_ratio/mean"] for r in rows if "sampling/importance_sampling_ratio/mean"
                  in r]
        if stage == "grpo":  # TRL's correction for the engine's numerics, on (RLOO recomputes its old log-probs)
            assert m["engine_importance_sampling"].startswith("sequence_mask"), m.get("engine_importance_sampling")
            diffs = [r["sampling/sampling_logp_difference/max"] for r in rows if "sampling/sampling_logp_difference/max"
                     in r]
            print("importance ratios", ratios, "largest log-prob differences", diffs)
            assert len(ratios) == 3 and all(abs(x - 1) < 1e-2 for x in ratios) and max(diffs) < 1e-3
        else:
            assert not ratios and "engine_importance_sampling" not in m
        assert not Path(m["engine"]["sync_path"]).exists()  # the bucket went with the engine

"""PPO, GRPO and RLOO on the same policy, reward model, prompts and episode budget, side by side, in one run.

Runs `align run pipelines/online_rl.yaml` (the default task's sft, preferences and reward, then align's PPO and
TRL 1.16's GRPOTrainer and RLOOTrainer as align stages: 5,120 episodes each, 2 passes over each batch, 32 new
tokens, the same reward model; then one evaluation of all of them on 512 held-out prompts) and prints per
algorithm:

  episodes/s  episodes / training time. PPO: the sum of its iterations' times (generation, scoring, update);
              GRPO/RLOO: TRL's train_runtime (generation, scoring and update inside the Trainer).
  tokens/s    response tokens sampled / the same time (GRPO/RLOO: mean completion length x episodes).
  gold        VADER win rate vs SFT [95% CI] and KL to SFT on the held-out prompts (report/metrics.json).

    python benchmarks/online_rl.py [--run-id bench] [align run overrides, e.g. grpo.beta=0.1]
    python benchmarks/online_rl.py --tiny runs_dir=/tmp/b   # the tests' version: tiny model, a few steps

`--tiny` shrinks the model and every stage (TINY below) so that the whole script runs in about a minute;
tests/test_benchmarks.py runs it that way, so the script cannot rot unnoticed. Its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PIPELINE = REPO / "pipelines" / "online_rl.yaml"
ALGORITHMS = ("ppo", "grpo", "rloo")
ONLINE_TINY = ["max_steps=2", "per_device_batch_size=8", "gradient_accumulation_steps=1", "num_generations=4",
               "max_length=64", "save_steps=2", "generation.max_new_tokens=8"]
TINY = ["builtin.vocab_size=512", "builtin.hidden_size=32", "builtin.num_layers=2", "builtin.num_heads=2",
        "builtin.intermediate_size=64", "builtin.max_position_embeddings=96", "tracking.wandb=disabled",
        "sft.max_steps=10", "sft.per_device_batch_size=16", "sft.max_train_examples=500", "sft.logging_steps=5",
        "sft.save_steps=10", "sft.eval_max_examples=32", "sft.max_truncated_fraction=0.1",
        "preferences.max_prompts=32", "preferences.samples_per_prompt=2", "preferences.min_margin=0.0",
        "preferences.generation.max_new_tokens=8", "reward.max_steps=4", "reward.per_device_batch_size=8",
        "reward.max_length=96", "reward.logging_steps=2", "reward.save_steps=4",
        "ppo.iterations=2", "ppo.rollout_batch_size=8", "ppo.mini_batch_size=4", "ppo.save_every=2",
        "ppo.generation.max_new_tokens=8", "ppo.max_prompt_length=48",
        *[f"{kind}.{o}" for kind in ("grpo", "rloo") for o in ONLINE_TINY],
        "evaluate.max_prompts=8", "evaluate.generation.max_new_tokens=8", "evaluate.bootstrap_samples=100"]


def rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def throughput(stage_dir: Path, kind: str, cfg) -> dict[str, float]:
    manifest = json.loads((stage_dir / "manifest.json").read_text())
    final = manifest["final_metrics"]
    metrics = rows(stage_dir / "metrics.jsonl")
    if kind == "ppo":
        its = [r for r in metrics if "perf/episodes_per_s" in r]
        seconds = sum(cfg.rollout_batch_size / r["perf/episodes_per_s"] for r in its)
        tokens = sum(r["perf/tokens_per_s"] * cfg.rollout_batch_size / r["perf/episodes_per_s"] for r in its)
        episodes = cfg.rollout_batch_size * len(its)
    else:
        seconds = final["perf/train_seconds"]
        # TRL samples one round of per_device_batch_size x steps_per_generation completions every
        # steps_per_generation x num_iterations micro-steps: each episode is trained on num_iterations times
        micro_steps = final["train/global_step"] * cfg.gradient_accumulation_steps
        episodes = micro_steps * cfg.per_device_batch_size // cfg.num_iterations
        lengths = [r["rollout/response_length"] for r in metrics if "rollout/response_length" in r]
        tokens = episodes * sum(lengths) / len(lengths)
    return {"episodes": episodes, "seconds": seconds, "episodes_per_s": episodes / seconds,
            "tokens_per_s": tokens / seconds}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run-id", default="bench")
    ap.add_argument("--tiny", action="store_true", help="a tiny model and a few steps per stage (the tests' mode)")
    ap.add_argument("--json", type=Path, help="also write the table's figures here")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    if args.tiny:
        args.overrides = [*TINY, *args.overrides]
    proc = subprocess.run([sys.executable, "-m", "align.cli", "run", str(PIPELINE), "--run-id", args.run_id,
                           *args.overrides], cwd=REPO)
    if proc.returncode:
        return proc.returncode
    from align.config import load_pipeline

    cfg = load_pipeline(PIPELINE, args.overrides)
    run = REPO / cfg.runs_dir / cfg.name / args.run_id
    report = json.loads((run / "report" / "metrics.json").read_text())
    figures = {}
    lines = ["| algorithm | episodes | train s | episodes/s | tokens/s | VADER win rate vs SFT [95% CI] | KL to SFT |",
             "|---|---|---|---|---|---|---|"]
    for kind in ALGORITHMS:
        t = throughput(run / kind, kind, cfg.stages[kind])
        lo, hi = report[f"eval/{kind}/vader/win_rate_ci"]
        figures[kind] = {**t, "vader_win_rate": report[f"eval/{kind}/vader/win_rate"], "kl": report[f"eval/{kind}/kl"]}
        lines.append(f"| {kind} | {t['episodes']:,} | {t['seconds']:.0f} | {t['episodes_per_s']:.1f} | "
                     f"{t['tokens_per_s']:.0f} | {report[f'eval/{kind}/vader/win_rate']:.3f} [{lo:.3f}, {hi:.3f}] | "
                     f"{report[f'eval/{kind}/kl']:.2f} |")
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps({"overrides": args.overrides, "algorithms": figures}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Throughput of align's PPO stage and TRL's RLOOTrainer and GRPOTrainer, side by side, in one run.

All get the same policy (an SFT checkpoint), the same frozen reward model, the same prompts, the same
episodes per generation batch, optimiser micro-batch, passes over each batch, response length and precision
(float32 on a CPU), and hold a reference for their KL term (beta 0.05):

  align PPO : rollout_batch_size = B, mini_batch_size = M, ppo_epochs = E, max_new_tokens = L
  TRL RLOO  : generation_batch_size = B (B/2 prompts x num_generations 2), per_device_train_batch_size = M,
  TRL GRPO    steps_per_generation = B/M, num_iterations = E, max_completion_length = L

The algorithms differ (PPO trains a value model; RLOO and GRPO take a group baseline and hold no value model),
so PPO does more work per episode by design; the table says so. align's PPO runs twice: with a separate value
model (value_init: reward, the default) and with a value head on the policy's own trunk (value_init: shared: one
forward pass gives log-probs and values). The first iteration of each is a warm-up and is
not timed. PPO's share of its time spent generating is printed beside it.

    python benchmarks/ppo_vs_rloo.py --run-dir runs/default/main --iterations 6
    python benchmarks/ppo_vs_rloo.py --run-dir runs/smollm2_sentiment/main --iterations 3 --epochs 2 --max-new-tokens 32

tests/test_pipeline_e2e.py runs it on the suite's tiny default run (2 iterations of 8 episodes), so the script
cannot rot unnoticed.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def run_ppo_stage(cfg, inputs: dict[str, str]) -> tuple[dict[str, float], list[dict], dict]:
    """Run align's PPO stage `cfg` (a PPOStage) in a temporary stage directory, `inputs` naming the upstream stage
    directories, as the orchestrator would. Returns the timing of every iteration after the first (a warm-up;
    mean weight-sync seconds per iteration included), the stage's metric rows and its manifest.
    benchmarks/rollout_engines.py runs its PPO through this too."""
    from align.config import to_dict
    from align.runtime.process import main as stage_main

    batch = cfg.rollout_batch_size
    with tempfile.TemporaryDirectory() as tmp:
        stage_dir = Path(tmp) / "ppo"
        stage_dir.mkdir()
        spec = {"stage_name": "ppo", "stage_dir": str(stage_dir), "fingerprint": "benchmark", "stage": to_dict(cfg),
                "inputs": inputs, "input_fingerprints": {k: None for k in inputs}, "data_cards": {},
                "code_version": "bench",
                "pipeline": {"name": "bench", "run_id": "bench", "seed": 0, "dtype": "float32",
                             "tracking": {"wandb": "disabled", "project": "align", "entity": None}}}
        (stage_dir / "spec.json").write_text(json.dumps(spec))
        t0 = time.perf_counter()
        failed = stage_main(str(stage_dir / "spec.json")) != 0
        wall = time.perf_counter() - t0
        manifest = json.loads((stage_dir / "manifest.json").read_text())
        if failed:
            raise SystemExit(f"align's PPO stage (engine {cfg.generation.engine}) failed: {manifest.get('error')}")
        rows = [json.loads(x) for x in (stage_dir / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in rows if "perf/episodes_per_s" in r][1:]
    seconds = sum(batch / r["perf/episodes_per_s"] for r in timed)
    tokens = sum(r["perf/tokens_per_s"] * batch / r["perf/episodes_per_s"] for r in timed)
    generating = sum(r["perf/generation_fraction"] * batch / r["perf/episodes_per_s"] for r in timed)
    syncing = sum(r.get("perf/sync_seconds", 0.0) for r in timed)  # a vLLM engine's weight sync; 0 for HF
    # NeMo-RL's split of an iteration, seconds per iteration (held-out KL sampling under "heldout")
    split = {p: sum(r.get(f"perf/{p}_seconds", 0.0) for r in timed) / len(timed)
             for p in ("generation", "scoring", "training", "weight_sync", "heldout")}
    return ({"episodes": batch * len(timed), "seconds": seconds, "tokens": tokens,
             "generation_fraction": generating / seconds, "sync_seconds": syncing / len(timed),
             "split": split, "stage_seconds": wall}, rows, manifest)


def ours(run_dir: Path, prompts_card: str, args, value_init: str = "reward") -> dict[str, float]:
    """align's PPO stage with a separate value model (value_init: reward, the default) or a value head on the
    policy's trunk (value_init: shared)."""
    from align.config import Generation
    from align.config.ppo import KLSettings, PPOStage

    cfg = PPOStage(type="ppo", policy="sft", reward="reward", value_init=value_init, prompts=prompts_card,
                   iterations=args.iterations,
                   rollout_batch_size=args.batch, mini_batch_size=args.mini_batch, ppo_epochs=args.epochs,
                   max_prompt_length=64, save_every=10_000, sample_every=10_000, kl=KLSettings(coef=0.05),
                   generation=Generation(max_new_tokens=args.max_new_tokens))
    summary, _, _ = run_ppo_stage(cfg, {"sft": str(run_dir / "sft"), "reward": str(run_dir / "reward")})
    return summary


def trl_online(kind: str, run_dir: Path, prompts: list[str], args) -> dict[str, float]:
    """TRL's RLOOTrainer or GRPOTrainer (`kind`), timed by its optimiser steps."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

    from align.modeling.models import load_causal_lm, load_scalar_model, load_tokenizer

    tok = load_tokenizer(str(run_dir / "sft" / "model"))
    tok.padding_side = "left"
    policy = load_causal_lm(str(run_dir / "sft" / "model"))
    reward = load_scalar_model(str(run_dir / "reward" / "model"), tok.pad_token_id)
    steps_per_gen = args.batch // args.mini_batch
    total_steps = args.iterations * steps_per_gen * args.epochs
    marks: list[tuple[int, float]] = []

    class Clock(TrainerCallback):
        def on_step_end(self, a, state, control, **kw):
            marks.append((state.global_step, time.time()))

    lengths: list[float] = []

    class Lengths(TrainerCallback):
        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                lengths.append(logs["completions/mean_length"])

    config_cls, trainer_cls = (RLOOConfig, RLOOTrainer) if kind == "rloo" else (GRPOConfig, GRPOTrainer)
    cfg = config_cls(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=args.mini_batch,
                     generation_batch_size=args.batch, num_generations=2, num_iterations=args.epochs,
                     max_completion_length=args.max_new_tokens, max_steps=total_steps, learning_rate=1e-5,
                     beta=0.05, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, bf16=False,
                     temperature=1.0, disable_tqdm=True, seed=0, activation_checkpointing=False)
    trainer = trainer_cls(model=policy, reward_funcs=reward, args=cfg, processing_class=tok,
                          reward_processing_classes=tok, callbacks=[Clock(), Lengths()],
                          train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]))
    trainer.train()
    # one generation batch = steps_per_gen * epochs optimiser steps; skip the first (warm-up) batch
    per_gen = steps_per_gen * args.epochs
    start = next(t for s, t in marks if s == per_gen)
    seconds = marks[-1][1] - start
    episodes = args.batch * (args.iterations - 1)
    mean_len = sum(lengths) / len(lengths) if lengths else float("nan")
    return {"episodes": episodes, "seconds": seconds, "tokens": episodes * mean_len}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", type=Path, default=Path("runs/default/main"),
                   help="a run directory with completed sft/ and reward/ stages")
    p.add_argument("--prompts", default=str(Path(__file__).resolve().parent.parent / "data_cards" /
                                            "movie_review_snippets.yaml"))
    p.add_argument("--iterations", type=int, default=6)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--mini-batch", type=int, default=16)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--trainers", default="align,shared,rloo,grpo",
                   help="which to run, comma-separated (align: align's PPO with a separate value model, shared: "
                        "with a value head on the policy's trunk, rloo, grpo); e.g. align alone, with another "
                        "checkout's align first on PYTHONPATH, for a before/after of align's PPO in the same sitting")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)
    if args.iterations < 2:
        raise SystemExit("--iterations must be >= 2: the first iteration of each trainer is a warm-up, not timed")
    if args.batch % args.mini_batch:
        raise SystemExit(f"--batch {args.batch} must be a multiple of --mini-batch {args.mini_batch}")
    for stage in ("sft", "reward"):
        if not (args.run_dir / stage / "model").is_dir():
            raise SystemExit(f"{args.run_dir / stage / 'model'} is missing: run the default pipeline first")
    from align.data.cards import load_split

    prompts = list(dict.fromkeys(r["prompt"] for r in load_split(args.prompts, "train").rows))[:4096]
    wanted = set(args.trainers.split(","))
    runs = {"align PPO": ("align", lambda: ours(args.run_dir, args.prompts, args)),
            "align PPO, shared value head": ("shared", lambda: ours(args.run_dir, args.prompts, args, "shared")),
            "TRL RLOO": ("rloo", lambda: trl_online("rloo", args.run_dir, prompts, args)),
            "TRL GRPO": ("grpo", lambda: trl_online("grpo", args.run_dir, prompts, args))}
    results = {name: run() for name, (key, run) in runs.items() if key in wanted}
    print(f"\nsettings: B={args.batch} episodes/iteration, M={args.mini_batch}, epochs={args.epochs}, "
          f"L={args.max_new_tokens} tokens, {args.iterations - 1} timed iterations, float32")
    print("| trainer | episodes/s | response tokens/s | timed episodes | seconds | generating |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        share = f"{r['generation_fraction']:.0%}" if "generation_fraction" in r else "-"
        print(f"| {name} | {r['episodes'] / r['seconds']:.2f} | {r['tokens'] / r['seconds']:.1f} | "
              f"{r['episodes']} | {r['seconds']:.1f} | {share} |")
    if args.json:
        args.json.write_text(json.dumps({"settings": {k: v for k, v in vars(args).items() if k != "json"},
                                         "results": results}, default=str, indent=2))


if __name__ == "__main__":
    main()

"""What the grpo and rloo stages share: prompts, the reward functions handed to TRL, and one run.

TRL's GRPOTrainer and RLOOTrainer sample `num_generations` completions per prompt, score each with the reward
functions, and optimise the clipped ratio with a group baseline (GRPO: the group's mean and std; RLOO: the mean
of the others) and a KL to the reference (beta). align hands them:

- the starting policy loaded by `ctx.load_lm` (TRL builds the reference from the same checkpoint with the
  policy's dtype and attention kernel; under LoRA the reference is the base with adapters disabled);
- prompts as text, conversational ones rendered with the chat template, as PPO's;
- one reward function per judge name with its weight, from the one judge builder (align/judges/pointwise.py): a
  reward stage's scalar head read at the last real token of prompt ids + completion ids (EOS included when
  sampled), the rule PPO's rollouts are scored by, or a Python judge on (prompts, decoded completions).
"""

from __future__ import annotations

from typing import Any

from align.config.online_rl import OnlineRLStage
from align.runtime.rows import load_rows, unique_prompts
from align.judges import judge_weights
from align.judges.pointwise import check_same_tokenizer, stage_judge
from align.data.lengths import LengthReport, enforce
from align.modeling.packing import install_padding_free
from align.modeling.models import load_tokenizer
from align.modeling.lora import peft_config
from align.runtime.context import StageContext, StageError
from align.runtime.trl import metrics_callback, online_rl_metric_name, padding_free, train_with_resume, training_args


def reward_functions(ctx: StageContext, cfg: OnlineRLStage, tokenizer) -> tuple[list, list[float]]:
    """One TRL reward function per name of `cfg.reward`, and their weights (TRL sums them): the one judge builder
    (align/judges/pointwise.py), so a reward stage scores prompt ids + completion ids by the rule PPO's rollouts are
    scored by."""
    stages = [n for n in judge_weights(cfg.reward) if n in ctx.inputs]
    check_same_tokenizer(ctx.name, cfg.policy, tokenizer, {n: load_tokenizer(ctx.input_model(n)) for n in stages})
    return stage_judge(ctx, cfg.reward).trl_reward_functions()


def training_prompts(ctx: StageContext, cfg: OnlineRLStage, tokenizer) -> list[str]:
    """Distinct prompts (rendered with the chat template when conversational) that leave room for max_new_tokens
    within max_length; longer ones are dropped, counted in the manifest, and refused above
    max_truncated_fraction (align/data/lengths.py)."""
    prompts = unique_prompts(load_rows(ctx, cfg.prompts, cfg.split, tokenizer=tokenizer))
    prompts = prompts[:cfg.max_train_examples] if cfg.max_train_examples else prompts
    room = cfg.max_length - cfg.generation.max_new_tokens
    lengths = [len(ids) for ids in tokenizer(prompts)["input_ids"]] if prompts else []
    report = LengthReport(ctx.name, "prompt", len(prompts), 0, sum(n > room for n in lengths),
                          max(lengths, default=0) + cfg.generation.max_new_tokens, cfg.max_length)
    ctx.extra_manifest["length_check"] = report.as_dict()
    if ctx.is_main:
        print(f"[align] length check {report.summary()} (prompt + max_new_tokens)", flush=True)
    enforce(report, cfg.max_truncated_fraction)
    kept = [p for p, n in zip(prompts, lengths) if n <= room]
    world = ctx.state.num_processes
    problem = cfg.batch_problem(world)
    if problem:
        raise ValueError(f"stage '{ctx.name}' ({world} processes): {problem}")
    steps = cfg.steps_per_generation or cfg.gradient_accumulation_steps
    needed = cfg.per_device_batch_size * world * steps // cfg.num_generations
    if len(kept) < needed:
        raise StageError(f"stage '{ctx.name}': {len(kept)} usable prompts in {cfg.prompts} split '{cfg.split}', but "
                         f"one generation round takes {needed}; use more prompts or a smaller per_device_batch_size")
    return kept


def run(ctx: StageContext, trainer_cls, config_cls, **algorithm_args: Any) -> dict[str, Any]:
    """Train the policy with a TRL online trainer (GRPOTrainer or RLOOTrainer) and publish model/."""
    from datasets import Dataset  # heavy: trl and datasets load only when the stage runs

    cfg: OnlineRLStage = ctx.cfg  # type: ignore[assignment]
    path = ctx.input_model(cfg.policy)
    tokenizer = load_tokenizer(path)
    prompts = training_prompts(ctx, cfg, tokenizer)
    # The reward models are loaded whole, before the config exists: each process scores its own completions with
    # them in a Python function (align/orchestrator/estimate.py counts them unsharded on every GPU).
    funcs, weights = reward_functions(ctx, cfg, tokenizer)
    gen = cfg.generation
    # max_length dropped: these trainers bound completions (max_completion_length); prompts are checked above
    args = training_args(config_cls, cfg, ctx, drop=("max_length",), num_generations=cfg.num_generations,
                         steps_per_generation=cfg.steps_per_generation, max_completion_length=gen.max_new_tokens,
                         temperature=gen.temperature, top_k=gen.top_k or 0, top_p=gen.top_p, beta=cfg.beta,
                         num_iterations=cfg.num_iterations, epsilon=cfg.epsilon, reward_weights=weights,
                         disable_dropout=True,  # old and new log-probs agree, as in PPO
                         trust_remote_code=ctx.pipeline.trust_remote_code, log_completions=False, **algorithm_args)
    model = ctx.load_lm(path, quantize=cfg.lora.quantize)
    padding_free(ctx, model)
    trainer = trainer_cls(model=model, reward_funcs=funcs, args=args, processing_class=tokenizer,
                          train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]),
                          callbacks=[metrics_callback(ctx, online_rl_metric_name)],
                          peft_config=peft_config(cfg.lora, "CAUSAL_LM"))
    if cfg.padding_free and getattr(trainer, "ref_model", None) is not None:  # TRL's own copy of the start
        install_padding_free(trainer.ref_model)
    final = train_with_resume(ctx, trainer)
    final.update(score_summary(ctx))
    final["train/prompts"] = len(prompts)
    ctx.save_trainer_model(trainer, tokenizer)
    return final


def score_summary(ctx: StageContext) -> dict[str, float]:
    """First and last logged score and KL of the whole run (metrics.jsonl holds a resumed run's earlier rows)."""
    import json

    if not ctx.is_main or not (ctx.dir / "metrics.jsonl").is_file():
        return {}
    rows = [json.loads(line) for line in (ctx.dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    out = {}
    for key in ("objective/scores", "objective/kl"):
        seen = [r[key] for r in rows if key in r]
        if seen:
            out[f"{key}_first"], out[f"{key}_last"] = seen[0], seen[-1]
    return out

"""What the grpo and rloo stages share: prompts, the reward functions handed to TRL, and one run.

TRL's GRPOTrainer and RLOOTrainer sample `num_generations` completions per prompt, score each with the reward
functions, and optimise the clipped ratio with a group baseline (GRPO: the group's mean and std; RLOO: the mean
of the others) and a KL to the reference (beta). align hands them:

- the starting policy loaded by `ctx.load_lm` (TRL builds the reference from the same checkpoint with the
  policy's dtype and attention kernel; under LoRA the reference is the base with adapters disabled);
- prompts as text, conversational ones rendered with the chat template, as PPO's;
- one reward function per judge name with its weight, from the one judge builder (align/judges/pointwise.py): a
  reward stage's scalar head read at the last real token of prompt ids + completion ids (EOS included when
  sampled), the rule PPO's rollouts are scored by, or a Python judge on (prompts, decoded completions);
- with `generation.engine: vllm`, the sampling (align/stages/online_engine.py `EngineRollouts`): each process's
  engine samples the trainer's prompt ids, synced to the policy whenever an optimiser step has passed since its last
  sync, the first rows of each round checked against the trainer's log-probs (generation.max_logprob_gap).
"""

from __future__ import annotations

import itertools
import logging
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from align.config.online_rl import OnlineRLStage
from align.runtime.rows import load_prompts
from align.judges import judge_weights
from align.judges.pointwise import check_same_tokenizer, stage_judge
from align.data.lengths import LengthReport, enforce
from align.core.fsutil import publish_dir, staging_dir
from align.modeling.models import adapter_base
from align.modeling.lora import peft_config
from align.modeling.packing import install_padding_free
from align.runtime.context import StageContext, StageError
from align.runtime.trl import metrics_callback, online_rl_metric_name, padding_free, train_with_resume, training_args
from align.stages.online_engine import GAP, correct_for_the_engine, open_engine, run_gap_max, trainer_with_engine


def plain_generation_kwargs(ctx: StageContext, model) -> dict | None:
    """TRL's own sampling (`generation.engine: hf`) fills every setting it leaves unset from the loaded policy's
    generation config (its checkpoint's generation_config.json, or its base model's for a LoRA adapter): the settings
    of it that would change what is sampled, set back to neutral values (modeling.generation.plain_sampling), as
    TRL's `generation_kwargs`. One whose only neutral value is None cannot be undone that way: named in the manifest
    (`generation_config_kept`) and the log."""
    from align.modeling.generation import plain_sampling

    undo = plain_sampling(getattr(model, "generation_config", None))
    if kept := sorted(k for k, v in undo.items() if v is None):
        ctx.note(generation_config_kept=kept)
        if ctx.is_main:
            print(f"[align] {ctx.name}: the policy's generation config sets {', '.join(kept)}, which TRL's sampling "
                  "keeps (remove them from its generation_config.json to sample from the plain distribution)",
                  flush=True)
    return {k: v for k, v in undo.items() if v is not None} or None


@contextmanager
def one_end_token(model, tokenizer) -> Iterator[None]:
    """While TRL's trainer is built, the policy's generation config names the tokenizer's EOS alone: TRL ends a
    completion at every end id the config declares (Llama-3.1-Instruct's three, Qwen2.5's two), where align's other
    samplers (PPO, evaluate, preferences, the vllm engine) and the reward models' scoring stop at the tokenizer's EOS
    alone. Put back after: the published generation_config.json keeps the model's own."""
    config = getattr(model, "generation_config", None)
    declared = getattr(config, "eos_token_id", None)
    if config is not None:
        config.eos_token_id = tokenizer.eos_token_id
    try:
        yield
    finally:
        if config is not None:
            config.eos_token_id = declared


def reward_functions(ctx: StageContext, cfg: OnlineRLStage, tokenizer) -> tuple[list, list[float]]:
    """One TRL reward function per name of `cfg.reward`, and their weights (TRL sums them): the one judge builder
    (align/judges/pointwise.py), so a reward stage scores prompt ids + completion ids by the rule PPO's rollouts are
    scored by."""
    stages = [n for n in judge_weights(cfg.reward) if n in ctx.inputs]
    check_same_tokenizer(ctx.name, cfg.policy, tokenizer, {n: ctx.load_tokenizer(ctx.input_model(n)) for n in stages})
    return stage_judge(ctx, cfg.reward).trl_reward_functions()


def training_prompts(ctx: StageContext, cfg: OnlineRLStage, tokenizer) -> list[str]:
    """Distinct prompts (rendered with the chat template when conversational) that leave room for max_new_tokens
    within max_length; longer ones are dropped, counted in the manifest, and refused above
    max_truncated_fraction (align/data/lengths.py)."""
    prompts = load_prompts(ctx, cfg.prompts, cfg.split, tokenizer=tokenizer)  # chat: rendered; empty ones dropped
    room = cfg.max_length - cfg.generation.max_new_tokens
    lengths = [len(ids) for ids in tokenizer(prompts)["input_ids"]] if prompts else []
    if cfg.max_train_examples:  # prompts read until the limit is filled (the long ones dropped), as other stages
        read = next((i + 1 for i, fit in enumerate(itertools.accumulate(n <= room for n in lengths))
                     if fit == cfg.max_train_examples), len(prompts))
        prompts, lengths = prompts[:read], lengths[:read]
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
    needed = cfg.prompts_per_round(world)
    if len(kept) < needed:
        raise StageError(f"stage '{ctx.name}': {len(kept)} usable prompts in {cfg.prompts} split '{cfg.split}', but "
                         f"one generation round takes {needed}; use more prompts or a smaller per_device_batch_size"
                         + (f" (max_train_examples is {cfg.max_train_examples})" if cfg.max_train_examples else ""))
    return kept


ROUNDS_APART = "frac_rounds_scored_apart"
"""Logged with TRL's metrics (train/frac_rounds_scored_apart): the fraction of the window's sampling rounds in which
some group's completions got different scores, from some reward function (`scored_apart`)."""


def scored_apart(rewards: list[float], group: int) -> bool:
    """Whether any group of `group` consecutive rewards (TRL's order: a prompt's completions together, every
    process's gathered) holds two that differ beyond float rounding (a judge's None is NaN: left out). TRL's own
    frac_reward_zero_std cannot say it: under scale_rewards: batch it is the batch's spread, and a constant 0.7 in
    float32 leaves a std of ~6e-8 that its isclose(std, 0) (atol 1e-8) reads as a spread, and advantages of ~6e-4."""
    for i in range(0, len(rewards) - group + 1, group):
        seen = [r for r in rewards[i:i + group] if r == r]
        if len(seen) > 1 and max(seen) - min(seen) > 1e-6 * max(1.0, *map(abs, seen)):
            return True
    return False


def round_apart(rewards: dict[str, list[float]], weights: dict[str, float], group: int) -> bool:
    """Whether a round trains: any judge of non-zero weight scored a group's completions apart (a judge of weight 0,
    scoring apart, hid a constant reward)."""
    return any(scored_apart(list(r), group) for name, r in rewards.items() if weights.get(name, 1.0))


class Watch:
    """What align reads from a TRL online trainer as it trains (`watched`): the prompt sampler, reseeded as each epoch
    begins; per micro-batch the tokens trained."""

    def __init__(self):
        self.sampler, self.tokens = None, 0

    def callback(self):
        from transformers import TrainerCallback

        watch = self

        class Reseed(TrainerCallback):
            def on_epoch_begin(self, args, state, control, **kwargs):
                generator = getattr(watch.sampler, "generator", None)
                if generator is not None and getattr(watch.sampler, "shuffle", False):
                    generator.manual_seed(args.seed + 7919 * int(state.epoch or 0))

        return Reseed()


def watched(trainer_cls) -> tuple[type, Watch]:
    """The trainer class, and what it reports to align (Watch), so that:
    - each epoch's prompt order is a function of the seed and the epoch. TRL's RepeatSampler draws every epoch's order
      from one generator seeded when it is built; a resumed run builds a new one, so its epochs after the first
      replayed the first's order (some prompts trained twice in an epoch, others never). Watch's callback reseeds it as
      each epoch begins (TrainerState.epoch, restored on resume), before the epoch's first batch is drawn: epoch 0 in
      TRL's own order, and every epoch alike resumed or not;
    - a round in which every group's completions scored alike (all processes' groups, as TRL gathers them to
      normalise: every advantage 0) is told apart from one that trains (ROUNDS_APART, logged and restored on resume);
    - the tokens trained are counted per micro-batch (prompt and completion tokens), each pass over a round's samples
      (num_iterations) counted, where TRL counts a round's tokens once as it samples them."""
    watch = Watch()

    class Watched(trainer_cls):
        def _get_train_sampler(self, dataset=None):
            watch.sampler = super()._get_train_sampler(dataset)
            return watch.sampler

        def _generate_and_score_completions(self, *args, **kwargs):
            out = super()._generate_and_score_completions(*args, **kwargs)
            if self.model.training:  # the round's scores over every process (TRL's own log of them, one round long)
                apart = round_apart(self._logs["rewards"], dict(zip(self.reward_func_names,
                                                                    self.reward_weights.tolist())), self.num_generations)
                self._metrics["train"][ROUNDS_APART].append(float(apart))
            return out

        def compute_loss(self, model, inputs, *args, **kwargs):
            if model.training:  # (TRL's prediction_step calls it too)
                watch.tokens += int(inputs["prompt_mask"].sum()) + int(inputs["completion_mask"].sum())
            return super().compute_loss(model, inputs, *args, **kwargs)

    Watched.__name__ = trainer_cls.__name__
    return Watched, watch


def reference_is_the_policy(ctx: StageContext, cfg: OnlineRLStage, model, path: str) -> Path | None:
    """TRL builds GRPO's and RLOO's reference (beta > 0, no LoRA here) from the policy's config name
    (`get_config_model_id`). A policy published as an adapter alone loads as its base with the adapter merged in, and
    that name is the base's: the KL would pull towards the model before the stage that trained the adapter. The
    policy as loaded is written once into the stage's directory (reference/, removed once the trainer has built the
    reference from it) and named there. Returns that directory (None when TRL's own name is right)."""
    if not cfg.beta or cfg.lora.enabled or adapter_base(path) is None:
        return None
    where = ctx.dir / "reference"
    if ctx.is_main:  # whole on every process here: a merged adapter loads unpartitioned (align/modeling/models.py)
        tmp = staging_dir(where)
        model.save_pretrained(tmp)
        publish_dir(tmp, where)
    ctx.state.wait_for_everyone()
    model.config._name_or_path = str(where)
    ctx.note(reference=f"the policy as loaded ({path}: an adapter merged into its base), not its base")
    return where


def reference_kwargs(ctx: StageContext, cfg: OnlineRLStage) -> dict[str, Any]:
    """How TRL loads the frozen reference it builds (beta > 0, no LoRA; else none is built and nothing is passed):
    as a frozen model, bf16 on a GPU computing in bf16. TRL's default is the policy's dtype, fp32 for a policy
    trained whole outside DeepSpeed: twice the memory `align estimate` counts, and fp32 matmuls for every reference
    forward. (TRL then warns that model_init_kwargs are ignored, as the policy is an instance; it reads them for the
    reference all the same: `quiet_init_warning`.)"""
    if not cfg.beta or cfg.lora.enabled:
        return {}
    return {"model_init_kwargs": {"dtype": ctx.weights_dtype(frozen=True)}}


class quiet_init_warning(logging.Filter):
    """Drops TRL's "model_init_kwargs will be ignored" warning while `trainer_cls` is built (see `reference_kwargs`)."""

    def __init__(self, trainer_cls):
        super().__init__()
        self.logger = logging.getLogger(trainer_cls.__module__)

    def filter(self, record: logging.LogRecord) -> bool:
        return "`model_init_kwargs` will be ignored" not in record.getMessage()

    def __enter__(self):
        self.logger.addFilter(self)

    def __exit__(self, *exc):
        self.logger.removeFilter(self)


def drop(ctx: StageContext, reference: Path | None) -> None:
    if reference is not None and ctx.is_main:
        shutil.rmtree(reference, ignore_errors=True)


def run(ctx: StageContext, trainer_cls, config_cls, **algorithm_args: Any) -> dict[str, Any]:
    """Train the policy with a TRL online trainer (GRPOTrainer or RLOOTrainer) and publish model/."""
    import torch  # heavy: stage processes only
    from datasets import Dataset  # heavy: trl and datasets load only when the stage runs

    cfg: OnlineRLStage = ctx.cfg  # type: ignore[assignment]
    path = ctx.input_model(cfg.policy)
    tokenizer = ctx.load_tokenizer(path)
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
                         ds3_gather_for_generation=gen.zero3_gather == "whole",  # TRL's own generate, under ZeRO-3
                         trust_remote_code=ctx.pipeline.trust_remote_code, log_completions=False,
                         **reference_kwargs(ctx, cfg), **algorithm_args)
    model = ctx.load_lm(path, quantize=cfg.lora.quantize, lora=cfg.lora.enabled)
    args.generation_kwargs = plain_generation_kwargs(ctx, model)  # read by the trainer as it starts
    padding_free(ctx, model, left_padded=True)
    rollouts, reference = open_engine(ctx, cfg, tokenizer, path), None
    try:
        reference = reference_is_the_policy(ctx, cfg, model, path)
        cls, sampling = trainer_with_engine(trainer_cls, rollouts)
        cls, watch = watched(cls)
        with quiet_init_warning(trainer_cls), one_end_token(model, tokenizer):
            trainer = cls(model=model, reward_funcs=funcs, args=args, processing_class=tokenizer,
                          train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]),
                          callbacks=[metrics_callback(ctx, online_rl_metric_name), watch.callback()],
                          peft_config=peft_config(cfg.lora, "CAUSAL_LM"), **sampling)
        ctx.state.wait_for_everyone()  # every process has built its reference from reference/: not needed again
        drop(ctx, reference)
        if "rollout_func" in sampling and (mode := correct_for_the_engine(trainer, gen)):
            ctx.note(engine_importance_sampling=mode)
        if cfg.padding_free and getattr(trainer, "ref_model", None) is not None:  # TRL's own copy of the start
            install_padding_free(trainer.ref_model)  # (TRL builds it inside the trainer, after the policy)
        final = train_with_resume(ctx, trainer)
        untrained(ctx, cfg, trainer.state.log_history)
        trained = int(trainer.accelerator.reduce(torch.tensor(watch.tokens, device=trainer.accelerator.device), "sum"))
        if "perf/train_tokens" in final:  # a run not resumed (TRL's count, of what it sampled, restarts at a resume)
            final["perf/train_tokens"], final["perf/tokens_per_s"] = trained, trained / final["perf/train_seconds"]
    finally:
        if rollouts is not None:
            rollouts.engine.close()
        drop(ctx, reference)  # also when building the trainer failed (the full policy, gigabytes at 8B)
    if rollouts is not None:
        final["perf/sync_seconds"] = sum(rollouts.engine.sync_seconds) / max(1, len(rollouts.engine.sync_seconds))
        final["perf/syncs"] = len(rollouts.engine.sync_seconds)  # one per sampling round: a skipped one shows here
        final[GAP] = run_gap_max(rollouts, trainer.state.log_history)
    final.update(score_summary(ctx))
    final["train/prompts"] = len(prompts)
    ctx.save_trainer_model(trainer, tokenizer)
    return final


def untrained(ctx: StageContext, cfg: OnlineRLStage, history: list[dict[str, Any]]) -> None:
    """Refuse to publish a policy no step trained: every group's completions scored alike in every logged step
    (TRL's frac_reward_zero_std, over all processes' groups, the same on each process), so every advantage was 0,
    the policy stayed the reference and the KL term had no gradient. A constant judge, or a pass/fail judge that
    fails every completion, "completed" with the starting weights published as the trained policy."""
    flat = [h["frac_reward_zero_std"] for h in history if "frac_reward_zero_std" in h]
    fix = ("so nothing is published. Check the judge (a constant score, or a pass/fail judge failing every completion, "
           "or one each prompt always passes or always fails), or sample more varied completions (num_generations, "
           "generation.temperature)")
    if flat and min(flat) >= 1.0:
        raise StageError(f"stage '{ctx.name}': in all {len(flat)} logged steps every group of {cfg.num_generations} "
                         f"completions got one score from {cfg.reward} (train/frac_reward_zero_std 1.0): "
                         f"{cfg.ALGORITHM}'s advantages were all 0 and the policy was not trained, {fix}")
    apart = [h[ROUNDS_APART] for h in history if ROUNDS_APART in h]  # (a resumed run's history is restored)
    if apart and max(apart) == 0.0:  # TRL's frac_reward_zero_std misses it under scale_rewards: batch, or a constant
        # score float32 does not hold exactly (scored_apart)
        raise StageError(f"stage '{ctx.name}': in every sampling round of all {len(apart)} logged steps every group of "
                         f"{cfg.num_generations} completions got one score from {cfg.reward} (each group its own; "
                         f"train/{ROUNDS_APART} 0): every advantage was 0 and the policy was not trained, {fix}")


def score_summary(ctx: StageContext) -> dict[str, float]:
    """First and last logged score and KL of the whole run (metrics.jsonl holds a resumed run's earlier rows)."""
    import json

    if not ctx.is_main or not (ctx.dir / "metrics.jsonl").is_file():
        return {}
    rows = [json.loads(line) for line in (ctx.dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    out = {}
    for key in ("objective/scores", "objective/kl_per_token"):
        seen = [r[key] for r in rows if key in r]
        if seen:
            out[f"{key}_first"], out[f"{key}_last"] = seen[0], seen[-1]
    return out

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
- with `generation.engine: vllm`, the sampling (EngineRollouts): each process's engine samples the trainer's prompt
  ids, synced to the policy whenever an optimiser step has passed since its last sync; GRPO through TRL's
  `rollout_func` (experimental in TRL 1.16), RLOO, which has no such argument in 1.16, through its one sampling
  method `_generate_single_turn` (prompt ids in, completion ids out), overridden in a subclass. Either way TRL
  computes every loss term as it does for its own samples. The first rows of each round are scored by the trainer
  too and compared with the engine's log-probs (generation.max_logprob_gap), as PPO checks its rollouts.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

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


CHECKED_ROWS = 8
"""Rows of each sampling round whose engine log-probs are compared with the trainer's (one forward pass of them)."""


class EngineRollouts:
    """A TRL online trainer's sampling through an align engine that holds its own copy of the policy (vllm): one
    engine per process, synced to the trained policy before the first round after each optimiser step (under ZeRO-3
    every process gathers a layer at a time as it sends, the same collectives everywhere), its samples checked."""

    def __init__(self, ctx: StageContext, cfg: OnlineRLStage, engine, tokenizer):
        self.ctx, self.cfg, self.engine, self.tokenizer = ctx, cfg, engine, tokenizer
        self.synced_step = -1
        self.round = (-1, 0)  # (the optimiser step a round was sampled at, its count at that step)

    def next_seed(self, step: int) -> int:
        """The seed of the round sampled at optimiser step `step`: distinct per process (a prompt's group may be split
        over processes) and per round, and the same in a resumed run as in one never stopped (a count of rounds
        since the attempt began restarted at every resume, so a resumed run replayed the first attempt's seeds)."""
        self.round = (step, self.round[1] + 1 if self.round[0] == step else 0)
        return ((self.ctx.seed * 7919 + step) * 31 + self.round[1]) * 1009 + self.ctx.state.process_index

    def rollout_func(self, prompts: list, trainer) -> dict[str, list]:
        """TRL GRPOTrainer's `rollout_func`: this process's prompts (each repeated num_generations times by TRL's
        sampler) -> one completion each, with the prompt ids it was sampled from and the engine's log-probs."""
        from align.modeling.generation import tokenize_prompts

        q_ids, q_mask = tokenize_prompts(self.tokenizer, list(prompts))
        r = self.sample(q_ids, q_mask, trainer)
        return {"prompt_ids": [row[m.bool()].tolist() for row, m in zip(r.query_ids, r.query_mask)],
                "completion_ids": completions(r), "logprobs": [lp[m.bool()].tolist() for lp, m in
                                                               zip(r.engine_logprobs, r.response_mask)]}

    def completion_ids(self, prompt_ids: list[list[int]], trainer) -> list[list[int]]:
        """RLOOTrainer's `_generate_single_turn`: prompt ids (unpadded lists) -> completion ids."""
        import torch  # heavy: stage processes only

        pad = self.tokenizer.pad_token_id
        width = max(len(p) for p in prompt_ids)
        q_ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompt_ids], dtype=torch.long)
        q_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids], dtype=torch.long)
        return completions(self.sample(q_ids, q_mask, trainer))

    def sample(self, q_ids, q_mask, trainer):
        """One round: sync if an optimiser step passed, sample (B, Lq) left-padded prompt ids, check the first rows."""
        import torch  # heavy: stage processes only

        from align.engines import EngineError
        from align.engines.base import across_processes, check_rollout, rest
        from align.modeling.generation import response_logprobs

        acc = trainer.accelerator
        policy = acc.unwrap_model(trainer.model)
        if trainer.state.global_step != self.synced_step:
            with torch.no_grad():
                self.engine.sync_weights(policy)
            if self.synced_step == -1:  # the manifest says how the weights travelled
                self.ctx.note_engine(self.engine, synced=True)
            self.synced_step = trainer.state.global_step
        # for an engine that takes a seed per call (vLLM's CPU sampler takes none: each process's engine was started
        # with a seed of its own)
        r = self.engine.generate_ids(q_ids, q_mask, self.cfg.generation, seed=self.next_seed(trainer.state.global_step))
        if r.engine_logprobs is None:  # TRL's rollout_func requires them, and the check below compares them
            raise EngineError(f"stage '{self.ctx.name}': generation.engine '{self.engine.name}' returned no log-probs "
                              "of its own samples; GRPO and RLOO on an engine with its own copy of the policy need them "
                              "(EngineKind.token_ids); use generation.engine: hf, or make the engine return them")
        rest(self.engine)  # generation.sleep: the engine frees its memory before any model computes, while it trains
        n = min(CHECKED_ROWS, q_ids.size(0))  # the same count on every process: a forward under ZeRO-3 is collective
        head = type(r)(r.query_ids[:n], r.query_mask[:n], r.response_ids[:n], r.response_mask[:n], r.eos_found[:n],
                       r.engine_logprobs[:n])
        was_training = policy.training
        policy.eval()
        try:
            with torch.no_grad(), self.ctx.compute.autocast():
                lp = response_logprobs(policy, head, temperature=self.cfg.generation.temperature)
        finally:
            policy.train(was_training)
        gap = check_rollout(self.engine, head, lp, self.cfg.generation.max_logprob_gap,
                            f"stage '{self.ctx.name}', step {trainer.state.global_step} (after a weight sync)",
                            reduce=across_processes(acc))
        if gap is not None:  # None: an engine that reports no log-probs of its own
            trainer._metrics["train" if trainer.model.training else "eval"]["rollout/logprob_gap_max"].append(gap["max"])
        return r


def completions(r) -> list[list[int]]:
    """Each row's sampled ids up to and including its first EOS (what TRL's own samplers return)."""
    return [ids[m.bool()].tolist() for ids, m in zip(r.response_ids, r.response_mask)]


def epoch_seeded(trainer_cls) -> tuple[type, Any]:
    """The trainer class, and a callback for it, so each epoch's prompt order is a function of the seed and the epoch.
    TRL's RepeatSampler draws every epoch's order from one generator seeded when it is built; a resumed run builds a
    new one, so its epochs after the first replayed the first's order (some prompts trained twice in an epoch, others
    never). The callback reseeds it as each epoch begins (TrainerState.epoch, restored on resume), before the epoch's
    first batch is drawn: epoch 0 in TRL's own order, and every epoch alike resumed or not."""
    from transformers import TrainerCallback

    class Reseed(TrainerCallback):
        sampler = None

        def on_epoch_begin(self, args, state, control, **kwargs):
            generator = getattr(self.sampler, "generator", None)
            if generator is not None and getattr(self.sampler, "shuffle", False):
                generator.manual_seed(args.seed + 7919 * int(state.epoch or 0))

    reseed = Reseed()

    class EpochSeeded(trainer_cls):
        def _get_train_sampler(self, dataset=None):
            reseed.sampler = super()._get_train_sampler(dataset)
            return reseed.sampler

    EpochSeeded.__name__ = trainer_cls.__name__
    return EpochSeeded, reseed


def trainer_with_engine(trainer_cls, rollouts: EngineRollouts | None) -> tuple[type, dict[str, Any]]:
    """The trainer class and the extra keyword arguments that make it sample through `rollouts` (None: TRL's own
    generate). GRPO: TRL's `rollout_func`; RLOO (no rollout_func in TRL 1.16): a subclass whose one sampling method
    asks the engine."""
    import inspect

    if rollouts is None:
        return trainer_cls, {}
    if "rollout_func" in inspect.signature(trainer_cls.__init__).parameters:
        return trainer_cls, {"rollout_func": rollouts.rollout_func}
    method = getattr(trainer_cls, "_generate_single_turn", None)
    if method is None or list(inspect.signature(method).parameters)[:2] != ["self", "prompt_ids"]:
        import trl

        raise StageError(f"{trainer_cls.__name__} in TRL {trl.__version__} has neither a rollout_func argument nor "
                         "the _generate_single_turn(prompt_ids, ...) method align samples through (TRL 1.16's): set "
                         "generation.engine: hf, or install trl 1.16")

    class EngineSampled(trainer_cls):
        def _generate_single_turn(self, prompt_ids, *args, **kwargs):
            return rollouts.completion_ids(prompt_ids, self)

    EngineSampled.__name__ = f"{trainer_cls.__name__}WithEngine"
    return EngineSampled, {}


class _AlignSyncs:
    """Stands for TRL's vLLM client where TRL would sync it before a rollout_func round: align's EngineRollouts
    syncs its engine itself, once per optimiser step."""

    def sync_weights(self) -> None:
        pass


def correct_for_the_engine(trainer, gen) -> str | None:
    """GRPO sampling through rollout_func: TRL corrects for an engine that samples with other numerics than the
    trainer (bf16 kernels, prefix caching) only where it drives vLLM itself (`use_vllm`): it then recomputes the
    trainer's log-probs of every round and weighs the loss by its importance-sampling ratio over the engine's
    (`vllm_importance_sampling_*` of GRPOConfig, grpo_trainer.py `_generate_and_score_completions`). Turned on for
    align's engine too, TRL's own sync a no-op. Not under `top_k`/`top_p` (`gen`): the engine's log-probs are then
    those of the truncated distribution it sampled, the trainer's of the whole one, so every ratio would be below 1
    and a sequence's product of them would all but erase its policy loss. Returns the mode, or why it is off (None:
    a trainer without that machinery)."""
    args = trainer.args
    if not getattr(args, "vllm_importance_sampling_correction", False) or not hasattr(trainer, "use_vllm"):
        return None
    if gen.top_k or gen.top_p < 1.0:
        return (f"off: top_k {gen.top_k} / top_p {gen.top_p} truncate what the engine samples, so its log-probs are "
                "not comparable with the trainer's")
    trainer.use_vllm, trainer.vllm_generation, trainer._last_loaded_step = True, _AlignSyncs(), -1
    return f"{args.vllm_importance_sampling_mode} (ratio bounds {args.vllm_importance_sampling_clip_min}, " \
           f"{args.vllm_importance_sampling_clip_max})"


def open_engine(ctx: StageContext, cfg: OnlineRLStage, tokenizer, path: str) -> EngineRollouts | None:
    """This process's engine when `generation.engine` names one with its own copy of the policy (else None: TRL
    samples with its own generate), started from the policy's directory."""
    from align.engines import kind, make_engine

    if not kind(cfg.generation.engine).own_copy:
        return None
    rank = ctx.state.process_index
    engine = make_engine(cfg.generation, model=None, tokenizer=tokenizer, model_dir=path, seed=ctx.seed * 7919 + rank,
                         dtype=ctx.compute.engine_dtype(), max_model_len=cfg.max_length + 1,
                         log_path=ctx.dir / f"engine.rank{rank}.log", rank=rank, device=ctx.state.device,
                         lora_rank=cfg.lora.r if cfg.lora.enabled else None)
    try:
        ctx.note_engine(engine)
        return EngineRollouts(ctx, cfg, engine, tokenizer)
    except BaseException:  # not yet in run()'s try: closed here
        engine.close()
        raise


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


def drop(ctx: StageContext, reference: Path | None) -> None:
    if reference is not None and ctx.is_main:
        shutil.rmtree(reference, ignore_errors=True)


def run(ctx: StageContext, trainer_cls, config_cls, **algorithm_args: Any) -> dict[str, Any]:
    """Train the policy with a TRL online trainer (GRPOTrainer or RLOOTrainer) and publish model/."""
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
                         trust_remote_code=ctx.pipeline.trust_remote_code, log_completions=False, **algorithm_args)
    model = ctx.load_lm(path, quantize=cfg.lora.quantize, lora=cfg.lora.enabled)
    args.generation_kwargs = plain_generation_kwargs(ctx, model)  # read by the trainer as it starts
    padding_free(ctx, model, left_padded=True)
    rollouts, reference = open_engine(ctx, cfg, tokenizer, path), None
    try:
        reference = reference_is_the_policy(ctx, cfg, model, path)
        cls, sampling = trainer_with_engine(trainer_cls, rollouts)
        cls, reseed = epoch_seeded(cls)
        trainer = cls(model=model, reward_funcs=funcs, args=args, processing_class=tokenizer,
                      train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]),
                      callbacks=[metrics_callback(ctx, online_rl_metric_name), reseed],
                      peft_config=peft_config(cfg.lora, "CAUSAL_LM"), **sampling)
        ctx.state.wait_for_everyone()  # every process has built its reference from reference/: not needed again
        drop(ctx, reference)
        if "rollout_func" in sampling and (mode := correct_for_the_engine(trainer, gen)):
            ctx.note(engine_importance_sampling=mode)
        if cfg.padding_free and getattr(trainer, "ref_model", None) is not None:  # TRL's own copy of the start
            install_padding_free(trainer.ref_model)  # (TRL builds it inside the trainer, after the policy)
        final = train_with_resume(ctx, trainer)
        untrained(ctx, cfg, trainer.state.log_history)
        for key in ("perf/train_tokens", "perf/tokens_per_s"):  # TRL counts a round's tokens once as it samples
            if key in final:  # them; each is trained num_iterations times
                final[key] *= cfg.num_iterations
    finally:
        if rollouts is not None:
            rollouts.engine.close()
        drop(ctx, reference)  # also when building the trainer failed (the full policy, gigabytes at 8B)
    if rollouts is not None:
        final["perf/sync_seconds"] = sum(rollouts.engine.sync_seconds) / max(1, len(rollouts.engine.sync_seconds))
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
    norms = [h["grad_norm"] for h in history if isinstance(h.get("grad_norm"), (int, float))]
    fix = ("so nothing is published. Check the judge (a constant score, or a pass/fail judge failing every completion, "
           "or one each prompt always passes or always fails), or sample more varied completions (num_generations, "
           "generation.temperature)")
    if flat and min(flat) >= 1.0:
        raise StageError(f"stage '{ctx.name}': in all {len(flat)} logged steps every group of {cfg.num_generations} "
                         f"completions got one score from {cfg.reward} (train/frac_reward_zero_std 1.0): "
                         f"{cfg.ALGORITHM}'s advantages were all 0 and the policy was not trained, {fix}")
    if norms and max(norms) == 0.0:  # scale_rewards: batch: TRL's frac_reward_zero_std is the batch's spread, not
        # the groups' (0.0 when every group scored alike but prompts apart): the first step's policy is the
        # reference, so a zero gradient there and after is every advantage 0
        raise StageError(f"stage '{ctx.name}': in all {len(norms)} logged steps the gradient norm was 0 "
                         f"(train/grad_norm): every group of {cfg.num_generations} completions got one score from "
                         f"{cfg.reward} (each its own), {cfg.ALGORITHM}'s advantages were all 0 and the policy was "
                         f"not trained, {fix}")


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

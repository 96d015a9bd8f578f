"""Per-stage settings checks that run at validation time, before any process is launched.

Each check raises ValueError naming the field and the fix. They are cheap: no model is loaded.
"""

from __future__ import annotations

from typing import Any, Callable

from align.config import (DPOStage, EvaluateStage, PipelineConfig, PPOStage, PreferencesStage, RewardStage,
                          SFTStage, TrainedStage)


def check_trained(cfg: TrainedStage) -> None:
    """Cross-field settings every TRL-trained stage needs (single-field ranges are declared on the config
    fields, align/schema.py); also called by the stage process itself."""
    if cfg.save_steps % cfg.logging_steps:
        raise ValueError(f"save_steps ({cfg.save_steps}) must be a multiple of logging_steps ({cfg.logging_steps}) "
                         "so a NaN loss is caught before a checkpoint is written")


def check_stage(plan: Any, pipeline: PipelineConfig, split_of: Callable) -> None:
    cfg = plan.cfg
    if isinstance(cfg, TrainedStage):
        check_trained(cfg)
    if isinstance(cfg, SFTStage):
        if cfg.model != "base" and cfg.model not in pipeline.stages:
            raise ValueError(f"model: '{cfg.model}' is neither `base` nor a stage of this pipeline")
        if "data" in plan.cards:
            produces = split_of(plan.cards["data"], cfg.split).card.produces
            if produces not in ("prompt_completion", "messages"):
                raise ValueError(f"data: card produces '{produces}'; sft needs prompt_completion or messages")
    if isinstance(cfg, (RewardStage, DPOStage)) and "data" in plan.cards:
        produces = split_of(plan.cards["data"], "train").card.produces
        if produces != "preference":
            raise ValueError(f"data: card produces '{produces}'; {cfg.type} needs preference pairs")
    if isinstance(cfg, PreferencesStage):
        _check_judge_field("judge", cfg.judge, pipeline)
    if isinstance(cfg, PPOStage):
        check_ppo(cfg, pipeline)
    if isinstance(cfg, EvaluateStage):
        if cfg.baseline not in cfg.policies:
            raise ValueError(f"baseline: '{cfg.baseline}' must be one of policies {cfg.policies}")
        for j in cfg.judges:
            if j in pipeline.stages:
                raise ValueError(f"judges: '{j}' is a stage; a reward stage goes in `reward:`, `judges:` lists "
                                 "Python judges (vader, or your own module:function)")
            _check_judge_field("judges", j, pipeline)


def _check_judge_field(field: str, spec, pipeline: PipelineConfig) -> None:
    from align.judges import JudgeError, check_judges

    stages = pipeline.stages
    try:
        check_judges(spec, {n for n, st in stages.items() if st.type == "reward"}, {n: st.type for n, st in stages.items()})
    except JudgeError as exc:
        raise ValueError(f"{field}: {exc}") from None


def check_ppo(cfg: PPOStage, pipeline: PipelineConfig) -> None:
    from align.judges import judge_weights

    _check_judge_field("reward", cfg.reward, pipeline)
    reward_stages = {n for n, st in pipeline.stages.items() if st.type == "reward"}
    used = [n for n in judge_weights(cfg.reward) if n in reward_stages]
    if cfg.value_init == "reward" and len(used) != 1:
        raise ValueError(f"value_init: 'reward' starts the value model from the reward model, but reward "
                         f"{cfg.reward!r} names {len(used)} reward stages; set value_init: policy")
    step = cfg.mini_batch_size * cfg.gradient_accumulation_steps
    if cfg.rollout_batch_size % step:
        raise ValueError(f"rollout_batch_size ({cfg.rollout_batch_size}) must be divisible by mini_batch_size x "
                         f"gradient_accumulation_steps ({cfg.mini_batch_size} x {cfg.gradient_accumulation_steps})")


def check_response_lengths(pipeline: PipelineConfig) -> list[str]:
    """PPO optimises responses of `generation.max_new_tokens`; its reward model learned from pairs sampled at
    the preferences stage's length, and the evaluation samples at its own. When they differ, PPO learns what a
    reward model says of responses it never saw (e.g. cut off before EOS) and is judged at yet another length.
    Returns one message per mismatch, naming the three settings."""
    from align.judges import judge_weights

    stages = pipeline.stages
    problems = []
    for name, st in stages.items():
        if st.type != "ppo":
            continue
        lengths = {f"stages.{name}.generation.max_new_tokens": st.generation.max_new_tokens}
        for rm in (n for n in judge_weights(st.reward) if n in stages and stages[n].type == "reward"):
            data = stages[rm].data
            if data in stages and stages[data].type == "preferences":
                lengths[f"stages.{data}.generation.max_new_tokens"] = stages[data].generation.max_new_tokens
        for ev_name, ev in stages.items():
            if ev.type == "evaluate" and name in ev.policies:
                lengths[f"stages.{ev_name}.generation.max_new_tokens"] = ev.generation.max_new_tokens
        if len(set(lengths.values())) > 1:
            problems.append("response lengths differ: " + ", ".join(f"{k}={v}" for k, v in lengths.items())
                            + f"; PPO would optimise {lengths[f'stages.{name}.generation.max_new_tokens']}-token "
                            "responses against a reward model trained on, and an evaluation run at, other lengths. "
                            "Set them equal")
    return problems

"""Per-stage settings checks that run at validation time, before any process is launched.

Each check raises ValueError naming the field and the fix. They are cheap: no model is loaded.
"""

from __future__ import annotations

from typing import Any, Callable

from align.config import (DPOStage, EvaluateStage, PipelineConfig, PPOStage, PreferencesStage, RewardStage,
                          SFTStage, TrainedStage)


def check_trained(cfg: TrainedStage) -> None:
    """Settings every TRL-trained stage needs; also called by the stage process itself."""
    if cfg.save_steps % cfg.logging_steps:
        raise ValueError(f"save_steps ({cfg.save_steps}) must be a multiple of logging_steps ({cfg.logging_steps}) "
                         "so a NaN loss is caught before a checkpoint is written")
    if cfg.per_device_batch_size < 1 or cfg.gradient_accumulation_steps < 1:
        raise ValueError("per_device_batch_size and gradient_accumulation_steps must be >= 1")
    if cfg.learning_rate <= 0:
        raise ValueError(f"learning_rate must be > 0, got {cfg.learning_rate}")


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
    if isinstance(cfg, (RewardStage, DPOStage)) and cfg.data in pipeline.stages:
        if pipeline.stages[cfg.data].type != "preferences":
            raise ValueError(f"data: stage '{cfg.data}' is a {pipeline.stages[cfg.data].type} stage; "
                             "pairs come from a preferences stage or a preference data card")
    if isinstance(cfg, PreferencesStage):
        if cfg.samples_per_prompt < 2:
            raise ValueError(f"samples_per_prompt must be >= 2 to form a pair, got {cfg.samples_per_prompt}")
        if cfg.judge not in pipeline.stages:
            from align.judges import PYTHON_JUDGES

            if cfg.judge not in PYTHON_JUDGES:
                raise ValueError(f"judge: '{cfg.judge}' is neither a stage nor a known judge ({sorted(PYTHON_JUDGES)})")
        elif pipeline.stages[cfg.judge].type != "reward":
            raise ValueError(f"judge: stage '{cfg.judge}' is not a reward stage")
    if isinstance(cfg, PPOStage):
        check_ppo(cfg, pipeline)
    if isinstance(cfg, EvaluateStage):
        if cfg.baseline not in cfg.policies:
            raise ValueError(f"baseline: '{cfg.baseline}' must be one of policies {cfg.policies}")
        from align.judges import PYTHON_JUDGES

        for j in cfg.judges:
            if j not in PYTHON_JUDGES:
                raise ValueError(f"judges: unknown judge '{j}'; known: {sorted(PYTHON_JUDGES)}")


def check_ppo(cfg: PPOStage, pipeline: PipelineConfig) -> None:
    if pipeline.stages[cfg.reward].type != "reward":
        raise ValueError(f"reward: stage '{cfg.reward}' is a {pipeline.stages[cfg.reward].type} stage, not a reward stage")
    if cfg.value_init not in ("reward", "policy"):
        raise ValueError(f"value_init: '{cfg.value_init}'; use `reward` or `policy`")
    step = cfg.mini_batch_size * cfg.gradient_accumulation_steps
    if cfg.rollout_batch_size % step:
        raise ValueError(f"rollout_batch_size ({cfg.rollout_batch_size}) must be divisible by mini_batch_size x "
                         f"gradient_accumulation_steps ({cfg.mini_batch_size} x {cfg.gradient_accumulation_steps})")
    if cfg.kl.estimator not in ("k1", "k2", "k3"):
        raise ValueError(f"kl.estimator: '{cfg.kl.estimator}'; use k1, k2 or k3")

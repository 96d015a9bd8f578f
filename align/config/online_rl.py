"""What the `grpo` and `rloo` stage types share: TRL's online trainers that sample a group of completions per
prompt from the policy, score them with a judge (a reward stage, Python judges, or a weighted sum, as PPO's
`reward:`), and take the group as the baseline for each completion's advantage (align/stages/online_rl.py).

`OnlineRLStage` has no TYPE, so it registers nothing; grpo.py and rloo.py subclass it with their own settings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

from align.config.contract import (HeldModel, DATA, POLICY, PROMPTS_ONLY, CheckContext, StageBase,
                                 TrainedStage)
from align.config.online import lora_sync_problem, response_length_problems, reward_length_problems, reward_stages
from align.config.settings import Generation
from align.engines import DEFAULT as DEFAULT_ENGINE, engine_names, holds_own_copy, kind
from align.core.schema import ranged, step_size


@dataclass
class OnlineRLStage(TrainedStage):
    """Group-sampled policy optimisation with a TRL trainer: num_generations completions per prompt, each
    scored, its advantage measured against the others of its group; KL to the starting policy (beta)."""

    LEFT_PADDED: ClassVar[bool] = True

    # hf: TRL's own generate; an engine with its own copy that samples token ids (vllm): align/stages/online_engine.py
    ENGINES: ClassVar[tuple[str, ...]] = tuple(n for n in engine_names() if n == DEFAULT_ENGINE or kind(n).token_ids)
    ENGINE_NOTE: ClassVar[str] = ("TRL's trainers hand over prompts as token ids, so an engine other than hf must "
                                  "hold its own copy and sample ids (EngineKind.token_ids)")

    PROMPTS: ClassVar[str] = "train"
    HEADLINE: ClassVar[tuple[str, ...]] = ("objective/scores_last", "objective/kl_per_token_last")
    CLIPS: ClassVar[tuple[str, ...]] = ("epsilon",)
    """The settings of the ratio's clip (unread where every round trains in the optimiser step it was sampled for)."""
    PRODUCES: ClassVar[str] = POLICY
    INPUTS: ClassVar[dict[str, tuple[str, bool]]] = {
        "policy": (POLICY, True), "reward": ("judge", False), "prompts": (DATA, False)}
    CARDS: ClassVar[dict[str, str]] = {"prompts": PROMPTS_ONLY}
    ALGORITHM: ClassVar[str] = ""
    """The trainer's name in messages (GRPO, RLOO)."""

    learning_rate: float = step_size(1e-6)
    """Peak learning rate: 1e-6 (TRL's GRPO default; full fine-tuning of 7-8B policies); a small model trained from
    scratch needs ~1e-3."""
    policy: str = "sft"
    """Stage whose model/ is the starting policy and the frozen reference."""
    reward: str | dict[str, float] = "reward"
    """What is maximised, as PPO's `reward:`: a reward stage (its scalar head read at the last real token of
    prompt + completion ids, as PPO reads it), a Python judge (`vader`, `length`, or a user's `module:function`
    taking (prompts, responses)), or a weighted sum of these as a mapping, e.g. {reward: 1.0, vader: 0.5}."""
    prompts: str = ""
    """Data card path, or a data stage (preferences): its distinct `prompt`s are used."""
    split: str = "train"
    """Split of the card (or of the data stage's output) to take prompts from."""
    num_generations: int = ranged(8, ge=2, fix="the group baseline needs at least 2 completions per prompt")
    """Completions sampled per prompt (G): each is judged against the others of its group."""
    steps_per_generation: int | None = ranged(None, ge=1, fix="use null for gradient_accumulation_steps")
    """Optimiser micro-steps served by one round of generation (None = gradient_accumulation_steps). One round
    samples per_device_batch_size x processes x steps_per_generation completions, which must be whole groups."""
    num_iterations: int = ranged(1, ge=1)
    """Optimisation passes over each generation round (mu; >1 reuses samples with the clipped ratio)."""
    epsilon: float = ranged(0.2, gt=0, lt=1, fix="the ratio's lower clip 1 - epsilon must stay above 0 to bind")
    """Clip range of the importance ratio (as PPO's clip_range)."""
    beta: float = ranged(0.05, ge=0, fix="a negative coefficient rewards moving away from the reference")
    """KL coefficient to the reference (the starting policy); 0 = no reference is held."""
    generation: Generation = field(default_factory=Generation)
    """Sampling settings: max_new_tokens (TRL's max_completion_length), temperature, top_k, top_p, and the engine:
    hf (TRL's own generate with the trained model) or vllm (align's engine, one per process, synced after each
    optimiser step; align/stages/online_engine.py). Each process's whole generation round is one call, so `batch_size`
    and `fast` are not used."""

    def check(self, ctx: CheckContext) -> None:
        super().check(ctx)
        problem = lora_sync_problem(self.generation, self.lora) or (self.beta and self.generation.truncation_problem(
            f"{self.ALGORITHM}'s KL to the reference (beta {self.beta:g})"))
        if problem:
            raise ValueError(problem)
        ctx.check_judge("reward", self.reward)
        if self.generation.max_new_tokens >= self.max_length:
            raise ValueError(f"generation.max_new_tokens ({self.generation.max_new_tokens}) leaves no room for a "
                             f"prompt within max_length ({self.max_length}); raise max_length or lower max_new_tokens")
        cycle = (self.steps_per_generation or self.gradient_accumulation_steps) * self.num_iterations
        ga = self.gradient_accumulation_steps
        if cycle % ga and ga % cycle:  # an epoch's last optimiser step takes what is left: later steps straddle rounds
            raise ValueError(f"steps_per_generation x num_iterations ({cycle} micro-steps a round) and gradient_"
                             f"accumulation_steps ({ga}) divide neither one the other: an epoch that ends inside an "
                             "accumulation window shifts every later checkpoint into a generation round (a resume "
                             "samples one round again and trains another on part of its data); make one a multiple of "
                             "the other (steps_per_generation: null takes gradient_accumulation_steps)")
        if self.num_iterations > 1 and ga % cycle == 0:  # TRL then keeps no old log-probs: the ratio is 1
            raise ValueError(f"num_iterations: {self.num_iterations} with steps_per_generation x num_iterations "
                             f"({cycle} micro-steps a round) dividing gradient_accumulation_steps ({ga}): every pass "
                             "over a round falls inside one optimiser step, so none sees an updated policy and the "
                             "passes only add the same gradient again; make steps_per_generation a multiple of "
                             "gradient_accumulation_steps, or use num_iterations: 1")
        if (self.save_steps * self.gradient_accumulation_steps) % cycle:  # TRL counts rounds from 0 at a resume
            unit = cycle // math.gcd(cycle, self.gradient_accumulation_steps)
            raise ValueError(f"save_steps ({self.save_steps}) would put checkpoints inside a generation round "
                             f"(steps_per_generation x num_iterations = {cycle} micro-steps, gradient_accumulation_"
                             f"steps {self.gradient_accumulation_steps}): a resume from one regenerates and trains "
                             f"that round's prompts again; set save_steps to a multiple of {unit}")
        hw, distributed = ctx.pipeline.hardware, self.accelerate != "cpu"
        per_node = self.num_processes or (hw.gpus_per_node if distributed else 1)  # one process per GPU by default
        if per_node:  # else (a distributed config, no count given) the count is known only at launch
            world = per_node * (hw.nodes if distributed else 1)
            problem = self.batch_problem(world)
            if problem:
                raise ValueError(problem)
            needed = self.prompts_per_round(world)
            if self.max_train_examples is not None and self.max_train_examples < needed:
                raise ValueError(f"max_train_examples: {self.max_train_examples} prompts, but one generation round "
                                 f"takes {needed} (per_device_batch_size x {world} process(es) x steps per round / "
                                 f"num_generations); raise max_train_examples to at least {needed}, or lower "
                                 "per_device_batch_size")

    def unread_settings(self) -> dict[str, str]:
        """Settings this stage does not read (dotted key -> why): a sweep over one trains twins."""
        unread = dict.fromkeys(("generation.batch_size", "generation.fast"), "a generation round is one call per process")
        cycle = (self.steps_per_generation or self.gradient_accumulation_steps) * self.num_iterations
        if self.gradient_accumulation_steps % cycle == 0:
            unread.update(dict.fromkeys(self.CLIPS, "every round is trained in the optimiser step it was sampled for: "
                                        "the ratio is 1 and the clip never binds"))  # (num_iterations 1: else refused)
        if holds_own_copy(self.generation.engine):
            unread["generation.zero3_gather"] = f"the {self.generation.engine} engine samples from its own copy"
        return {**super().unread_settings(), **unread}

    def card_split(self, fld: str) -> str:
        return self.split

    def generation_settings(self) -> Generation:
        return self.generation

    def completions_per_round(self, world: int) -> int:
        """Completions one generation round samples over `world` processes (TRL's generation_batch_size)."""
        return self.per_device_batch_size * world * (self.steps_per_generation or self.gradient_accumulation_steps)

    def prompts_per_round(self, world: int) -> int:
        """Prompts one generation round takes (TRL's RepeatSampler: whole rounds only)."""
        return self.completions_per_round(world) // self.num_generations

    def batch_problem(self, world: int) -> str | None:
        """TRL's rule, named in align's fields: a generation round holds whole groups of num_generations."""
        steps = self.steps_per_generation or self.gradient_accumulation_steps
        per_round = self.completions_per_round(world)
        if per_round % self.num_generations == 0:
            return None
        which = "steps_per_generation" if self.steps_per_generation else "gradient_accumulation_steps"
        return (f"per_device_batch_size x processes x {which} ({self.per_device_batch_size} x {world} x {steps} = "
                f"{per_round} completions per generation round) must be divisible by num_generations "
                f"({self.num_generations}), so every prompt's group of completions is sampled in one round; change "
                f"per_device_batch_size, {which} or num_generations")

    def pipeline_problems(self, name: str, stages: dict[str, StageBase]) -> list[str]:
        """As PPO's: the responses optimised here, those the reward model learned from (its preferences stage) and
        those the evaluation samples must have one length."""
        return (response_length_problems(name, self.ALGORITHM, self.generation.max_new_tokens, self.reward, stages)
                + reward_length_problems(name, self.max_length, "max_length", self.reward, stages))

    def held_models(self, stages: dict[str, StageBase]) -> list[HeldModel]:
        held = [HeldModel("policy", "lm", True)]
        if self.beta and not self.lora.enabled:  # with LoRA the reference is the base with adapters disabled
            held.append(HeldModel("reference", "lm", False))  # TRL shards it under ZeRO-3
        rewards = reward_stages(self.reward, stages)
        # a reward model scores from a Python reward function (align/stages/online_rl.py): whole on every GPU
        return held + [HeldModel("reward", "scalar", False, False)] * len(rewards)

    def gathers_policy_for_generation(self) -> bool:  # TRL samples from the whole policy, gathered
        # (ds3_gather_for_generation: zero3_gather whole); an engine of align's from its own copy, synced by layers
        return not holds_own_copy(self.generation.engine) and self.generation.zero3_gather == "whole"

    def workload(self) -> tuple[int, int, int, int]:
        return self.per_device_batch_size, self.max_length, self.completions_per_round(1), self.max_length

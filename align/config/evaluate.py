"""The `evaluate` stage type: held-out comparison of policies with judges, KL and win rates
(align/stages/evaluate.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from align.engines import engine_names
from align.config.contract import HeldModel, DATA, POLICY, PROMPTS_ONLY, REPORT, REWARD_MODEL, CheckContext, StageBase
from align.config.online import reply_room_check, reward_room_problems
from align.config.settings import Generation, PairwiseJudge
from align.core.schema import ranged
from align.data.lengths import LengthRule


@dataclass
class EvaluateStage(StageBase):
    """Sample held-out prompts from each policy and compare them with judges, KL and win rates."""

    ENGINES: ClassVar[tuple[str, ...]] = engine_names()  # every engine (align/engines/)
    ENGINE_MODEL: ClassVar[str] = "reference"  # the engine starts from it; every policy reaches it by a sync
    TYPE: ClassVar[str] = "evaluate"
    PROMPTS: ClassVar[str] = "held_out"
    HEADLINE: ClassVar[tuple[str, ...]] = ("eval/prompts",)
    PRODUCES: ClassVar[str] = REPORT
    INPUTS: ClassVar[dict[str, tuple[str, bool]]] = {
        "policies": (POLICY, True), "baseline": (POLICY, True), "reference": (POLICY, True),
        "reward": (REWARD_MODEL, True), "preferences": (DATA, True)}
    CARDS: ClassVar[dict[str, str]] = {"prompts": PROMPTS_ONLY}
    WORK: ClassVar[str] = "eval/prompts"
    DIVERGED: ClassVar[tuple[str, ...]] = ()  # nothing trains; a NaN (an lc win rate, an agreement) reads "n/a"

    policies: list[str] = field(default_factory=lambda: ["sft"])
    """Stages whose model/ to evaluate."""
    baseline: str = "sft"
    """Policy that win rates are measured against."""
    reference: str = "sft"
    """Policy that KL is measured against."""
    reward: str | None = "reward"
    """Reward stage used as a judge and for reward-model accuracy (None = skip)."""
    preferences: str | None = "preferences"
    """Preferences stage whose held-out pairs measure reward-model accuracy (None = skip)."""
    judges: list[str] = field(default_factory=lambda: ["vader"])
    """Python judges (vader, or your own module:function), gold scorers reported beside the reward model."""
    pairwise: list[PairwiseJudge] = field(default_factory=list)
    """Pairwise LLM judges (a local model or an OpenAI-compatible endpoint): each policy's responses against the
    baseline's on the same prompts, judged in both orders; win rate, ties, position consistency, invalid answers,
    a length-controlled win rate, and agreement with the gold judges (align/judges/pairwise.py)."""
    prompts: str = ""
    """Data card path; its `prompt` column is used."""
    split: str = "test"
    """Held-out split of the card."""
    max_prompts: int | None = ranged(512, ge=1, fix="use null for all prompts")
    """Evaluate on at most this many prompts, a seeded uniform sample of the split's (None = all)."""
    bootstrap_samples: int = ranged(2000, ge=100, fix="fewer resamples give confidence intervals that are noise")
    """Bootstrap resamples for confidence intervals."""
    generation: Generation = field(default_factory=Generation)
    """Decoding settings (identical for every policy)."""

    def check(self, ctx: CheckContext) -> None:
        problem = self.generation.truncation_problem("the report's KL to the reference")
        if problem:
            raise ValueError(problem)
        repeated = sorted({p for p in self.policies if self.policies.count(p) > 1})
        if repeated:
            raise ValueError(f"policies: {self.policies} names {', '.join(repeated)} more than once; each policy is "
                             "compared once, so list it once")
        if self.baseline not in self.policies:
            raise ValueError(f"baseline: '{self.baseline}' must be one of policies {self.policies}")
        if "prompt" in self.policies:  # samples.jsonl's rows: {"prompt": ..., <policy>: {...}, ...}
            raise ValueError("policies: a stage named 'prompt' would replace the prompt in report/samples.jsonl "
                             "(each row holds the prompt beside every policy's sample); rename that stage")
        for j in self.judges:
            if j in ctx.pipeline.stages:
                raise ValueError(f"judges: '{j}' is a stage; a reward stage goes in `reward:`, `judges:` lists "
                                 "Python judges (vader, or your own module:function)")
            ctx.check_judge("judges", j)
        names = [*self.judges, "reward_model"]
        for i, judge in enumerate(self.pairwise):
            if judge.name in names or judge.name in ("response", "kl"):  # a sample's own fields in samples.jsonl
                raise ValueError(f"pairwise[{i}].name: '{judge.name}' is taken by another judge of this stage or by "
                                 "a sample's own fields (response, kl); give it a name of its own")
            names.append(judge.name)
            judge.check(f"pairwise[{i}]", ctx.base_dir)
        if self.pairwise and self.policies == [self.baseline]:
            raise ValueError(f"pairwise: each policy is judged against the baseline '{self.baseline}', and policies "
                             f"lists no other, so nothing would be judged; add the policies to compare, or remove "
                             "pairwise")

    def pipeline_problems(self, name: str, stages: dict[str, StageBase]) -> list[str]:
        return reward_room_problems(name, self.generation.max_new_tokens, self.reward, stages)

    def length_check(self, fld: str, stages: dict[str, StageBase]) -> tuple[LengthRule, int, float] | None:
        return reply_room_check(self.generation.max_new_tokens, self.reward, stages) if fld == "prompts" else None

    def references(self, role: str) -> list[str]:
        return super().references(role) + (list(self.judges) if role == "judge" else [])  # its gold judges too

    def relative_files(self) -> dict[str, str]:
        return {f"pairwise.{i}.template": j.template for i, j in enumerate(self.pairwise) if j.template}

    def local_models(self) -> dict[str, str]:
        return {f"pairwise.{i}.model": j.model for i, j in enumerate(self.pairwise) if j.loads_a_model()}

    def card_split(self, fld: str) -> str:
        return self.split

    def generation_settings(self) -> Generation:
        return self.generation

    def scoring_bytes(self, vocab: int) -> int:
        """The logits one scoring call holds (align/stages/evaluate.py scored_logprobs), for the memory estimate."""
        rows = min(self.generation.batch_size, scoring_rows(self.generation.max_new_tokens, vocab))
        return 8 * rows * self.generation.max_new_tokens * vocab

    def held_models(self, stages: dict[str, StageBase]) -> list[HeldModel]:
        """One policy at a time, the reference and the reward model, each whole on every GPU (nothing trains)."""
        return [HeldModel("policy", "lm", False, False), HeldModel("reference", "lm", False, False)] + \
            ([HeldModel("reward", "scalar", False, False)] if self.reward else [])


SCORING_BYTES = 2 * 2 ** 30
"""The most one scoring call of evaluate holds in logits: without a fused head, scoring a batch keeps ~8 bytes per
response token per vocabulary entry (an fp32 copy and its log-softmax): 31 GiB for 32 replies of 1024 tokens at
Llama-3's 128k vocabulary, counted by no estimate. A batch past it is scored a slice of rows at a time."""


def scoring_rows(length: int, vocab: int) -> int:
    """Rows of `length` response tokens whose scoring logits (8 bytes an entry) fit SCORING_BYTES (at least one)."""
    return max(1, SCORING_BYTES // max(1, 8 * length * vocab))

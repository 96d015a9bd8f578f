"""The `preferences` stage type: judged preference pairs sampled from a policy (align/stages/preferences.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from align.engines import engine_names
from align.config.contract import HeldModel, DATA, POLICY, PROMPTS_ONLY, CheckContext, StageBase
from align.config.online import reply_room_check, reward_room_problems, reward_stages
from align.config.settings import Generation, PairwiseJudge
from align.core.schema import ranged
from align.data.formats import row_prompt_key
from align.data.lengths import LengthRule


@dataclass
class PreferencesStage(StageBase):
    """Sample several completions per prompt from a policy and keep judged (chosen, rejected) pairs."""

    ENGINES: ClassVar[tuple[str, ...]] = engine_names()  # every engine (align/engines/)
    TYPE: ClassVar[str] = "preferences"
    PROMPTS: ClassVar[str] = "train"
    HEADLINE: ClassVar[tuple[str, ...]] = ("preferences/pairs_train", "preferences/mean_margin")
    PRODUCES: ClassVar[str] = DATA
    INPUTS: ClassVar[dict[str, tuple[str, bool]]] = {"policy": (POLICY, True), "judge": ("judge", False)}
    CARDS: ClassVar[dict[str, str]] = {"prompts": PROMPTS_ONLY}
    WORK: ClassVar[str] = "preferences/prompts"
    PAIR_SPLITS: ClassVar[tuple[str, ...]] = ("train", "test", "train_all_pairs")
    """The splits of pairs the stage writes (align/stages/preferences.py): a reward stage's `split` names one."""

    policy: str = "sft"
    """Stage whose model/ samples the completions."""
    prompts: str = ""
    """Data card path; its `prompt` column is used."""
    split: str = "train"
    """Split of the card to take prompts from."""
    max_prompts: int | None = ranged(2048, ge=1, fix="use null for all prompts")
    """Use at most this many prompts, a seeded uniform sample of the split's (None = all)."""
    samples_per_prompt: int = ranged(4, ge=2, fix="a pair needs two completions")
    """Completions per prompt (>= 2); the best and worst by the judge form the pair (2 with a pairwise judge, which
    compares two)."""
    judge: str | dict[str, float] = "vader"
    """A reward stage, a Python judge (vader, or your own module:function), or a weighted sum of them as a
    mapping (see align/judges/__init__.py)."""
    pairwise: PairwiseJudge | None = None
    """Label pairs with a pairwise LLM judge instead of `judge` (RLAIF): the first two samples of each prompt are
    judged in both orders; a consistent verdict makes the pair, a tie or a flip is dropped as a tie, and
    `min_margin` does not apply."""
    min_margin: float = ranged(0.05, ge=0)
    """Pairs whose judge scores differ by less than this are ties: dropped and counted."""
    drop_unfinished: bool = True
    """Leave out of every pair a sample that did not end (no EOS within generation.max_new_tokens): TRL's DPO, KTO
    and reward trainers append EOS to a reply as text, so a cut sample would be trained as a reply that ends there.
    Counted (`preferences/unfinished_samples`); a prompt left with fewer than two finished samples makes no pair.
    false: pair every sample, cut ones too."""
    test_fraction: float = ranged(0.1, gt=0, lt=1, fix="the reward and evaluate stages need held-out pairs")
    """Fraction of prompts whose pairs go to the held-out `test` split: each prompt by a hash of it and the stage's
    seed, so preferences stages with the same seed and test_fraction hold out the same prompts, whatever else they
    sample (iterated DPO's rounds never test on a prompt an earlier round trained on; a larger test_fraction holds
    out a superset). The count is about test_fraction x prompts; with two or more prompts at least one is held out
    and one kept."""
    generation: Generation = field(default_factory=Generation)
    """Decoding settings."""

    def check(self, ctx: CheckContext) -> None:
        if self.pairwise is not None:
            n = self.samples_per_prompt
            if n != 2:
                raise ValueError(f"samples_per_prompt: {n} with a pairwise judge, which compares the first two responses "
                                 f"of each prompt: the other {n - 2} would be sampled for nothing; set "
                                 "samples_per_prompt: 2")
            if self.pairwise.max_prompts is not None:
                raise ValueError(f"pairwise.max_prompts: {self.pairwise.max_prompts}: a preferences stage judges every "
                                 "prompt it samples; set the stage's max_prompts instead, and pairwise.max_prompts: null")
            self.pairwise.check("pairwise", ctx.base_dir)  # last: it may ask the endpoint
        else:
            ctx.check_judge("judge", self.judge)
        if "prompts" in ctx.cards:
            self._check_split(ctx.split_of(ctx.cards["prompts"], self.split), ctx.cards["prompts"].name)

    def _check_split(self, loaded, card: str) -> None:
        """Both splits of pairs get prompts: the stage holds out about test_fraction x prompts of its distinct ones
        (refused here when that rounds to none or all of them)."""
        if not loaded.available:
            return
        n = len({k for k in map(row_prompt_key, loaded.rows) if k is not None})
        n = n if self.max_prompts is None else min(n, self.max_prompts)
        held = round(self.test_fraction * n)
        if n and held in (0, n):
            which, fix = ("held-out", "raise test_fraction or max_prompts") if held == 0 else \
                ("training", "lower test_fraction or raise max_prompts")
            raise ValueError(f"test_fraction: {self.test_fraction} of {n} prompts ({card} split '{self.split}') "
                             f"holds out {held}: no {which} pairs would be written; {fix}")

    def pipeline_problems(self, name: str, stages: dict[str, StageBase]) -> list[str]:
        """A stage training on these pairs whose `max_length` cannot hold a reply of `generation.max_new_tokens`
        after any prompt: it drops or cuts such pairs, and refuses once too many are (after this stage sampled)."""
        tokens = self.generation.max_new_tokens
        return [f"stages.{other}.max_length: {st.max_length} cannot hold a reply of stages.{name}.generation."
                f"max_new_tokens ({tokens} tokens) after any prompt: {st.TYPE} would drop or cut such pairs (refusing "
                f"after {name} has sampled once more than max_truncated_fraction are); raise max_length above "
                "max_new_tokens plus the prompts' length, or lower max_new_tokens"
                for other, st in stages.items() if name in st.references(DATA)
                and isinstance(getattr(st, "max_length", None), int) and tokens >= st.max_length] + \
            ([] if self.pairwise else reward_room_problems(name, tokens, self.judge, stages))

    def length_check(self, fld: str, stages: dict[str, StageBase]) -> tuple[LengthRule, int, float] | None:
        if fld != "prompts" or self.pairwise is not None:  # a pairwise judge scores with no reward model
            return None
        return reply_room_check(self.generation.max_new_tokens, self.judge, stages)

    def unread_settings(self) -> dict[str, str]:
        if self.pairwise is None:
            return {}
        return dict.fromkeys(("judge", "min_margin"), "a pairwise judge labels the pairs")

    def relative_files(self) -> dict[str, str]:
        return {"pairwise.template": self.pairwise.template} if self.pairwise and self.pairwise.template else {}

    def local_models(self) -> dict[str, str]:
        return {"pairwise.model": self.pairwise.model} if self.pairwise and self.pairwise.loads_a_model() else {}

    def card_split(self, fld: str) -> str:
        return self.split

    def generation_settings(self) -> Generation:
        return self.generation

    def held_models(self, stages: dict[str, StageBase]) -> list[HeldModel]:
        """Nothing trains: each model whole on every GPU."""
        rewards = reward_stages(self.judge, stages)
        return [HeldModel("policy", "lm", False, False)] + [HeldModel("judge", "scalar", False, False)] * len(rewards)

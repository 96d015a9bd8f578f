"""The one judge builder every stage that scores uses (preferences labels pairs with it, PPO, GRPO and RLOO take
their rewards from it, evaluate reports it), and the one scoring rule for reward models.

A pointwise judge scores each (prompt, response), higher is better. The setting (`ppo.reward`, `preferences.judge`,
`evaluate.judges`, ...) is a name or a weighted mapping of names (`{reward: 1.0, vader: 0.5}`); each name is a
reward-model stage of the pipeline or a Python judge (align/judges/__init__.py: built-in or `module:function`).
`build_judge` turns it into a `WeightedJudge` that scores

- sampled rollouts (`score_rollout`: PPO, preferences, evaluate): a reward model reads the sampled ids (the decoded
  texts when its vocabulary is not the sampler's), a Python judge the decoded texts;
- TRL's completions (`trl_reward_functions`: GRPO, RLOO): prompt ids + completion ids, or texts;
- plain texts (`__call__`: held-out pairs, a user's texts).

**The one rule for a reward model** (`RewardModelJudge`): its scalar head at the last real, non-pad token of the
sequence (transformers' sequence-classification rule, `losses.last_token_index`), positions from the attention
mask, whatever the padding side. The ids are the sampled ones as they are (EOS included when it was sampled), or,
for text, `prompt + response + EOS` tokenised as one text: what TRL's RewardTrainer trained the model on.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable

import torch

from align.judges import Judge, JudgeError, judge_weights, python_judge
from align.modeling.generation import Rollout, scalar_outputs
from align.modeling.losses import last_token_index

ScalarOutputs = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(ids, mask) (B, T) -> the scalar head's output at every token (B, T): `scalar_outputs` of a loaded model, a
DeepSpeed-prepared one, or PPO's FrozenView (a LoRA model's base)."""


class RewardModelJudge:
    """A reward-model stage as a judge: the one scoring rule (module docstring)."""

    def __init__(self, name: str, outputs: ScalarOutputs, tokenizer, batch_size: int = 64, autocast=None):
        self.__name__ = self.name = name  # TRL logs rewards/<name>/mean
        self.outputs, self.tokenizer, self.batch_size = outputs, tokenizer, batch_size
        self.autocast = autocast

    @classmethod
    def load(cls, name: str, model_dir: str, load: Callable[[str, int | None], Any] | None = None,
             batch_size: int = 64, autocast=None, trust_remote_code: bool = False) -> RewardModelJudge:
        """From a reward stage's model/: `load(path, pad_token_id)` loads the model (a stage passes its own, for
        device, dtype and attention kernel; and the pipeline's trust_remote_code, as the model loads with it)."""
        from align.modeling.models import load_scalar_model, load_tokenizer

        tokenizer = load_tokenizer(model_dir, trust_remote_code)
        model = (load or load_scalar_model)(model_dir, tokenizer.pad_token_id).eval()
        judge = cls(name, lambda ids, mask: scalar_outputs(model, ids, mask), tokenizer, batch_size, autocast)
        judge.model = model
        return judge

    @torch.no_grad()
    def score_ids(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The rule: the head's output at each row's last real, non-pad token (B,)."""
        with self.autocast() if self.autocast else contextlib.nullcontext():
            per_token = self.outputs(ids, mask)
        return per_token[torch.arange(ids.size(0), device=ids.device),
                         last_token_index(ids, mask, self.tokenizer.pad_token_id)].float()

    def score_sequences(self, seqs: list[list[int]], device=None) -> list[float]:
        """Whole token sequences, right-padded in batches (positions come from the mask, so padding changes
        nothing)."""
        pad = self.tokenizer.pad_token_id
        out: list[float] = []
        for start in range(0, len(seqs), self.batch_size):
            batch = seqs[start:start + self.batch_size]
            width = max(len(s) for s in batch)
            ids = torch.tensor([list(s) + [pad] * (width - len(s)) for s in batch], device=device)
            mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in batch], device=device)
            out += self.score_ids(ids, mask).tolist()
        return out

    def encode(self, prompts: list[str], responses: list[str], ended: list[bool] | None = None) -> list[list[int]]:
        """Text as the model was trained on it: prompt + response + EOS, tokenised as one text (TRL's
        RewardTrainer appends EOS to non-conversational text that does not end with it, and tokenises prompt +
        completion together). `ended`: sampled responses decoded from another vocabulary's ids get EOS only where
        one was sampled (one cut at max_new_tokens is read as the ids rule reads it, unfinished)."""
        eos = self.tokenizer.eos_token
        ends = ended if ended is not None else [not r.endswith(eos) for r in responses]
        return self.tokenizer([p + r + (eos if e else "") for p, r, e in zip(prompts, responses, ends)])["input_ids"]

    def __call__(self, prompts: list[str], responses: list[str], ended: list[bool] | None = None) -> list[float]:
        return self.score_sequences(self.encode(prompts, responses, ended), self.device)

    def score_completions(self, prompts: list[str], completion_ids: list[list[int]]) -> list[float]:
        """TRL's completions (GRPO, RLOO): prompt ids (the tokenizer's, as TRL and PPO tokenise prompts) +
        completion ids (EOS included when sampled)."""
        prompt_ids = self.tokenizer(list(prompts))["input_ids"]
        return self.score_sequences([list(p) + list(c) for p, c in zip(prompt_ids, completion_ids)], self.device)

    def reads_ids_of(self, tokenizer) -> bool:
        """Whether token ids of `tokenizer` mean to this model what they meant when sampled: the same vocabulary,
        added tokens included (asked once per tokenizer)."""
        known = self.__dict__.setdefault("_same_vocab", {})
        if id(tokenizer) not in known:
            known[id(tokenizer)] = tokenizer is self.tokenizer or tokenizer.get_vocab() == self.tokenizer.get_vocab()
        return known[id(tokenizer)]

    @property
    def device(self):
        model = getattr(self, "model", None)
        return next(model.parameters()).device if model is not None else None


class WeightedJudge:
    """sum_i w_i * judge_i over reward-model judges (ids) and Python judges (texts)."""

    def __init__(self, parts: dict[str, tuple[float, Judge | RewardModelJudge]]):
        self.parts = parts

    @property
    def reward_models(self) -> dict[str, RewardModelJudge]:
        return {n: j for n, (_, j) in self.parts.items() if isinstance(j, RewardModelJudge)}

    def __call__(self, prompts: list[str], responses: list[str]) -> list[float]:
        total = [0.0] * len(prompts)
        for weight, judge in self.parts.values():
            total = [t + weight * s for t, s in zip(total, judge(prompts, responses))]
        return total

    def score_rollout(self, r: Rollout, prompts: list[str], tokenizer) -> torch.Tensor:
        """Scores (B,) of sampled responses (sampled with `tokenizer`): reward models read the sampled ids, Python
        judges the decoded texts, and so does a reward model of another vocabulary (evaluate's and preferences':
        PPO, GRPO and RLOO refuse one, `check_same_tokenizer`), which would read the ids as other tokens. The
        prompts are rendered with the pipeline's one chat template, which every stage's tokenizer carries."""
        ids, mask = r.input_ids, r.attention_mask
        total = torch.zeros(ids.size(0), device=ids.device)
        texts = None
        for weight, judge in self.parts.values():
            if isinstance(judge, RewardModelJudge) and judge.reads_ids_of(tokenizer):
                total += weight * judge.score_ids(ids, mask).to(total.device)
                continue
            texts = r.texts(tokenizer) if texts is None else texts
            scores = (judge(prompts, texts, r.eos_found.tolist()) if isinstance(judge, RewardModelJudge)
                      else judge(prompts, texts))
            total += weight * torch.tensor(scores, dtype=torch.float32, device=ids.device)
        return total

    def trl_reward_functions(self) -> tuple[list[Callable[..., list[float]]], list[float]]:
        """One TRL reward function per part and their weights (TRL sums them, and logs rewards/<name>/mean)."""
        funcs, weights = [], []
        for name, (weight, judge) in self.parts.items():
            funcs.append(_TRLReward(name, judge))
            weights.append(weight)
        return funcs, weights


class _TRLReward:
    """A part of a WeightedJudge in TRL's reward-function calling convention."""

    def __init__(self, name: str, judge: Judge | RewardModelJudge):
        self.__name__, self.judge = name, judge

    def __call__(self, prompts: list[str], completions: list[str], completion_ids: list[list[int]],
                 **_: Any) -> list[float]:
        if isinstance(self.judge, RewardModelJudge):
            return self.judge.score_completions(prompts, completion_ids)
        return [float(s) for s in self.judge(list(prompts), list(completions))]


def build_judge(spec: str | dict[str, float], reward_model: Callable[[str], RewardModelJudge | None]) -> WeightedJudge:
    """The judge a setting names. `reward_model(name)` gives the stage's RewardModelJudge for a reward stage of the
    pipeline (None for any other name, which is then a Python judge)."""
    parts: dict[str, tuple[float, Judge | RewardModelJudge]] = {}
    for name, weight in judge_weights(spec).items():
        rm = reward_model(name)
        parts[name] = (weight, rm if rm is not None else python_judge(name))
    return WeightedJudge(parts)


def stage_judge(ctx, spec: str | dict[str, float]) -> WeightedJudge:
    """A setting's judge in a stage process (`ctx`: its StageContext), its reward stages loaded on the process's
    device in the pipeline's dtype and precision: preferences, evaluate, GRPO, RLOO. (PPO prepares its reward models
    for its training backend, ZeRO-3 or LoRA bases, and calls `build_judge` with them.)"""
    return build_judge(spec, lambda n: RewardModelJudge.load(
        n, ctx.input_model(n), load=lambda p, pad: ctx.load_scalar(p, pad, device=True, frozen=True),
        autocast=ctx.compute.autocast, trust_remote_code=ctx.pipeline.trust_remote_code) if n in ctx.inputs else None)


def check_same_tokenizer(stage: str, policy: str, policy_tokenizer, reward_tokenizers: dict[str, Any]) -> None:
    """A reward model reads the policy's token ids: each reward stage's tokenizer must be the policy's."""
    for name, tokenizer in reward_tokenizers.items():
        if tokenizer.get_vocab() != policy_tokenizer.get_vocab():
            raise ValueError(f"stage '{stage}': the reward model's tokenizer ({name}) differs from the policy's "
                             f"({policy}); its score reads the policy's token ids, so both must share one tokenizer "
                             "(train the reward model from the same SFT checkpoint)")


def pairwise_accuracy(judge: RewardModelJudge, pairs: list[dict[str, Any]], rank: int = 0,
                      world: int = 1) -> dict[str, float]:
    """Fraction of pairs whose chosen response scores above the rejected one (a tie counts half, as in every win
    rate: a model that scores both alike is at chance, not wrong; `ties` counts them), and the mean margin (each text
    scored by the one rule, as the model was trained on it: align/judges/pointwise.py).

    Over several processes (`rank` of `world`: a collective every process joins) each scores every world-th batch of
    `judge.batch_size` pairs and the scores are gathered: every process returns what one process would, batch for
    batch the same rows (so the same floats)."""
    size = judge.batch_size
    mine: dict[int, tuple[list[float], list[float]]] = {}
    for start in list(range(0, len(pairs), size))[rank::world]:
        rows = pairs[start:start + size]
        prompts = [p["prompt"] for p in rows]
        mine[start] = (judge(prompts, [p["chosen"] for p in rows]), judge(prompts, [p["rejected"] for p in rows]))
    if world > 1:
        from align.engines.base import all_gather_objects

        mine = {start: scored for share in all_gather_objects(mine) for start, scored in share.items()}
    chosen = [s for start in sorted(mine) for s in mine[start][0]]
    rejected = [s for start in sorted(mine) for s in mine[start][1]]
    margins = [c - r for c, r in zip(chosen, rejected)]
    if (bad := next((i for i, m in enumerate(margins) if not math.isfinite(m)), None)) is not None:  # (every process)
        raise JudgeError(f"reward model '{getattr(judge, 'name', 'reward')}' scored held-out pair {bad} non-finite "
                         f"(chosen {chosen[bad]}, rejected {rejected[bad]}; {sum(not math.isfinite(m) for m in margins)}"
                         " pairs in all): it has non-finite weights or overflowed (score it in float32); a NaN "
                         "counted as a wrong answer")
    return {"accuracy": sum(1.0 if m > 0 else 0.5 if m == 0 else 0.0 for m in margins) / len(margins),  # a tie: half
            "ties": sum(m == 0 for m in margins), "margin": sum(margins) / len(margins),
            "chosen": sum(chosen) / len(chosen), "rejected": sum(rejected) / len(rejected),
            "margins": margins, "chosen_scores": chosen, "rejected_scores": rejected}

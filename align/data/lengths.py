"""How many examples exceed a stage's `max_length` once templated and tokenised, checked before training.

The TRL trainers treat over-long examples differently, and silently: SFTTrainer truncates (a completion-only
example whose prompt fills the window teaches nothing), DPOTrainer truncates and drops pairs whose prompt alone
fills it, RewardTrainer drops pairs whose chosen or rejected sequence is longer. align counts them first, logs
the counts, writes them to the manifest, and refuses to train when more than `max_truncated_fraction` of the
examples would be affected.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Callable


POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
"""Where a model's config.json gives the longest sequence it accepts (the first one present counts)."""


def config_positions(config: dict[str, Any] | None) -> int | None:
    """The longest sequence a model accepts, from its config (a composite's text config where it has one), when
    it says."""
    parts = [(config or {}).get("text_config") or {}, config or {}]
    return next((d[k] for d in parts if isinstance(d, dict) for k in POSITION_KEYS if isinstance(d.get(k), int)), None)


class LengthError(ValueError):
    """Too many examples would be truncated or dropped by a stage's max_length."""


@dataclass
class LengthReport:
    stage: str
    kind: str  # the rule's name
    examples: int
    truncated: int  # the sequence is cut but the example still trains
    dropped: int  # the example is removed or teaches nothing
    longest: int
    max_length: int
    setting: str = "max_length"
    """The stage setting `max_length` stands for (e.g. max_prompt_length for a prompt rule)."""

    @property
    def affected(self) -> int:
        return self.truncated + self.dropped

    @property
    def fraction(self) -> float:
        return self.affected / self.examples if self.examples else 0.0

    def summary(self) -> str:
        return (f"{self.stage}: {self.examples} examples, {self.truncated} truncated and {self.dropped} dropped at "
                f"{self.setting}={self.max_length} ({100 * self.fraction:.1f}%); longest {self.longest} tokens")

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "fraction": round(self.fraction, 6)}


def _ids(tokenizer, texts: list[str]) -> list[int]:
    """Token counts as the trainers tokenise (special tokens such as BOS included)."""
    return [len(x) for x in tokenizer(texts)["input_ids"]] if texts else []


def _reply_ids(tokenizer, texts: list[str]) -> list[list[int]]:
    """Replies' ids as they follow a prompt in the trainers' sequences: no BOS of their own (the prompt's is the
    sequence's), and the EOS every trainer appends to a text reply that does not already end with it."""
    if not texts:
        return []
    eos = tokenizer.eos_token or ""  # none: the trainers append nothing
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return [list(x) + ([] if not eos or t.endswith(eos) else [tokenizer.eos_token_id] * EOS) for x, t in zip(ids, texts)]


def _replies(tokenizer, texts: list[str]) -> list[int]:
    return [len(x) for x in _reply_ids(tokenizer, texts)]


def _chat_lengths(tokenizer, conversations: list[list[dict[str, str]]], prompt: bool = False) -> list[int]:
    """Each conversation's tokens through the chat template (`prompt`: its turns with the generation prompt), with the
    BOS a conversation's ids start with where the tokenizer adds one and the template writes none (chat.sft_example)."""
    from align.data.chat import TemplateError, _apply, adds_bos

    bos = tokenizer.bos_token_id if adds_bos(tokenizer) else None
    out = []
    for i, messages in enumerate(conversations):
        try:  # a template's refusal (a system turn Mistral's does not take) names its row, not a Jinja traceback
            ids = _apply(tokenizer, messages, tokenize=True, add_generation_prompt=prompt) if messages else []
        except TemplateError as exc:
            raise TemplateError(f"row {i}: {exc}") from None
        if hasattr(ids, "keys"):  # transformers >= 5 returns a BatchEncoding by default
            ids = ids["input_ids"]
        out.append(len(ids) + (bos is not None and list(ids[:1]) != [bos]))
    return out


EOS = 1  # every trainer appends EOS to the completion
RULES: dict[str, LengthRule] = {}
"""Every length rule by name: these, and any a stage type's module defines (registered when it is built)."""


LAST_REPLY = "last"
"""A conversation row's `trains_from` (set by a stage's `length_rows`): only its final reply trains."""


def _trained_from(row: dict[str, Any]) -> int:
    """The index of a conversation's first trained message: its first assistant turn, or its last (LAST_REPLY)."""
    turns = [i for i, m in enumerate(row["messages"]) if m["role"] == "assistant"] or [0]
    return turns[-1] if row.get("trains_from") == LAST_REPLY else turns[0]


def _truncate_completions(rows: list[dict[str, Any]], tokenizer, max_length: int) -> tuple[int, int, int]:
    """A prompt and one completion (or a conversation) per example, cut at max_length; an example whose prompt (for a
    conversation: the turns before its first trained reply, and the generation prompt) alone fills the window teaches
    nothing: dropped (SFTTrainer drops an example left without a trained token once cut; a conversation whose first
    reply starts inside the window is truncated, not dropped, however long its later turns)."""
    if rows and "messages" in rows[0]:
        totals = _chat_lengths(tokenizer, [r["messages"] for r in rows])
        firsts = _chat_lengths(tokenizer, [r["messages"][:_trained_from(r)] for r in rows], True)
    else:
        firsts = _ids(tokenizer, [r["prompt"] for r in rows])
        totals = [p + c for p, c in zip(firsts, _replies(tokenizer, [r["completion"] for r in rows]))]
    dropped = sum(f >= max_length for f in firsts)
    truncated = sum(t > max_length for t in totals) - dropped
    return truncated, dropped, max(totals, default=0)


def _pair_ids(rows: list[dict[str, Any]], tokenizer) -> tuple[list[int], list[list[int]], list[list[int]]]:
    """Per pair: the prompt's length, and each side's reply ids as they follow it (`_reply_ids`)."""
    return (_ids(tokenizer, [r["prompt"] for r in rows]), _reply_ids(tokenizer, [r["chosen"] for r in rows]),
            _reply_ids(tokenizer, [r["rejected"] for r in rows]))


def _pairs(rows: list[dict[str, Any]], tokenizer) -> tuple[list[int], list[int]]:
    """Per pair: the prompt's length and the longer side's whole length (prompt + reply + EOS)."""
    prompts, chosen, rejected = _pair_ids(rows, tokenizer)
    return prompts, [p + max(len(c), len(r)) for p, c, r in zip(prompts, chosen, rejected)]


def pairs_within(rows: list[dict[str, Any]], tokenizer, max_length: int) -> list[dict[str, Any]]:
    """The pairs whose both sides fit max_length (what RewardTrainer keeps of its training pairs): held-out pairs
    are scored on the same terms, never past the positions the model has."""
    _, totals = _pairs(rows, tokenizer)
    return [r for r, t in zip(rows, totals) if t <= max_length]


def _drop_long_pairs(rows: list[dict[str, Any]], tokenizer, max_length: int) -> tuple[int, int, int]:
    """A pair is dropped when either side is longer than max_length."""
    _, totals = _pairs(rows, tokenizer)
    return 0, sum(t > max_length for t in totals), max(totals, default=0)


def _truncate_pairs(rows: list[dict[str, Any]], tokenizer, max_length: int) -> tuple[int, int, int]:
    """A pair whose prompt alone fills max_length is dropped; the rest are cut at max_length (keeping the start),
    and a pair whose two sides are the same once cut teaches nothing (its loss has no gradient, and it is scored a
    wrong pair in the trainer's accuracy): counted as dropped."""
    prompts, chosen, rejected = _pair_ids(rows, tokenizer)
    totals = [p + max(len(c), len(r)) for p, c, r in zip(prompts, chosen, rejected)]
    dropped = sum(p >= max_length or (t > max_length and c[:max_length - p] == r[:max_length - p])
                  for p, c, r, t in zip(prompts, chosen, rejected, totals))
    return sum(t > max_length for t in totals) - dropped, dropped, max(totals, default=0)


@dataclass(frozen=True)
class LengthRule:
    """How a trainer treats over-long examples, named by what it does (a stage type declares its trainer's rule as
    `LENGTH_RULE` on its config class). `count(rows, tokenizer, max_length)` -> (truncated, dropped, longest)."""

    name: str
    count: Callable[[list[dict[str, Any]], Any, int], tuple[int, int, int]]
    setting: str = "max_length"
    """The stage setting that bounds the length (named in reports and errors)."""
    per_prompt: bool = False
    """Whether an example is a distinct prompt (rows of sampled pairs may repeat one), not a row."""
    nothing_left: str = ("stages.{stage}.{setting}={max_length}: all {examples} examples would be dropped (longest "
                         "{longest} tokens after templating and tokenisation), so the stage would train on nothing, "
                         "whatever max_truncated_fraction allows. Raise {setting}, or shorten or filter the data")
    """The refusal when every example would be dropped (formatted with the LengthReport's fields)."""

    def __post_init__(self) -> None:
        if RULES.get(self.name, self) != self:
            raise ValueError(f"length rule '{self.name}' is defined twice, differently")
        RULES[self.name] = self  # a validation job names the rule; align/modeling/checks.py looks it up

    def measure(self, stage: str, rows: list[dict[str, Any]], tokenizer, max_length: int) -> LengthReport:
        """Count the over-long examples among `rows` (text rows: conversational ones rendered first)."""
        truncated, dropped, longest = self.count(rows, tokenizer, max_length)
        examples = len({_key(r["prompt"]) for r in rows}) if self.per_prompt else len(rows)
        return LengthReport(stage, self.name, examples, truncated, dropped, longest, max_length, self.setting)


def _key(prompt: Any) -> str:
    return prompt if isinstance(prompt, str) else repr(prompt)


def drop_long_prompts(rows: list[dict[str, Any]], tokenizer, max_length: int) -> tuple[int, int, int]:
    """Each distinct prompt once (rows of sampled pairs may repeat one): dropped when its tokens exceed max_length."""
    prompts = list({_key(r["prompt"]): r["prompt"] for r in rows}.values())
    lengths = _ids(tokenizer, prompts)
    return 0, sum(n > max_length for n in lengths), max(lengths, default=0)


TRUNCATES_COMPLETIONS = LengthRule("truncates_completions", _truncate_completions)
"""TRL's SFTTrainer and KTOTrainer: prompt + completion (or a whole conversation) truncated at max_length; an
example whose prompt fills the window is dropped (KTOTrainer) or teaches nothing (SFTTrainer's completion-only
loss)."""
DROPS_LONG_PAIRS = LengthRule("drops_long_pairs", _drop_long_pairs)
"""TRL's RewardTrainer: filters out pairs where either side is longer than max_length."""
TRUNCATES_PAIRS = LengthRule("truncates_pairs", _truncate_pairs)
"""TRL's DPOTrainer: drops pairs whose prompt fills max_length, truncates the rest."""
DROPS_LONG_PROMPTS = LengthRule("drops_long_prompts", drop_long_prompts, setting="max_prompt_length",
                                per_prompt=True)
"""Rollout prompts: a prompt longer than max_prompt_length tokens is dropped before the first rollout."""


def enforce(report: LengthReport, max_fraction: float) -> None:
    """Raise LengthError naming the field and the fix when too many examples are affected, or when every one would be
    dropped (nothing would train, whatever max_truncated_fraction allows)."""
    if report.examples and report.dropped == report.examples:
        raise LengthError(RULES[report.kind].nothing_left.format(**report.as_dict()))
    if report.fraction <= max_fraction:
        return
    suggestion = min(report.longest, 2 ** (report.longest - 1).bit_length()) if report.longest else 0
    raise LengthError(
        f"stages.{report.stage}.{report.setting}={report.max_length}: {report.affected} of {report.examples} examples "
        f"({100 * report.fraction:.1f}%) are longer after templating and tokenisation ({report.truncated} would be "
        f"truncated, {report.dropped} dropped; longest {report.longest} tokens), above "
        f"stages.{report.stage}.max_truncated_fraction={max_fraction}. Raise {report.setting} (e.g. to {suggestion}), "
        "shorten or filter the data, or raise max_truncated_fraction to accept the loss.")

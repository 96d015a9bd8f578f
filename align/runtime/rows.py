"""Rows a stage reads: from an upstream stage's `data/<split>.jsonl` or from a data card.

Given the stage's tokenizer, conversational rows come back rendered with its chat template (align/data/chat.py),
so every stage after SFT reads text, rendered the same way everywhere.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from align.core.rundir import SPEC, StageSpec
from align.data.cards import LoadedSplit, load_card, load_split, read_jsonl, seeded_rank
from align.data.chat import as_text, same_after_template, same_after_template_problem
from align.data.special_text import without_special_text
from align.data.formats import FormatError, plain_prompt, prompt_key, text_of
from align.runtime.context import StageContext, StageError


def load_rows(ctx: StageContext, ref: str, split: str, limit: int | None = None,
              tokenizer=None) -> list[dict[str, Any]]:
    """Rows from a data reference: an upstream stage that wrote `data/<split>.jsonl`, or a data card path;
    conversational rows rendered with `tokenizer`'s chat template when one is given."""
    if ref in ctx.inputs:
        rows = read_jsonl(ctx.input_dir(ref) / "data" / f"{split}.jsonl")
    else:
        rows = card_split(ctx, ref, split).rows
    rows = rows if tokenizer is None else _rendered(ctx, rows, tokenizer, f"{ref} split '{split}'")
    return rows[:limit] if limit else rows  # after the drops: `limit` rows train when there are as many


def card_split(ctx: StageContext, card: str, split: str) -> LoadedSplit:
    """A data card's split, with the rows its transforms and checks dropped counted in the manifest (`dropped_rows`:
    of the dataset's own split where the card names them, else of the card's whole file, a split drawn after them). The card and its data are what the run planned (their
    digest is in the spec and so in the stage's fingerprint): a file edited since is refused, not trained on
    under the planned digest."""
    loaded = load_split(card, split)
    planned = next((c.get("sha256") for c in ctx.spec.data_cards.values()
                    if isinstance(c, dict) and Path(str(c.get("path"))) == Path(card).resolve()), None)
    if planned and loaded.card.file is not None and load_card(card).content_hash() != planned:  # after loading:
        # what was read is what was planned (a hub dataset's commit is pinned to the plan's: align/data/hub.py)
        raise StageError(f"stage '{ctx.name}': data card {card} (or its data file) changed since this run planned "
                         "the stage; run `align run` again: the stage's fingerprint follows the new content")
    where = (f"{card} split '{split}'" if loaded.card.source_splits is not None  # the dataset's own split, read alone
             else f"{card} (the whole file, before the split)")
    for why, n in loaded.dropped.items():
        count_dropped(ctx, f"{where}: {why}", n)
    return loaded


def count_dropped(ctx: StageContext, why: str, n: int) -> None:
    """Rows a stage dropped, counted in its manifest (`dropped_rows`: where and why -> how many)."""
    ctx.extra_manifest.setdefault("dropped_rows", {})[why] = n


def drop_special_text(ctx: StageContext, rows: list[dict[str, Any]], tokenizer, where: str) -> list[dict[str, Any]]:
    """Rows whose text holds a special token's text (align/data/special_text.py): up to
    MAX_SPECIAL_TEXT of them are dropped and counted (`dropped_rows` in the manifest), more refuse the data (as
    `align validate` does before anything trains: align/modeling/checks.py)."""
    try:
        kept, found = without_special_text(rows, tokenizer, where)
    except FormatError as exc:
        raise StageError(f"stage '{ctx.name}': {exc}") from None
    if found:
        count_dropped(ctx, f"{where}: holds a special token's text", len(found))
    return kept


def _rendered(ctx: StageContext, rows: list[dict[str, Any]], tokenizer, where: str) -> list[dict[str, Any]]:
    rows = drop_special_text(ctx, rows, tokenizer, where)
    try:
        rendered = as_text(rows, tokenizer)
    except FormatError as exc:
        raise StageError(f"stage '{ctx.name}': {where}: {exc}") from None
    return drop_same_after_template(ctx, rendered, where)


def drop_same_after_template(ctx: StageContext, rows: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    """Preference pairs whose chosen and rejected are the same text as the model reads them (after the chat
    template, which may trim or rewrite what the data card compared) teach nothing: up to MAX_SAME_AFTER_TEMPLATE of
    them are dropped and counted (`dropped_rows` in the manifest), more refuse the data (`align validate` refuses a
    card's pairs so before anything trains: align/modeling/checks.py)."""
    same = same_after_template(rows)
    if not same:
        return rows
    problem = same_after_template_problem(rows, where)
    if problem:
        raise StageError(f"stage '{ctx.name}': {problem}")
    count_dropped(ctx, f"{where}: identical after the chat template", len(same))
    drop = set(same)
    return [r for i, r in enumerate(rows) if i not in drop]


def seeded_sample(rows: list[dict[str, Any]], limit: int, seed: int) -> list[dict[str, Any]]:
    """At most `limit` of `rows`, a uniform sample of them in a seeded random order (cards.seeded_rank of each row's
    content), the same on every machine and rerun. The head of a file is no sample of it: the movie reviews are
    sorted, positive first, so SFT's 256 evaluation rows were 250 positive reviews of a split half negative. A column
    JSON cannot hold (a parquet timestamp a card passes through) is ranked by its text."""
    order = sorted(range(len(rows)), key=lambda i: seeded_rank(seed, json.dumps(rows[i], sort_keys=True, default=str)))
    return [rows[i] for i in order[:limit]]


def unique_prompts(rows: list[dict[str, Any]], limit: int | None = None) -> list[str]:
    """Distinct prompts in order of first appearance (so a prompt is never sampled twice by accident)."""
    if rows and not isinstance(rows[0]["prompt"], str):
        raise FormatError("conversational prompts must be rendered with the chat template first (load_rows with "
                          "the stage's tokenizer)")
    seen = dict.fromkeys(r["prompt"] for r in rows)
    prompts = list(seen)
    return prompts[:limit] if limit else prompts


def load_prompts(ctx: StageContext, ref: str, split: str, tokenizer=None, plain: dict[str, str] | None = None,
                 sample: tuple[int | None, int] | None = None) -> list[str]:
    """Distinct non-empty prompts of a data reference, conversational ones rendered with `tokenizer`'s chat template;
    none at all fails the stage. `plain`, when given, is filled with each prompt's text without the template
    (formats.plain_prompt): what an LLM judge reads. `sample` = (limit, seed): the prompts in a seeded random order
    (cards.seeded_rank), at most `limit` of them after the drops, so they and any prefix of them are a uniform sample
    of the split (a file in sorted order, as the movie reviews are, positive first, gave a skewed head); without it, in
    file order."""
    first: dict[str, dict[str, Any]] = {}
    for row in load_rows(ctx, ref, split):
        first.setdefault(prompt_key(row["prompt"]), row)
    if sample is not None:
        first = {k: first[k] for k in sorted(first, key=lambda k: seeded_rank(sample[1], k))}
    rows = list(first.values())
    kept = [r for r in rows if text_of(r["prompt"])]  # visible text: not whitespace or zero-width characters alone
    if len(kept) < len(rows):
        count_dropped(ctx, f"{ref} split '{split}': empty prompt", len(rows) - len(kept))
    if not kept:
        raise StageError(f"stage '{ctx.name}': no non-empty prompts in {ref} split '{split}'")
    # the prompts alone: a reply holding a special token's text (or two replies the template renders alike) is no
    # reason to drop the prompt, nor to refuse the card, in a stage that samples its own replies
    rows = [{"prompt": r["prompt"], **({"plain_prompt": plain_prompt(r["prompt"])} if plain is not None else {})}
            for r in kept]
    if tokenizer is not None:
        rows = _rendered(ctx, rows, tokenizer, f"{ref} split '{split}'")
    if plain is not None:
        plain.update({r["prompt"]: r["plain_prompt"] for r in reversed(rows)})  # a prompt's first row's text
    return unique_prompts(rows, sample[0] if sample else None)


def prompts_within_positions(ctx: StageContext, prompts: list[str], tokenizer, model_path: str,
                             new_tokens: int) -> list[str]:
    """The prompts that leave `new_tokens` (generation.max_new_tokens) within the positions of the model at
    `model_path`: the rest are dropped and counted (`dropped_rows`), as PPO drops prompts over max_prompt_length.
    Past its positions a model samples from positions it never learned (RoPE refuses nothing) and the vllm engine
    refuses to start, after loading; none left fails the stage. A model whose config says no limit keeps them all."""
    limit = model_positions(model_path, ctx.pipeline.trust_remote_code)
    if limit is None:
        return prompts
    # the engine takes one position more than it samples: a prompt of n tokens needs n + new_tokens < limit
    return prompts_within(ctx, prompts, tokenizer, limit - 1, new_tokens, f"the model's {limit} positions")


def prompts_within(ctx: StageContext, prompts: list[str], tokenizer, limit: int, new_tokens: int,
                   within: str) -> list[str]:
    """The prompts whose tokens (`tokenizer`'s, special ones added) and `new_tokens` make at most `limit`; the rest
    are dropped and counted (`dropped_rows`), named by `within` (what the limit is); none left fails the stage."""
    if not prompts:
        return prompts
    lengths = [len(ids) for ids in tokenizer(prompts, add_special_tokens=True)["input_ids"]]
    kept = [p for p, n in zip(prompts, lengths) if n + new_tokens <= limit]
    if len(kept) < len(prompts):
        why = f"no room for generation.max_new_tokens ({new_tokens}) within {within}"
        count_dropped(ctx, why, len(prompts) - len(kept))
        if ctx.is_main:
            print(f"[align] {ctx.name}: {len(prompts) - len(kept)} of {len(prompts)} prompts dropped: {why}", flush=True)
    if not kept:
        raise StageError(f"stage '{ctx.name}': every prompt is too long to sample {new_tokens} tokens after it within "
                         f"{within} (the shortest has {min(lengths)} tokens); lower generation.max_new_tokens or use "
                         "shorter prompts")
    return kept


def prompts_within_reward_models(ctx: StageContext, prompts: list[str], judge, new_tokens: int) -> list[str]:
    """The prompts after which a response of `new_tokens` stays within the max_length of each reward stage `judge`
    (a WeightedJudge) scores with, in its own tokens: the longest sequence it trained on (RewardTrainer drops longer
    pairs). A score past it is read from positions the head never learned to score (where a learned-position model
    fails); the rest are dropped and counted."""
    for name, model in (judge.reward_models.items() if judge is not None else ()):
        trained = trained_length(ctx, name)
        if trained is not None:
            prompts = prompts_within(ctx, prompts, model.tokenizer, trained, new_tokens,
                                     f"the max_length of reward stage '{name}' ({trained}), the longest it trained on")
    return prompts


def trained_length(ctx: StageContext, reward: str) -> int | None:
    """The reward stage's max_length, as its spec.json says (None when it does not)."""
    try:
        value = StageSpec.read(ctx.input_dir(reward) / SPEC).stage.get("max_length")
    except (OSError, ValueError, KeyError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def model_positions(path: str, trust_remote_code: bool = False) -> int | None:
    """The longest sequence the model at `path` accepts (a published adapter: its base's), when its config says."""
    import json

    from align.data.lengths import config_positions
    from align.modeling.models import adapter_base  # heavy: stage processes only

    if (base := adapter_base(path)) is not None:
        return model_positions(base["base_model"], trust_remote_code)
    if (Path(path) / "config.json").is_file():
        return config_positions(json.loads((Path(path) / "config.json").read_text(encoding="utf-8")))
    try:  # a hub base: its config, cached where the base itself loads from
        from transformers import AutoConfig  # heavy: loaded on use
        return config_positions(AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code).to_dict())
    except (OSError, ValueError):
        return None

"""Rows whose messages hold the text of a special token of the tokenizer: it reads that text as the token itself, so
an `<|im_end|>` a reply mentions ends the reply there. A few such rows are dropped and counted
(align/runtime/rows.py `drop_special_text`), more refuse the data."""

from __future__ import annotations

import re
from collections import Counter
from typing import Any, Iterator

from align.data.formats import FormatError


MAX_SPECIAL_TEXT = 0.01
"""The largest fraction of rows holding a special token's text that a stage drops (and counts in its manifest)
instead of refusing the data; at least MIN_SPECIAL_TEXT rows of any split (a held-out split of 100 rows drawn from
data that passed at 0.8% holds two such rows about one time in five)."""
MIN_SPECIAL_TEXT = 3


def special_texts(tokenizer) -> list[str]:
    """The text of every special token (and added token marked special) that the tokenizer reads as the token itself
    where it appears in text, longest first; none where it splits such text into ordinary tokens."""
    if getattr(tokenizer, "split_special_tokens", False):
        return []
    found = set(getattr(tokenizer, "all_special_tokens", []))
    found |= {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special}
    return sorted((t for t in found if t), key=len, reverse=True)


def _contents(row: dict[str, Any]) -> Iterator[str]:
    """The messages' content of a conversational row (prompt, replies, messages)."""
    for value in row.values():
        if isinstance(value, list):
            yield from (m["content"] for m in value if isinstance(m, dict) and isinstance(m.get("content"), str))


def holding_special_text(rows: list[dict[str, Any]], tokenizer) -> list[tuple[int, str]]:
    """(position, token text) of the conversational rows (before the chat template) whose messages hold a special
    token's text: the tokenizer reads it as the token, so an `<|im_end|>` a reply mentions ends the reply there (the
    reward model, DPO and PPO read it cut; SFT trains an end of turn mid-reply), and a user turn holding
    `<|im_start|>assistant` opens a turn the data never had. Text rows are the user's own rendering, where such tokens
    may be meant (a prompt written in the template already): they are left as they are."""
    texts = special_texts(tokenizer)
    if not texts or not rows:
        return []
    pattern = re.compile("|".join(map(re.escape, texts)))
    found = []
    for i, row in enumerate(rows):
        hit = next((m.group() for text in _contents(row) if (m := pattern.search(text))), None)
        if hit is not None:
            found.append((i, hit))
    return found


def special_text_problem(rows: list[dict[str, Any]], found: list[tuple[int, str]], where: str) -> str | None:
    """The refusal when more than MAX_SPECIAL_TEXT of `rows` hold a special token's text (None: few enough to drop
    and count)."""
    if len(found) <= max(MAX_SPECIAL_TEXT * len(rows), MIN_SPECIAL_TEXT):
        return None
    tokens = ", ".join(f"{t!r} ({n})" for t, n in Counter(t for _, t in found).most_common(3))
    more = f" and {len(found) - 5} more" if len(found) > 5 else ""
    return (f"{where}: {len(found)} of {len(rows)} conversations hold the text of the tokenizer's special tokens {tokens}, "
            f"which it reads as the tokens themselves (a reply would end, or a turn begin, where the data only "
            f"mentions one): rows {', '.join(str(i) for i, _ in found[:5])}{more} of the split. Remove or rewrite "
            f"them (up to {MAX_SPECIAL_TEXT:.0%} of a split, or {MIN_SPECIAL_TEXT} rows, are dropped and counted instead)")


def without_special_text(rows: list[dict[str, Any]], tokenizer, where: str) -> tuple[list[dict[str, Any]], list]:
    """`rows` less those holding a special token's text (`holding_special_text`), and those found (position, token
    text); a FormatError naming them when more than MAX_SPECIAL_TEXT of the rows (and MIN_SPECIAL_TEXT) hold one."""
    found = holding_special_text(rows, tokenizer)
    problem = special_text_problem(rows, found, where)
    if problem:
        raise FormatError(problem)
    drop = {i for i, _ in found}
    return [r for i, r in enumerate(rows) if i not in drop], found

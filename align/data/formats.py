"""Converters from source rows to the canonical forms every stage consumes.

Canonical forms (they match TRL's dataset formats):
- ``prompt_completion``: ``{"prompt": str, "completion": str}``
- ``messages``: ``{"messages": [{"role": ..., "content": ...}, ...]}``
- ``preference``: ``{"prompt": str, "chosen": str, "rejected": str}``, or conversational (TRL's form):
  ``prompt`` a list of messages ending with a user turn, ``chosen`` / ``rejected`` lists of one assistant message
- ``prompt``: ``{"prompt": str}``, or ``prompt`` a list of messages ending with a user turn

Conversational rows are rendered with the chat template by the stages that read them (align/data/chat.py).

Each transform takes a list of row dicts and returns ``(rows, dropped)``, where ``dropped`` counts rows
skipped for a stated reason (reported by ``align validate``), so nothing disappears silently.
"""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from typing import Any, Callable

CANONICAL_COLUMNS = {
    "prompt_completion": ("prompt", "completion"),
    "messages": ("messages",),
    "preference": ("prompt", "chosen", "rejected"),
    "prompt": ("prompt",),
}

Rows = list[dict[str, Any]]
ROLES = ("system", "user", "assistant")


class FormatError(ValueError):
    """A row that cannot be converted; the message names the row and field."""


def is_conversation(value: Any) -> bool:
    """A non-empty list of {role, content} messages with text content."""
    return isinstance(value, list) and bool(value) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value)


def check_conversation(messages: Any, where: str, last_role: str | None = None) -> None:
    """Raise FormatError naming `where` unless `messages` is a conversation (ending with `last_role` if given)."""
    if not is_conversation(messages):
        raise FormatError(f"{where}: expected a list of {{role, content}} messages with text content")
    bad = [m["role"] for m in messages if m["role"] not in ROLES]
    if bad:
        raise FormatError(f"{where}: role '{bad[0]}' is not one of {list(ROLES)}")
    if last_role and messages[-1]["role"] != last_role:
        raise FormatError(f"{where}: the last message must be a '{last_role}' turn, got '{messages[-1]['role']}'")


def prompt_key(prompt: str | list[dict[str, str]]) -> str:
    """A prompt as a hashable key, for splits and overlap checks: text is its own key; a conversation is keyed
    like a `messages` row's earlier turns (`row_prompt_key`), so a messages card and a preference card over the
    same transcripts split alike, and their overlap is found."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)


def row_prompt_key(row: dict[str, Any]) -> str | None:
    """The key of what a row prompts with: its `prompt`, or a `messages` row's turns before the last one."""
    if "prompt" in row:
        return prompt_key(row["prompt"])
    if "messages" in row:
        return json.dumps(row["messages"][:-1], sort_keys=True)
    return None


def prefix_words(rows: Rows, args: Any, seed: int) -> tuple[Rows, Counter]:
    """Split `text` into a prompt of the first k words (k uniform in [lo, hi]) and the rest as completion.

    This is the DPO paper's controlled-sentiment prompt construction (review prefixes). Rows with too few
    words to leave a non-empty completion are dropped and counted.
    """
    lo, hi = (int(args[0]), int(args[1])) if isinstance(args, (list, tuple)) else (int(args), int(args))
    if not 1 <= lo <= hi:
        raise FormatError(f"transform prefix_words: expected [min, max] with 1 <= min <= max, got {args!r}")
    rng = random.Random(seed)
    out, dropped = [], Counter()
    for i, row in enumerate(rows):
        if "text" not in row:
            raise FormatError(f"row {i}: transform prefix_words needs a `text` column (map one in `columns`)")
        words = str(row["text"]).split()
        k = rng.randint(lo, hi)
        if len(words) <= k:
            dropped["too few words for the prefix"] += 1
            continue
        out.append({**_keep(row), "prompt": " ".join(words[:k]), "completion": " " + " ".join(words[k:])})
    return out, dropped


_HH_TURN = re.compile(r"\n\n(Human|Assistant):")


def parse_hh_turns(transcript: str) -> list[tuple[str, str]]:
    """Split an Anthropic HH transcript ("\\n\\nHuman: ...\\n\\nAssistant: ...") into (role, text) turns."""
    pieces = _HH_TURN.split(transcript)
    if pieces[0].strip():
        raise FormatError("transcript does not start with '\\n\\nHuman:'")
    turns = []
    for role, text in zip(pieces[1::2], pieces[2::2]):
        turns.append(("user" if role == "Human" else "assistant", text.strip()))
    if not turns or turns[-1][0] != "assistant":
        raise FormatError("transcript does not end with an Assistant turn")
    return turns


def render_hh_prompt(turns: list[tuple[str, str]]) -> str:
    """The prompt text: every turn, then the cue for the final assistant reply."""
    body = "".join(f"\n\n{'Human' if r == 'user' else 'Assistant'}: {t}" for r, t in turns)
    return body + "\n\nAssistant:"


def _hh_pairs(rows: Rows, args: Any, transform: str) -> tuple[list[tuple[list, str, str]], Counter]:
    """Parsed HH-RLHF pairs as (turns before the final reply, chosen reply, rejected reply), filtered and counted
    as `hh_transcript` documents (the max_prompt_chars limit applies to the HH-format prompt text)."""
    max_chars = args.get("max_prompt_chars") if isinstance(args, dict) else None
    out, dropped = [], Counter()
    for row in rows:
        try:
            chosen, rejected = parse_hh_turns(row["chosen"]), parse_hh_turns(row["rejected"])
        except FormatError:
            dropped["unparseable transcript"] += 1
            continue
        except KeyError as exc:
            raise FormatError(f"transform {transform} needs a {exc} column") from exc
        if chosen[:-1] != rejected[:-1]:
            dropped["chosen and rejected diverge before the final reply"] += 1
            continue
        if not _text(chosen[-1][1]) or not _text(rejected[-1][1]):
            dropped["empty final reply"] += 1
            continue
        if _text(chosen[-1][1]) == _text(rejected[-1][1]):
            dropped["chosen identical to rejected (up to whitespace)"] += 1
            continue
        if max_chars is not None and len(render_hh_prompt(chosen[:-1])) > max_chars:
            dropped[f"prompt longer than {max_chars} characters"] += 1
            continue
        out.append((chosen[:-1], chosen[-1][1], rejected[-1][1]))
    return out, dropped


def hh_transcript(rows: Rows, args: Any, seed: int) -> tuple[Rows, Counter]:
    """HH-RLHF pairs -> preference rows.

    prompt = every turn before the final assistant reply (rendered in the HH format, ending with the
    "Assistant:" cue); chosen / rejected = the two final replies. Pairs whose turns differ before the final
    reply, whose final replies are identical, or that do not parse, are dropped and counted by reason.
    Args: `true`, or `{max_prompt_chars: N}` to also drop (and count) pairs with longer prompts.
    """
    pairs, dropped = _hh_pairs(rows, args, "hh_transcript")
    return [{"prompt": render_hh_prompt(turns), "chosen": " " + c, "rejected": " " + r}
            for turns, c, r in pairs], dropped


def hh_chosen_sft(rows: Rows, args: Any, seed: int) -> tuple[Rows, Counter]:
    """HH-RLHF pairs -> prompt_completion rows for SFT on the chosen transcript's final reply (same args)."""
    pairs, dropped = hh_transcript(rows, args, seed)
    return [{"prompt": r["prompt"], "completion": r["chosen"]} for r in pairs], dropped


def _messages(turns: list[tuple[str, str]]) -> list[dict[str, str]]:
    return [{"role": role, "content": text} for role, text in turns]


def hh_messages(rows: Rows, args: Any, seed: int) -> tuple[Rows, Counter]:
    """HH-RLHF pairs -> conversational preference rows (TRL's form): prompt = the turns before the final reply
    as messages (user / assistant), chosen / rejected = [the final assistant reply]. Same filters and args as
    `hh_transcript`, so the same pairs are kept."""
    pairs, dropped = _hh_pairs(rows, args, "hh_messages")
    return [{"prompt": _messages(turns), "chosen": [{"role": "assistant", "content": c}],
             "rejected": [{"role": "assistant", "content": r}]} for turns, c, r in pairs], dropped


def hh_chosen_messages(rows: Rows, args: Any, seed: int) -> tuple[Rows, Counter]:
    """HH-RLHF pairs -> `messages` rows for SFT: the whole chosen transcript, every assistant turn trained
    (assistant-only loss). Same filters and args as `hh_transcript`."""
    pairs, dropped = _hh_pairs(rows, args, "hh_chosen_messages")
    return [{"messages": _messages(turns) + [{"role": "assistant", "content": c}]} for turns, c, _ in pairs], dropped


def alpaca(rows: Rows, args: Any, seed: int) -> tuple[Rows, Counter]:
    """Alpaca rows (instruction / input / output) -> prompt_completion."""
    out, dropped = [], Counter()
    for i, row in enumerate(rows):
        if "instruction" not in row or "output" not in row:
            raise FormatError(f"row {i}: transform alpaca needs `instruction` and `output` columns")
        if not str(row["output"]).strip():
            dropped["empty output"] += 1
            continue
        extra = str(row.get("input") or "").strip()
        prompt = str(row["instruction"]).strip() + (f"\n\n{extra}" if extra else "")
        out.append({"prompt": prompt, "completion": " " + str(row["output"]).strip()})
    return out, dropped


def _keep(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if k in ("id", "score")}


TRANSFORMS: dict[str, Callable[[Rows, Any, int], tuple[Rows, Counter]]] = {
    "prefix_words": prefix_words,
    "hh_transcript": hh_transcript,
    "hh_chosen_sft": hh_chosen_sft,
    "hh_messages": hh_messages,
    "hh_chosen_messages": hh_chosen_messages,
    "alpaca": alpaca,
}


def check_canonical(rows: Rows, produces: str, source: str) -> None:
    """Every row must carry the canonical columns of `produces` with the right types (text, or for preference
    and prompt rows TRL's conversational form: see the module docstring)."""
    needed = CANONICAL_COLUMNS[produces]
    for i, row in enumerate(rows):
        for col in needed:
            if col not in row:
                raise FormatError(f"{source}: row {i}: missing field '{col}' required by produces={produces}")
        if produces == "messages":
            if not is_conversation(row["messages"]):
                raise FormatError(f"{source}: row {i}: field 'messages' must be a list of {{role, content}}")
        elif produces in ("preference", "prompt") and isinstance(row["prompt"], list):
            check_conversation(row["prompt"], f"{source}: row {i}: field 'prompt'", last_role="user")
            for col in needed[1:]:
                reply = row[col]
                check_conversation(reply, f"{source}: row {i}: field '{col}'", last_role="assistant")
                if len(reply) != 1:
                    raise FormatError(f"{source}: row {i}: field '{col}': expected one assistant message, got "
                                      f"{len(reply)} (earlier turns belong in 'prompt')")
        else:
            for col in needed:
                if not isinstance(row[col], str):
                    raise FormatError(f"{source}: row {i}: field '{col}' must be text, got {type(row[col]).__name__}")
    _check_contents(rows, produces, source)


def _text(value: str | list[dict[str, str]]) -> str:
    """The words of a reply or conversation, whitespace normalised: what a comparison of contents looks at."""
    text = value if isinstance(value, str) else "\n".join(m["content"] for m in value)
    return " ".join(text.split())


def _rows_named(rows: list[int]) -> str:
    shown = ", ".join(str(i) for i in rows[:8])
    return f"{len(rows)} row{'s' if len(rows) > 1 else ''} ({shown}{', ...' if len(rows) > 8 else ''})"


def _check_contents(rows: Rows, produces: str, source: str) -> None:
    """Rows whose form is right but that cannot teach anything, all named at once (row numbers count from 0,
    after the card's transforms): a preference pair with an empty reply, or whose replies differ only in
    whitespace; a conversation with no assistant turn with text (nothing to train on)."""
    problems = []
    if produces == "preference":
        replies = [(_text(r["chosen"]), _text(r["rejected"])) for r in rows]
        empty = [i for i, (c, r) in enumerate(replies) if not c or not r]
        same = [i for i, (c, r) in enumerate(replies) if c and c == r]
        if empty:
            problems.append(f"{_rows_named(empty)} with an empty 'chosen' or 'rejected'")
        if same:
            problems.append(f"{_rows_named(same)} whose 'chosen' and 'rejected' differ at most in whitespace")
    elif produces == "messages":
        silent = [i for i, r in enumerate(rows)
                  if not any(m["role"] == "assistant" and m["content"].strip() for m in r["messages"])]
        if silent:
            problems.append(f"{_rows_named(silent)} with no assistant turn with text (nothing to train on)")
    if problems:
        raise FormatError(f"{source}: " + "; ".join(problems) + ". Remove those rows from the data (or filter "
                          "them in a transform) and run again")

"""Converters from source rows to the canonical forms every stage consumes.

Canonical forms (they match TRL's dataset formats):
- ``prompt_completion``: ``{"prompt": str, "completion": str}``
- ``messages``: ``{"messages": [{"role": ..., "content": ...}, ...]}``
- ``preference``: ``{"prompt": str, "chosen": str, "rejected": str}``, or conversational (TRL's form):
  ``prompt`` a list of messages ending with a user turn, ``chosen`` / ``rejected`` lists of one assistant message;
  TRL's implicit-prompt form (``chosen`` / ``rejected`` whole conversations sharing their earlier turns, as
  UltraFeedback publishes it) is read as that explicit form (``implicit_prompt``)
- ``prompt``: ``{"prompt": str}``, or ``prompt`` a list of messages ending with a user turn

Conversational rows are rendered with the chat template by the stages that read them (align/data/chat.py).
A stage type that needs another form registers it from its config module (`register_form`); a card's `produces`
may then name it.

The named transforms a card may apply before its rows are checked against their form: align/data/transforms.py.
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

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
        hint = ("; ShareGPT's human/gpt are user/assistant: rename them in a transform of your own (module:function)"
                if bad[0] in ("human", "gpt") else "")
        raise FormatError(f"{where}: role '{bad[0]}' is not one of {list(ROLES)}{hint}")
    if last_role and messages[-1]["role"] != last_role:
        raise FormatError(f"{where}: the last message must be a '{last_role}' turn, got '{messages[-1]['role']}'")


def prompt_key(prompt: str | list[dict[str, str]]) -> str:
    """A prompt as a hashable key, for splits and overlap checks: text is its own key; a conversation is keyed
    like a `messages` row's earlier turns (`row_prompt_key`), so a messages card and a preference card over the
    same transcripts split alike, and their overlap is found."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)


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


def turns_key(prompt: str | list[dict[str, str]]) -> str:
    """A prompt by its turns, whatever its form, for the overlap check between training and evaluation prompts (the
    splits keep `prompt_key`): a conversation's (role, text) turns; a text prompt in Anthropic's HH format
    ("\\n\\nHuman: ...\\n\\nAssistant:") parsed into its turns; any other text one user turn. A text card and a chat
    card over the same transcripts key the same prompt alike, so training on one and evaluating on the other is
    found."""
    if isinstance(prompt, str):
        turns = [("user", prompt.strip())]
        if prompt.startswith("\n\nHuman:") and prompt.rstrip().endswith("\n\nAssistant:"):
            try:
                turns = parse_hh_turns(prompt.rstrip() + " .")[:-1]  # the final cue, given a reply to parse
            except FormatError:
                pass
    else:
        turns = [(m["role"], m["content"].strip()) for m in prompt]
    return json.dumps(turns)


def row_prompt_key(row: dict[str, Any], key: Callable[[Any], str] = prompt_key) -> str | None:
    """The key (`prompt_key`, or `turns_key` for the overlap check) of what a row prompts with: its `prompt`, or a
    `messages` row's turns before the last one."""
    if "prompt" in row:
        return key(row["prompt"])
    if "messages" in row:
        return key(row["messages"][:-1])
    return None


@dataclass(frozen=True)
class DataForm:
    """A canonical form of rows (TRL's dataset formats): its columns and what each must hold."""

    name: str
    columns: tuple[str, ...]
    """Every row has these fields."""
    replies: tuple[str, ...] = ()
    """Reply columns: text, or, when the row's `prompt` is a conversation, a list of one assistant message."""
    flags: tuple[str, ...] = ()
    """Columns that hold true / false (not text)."""
    conversational: bool = False
    """Whether `prompt` may be a conversation (a list of messages ending with a user turn)."""
    check_row: Callable[[dict[str, Any], str], None] | None = None
    """A check of one row's types instead of the rules above (raise FormatError naming `where`)."""
    contents: Callable[[Rows], dict[str, list[int]]] | None = None
    """Rows of the right form that cannot teach anything: what is wrong with them -> their row numbers
    (`drop_unusable` drops and counts them, or refuses the card above its max_unusable_fraction)."""
    normalise: Callable[[dict[str, Any], str], dict[str, Any]] | None = None
    """Another spelling of the form -> the canonical one, row by row, before the checks (e.g. the implicit-prompt
    conversational preference form); raise FormatError naming `where` when a row is neither."""


FORMS: dict[str, DataForm] = {}
"""Form name -> its definition; a card's `produces` names one."""


def register_form(form: DataForm) -> DataForm:
    """Make `form` a canonical form cards may produce. A stage type that needs a form of its own registers it
    from its config module (imported wherever configs are parsed, before any card is read)."""
    old = FORMS.get(form.name)
    if old is not None and old != form:
        raise ValueError(f"data form '{form.name}' is defined twice, differently")
    FORMS[form.name] = form
    return form


_FLAG_SPELLINGS = {"true": True, "false": False, "1": True, "0": False, "1.0": True, "0.0": False}


def flag_value(value: Any, where: str) -> bool:
    """A true / false field as a bool: JSON's true / false; as CSV / TSV (which hold text only) spell it, "true" /
    "false" (any case) or "1" / "0"; or a number 1 / 0 (a 0/1 column, one made float by a missing value, a numpy
    scalar from a transform). Anything else is refused, naming `where`."""
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):  # numpy / torch scalars
        value = value.item()
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    key = value.strip().lower() if isinstance(value, str) else None
    if key in _FLAG_SPELLINGS:
        return _FLAG_SPELLINGS[key]
    raise FormatError(f"{where} must be true or false (or, as text, 1 / 0), got {value!r}")


def check_canonical(rows: Rows, produces: str, source: str) -> None:
    """Every row must carry the canonical columns of `produces` with the right types (text, or for forms that
    allow it TRL's conversational form: see the module docstring), then hold something to learn from."""
    form = FORMS[produces]
    if form.normalise is not None:
        rows[:] = [form.normalise(row, f"{source}: row {i}") for i, row in enumerate(rows)]
    for i, row in enumerate(rows):
        where = f"{source}: row {i}"
        for col in form.columns:
            if col not in row:
                have = ", ".join(sorted(map(str, row))) or "none"
                raise FormatError(f"{where}: missing field '{col}' required by produces={produces} (its fields: "
                                  f"{have}); " + (_form_hint(row, produces) or "map a field to it in the card, e.g. "
                                                  f"`columns: {{{col}: <field>}}`"))
        if form.check_row is not None:
            form.check_row(row, where)
            continue
        for col in form.flags:
            row[col] = flag_value(row[col], f"{where}: field '{col}'")
        if form.conversational and isinstance(row.get("prompt"), list):
            check_conversation(row["prompt"], f"{where}: field 'prompt'", last_role="user")
            for col in form.replies:
                reply = row[col]
                check_conversation(reply, f"{where}: field '{col}'", last_role="assistant")
                if len(reply) != 1:
                    raise FormatError(f"{where}: field '{col}': expected one assistant message, got {len(reply)} "
                                      "(earlier turns belong in 'prompt')")
            continue
        for col in (c for c in form.columns if c not in form.flags):
            if not isinstance(row[col], str):
                raise FormatError(f"{where}: field '{col}' must be text, got {type(row[col]).__name__}"
                                  + (f"; {hint}" if (hint := _form_hint(row, produces)) else ""))


HH_TRANSFORMS = {"preference": "`transform: {hh_transcript: true}` to the card (text), or `transform: {hh_messages: "
                               "true}` (conversations)",
                 "messages": "`transform: {hh_chosen_messages: true}` to the card (the chosen conversation)",
                 "prompt_completion": "`transform: {hh_chosen_sft: true}` to the card (the chosen final reply)"}


def _form_hint(row: dict[str, Any], produces: str) -> str | None:
    """The fix for a row in a known form other than the card's: Anthropic's HH transcripts, TRL's conversational
    prompt-completion form, or conversations with a message whose content is not text (a tool call, an image)."""
    for col in ("chosen", "rejected", "prompt", "completion", "messages"):
        value = row.get(col)
        if isinstance(value, str) and col in ("chosen", "rejected") and value.startswith("\n\nHuman:"):
            return ("the rows are Anthropic HH transcripts: add " + HH_TRANSFORMS.get(
                produces, HH_TRANSFORMS["preference"] + ", with `produces: preference`"))
        if isinstance(value, list) and value and all(isinstance(m, dict) and "role" in m for m in value):
            odd = next((i for i, m in enumerate(value) if not isinstance(m.get("content"), str)), None)
            if odd is not None:
                return (f"field '{col}': message {odd} (role {value[odd]['role']!r}) has content "
                        f"{str(value[odd].get('content'))[:60]!r}, not text (a tool call or an image?): drop or "
                        "rewrite such rows in a transform of your own (`transform: module:function`)")
    if is_conversation(row.get("prompt")) and is_conversation(row.get("completion")):
        return ("the rows are TRL's conversational prompt-completion form: declare `produces: messages` and add "
                "`transform: {prompt_completion_messages: true}` (the turns joined; every assistant turn is trained)")
    return None

def drop_unusable(rows: Rows, produces: str, source: str, max_fraction: float) -> tuple[Rows, Counter]:
    """Rows in the right form that cannot teach anything (the form's `contents` rule: an empty reply, a pair whose
    replies are equal, a conversation without an assistant turn) are dropped and counted, by reason; when more
    than `max_fraction` of the rows are (the card's `max_unusable_fraction`), the card is refused, naming them."""
    form = FORMS[produces]
    found = form.contents(rows) if form.contents is not None else {}
    bad = sorted({i for idx in found.values() for i in idx})
    if not bad:
        return rows, Counter()
    named = "; ".join(f"{rows_named(idx)} {why}" for why, idx in found.items() if idx)
    if len(bad) == len(rows):  # whatever max_unusable_fraction says: nothing would be left
        raise FormatError(f"{source}: {named}. That is every row, so no setting can help: the data itself must change")
    if len(bad) > max_fraction * len(rows):
        raise FormatError(f"{source}: {named}. That is {len(bad)} of {len(rows)} rows ({len(bad) / len(rows):.1%}), "
                          f"above the card's max_unusable_fraction ({max_fraction}). Remove those rows from the data "
                          "(or filter them in a transform) and run again, or raise max_unusable_fraction to drop them")
    drop = set(bad)
    return [r for i, r in enumerate(rows) if i not in drop], Counter({why: len(idx) for why, idx in found.items() if idx})


def plain_prompt(prompt: str | list[dict[str, str]]) -> str:
    """A prompt as a judge reads it, without any chat template's markup (an LLM judge wraps it in its own template,
    and a policy's `<|im_start|>`-style text in it reads as the judge's own control tokens): a text prompt as it is,
    one user turn as its words, a longer conversation as its turns, each led by its role."""
    if isinstance(prompt, str):
        return prompt
    if len(prompt) == 1:
        return prompt[0]["content"]
    return "\n\n".join(f"{m['role'].capitalize()}: {m['content']}" for m in prompt)


def text_of(value: str | list[dict[str, str]]) -> str:
    """The words of a reply or conversation, whitespace normalised: what a comparison of contents looks at."""
    text = value if isinstance(value, str) else "\n".join(m["content"] for m in value)
    return " ".join(visible(text).split())


def visible(text: str) -> str:
    """`text` without invisible format characters (zero-width space and joiners, word joiner, BOM, soft hyphen:
    Unicode category Cf): two replies that differ only in them read the same to every reader and judge."""
    return "".join(ch for ch in text if unicodedata.category(ch) != "Cf") if not text.isascii() else text


def rows_named(rows: list[int]) -> str:
    shown = ", ".join(str(i) for i in rows[:8])
    return f"{len(rows)} row{'s' if len(rows) > 1 else ''} ({shown}{', ...' if len(rows) > 8 else ''})"


def _check_messages(row: dict[str, Any], where: str) -> None:
    if not is_conversation(row["messages"]):
        raise FormatError(f"{where}: field 'messages' must be a list of {{role, content}}")
    check_conversation(row["messages"], f"{where}: field 'messages'")  # roles the templates and later stages know


def _silent_conversations(rows: Rows) -> dict[str, list[int]]:
    """A conversation with no assistant turn with text has nothing to train on; one with an empty assistant turn
    among others would teach ending a reply at once (its end-of-turn token is trained right after the prompt)."""
    replies = [[text_of(m["content"]) for m in r["messages"] if m["role"] == "assistant"] for r in rows]
    return {"with no assistant turn with visible text (nothing to train on)": [i for i, t in enumerate(replies)
                                                                                if not any(t)],
            "with an empty assistant turn among others (it would teach ending a reply at once)":
                [i for i, t in enumerate(replies) if any(t) and not all(t)]}


def _empty_field(column: str) -> Callable[[Rows], dict[str, list[int]]]:
    """Rows whose `column` holds no visible text (empty, whitespace, zero-width characters only)."""
    def empty(rows: Rows) -> dict[str, list[int]]:
        return {f"with no visible text in '{column}' (empty, whitespace or invisible characters only)":
                [i for i, r in enumerate(rows) if not text_of(r[column])]}
    return empty


def _uninformative_pairs(rows: Rows) -> dict[str, list[int]]:
    """A preference pair with an empty reply, or whose replies differ only in whitespace, teaches nothing."""
    diverged = {i for i, r in enumerate(rows) if r.get(DIVERGED)}  # marked by implicit_prompt: counted there alone
    replies = [(text_of(r["chosen"]), text_of(r["rejected"])) for r in rows]
    return {"with no visible text in 'chosen' or 'rejected'": [i for i, (c, r) in enumerate(replies)
                                                                if (not c or not r) and i not in diverged],
            "whose 'chosen' and 'rejected' differ at most in whitespace or invisible characters":
                [i for i, (c, r) in enumerate(replies) if c and c == r and i not in diverged],
            "whose 'chosen' and 'rejected' conversations diverge before the final reply (no one prompt to compare "
            "the replies on)": sorted(diverged)}


DIVERGED = "_diverges_before_the_final_reply"  # an implicit-prompt row's mark: dropped and counted, never kept


def implicit_prompt(row: dict[str, Any], where: str) -> dict[str, Any]:
    """A preference row in TRL's implicit-prompt conversational form -> the explicit one.

    Implicit (UltraFeedback as published, HuggingFaceH4/ultrafeedback_binarized): `chosen` and `rejected` are whole
    conversations that share every turn but the last, which is the assistant's reply; `prompt`, when present, is
    the last user turn's text. Explicit: `prompt` = the shared turns (ending with a user turn), `chosen` /
    `rejected` = [the reply]. A row already explicit, or in text form, is returned as it is; an implicit row whose
    conversations share more or less than everything but one final assistant reply, or whose text `prompt` is not
    their last user turn, is an error naming the row and the first turn that differs. Turns compare with their text
    stripped (a trailing space is no other prompt). Two well-formed conversations (each a final assistant reply
    after a user turn) that diverge earlier are marked (DIVERGED) for `_uninformative_pairs` to drop and count, up to
    the card's max_unusable_fraction, as the HH transforms drop theirs: one such row refused the whole card."""
    chosen, rejected, prompt = row.get("chosen"), row.get("rejected"), row.get("prompt")
    if not (is_conversation(chosen) and is_conversation(rejected)) or isinstance(prompt, list) or \
            (len(chosen) == 1 and len(rejected) == 1):
        return row
    turn = lambda m: (m.get("role"), m.get("content").strip() if isinstance(m.get("content"), str)  # noqa: E731
                      else m.get("content"))
    shared = 0
    while shared < min(len(chosen), len(rejected)) and turn(chosen[shared]) == turn(rejected[shared]):
        shared += 1
    if shared == len(chosen) == len(rejected):  # identical replies (UltraFeedback has some): split off the last
        shared = len(chosen) - 1  # turn; the pair is then dropped and counted as teaching nothing (_uninformative_pairs)
    turns = chosen[:shared]
    if shared == 0 or turns[-1].get("role") != "user" or len(chosen) != shared + 1 or len(rejected) != shared + 1:
        if all(len(c) >= 2 and turn(c[-1])[0] == "assistant" and turn(c[-2])[0] == "user" for c in (chosen, rejected)):
            return {**row, "prompt": chosen[:-1], "chosen": chosen[-1:], "rejected": rejected[-1:], DIVERGED: True}
        differ = (f"; turn {shared} differs: {turn(chosen[shared]) if shared < len(chosen) else None!r:.80} in "
                  f"'chosen', {turn(rejected[shared]) if shared < len(rejected) else None!r:.80} in 'rejected'")
        raise FormatError(f"{where}: fields 'chosen' and 'rejected' are whole conversations (the implicit-prompt form), "
                          "but they do not share every turn up to a user turn followed by one assistant reply each "
                          f"(they share {shared} of {len(chosen)} and {len(rejected)} turns{differ})")
    if isinstance(prompt, str) and prompt.strip() != turns[-1]["content"].strip():
        raise FormatError(f"{where}: field 'prompt' is not the conversation's last user turn (prompt "
                          f"{prompt[:60]!r}, user turn {turns[-1]['content'][:60]!r})")
    return {**row, "prompt": turns, "chosen": chosen[shared:], "rejected": rejected[shared:]}


# The forms every stage type shares. Row numbers in problems count from 0, after the card's transforms.
register_form(DataForm("prompt_completion", ("prompt", "completion"), contents=_empty_field("completion")))
register_form(DataForm("messages", ("messages",), check_row=_check_messages, contents=_silent_conversations))
register_form(DataForm("preference", ("prompt", "chosen", "rejected"), replies=("chosen", "rejected"),
                       conversational=True, contents=_uninformative_pairs, normalise=implicit_prompt))
register_form(DataForm("prompt", ("prompt",), conversational=True, contents=_empty_field("prompt")))

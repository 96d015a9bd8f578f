"""The transforms a data card may name (`transform:`), applied to its rows before they are checked against the form
it produces (align/data/formats.py): the built-in ones (TRANSFORMS) and a user's `module:function`.

Each transform takes a list of row dicts, its arguments and a seed, and returns ``(rows, dropped)``, where
``dropped`` counts rows skipped for a stated reason (reported by ``align validate``), so nothing disappears silently.
"""

from __future__ import annotations

import hashlib
import os
import random
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Callable

from align.core.userfunc import import_function
from align.data.formats import FormatError, Rows, parse_hh_turns, text_of

def prefix_words(rows: Rows, args: Any, seed: int) -> tuple[Rows, Counter]:
    """Split `text` into a prompt of the first k words (k uniform in [lo, hi]) and the rest as completion.

    This is the DPO paper's controlled-sentiment prompt construction (review prefixes). Rows with too few
    words to leave a non-empty completion are dropped and counted.
    """
    bounds = list(args) if isinstance(args, (list, tuple)) else [args, args]
    if len(bounds) != 2 or not all(_whole(b) for b in bounds) or not 1 <= bounds[0] <= bounds[1]:
        raise FormatError(f"transform prefix_words: expected [min, max] whole numbers of words with 1 <= min <= max "
                          f"(or one number), got {args!r}")
    lo, hi = bounds
    rng = random.Random(seed)
    out, dropped = [], Counter()
    for i, row in enumerate(rows):
        if "text" not in row:
            raise FormatError(f"row {i}: transform prefix_words needs a `text` column (map one in `columns`)")
        words = _text(row, "text", i, "prefix_words").split()
        k = rng.randint(lo, hi)
        if len(words) <= k:
            dropped["too few words for the prefix"] += 1
            continue
        out.append({**_keep(row), "prompt": " ".join(words[:k]), "completion": " " + " ".join(words[k:])})
    return out, dropped


def render_hh_prompt(turns: list[tuple[str, str]]) -> str:
    """The prompt text: every turn, then the cue for the final assistant reply."""
    body = "".join(f"\n\n{'Human' if r == 'user' else 'Assistant'}: {t}" for r, t in turns)
    return body + "\n\nAssistant:"


def _hh_pairs(rows: Rows, args: Any, transform: str) -> tuple[list[tuple[list, str, str]], Counter]:
    """Parsed HH-RLHF pairs as (turns before the final reply, chosen reply, rejected reply), filtered and counted
    as `hh_transcript` documents (the max_prompt_chars limit applies to the HH-format prompt text)."""
    max_chars = args.get("max_prompt_chars") if isinstance(args, dict) else None
    if max_chars is not None and (not _whole(max_chars) or max_chars < 1):
        raise FormatError(f"transform {transform}: max_prompt_chars is a whole number of characters, got {max_chars!r}")
    out, dropped = [], Counter()
    for row in rows:
        try:
            texts = row["chosen"], row["rejected"]
        except KeyError as exc:
            raise FormatError(f"transform {transform} needs a {exc} column") from exc
        if not all(isinstance(t, str) for t in texts):
            dropped["transcript not text (null or another type)"] += 1
            continue
        try:
            chosen, rejected = parse_hh_turns(texts[0]), parse_hh_turns(texts[1])
        except FormatError:
            dropped["unparseable transcript"] += 1
            continue
        if chosen[:-1] != rejected[:-1]:
            dropped["chosen and rejected diverge before the final reply"] += 1
            continue
        if len(chosen) < 2 or chosen[-2][0] != "user":  # two Assistant turns in a row: no Human turn to reply to
            dropped["final reply not after a Human turn"] += 1
            continue
        if any(a[0] == b[0] for a, b in zip(chosen, chosen[1:])):  # as a chat template reads the turns: Gemma's and
            dropped["two turns of one role in a row"] += 1  # Mistral's refuse them, and one row refused the card
            continue
        if not text_of(chosen[-1][1]) or not text_of(rejected[-1][1]):
            dropped["empty final reply"] += 1
            continue
        if text_of(chosen[-1][1]) == text_of(rejected[-1][1]):
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
    reply, whose final replies are identical, with two turns of one role in a row (~0.2% of HH: a chat template
    such as Gemma's refuses them), or that do not parse, are dropped and counted by reason.
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


def prompt_completion_messages(rows: Rows, args: Any, seed: int) -> tuple[Rows, Counter]:
    """TRL's conversational prompt-completion rows (`prompt` and `completion` lists of messages) -> `messages` rows,
    the prompt's turns then the completion's. SFT on them trains every assistant turn, the prompt's earlier ones too
    (TRL's prompt-completion loss trains the completion's alone)."""
    out = []
    for i, row in enumerate(rows):
        prompt, completion = row.get("prompt"), row.get("completion")
        if not (isinstance(prompt, list) and isinstance(completion, list)):
            raise FormatError(f"row {i}: transform prompt_completion_messages needs `prompt` and `completion` lists "
                              f"of messages, got {type(prompt).__name__} and {type(completion).__name__}")
        out.append({**_keep(row), "messages": prompt + completion})
    return out, Counter()


def alpaca(rows: Rows, args: Any, seed: int) -> tuple[Rows, Counter]:
    """Alpaca rows (instruction / input / output) -> prompt_completion."""
    out, dropped = [], Counter()
    for i, row in enumerate(rows):
        if "instruction" not in row or "output" not in row:
            raise FormatError(f"row {i}: transform alpaca needs `instruction` and `output` columns")
        if row["output"] is None or not _text(row, "output", i, "alpaca").strip():
            dropped["empty output"] += 1
            continue
        extra = row.get("input")  # optional: null, or NaN where pandas wrote a missing value
        extra = "" if extra is None or (isinstance(extra, float) and extra != extra) else _text(row, "input", i, "alpaca")
        extra = extra.strip()
        prompt = _text(row, "instruction", i, "alpaca").strip() + (f"\n\n{extra}" if extra else "")
        out.append({"prompt": prompt, "completion": " " + row["output"].strip()})
    return out, dropped


def drop_score_ties(rows: Rows, args: Any, seed: int) -> tuple[Rows, Counter]:
    """Preference pairs whose own ratings do not prefer `chosen` are dropped and counted: a tie teaches a coin flip
    (HuggingFaceH4's UltraFeedback binarization draws `rejected` at random from the other completions, which may be
    rated as high as the best; Argilla's cleaned version removes such ties), and a `rejected` rated higher teaches
    the reverse. Reads the ratings from `score_chosen` / `score_rejected` (map them in the card's `columns:`; args
    `{chosen: <field>, rejected: <field>}` name others) and leaves them out of the rows it keeps."""
    if args is not None and not (isinstance(args, dict) and set(args) <= {"chosen", "rejected"}):
        raise FormatError(f"transform drop_score_ties: expected {{}} or {{chosen: <field>, rejected: <field>}} naming "
                          f"the ratings' fields, got {args!r}")
    fields = {"chosen": "score_chosen", "rejected": "score_rejected", **(args or {})}
    out, dropped = [], Counter()
    for i, row in enumerate(rows):
        chosen, rejected = (_rating(row, fields[side], i) for side in ("chosen", "rejected"))
        if chosen <= rejected:
            dropped["rated alike (a tie)" if chosen == rejected else "rejected rated above chosen"] += 1
            continue
        out.append({k: v for k, v in row.items() if k not in fields.values()})
    return out, dropped


def _rating(row: dict[str, Any], key: str, i: int) -> float:
    value = row.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise FormatError(f"row {i}: transform drop_score_ties: field '{key}' must be a number (a rating), got "
                          f"{str(value)[:60]}; map the ratings in `columns:` (e.g. {key}: {key})")
    return float(value)


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _text(row: dict[str, Any], key: str, i: int, transform: str) -> str:
    """A row's field that a transform reads as text; anything else (null, a number, a list) is an error naming it,
    not text made of its repr."""
    value = row[key]
    if not isinstance(value, str):
        raise FormatError(f"row {i}: transform {transform}: field '{key}' must be text, got {type(value).__name__} "
                          f"{str(value)[:60]}; fix the row, or map `columns:` to the field that holds the text")
    return value


def _keep(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if k in ("id", "score")}


def user_transform(name: str, card: Path) -> Callable[[Rows, Any, int], tuple[Rows, Counter]]:
    """A card's own transform, `module:function` (like a judge): the module is imported from the card's directory,
    else the working directory or the Python path. It is called as the named transforms are, `(rows, args, seed)`,
    and returns `(rows, dropped)` (a Counter of reasons) or just the rows; what it returns is checked like any row.
    Its source file is part of the card's content hash, so editing it reruns the stages that read the card."""
    folder = card.resolve().parent
    fn = import_function(name, "transform", [str(folder), os.getcwd()], FormatError,
                         lambda path: f"put {path} beside the card ({folder}) or on PYTHONPATH")

    def run(rows: Rows, args: Any, seed: int) -> tuple[Rows, Counter]:
        try:
            out = fn(rows, args, seed)
        except Exception as exc:  # the user's code: any exception is its fault, reported as the transform's
            raise FormatError(f"transform '{name}' raised {type(exc).__name__}: {exc}") from exc
        new, dropped = out if isinstance(out, tuple) and len(out) == 2 else (out, Counter())
        if not isinstance(new, list) or not all(isinstance(r, dict) for r in new):
            raise FormatError(f"transform '{name}' returned {type(new).__name__}, not a list of rows (dicts)")
        return new, Counter(dropped)

    module = sys.modules.get(name.partition(":")[0])  # the module the card names (imported just above)
    run.source_file = getattr(module, "__file__", None)  # type: ignore[attr-defined]
    return run


def transform_source_digest(name: str, card: Path) -> str:
    """sha256 of a user transform's module file (what the card's content hash covers)."""
    file = getattr(user_transform(name, card), "source_file", None)
    return hashlib.sha256(Path(file).read_bytes()).hexdigest() if file else ""


TRANSFORMS: dict[str, Callable[[Rows, Any, int], tuple[Rows, Counter]]] = {
    "prefix_words": prefix_words,
    "hh_transcript": hh_transcript,
    "hh_chosen_sft": hh_chosen_sft,
    "hh_messages": hh_messages,
    "hh_chosen_messages": hh_chosen_messages,
    "alpaca": alpaca,
    "prompt_completion_messages": prompt_completion_messages,
    "drop_score_ties": drop_score_ties,
}

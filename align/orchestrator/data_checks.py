"""`align validate`'s checks across the data cards of several stages: evaluation prompts no stage trains on, and
one form of text (conversations rendered with the chat template, or plain text) along every chain of stages.

Like the rest of the orchestrator it names no stage type: it reads what the config classes declare (`PROMPTS`,
`CARDS`) and the plan's graph.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from align.core.errors import PipelineError
from align.data.cards import LoadedSplit
from align.data.formats import row_prompt_key, turns_key
from align.orchestrator.plan import StagePlan

SplitLoader = Callable[[Path, str], LoadedSplit]
CHAT, TEXT = "conversations (rendered with the chat template)", "plain text (no chat template)"


def _turn_keys(rows: list[dict]) -> set[str]:
    """The rows' prompts by their turns (formats.turns_key), whatever the card's form."""
    return {k for k in (row_prompt_key(r, turns_key) for r in rows) if k is not None}


def check_eval_overlap(plans: list[StagePlan], split_of: SplitLoader, source: str) -> None:
    """Evaluation prompts must not appear among any stage's training prompts, in whatever form either card gives
    them (formats.turns_key: a text card and a chat card over the same transcripts)."""
    trained: dict[str, set[str]] = {}
    for plan in plans:
        if plan.cfg.PROMPTS == "train":
            for fld, card in plan.cards.items():
                rows = split_of(card, plan.cfg.card_split(fld)).rows  # conversations: keyed by their turns
                trained.setdefault(plan.name, set()).update(_turn_keys(rows))
    for plan in plans:
        if plan.cfg.PROMPTS != "held_out":
            continue
        for fld, card in plan.cards.items():
            split = plan.cfg.card_split(fld)
            held_out = _turn_keys(split_of(card, split).rows)
            for name, prompts in trained.items():
                overlap = held_out & prompts
                if overlap:
                    example = json.loads(min(overlap, key=len))[-1][1]  # its last turn's text
                    example = example if len(example) <= 160 else example[:160] + "..."
                    raise PipelineError(
                        f"{source}: stages.{plan.name}: {len(overlap)} evaluation prompts (split '{split}') "
                        f"also occur in the training prompts of stage '{name}', e.g. {example!r}. Measure on a "
                        "split no stage trains on.")


def card_form(data: LoadedSplit) -> str | None:
    """CHAT when the split's rows are conversations (a `messages` card, or prompts / replies as message lists),
    TEXT when they are text, None when unknown (a hub dataset not read here, or no rows)."""
    if data.card.produces == "messages":
        return CHAT
    if not data.available or not data.rows:
        return None
    row: dict[str, Any] = data.rows[0]
    return CHAT if any(isinstance(row.get(col), list) for col in ("prompt", "chosen", "completion")) else TEXT


def form_mismatches(plans: list[StagePlan], split_of: SplitLoader, source: str) -> list[str]:
    """Warnings for a stage whose cards give another form of text than a stage upstream of it (its policy, its
    scoring model or its data, however far up) trained on or sampled from: a policy fine-tuned on chat-template
    conversations, then trained on the same transcripts as "\\n\\nHuman: ..." text (or the reverse, or a scoring
    model trained on one form scoring the other), learns from, or is scored on, text in a form it never saw."""
    by_name = {p.name: p for p in plans}
    forms: dict[str, tuple[str, str]] = {}  # stage -> (form, card name)
    for plan in plans:
        for fld, card in plan.cards.items():
            form = card_form(split_of(card, plan.cfg.card_split(fld)))
            if form is not None:
                forms.setdefault(plan.name, (form, card.name))
    warnings = []
    for plan in plans:
        if plan.name not in forms:
            continue
        form, card = forms[plan.name]
        for up in _upstream(plan.name, by_name):
            if up in forms and forms[up][0] != form:
                warnings.append(f"{source}: stages.{plan.name}: {card} gives {form}, but stage '{up}' upstream of it "
                                f"trained on or sampled from {forms[up][1]}, which gives {forms[up][0]}: one of them "
                                "reads text in a form the other's model never saw. Use cards of one form along the "
                                "pipeline (the HH cards come in both: hh_rlhf_harmless_*_pairs.yaml and *_chat_*.yaml)")
                break
    return warnings


def _upstream(name: str, by_name: dict[str, StagePlan]) -> list[str]:
    """Every stage `name` depends on, however far up, nearest first."""
    seen: list[str] = []
    todo = list(by_name[name].deps)
    while todo:
        dep = todo.pop(0)
        if dep not in seen and dep in by_name:
            seen.append(dep)
            todo.extend(by_name[dep].deps)
    return seen

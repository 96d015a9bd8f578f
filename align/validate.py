"""`align validate`: everything that can be checked before anything is launched or trained.

The graph and fingerprints (align/plan.py), every data card and the rows of the split each stage reads, each
stage type's own settings checks (`check` on its config class), checks between stages, the accelerate configs,
the base model's files (align/inputs.py). What needs a loaded tokenizer or the model classes (the tokenizer itself,
the rendered example per stage, over-long examples, LoRA targets) runs in a helper process (align/modelchecks.py
through align/helper.py): this module, like the rest of the orchestrator, never imports torch.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from typing import Callable

from align import helper
from align.builtin import is_builtin
from align.compute import flash_attention_problem
from align.config import CheckContext, ConfigError, PipelineConfig, TrainedStage, to_dict
from align.config.common import PROMPTS_ONLY
from align.data.cards import DataCardError, DataUnavailableError, LoadedSplit, hub_reachable, load_card, load_split
from align.data.formats import row_prompt_key
from align.inputs import check_model_inputs, tokenizer_to_check
from align.launch import check_accelerate
from align.plan import PipelineError, StagePlan, build_plan
from align.sweeps import by_stage

SplitLoader = Callable[[Path, str], LoadedSplit]


def card_loader() -> SplitLoader:
    """(card, split) -> its rows, loaded once per card and split; a hub dataset this machine cannot reach is an
    empty split marked unavailable (its rows are checked when the stage starts on a machine that can fetch them)."""
    cache: dict[tuple[str, str], LoadedSplit] = {}

    def split_of(card: Path, split: str) -> LoadedSplit:
        key = (str(card), split)
        if key not in cache:
            try:
                loaded = load_card(card)
                if loaded.format == "hub" and not hub_reachable():
                    raise DataUnavailableError(str(card))
                cache[key] = load_split(loaded, split)
            except DataUnavailableError:
                cache[key] = LoadedSplit(loaded, split, [], Counter(), 0, available=False)
            except DataCardError as exc:
                raise PipelineError(str(exc)) from None
        return cache[key]

    return split_of


def validate(cfg: PipelineConfig, source: str | Path, plans: list[StagePlan] | None = None,
             verbose: bool = True) -> list[StagePlan]:
    """Everything that can be checked without training: graph, cards and their data, stage settings; then, in a
    helper process, what needs the tokenizer or the model classes."""
    plans = plans or build_plan(cfg, source)
    split_of = card_loader()
    problem = flash_attention_problem(cfg.attn_implementation)
    if problem:
        raise PipelineError(f"{source}: attn_implementation: {cfg.attn_implementation!r}: {problem}")
    for note in check_model_inputs(cfg, source):
        if verbose:
            print(f"  warning: {note}")
    for plan in plans:
        check_accelerate(plan, source)
        for fld, card in plan.cards.items():
            data = split_of(card, plan.cfg.card_split(fld))
            _check_card_rows(plan, fld, card, data, str(source))
            if verbose and not data.available:
                print(f"  {plan.name}.{fld}: {card.name}: warning: hub dataset {data.card.source.get('hub')} not "
                      "reachable from here; its rows are checked when the stage starts")
            elif verbose:
                dropped = ", ".join(f"{n} {why}" for why, n in data.dropped.items()) or "none dropped"
                print(f"  {plan.name}.{fld}: {card.name} split '{data.split}': {len(data.rows)} rows ({dropped})")
        try:
            plan.cfg.check(CheckContext(plan.name, cfg, plan.cards, split_of))
        except (ConfigError, ValueError) as exc:
            raise PipelineError(f"{source}: stages.{plan.name}: {exc}") from None
    _check_eval_overlap(plans, split_of, str(source))
    mismatches = [line for name, st in cfg.stages.items() for line in st.pipeline_problems(name, cfg.stages)]
    if mismatches:
        raise PipelineError(f"{source}: " + "\n".join(mismatches))
    tokenizer = tokenizer_to_check(cfg, source)
    if tokenizer is not None or any(isinstance(p.cfg, TrainedStage) and p.cfg.lora.enabled for p in plans):
        sys.stdout.flush()  # the helper writes to the same console: keep the order of lines
        helper.call("align.modelchecks:run", config=to_dict(cfg), source=str(source), verbose=verbose)
    if verbose and is_builtin(cfg.base_model) and not cfg.tokenizer:
        print("  length check: at stage start (the builtin model's tokenizer is trained by the first stage)")
    return plans


def stage_lines(cfg: PipelineConfig, plans: list[StagePlan]) -> list[str]:
    """`align validate`'s listing: one line per stage in run order, each sweep variant with its values."""
    width = max(12, *(len(p.name) for p in plans))
    lines = []
    for plan in plans:
        line = (f"  {plan.name:{width}s} {plan.cfg.type:12s} <- {', '.join(plan.deps) or '-':24s} "
                f"fingerprint {plan.fingerprint}")
        variant = cfg.variants.get(plan.name)
        if variant:
            values = " ".join(f"{k}={v}" for k, v in variant["values"].items())
            line += f"  (sweep of {variant['stage']}: {values})"
        lines.append(line)
    for stage, variants in sorted(by_stage(cfg.variants).items()):
        lines.append(f"  sweep {stage}: {len(variants)} variants")
    return lines


def _check_card_rows(plan: StagePlan, fld: str, card: Path, data: LoadedSplit, source: str) -> None:
    """A card a stage samples prompts from needs prompts that are not all empty (what a stage type needs of its
    cards beyond that is its own `check`)."""
    if not data.available:
        return
    where = f"{source}: stages.{plan.name}.{fld}"
    if type(plan.cfg).CARDS[fld] == PROMPTS_ONLY and not any(str(r.get("prompt", "")).strip() for r in data.rows):
        raise PipelineError(f"{where}: every one of the {len(data.rows)} prompts of {card.name} split "
                            f"'{data.split}' is empty; a policy would be sampled from nothing")


def _check_eval_overlap(plans: list[StagePlan], split_of, source: str) -> None:
    """Evaluation prompts must not appear among any stage's training prompts."""
    trained: dict[str, set[str]] = {}
    for plan in plans:
        if plan.cfg.PROMPTS == "train":
            for fld, card in plan.cards.items():
                rows = split_of(card, plan.cfg.card_split(fld)).rows  # conversations: keyed by their turns
                trained.setdefault(plan.name, set()).update(k for k in map(row_prompt_key, rows) if k is not None)
    for plan in plans:
        if plan.cfg.PROMPTS != "held_out":
            continue
        for fld, card in plan.cards.items():
            split = plan.cfg.card_split(fld)
            held_out = {k for k in map(row_prompt_key, split_of(card, split).rows) if k is not None}
            for name, prompts in trained.items():
                overlap = held_out & prompts
                if overlap:
                    example = sorted(overlap)[0]
                    raise PipelineError(
                        f"{source}: stages.{plan.name}: {len(overlap)} evaluation prompts (split '{split}') "
                        f"also occur in the training prompts of stage '{name}', e.g. {example!r}. Measure on a "
                        "split no stage trains on.")

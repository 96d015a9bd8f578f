"""`align validate`: everything that can be checked before anything is launched or trained.

The graph and fingerprints (align/plan.py), every data card and the rows of the split each stage reads, each
stage type's own settings checks (`check` on its config class), checks between stages, the accelerate configs,
the base model and tokenizer (align/inputs.py), and over-long examples when the tokenizer can be loaded here.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from align import templates
from align.builtin import is_builtin
from align.compute import flash_attention_problem
from align.config import CheckContext, ConfigError, PipelineConfig, TrainedStage
from align.data.cards import DataCardError, DataUnavailableError, LoadedSplit, hub_reachable, load_card, load_split
from align.data.chat import as_text
from align.data.formats import FormatError, prompt_key, row_prompt_key
from align.inputs import check_model_inputs, resolve_model_paths
from align.launch import check_accelerate
from align.lengths import LengthError, enforce, measure
from align.plan import PipelineError, StagePlan, build_plan
from align.sweeps import by_stage


def validate(cfg: PipelineConfig, source: str | Path, plans: list[StagePlan] | None = None,
             verbose: bool = True) -> list[StagePlan]:
    """Everything that can be checked without training: graph, cards and their data, stage settings."""
    plans = plans or build_plan(cfg, source)
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
                # A hub dataset this machine cannot reach (e.g. an offline login node): the card is checked,
                # its rows are checked when the stage starts on a machine that can fetch them.
                cache[key] = LoadedSplit(loaded, split, [], Counter(), 0, available=False)
            except DataCardError as exc:
                raise PipelineError(str(exc)) from None
        return cache[key]

    problem = flash_attention_problem(cfg.attn_implementation)
    if problem:
        raise PipelineError(f"{source}: attn_implementation: {cfg.attn_implementation!r}: {problem}")
    for note in check_model_inputs(cfg, source):
        if verbose:
            print(f"  warning: {note}")
    for plan in plans:
        check_accelerate(plan, source)
        for fld, card in plan.cards.items():
            data = split_of(card, getattr(plan.cfg, "split", "train"))
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
    _check_lengths(cfg, plans, split_of, str(source), verbose)
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
    """Prompt cards need prompts that are not all empty (what a stage type needs of its cards beyond that is
    its own `check`)."""
    if not data.available:
        return
    where = f"{source}: stages.{plan.name}.{fld}"
    if fld == "prompts" and not any(str(r.get("prompt", "")).strip() for r in data.rows):
        raise PipelineError(f"{where}: every one of the {len(data.rows)} prompts of {card.name} split "
                            f"'{data.split}' is empty; a policy would be sampled from nothing")


def _check_lengths(cfg: PipelineConfig, plans: list[StagePlan], split_of, source: str, verbose: bool) -> None:
    """Over-long examples per trained stage whose data is a card, when the tokenizer can be loaded here.

    Every stage repeats the check at its start (the only place it can run when the tokenizer is trained by
    the first stage, or the hub is unreachable), so skipping it here never lets a bad run train."""
    from align.models import ModelError, load_tokenizer  # heavy (torch): only when a length check runs

    data = {p.name: split_of(p.cards["data"], getattr(p.cfg, "split", "train"))
            for p in plans if isinstance(p.cfg, TrainedStage) and p.cfg.LENGTH_RULE and "data" in p.cards}
    todo = [p for p in plans if p.name in data and data[p.name].available]
    if not todo:
        return
    paths = resolve_model_paths(cfg, source)
    name = paths["tokenizer"] or (None if is_builtin(str(paths["base_model"])) else paths["base_model"])
    if name is None:
        if verbose:
            print("  length check: at stage start (the builtin model's tokenizer is trained by the first stage)")
        return
    try:
        chat = any(data[p.name].card.produces == "messages" for p in todo)
        tokenizer = load_tokenizer(name, cfg.trust_remote_code, needs_chat_template=chat)
        if paths["chat_template"] or chat:  # as the first SFT stage will: the template, EOS = end of turn
            templates.install(tokenizer, paths["chat_template"] and templates.template_text(paths["chat_template"]))
            problem = templates.prompt_boundary_problem(tokenizer)
            if problem and verbose:
                print(f"  warning: chat template: {problem}")
    except ModelError as exc:
        raise PipelineError(f"{source}: tokenizer: {exc}") from None
    except (OSError, ValueError) as exc:  # a hub tokenizer offline (a local one failed check_model_inputs)
        if verbose:
            first = str(exc).splitlines()[0] if str(exc) else ""
            print(f"  length check: at stage start (tokenizer '{name}' not loadable here: {type(exc).__name__}: "
                  f"{first})")
        return
    for plan in todo:
        rows = data[plan.name].rows
        rows = rows[: plan.cfg.max_train_examples] if plan.cfg.max_train_examples else rows
        if plan.cfg.LENGTH_RULE != "sft":  # conversational pairs: as the stage will see them (data/chat.py)
            try:
                rows = as_text(rows, tokenizer)
            except FormatError as exc:
                raise PipelineError(f"{source}: stages.{plan.name}.data: {exc}") from None
        report = measure(plan.name, plan.cfg.LENGTH_RULE, rows, tokenizer, plan.cfg.max_length)
        if verbose:
            print(f"  length check {report.summary()}")
        try:
            enforce(report, plan.cfg.max_truncated_fraction)
        except LengthError as exc:
            raise PipelineError(f"{source}: {exc}") from None


def _check_eval_overlap(plans: list[StagePlan], split_of, source: str) -> None:
    """Evaluation prompts must not appear among any stage's training prompts."""
    trained: dict[str, set[str]] = {}
    for plan in plans:
        if plan.cfg.PROMPTS == "train":
            for card in plan.cards.values():
                rows = split_of(card, plan.cfg.split).rows  # conversations: keyed by their turns (formats.py)
                trained[plan.name] = {k for k in map(row_prompt_key, rows) if k is not None}
    for plan in plans:
        if plan.cfg.PROMPTS != "held_out" or "prompts" not in plan.cards:
            continue
        held_out = {prompt_key(r["prompt"]) for r in split_of(plan.cards["prompts"], plan.cfg.split).rows}
        for name, prompts in trained.items():
            overlap = held_out & prompts
            if overlap:
                example = sorted(overlap)[0]
                raise PipelineError(
                    f"{source}: stages.{plan.name}: {len(overlap)} evaluation prompts (split '{plan.cfg.split}') "
                    f"also occur in the training prompts of stage '{name}', e.g. {example!r}. Evaluate on a "
                    "split no stage trains on.")

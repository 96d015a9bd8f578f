"""`align validate`: everything that can be checked before anything is launched or trained.

The graph and fingerprints (plan.py), every data card and the rows of the split each stage reads, each stage type's
own settings checks (`check` on its config class), checks between stages, the accelerate configs, the base model's
files (inputs.py). What needs a loaded tokenizer or the model classes (the tokenizer itself, the rendered example
per stage, over-long examples, the model shapes for LoRA targets) runs in a helper process (helper.py ->
align/modeling/checks.py) from a job this module builds (`model_job`): like the rest of the orchestrator, it never
imports torch.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from typing import Any

from align.core.tracking import wandb_env_problem
from align.config import CheckContext, ConfigError, PipelineConfig, TrainedStage
from align.config.contract import EXAMPLES, POLICY, PROMPTS_ONLY, REWARD_MODEL, refs
from align.config.settings import flash_attention_problem
from align.config.sweeps import by_stage
from align.core.builtin import is_builtin
from align.core.fsutil import runs_dir_problem
from align.data.hub import hub_unreadable
from align.data.cards import DataCardError, DataUnavailableError, LoadedSplit, load_card, load_split
from align.orchestrator import helper
from align.orchestrator.data_checks import SplitLoader, check_eval_overlap, form_mismatches
from align.orchestrator.estimate import EstimateError, ModelShape, model_sources
from align.orchestrator.memory import enabled_lora, missing_lora_targets, qlora_base_problems, targeted
from align.orchestrator.inputs import (base_model_config, check_model_inputs, fetch_tokenizer, local_model_problem,
                                       resolve_model_paths, tokenizer_name, tokenizer_to_check)
from align.orchestrator.launch import accelerate_config, accelerate_mode, check_accelerate
from align.orchestrator.plan import StagePlan, build_plan
from align.core.errors import PipelineError

def card_loader() -> SplitLoader:
    """(card, split) -> its rows, loaded once per card and split; a hub dataset this machine cannot reach is an
    empty split marked unavailable (its rows are checked when the stage starts on a machine that can fetch them)."""
    cache: dict[tuple[str, str], LoadedSplit] = {}

    def split_of(card: Path, split: str) -> LoadedSplit:
        key = (str(card), split)
        if key not in cache:
            try:
                loaded = load_card(card)
                if loaded.format == "hub" and hub_unreadable(loaded.source["hub"]):
                    raise DataUnavailableError(str(card))
                cache[key] = load_split(loaded, split)
            except DataUnavailableError:
                cache[key] = LoadedSplit(loaded, split, [], Counter(), 0, available=False)
            except DataCardError as exc:
                raise PipelineError(str(exc)) from None
        return cache[key]

    return split_of


def check_environment(plans: list[StagePlan], names: set[str], source: str | Path) -> None:
    """Refuse the stages named in `names` whose environment lacks what they need to run (a hub token;
    StageBase.environment_problem): `align validate` asks for every stage, `align run` for those it will run
    (`align report` rebuilds the report without asking for an upload's token)."""
    for plan in plans:
        if plan.name in names and (problem := plan.cfg.environment_problem()):
            raise PipelineError(f"{source}: stages.{plan.name}: {problem}")


def validate(cfg: PipelineConfig, source: str | Path, plans: list[StagePlan] | None = None,
             verbose: bool = True) -> list[StagePlan]:
    """Everything that can be checked without training: graph, cards and their data, stage settings; then, in a
    helper process, what needs the tokenizer or the model classes. A hub tokenizer not cached here is fetched first
    when the hub answers (its small files: inputs.fetch_tokenizer), so the plan and the checks read it."""
    if plans is None and (note := fetch_tokenizer(cfg, source)) and verbose:
        print(f"  warning: {note}")
    plans = plans or build_plan(cfg, source)
    split_of = card_loader()
    problem = flash_attention_problem(cfg.attn_implementation) or (
        "flash-attention computes in 16 bits only, and precision: float32 keeps fp32 weights and no autocast; use "
        "precision: bfloat16 (or auto on a GPU with bf16), or attn_implementation: sdpa"
        if cfg.attn_implementation == "flash_attention_2" and cfg.precision == "float32" else None)
    if problem:
        raise PipelineError(f"{source}: attn_implementation: {cfg.attn_implementation!r}: {problem}")
    problem = runs_dir_problem(cfg.runs_dir)
    if problem:
        raise PipelineError(f"{source}: runs_dir: {cfg.runs_dir!r}: {problem}")
    if cfg.tracking.wandb != "disabled" and (problem := wandb_env_problem()):
        raise PipelineError(f"{source}: tracking.wandb: {problem}")
    for note in check_model_inputs(cfg, source):
        if verbose:
            print(f"  warning: {note}")
    for plan in plans:
        check_accelerate(plan, source, cfg.precision)
        problem = _half_weights_problem(plan, cfg, source)
        if problem:
            raise PipelineError(f"{source}: stages.{plan.name}: {problem}")
        lora = enabled_lora(plan.cfg)
        if verbose and lora is not None and lora.dropout and not type(plan.cfg).DROPOUT:
            print(f"  warning: stages.{plan.name}.lora.dropout {lora.dropout:g} is not applied: a {plan.cfg.type} stage "
                  "trains with dropout off (its trainer sets every dropout to 0, the adapters' too); set it to 0")
        _check_cards(plan, split_of, str(source), verbose)
        try:
            plan.cfg.check(CheckContext(plan.name, cfg, plan.cards, split_of, Path(source).resolve().parent))
        except (ConfigError, ValueError) as exc:
            raise PipelineError(f"{source}: stages.{plan.name}: {exc}") from None
        _check_engine(plan, cfg, str(source))
        for key, value in plan.cfg.local_models().items():  # checked as the base model is, not when first loaded
            if problem := local_model_problem(value, Path(source).resolve().parent, cfg.trust_remote_code):
                raise PipelineError(f"{source}: stages.{plan.name}.{key}: {problem}")
    check_eval_overlap(plans, split_of, str(source))
    for note in form_mismatches(plans, split_of, str(source)) if verbose else ():
        print(f"  warning: {note}")
    mismatches = [line for name, st in cfg.stages.items() for line in st.pipeline_problems(name, cfg.stages)]
    mismatches += qlora_base_problems(cfg.stages)
    if mismatches:
        raise PipelineError(f"{source}: " + "\n".join(mismatches))
    job = model_job(cfg, plans, split_of, str(source), verbose)
    if job:
        sys.stdout.flush()  # the helper writes to the same console: keep the order of lines
        answer = helper.call("align.modeling.checks:run", **job)
        if "shapes" in answer:
            _check_lora_targets(cfg, plans, answer["shapes"], str(source), verbose)
        _check_new_token_rows(cfg, plans, answer, str(source))
    if verbose and is_builtin(cfg.base_model) and not cfg.tokenizer:
        print("  length check: at stage start (the builtin model's tokenizer is trained by the first stage)")
    return plans


def _check_cards(plan: StagePlan, split_of: SplitLoader, source: str, verbose: bool) -> None:
    """Each card the stage reads: its split exists and its rows are usable (and, verbose, how many were kept)."""
    for fld, card in plan.cards.items():
        try:
            data = split_of(card, plan.cfg.card_split(fld))
        except PipelineError as exc:  # a split the card lacks: which stage asked for it
            raise PipelineError(f"{source}: stages.{plan.name}.{fld} (split '{plan.cfg.card_split(fld)}'): "
                                f"{exc}") from None
        _check_card_rows(plan, fld, card, data, source)
        if verbose and not data.available:
            print(f"  {plan.name}.{fld}: {card.name}: warning: hub dataset {data.card.source.get('hub')} not read: no "
                  "mirror or cached copy, no hub; its rows are checked as the stage starts, not their overlap with "
                  "evaluation prompts (HF_HUB_OFFLINE=1 reads a cached copy)")
        elif verbose:
            dropped = ", ".join(f"{n} {why}" for why, n in data.dropped.items()) or "none dropped"
            print(f"  {plan.name}.{fld}: {card.name} split '{data.split}': {len(data.rows)} rows, of {data.read} "
                  f"read ({dropped})")


def _check_engine(plan: StagePlan, cfg: PipelineConfig, source: str) -> None:
    """`generation.engine` is one the stage type samples with, its kind reports no problem on this machine (vLLM:
    installed where align looks for it, a head size its attention supports), and an engine with its own copy starts
    from whole weights (a LoRA stage publishes its adapter alone unless `lora.merge`)."""
    from align.engines import DEFAULT, kind as engine_kind

    gen = plan.cfg.generation_settings()
    if gen is None:
        return
    where = f"{source}: stages.{plan.name}.generation.engine"
    if gen.engine not in plan.cfg.ENGINES:
        why = f" {plan.cfg.ENGINE_NOTE}" if plan.cfg.ENGINE_NOTE else ""
        raise PipelineError(f"{where}: '{gen.engine}' is not available for stage type '{plan.cfg.TYPE}' (it samples "
                            f"with {', '.join(plan.cfg.ENGINES)}).{why} Set generation.engine: {DEFAULT}")
    kind = engine_kind(gen.engine)
    if gen.sleep and not kind.sleeps:
        raise PipelineError(f"{source}: stages.{plan.name}.generation.sleep: true, but '{gen.engine}' cannot free its "
                            f"memory while the policy trains; remove it, or use an engine that can (generation.engine: "
                            f"{', '.join(n for n in plan.cfg.ENGINES if engine_kind(n).sleeps) or 'none here'})")
    if gen.sleep and plan.cfg.PRODUCES != POLICY:
        raise PipelineError(f"{source}: stages.{plan.name}.generation.sleep: true, but stage type '{plan.cfg.TYPE}' "
                            f"trains nothing between its rounds of sampling, so its engine would never sleep: remove it")
    if not kind.own_copy:  # it samples with the stage's own model
        placed = [k for k, v in (("tensor_parallel_size", 1), ("placement", "colocated")) if getattr(gen, k) != v]
        if placed:
            key = placed[0]
            raise PipelineError(f"{source}: stages.{plan.name}.generation.{key}: {getattr(gen, key)!r} places an "
                                f"engine with its own copy of the policy; '{gen.engine}' samples with each process's "
                                f"own model: remove the setting, or use an engine with its own copy (generation.engine:"
                                f" {', '.join(n for n in plan.cfg.ENGINES if engine_kind(n).own_copy) or 'none here'})")
        return
    for ref in refs(getattr(plan.cfg, plan.cfg.ENGINE_MODEL, None)):
        lora = enabled_lora(cfg.stages.get(ref))
        if lora is not None and not lora.merge:
            raise PipelineError(f"{where}: '{gen.engine}' starts from stage '{ref}''s model/, which holds LoRA adapters "
                                f"alone; the engine needs whole weights: set stages.{ref}.lora.merge: true")
    if (base_model_config(cfg, source, resolve_model_paths(cfg, source)) or {}).get("auto_map"):
        raise PipelineError(f"{where}: '{gen.engine}' keeps its own copy of the policy and loads it without the "
                            "model's own code (align starts it with trust_remote_code off); use generation.engine: hf")
    problem = kind.problems(where, lambda: _head_dim(cfg, source))
    if problem:
        raise PipelineError(problem)


def _head_dim(cfg: PipelineConfig, source: str) -> int | None:
    """The base model's attention head size, from its config (None when nothing here describes it)."""
    if is_builtin(cfg.base_model):
        return cfg.builtin.hidden_size // cfg.builtin.num_heads
    try:
        config = base_model_config(cfg, source, resolve_model_paths(cfg, source)) or {}
    except ConfigError:
        return None  # named by the model-input checks
    heads = config.get("num_attention_heads")
    return config.get("head_dim") or (config["hidden_size"] // heads if heads and config.get("hidden_size") else None)


def model_job(cfg: PipelineConfig, plans: list[StagePlan], split_of: SplitLoader, source: str,
              verbose: bool) -> dict[str, Any]:
    """What validation asks of its helper process (align/modeling/checks.py `run`), as JSON: the tokenizer to load,
    the planned chat template and whether it is installed, the rows to render an example from and the rows to count
    lengths of (each stage's card, as its class reads it), and the model's shapes when a stage trains LoRA adapters.
    Empty when there is nothing to load here (a builtin model's tokenizer is trained by its first stage)."""
    lora = any(enabled_lora(p.cfg) is not None for p in plans)
    name = tokenizer_to_check(cfg, source)
    if name is None and not lora:
        return {}
    job: dict[str, Any] = {"source": source, "verbose": verbose}
    if lora:
        try:
            job["shapes"] = {**model_sources(cfg, source), "probe": False}  # names only: no layer probe
        except EstimateError as exc:
            if verbose:
                print(f"  warning: LoRA target_modules not checked here ({exc})")
    if name is None:
        return job
    paths = resolve_model_paths(cfg, source)
    _, field = tokenizer_name(cfg, paths)
    config = base_model_config(cfg, source, paths) or {}
    job["tokenizer"] = {"name": name, "field": field, "trust_remote_code": cfg.trust_remote_code,
                        "vocab": config.get("vocab_size")}
    if config.get("model_type") and not (config.get("auto_map") and cfg.trust_remote_code):  # transformers' classes
        job["model"] = {"name": cfg.base_model, "model_type": config["model_type"],
                        "scalar": any(p.cfg.PRODUCES == REWARD_MODEL for p in plans)}
    cards = {(p.name, fld): split_of(card, p.cfg.card_split(fld)) for p in plans for fld, card in p.cards.items()}
    cards = {k: d for k, d in cards.items() if d.available and d.rows}
    template = plans[0].chat_template if plans else None
    job["template"] = template.as_dict() if template is not None else None
    # Installed as the stage that installs it will (its class's rule: e.g. from the base model, on conversations).
    job["install_template"] = any(p.installs_template(cfg.chat_template is not None) for p in plans)
    job["examples"], job["lengths"] = [], []
    for plan in plans:
        limit = plan.cfg.max_train_examples if isinstance(plan.cfg, TrainedStage) else None
        for fld, use in type(plan.cfg).CARDS.items():
            if (plan.name, fld) not in cards:
                continue
            rows = [r if use == EXAMPLES else {"prompt": r.get("prompt")} for r in cards[(plan.name, fld)].rows]
            rows = rows[:limit] if limit else rows  # (a stage that samples its replies reads a card's prompts alone)
            where = f"stages.{plan.name}.{fld}"
            split_all = "messages" in rows[0] and plan.cfg.trains_on_assistant_turns()
            if split_all or isinstance(rows[0].get("prompt"), list):  # conversations: rendered in the helper
                job["examples"].append({"where": where, "label": f"{plan.name}.{fld}", "rows": rows if split_all else rows[:1],
                                        "assistant_turns": split_all and getattr(plan.cfg, "train_turns", "all"), "replies": use == EXAMPLES})
            check = plan.cfg.length_check(fld, cfg.stages)
            if check is not None:
                rule, bound, fraction = check
                job["lengths"].append({"where": where, "stage": plan.name, "rule": rule.name,
                                       "rows": plan.cfg.length_rows(rows), "max_length": bound,
                                       "max_fraction": fraction})
    return job


def _check_lora_targets(cfg: PipelineConfig, plans: list[StagePlan], answer: dict[str, Any], source: str,
                        verbose: bool) -> None:
    """Every LoRA target names a linear layer of each model the stage trains (the shapes were built on the meta
    device by the helper: config and module names only, no weights)."""
    if "error" in answer:  # e.g. no config here, or an architecture transformers builds no scalar head for
        if verbose:
            print(f"  warning: LoRA target_modules not checked here ({answer['error']})")
        return
    shapes = {kind: ModelShape(**d) for kind, d in answer["shapes"].items()}
    for plan in plans:
        lora = enabled_lora(plan.cfg)
        if lora is None:
            continue
        for held in plan.cfg.held_models(cfg.stages):
            if not held.trained:
                continue
            shape = shapes[held.kind]
            missing = missing_lora_targets(shape, lora)
            if missing:
                names = sorted({n.rsplit(".", 1)[-1] for n in shape.linears})
                raise PipelineError(f"{source}: stages.{plan.name}.lora.target_modules: {missing} name no linear "
                                    f"layer of the {held.role} model ({cfg.base_model}); its linear layers are named "
                                    f"{names}: name some of those")
            if shape.tied and targeted(shape.head, set(lora.target_modules)):
                raise PipelineError(f"{source}: stages.{plan.name}.lora.target_modules: {shape.head} is the {held.role} "
                                    "model's output head, tied to its input embeddings: merging writes the adapter into "
                                    f"the embeddings too, and a vLLM engine drops a tied head; leave {shape.head} out")
            widest = max((min(dims) for n, dims in shape.linears.items() if targeted(n, set(lora.target_modules))),
                         default=None)  # the head alone is a target too (its width: the hidden size)
            if widest is not None and lora.r > widest:
                raise PipelineError(f"{source}: stages.{plan.name}.lora.r: {lora.r} is above the rank any targeted "
                                    f"layer of the {held.role} model can have ({widest}: the smallest of its in and "
                                    f"out features); an adapter of higher rank trains no more. Lower lora.r")


def _check_new_token_rows(cfg: PipelineConfig, plans: list[StagePlan], answer: dict[str, Any], source: str) -> None:
    """A stage that installs a chat template whose tokens the tokenizer lacks adds them: a stage that trains nothing
    would leave their rows random; under LoRA peft trains them (align/modeling/lora.py `new_token_rows`), which it
    cannot do on a head tied to the embeddings or on ZeRO-3's partitions: refused here, not after the model loads."""
    added = answer.get("tokens_added")
    if not isinstance(added, int) or added <= 0:
        return
    for plan in (p for p in plans if p.installs_template(cfg.chat_template is not None)
                 and not any(h.trained for h in p.cfg.held_models(cfg.stages))):  # it republishes the base
        raise PipelineError(f"{source}: stages.{plan.name}: the chat template adds {added} special tokens to the model, "
                            "whose embedding rows would start random, and this stage trains nothing; use the model's "
                            "own template (chat_template: null), a template built on its tokens, or a fine-tuning stage "
                            "from the base (model: base), which trains them")
    tied = bool((((answer.get("shapes") or {}).get("shapes") or {}).get("lm") or {}).get("tied"))
    for plan in (p for p in plans if enabled_lora(p.cfg) is not None and p.installs_template(
            cfg.chat_template is not None)):
        where = f"{source}: stages.{plan.name}: the chat template adds {added} tokens to the model"
        if tied:
            raise PipelineError(f"{where}, whose output head is tied to its embeddings: LoRA cannot train their rows "
                                "there (TRL's fused head reads the head's frozen weight); use a template whose tokens "
                                f"the model has, or set stages.{plan.name}.lora.enabled: false")
        if accelerate_mode(accelerate_config(plan.cfg.accelerate, source))[0].startswith("zero3"):
            raise PipelineError(f"{where}: LoRA trains their new embedding rows whole (peft's trainable tokens), which "
                                f"it cannot do on ZeRO-3's partitions; set stages.{plan.name}.accelerate: zero2, or "
                                f"stages.{plan.name}.lora.enabled: false, or use a template whose tokens the model has")


def _half_weights_problem(plan: StagePlan, cfg: PipelineConfig, source: str | Path) -> str | None:
    """`dtype: float16` for a model trained whole outside DeepSpeed (whose optimiser keeps fp32 master weights)."""
    if cfg.dtype != "float16" or enabled_lora(plan.cfg) is not None or \
            not any(h.trained for h in plan.cfg.held_models(cfg.stages)):
        return None
    if accelerate_mode(accelerate_config(plan.cfg.accelerate, source))[0] != "ddp":
        return None
    return (f"dtype: float16 trains the model's own fp16 weights outside DeepSpeed (accelerate: {plan.cfg.accelerate}):"
            " under precision float16 the loss scaler refuses fp16 gradients at the first step ('Attempting to unscale "
            "FP16 gradients'), else AdamW steps fp16 weights with no fp32 master copy; use dtype: auto (fp32 weights "
            "under mixed precision), LoRA (fp32 adapters), or a DeepSpeed config (fp32 master weights)")


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
    """A card a stage samples prompts from needs prompts that are not all empty (beyond that: the type's `check`)."""
    where = f"{source}: stages.{plan.name}.{fld}"
    if type(plan.cfg).CARDS[fld] == PROMPTS_ONLY and data.card.produces == "messages":  # known without its rows
        raise PipelineError(f"{where}: {card.name} produces 'messages' (whole conversations); the stage samples prompts: "
                            "use a card with prompts (prompt, prompt_completion or preference form) or a data stage")
    if not data.available:
        return
    if type(plan.cfg).CARDS[fld] == PROMPTS_ONLY and not any(str(r.get("prompt", "")).strip() for r in data.rows):
        raise PipelineError(f"{where}: every one of the {len(data.rows)} prompts of {card.name} split "
                            f"'{data.split}' is empty; a policy would be sampled from nothing")

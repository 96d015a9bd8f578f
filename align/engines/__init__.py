"""Rollout engines: what samples for the stages that sample (PPO, preferences, evaluate), behind one seam.

    engine = make_engine(gen, model=..., tokenizer=..., model_dir=..., ...)
    engine.generate(prompts, gen, seed)  -> Rollout (token ids, masks; `engine_logprobs` where the engine has them)
    engine.sync_weights(model)           after optimiser steps: the engine samples from `model`'s weights from then on
    engine.close()

This module is the registry, and torch-free (`align validate` and `align estimate` read it): each engine declares an
`EngineKind` (its name, the module that builds it, whether it holds its own copy of the policy, why it cannot run
here, the memory it takes beside training). Nothing outside align/engines/ tests an engine's class or name; the
stages ask the kind. The engines themselves: `hf` (hf.py: transformers.generate with the stage's own model, nothing
to sync) and `vllm` (vllm.py: vLLM in its own process and environment, vllm_env.py: where that environment is).
The interface and the engine-vs-trainer log-prob check all callers share: base.py.

An engine from outside align registers itself the same way from a module named in ALIGN_ENGINE_MODULES (the test
suite's third engine: tests/enginetypes/copy_engine.py).
"""

from __future__ import annotations

import importlib
import os

from align.engines.kinds import EngineError, EngineKind, OnDevice

__all__ = ["DEFAULT", "EngineError", "EngineKind", "KINDS", "PLUGIN_ERRORS", "register", "engine_names", "kind",
           "holds_own_copy", "make_engine", "placement_problem"]

DEFAULT = "hf"
"""The engine `generation.engine` names unless a pipeline says otherwise."""
ENGINE_MODULES_ENV = "ALIGN_ENGINE_MODULES"


KINDS: dict[str, EngineKind] = {}


def register(kind: EngineKind) -> EngineKind:
    """Make `kind` selectable as `generation.engine: <kind.name>`."""
    KINDS[kind.name] = kind
    return kind


def engine_names() -> tuple[str, ...]:
    return tuple(KINDS)


def kind(name: str) -> EngineKind:
    if name not in KINDS:
        raise ValueError(f"generation.engine: unknown engine {name!r}; choose one of {', '.join(KINDS)}")
    return KINDS[name]


def holds_own_copy(name: str) -> bool:
    """Whether the engine named `name` keeps its own copy of the policy (EngineKind.own_copy)."""
    return kind(name).own_copy


def placement_problem(gen, processes: int, gpus: int) -> str | None:
    """Why the engines `gen` asks for cannot be placed on a node of `gpus` GPUs (0: none) running `processes` training
    processes (placement.py, what every stage process runs at its start), or None; None too for an engine that
    samples with the stage's own model (nothing to place)."""
    if not kind(gen.engine).own_copy:
        return None
    if gen.sleep and kind(gen.engine).sleep_needs_gpu and gpus == 0:
        return (f"generation.sleep: '{gen.engine}' sleeps on a GPU only (vLLM's sleep mode is CUDA-only) and this "
                "machine has none; set generation.sleep: false")
    if gen.sleep and gen.placement == "separate":
        return ("generation.sleep frees a colocated engine's memory for training, and separate engines have GPUs of "
                "their own; remove generation.sleep, or colocate the engines")
    from align.engines.placement import place

    try:
        place(0, processes, gpus, gen.tensor_parallel_size, gen.placement == "colocated", gen.gpu_memory_utilization)
    except ValueError as exc:
        return str(exc)
    return None


def start_seed(seed: int, rank: int, resumed_at: int = 0) -> int:
    """The seed an engine with its own copy of the policy starts with (vLLM takes one as it starts, none per request on
    a CPU): its process's, and for a run resumed at step or iteration `resumed_at` that point's, so a resumed run does
    not sample with its first attempt's random stream again. Below 2**31: numpy and vLLM take 32-bit seeds."""
    return (seed * 7919 + rank + 104_729 * resumed_at) % 2 ** 31


def make_engine(gen, *, model, tokenizer, model_dir: str, fast: bool = False, synced_gpus: bool = False,
                context=None, seed: int = 0, dtype: str = "float32", max_model_len: int = 512, log_path=None,
                rank: int = 0, device=None, lora_rank: int | None = None):
    """The engine `gen.engine` names (a base.RolloutEngine). `model`: the stage's own model (what an engine without its
    own copy samples with); `model_dir`: the Hugging Face directory an engine with its own copy starts from (the
    training model's weights reach it by `sync_weights`); `context`, when given, is called for each batch and yields
    the model to sample with (PPO under ZeRO-3 gathers the policy's parameters for the duration); `device`, when
    given, is the training device every rollout is moved to (kinds.OnDevice); `lora_rank`: the trained policy's
    LoRA rank, for an engine that takes adapters alone (vllm with generation.lora_sync: adapter)."""
    module = importlib.import_module(kind(gen.engine).module)
    engine = module.make(gen, model=model, tokenizer=tokenizer, model_dir=model_dir, fast=fast,
                         synced_gpus=synced_gpus, context=context, seed=seed, dtype=dtype,
                         max_model_len=max_model_len, log_path=log_path, rank=rank, lora_rank=lora_rank)
    return engine if device is None else OnDevice(engine, device)


def _register_builtin() -> None:
    from align.engines import vllm_env

    register(EngineKind(DEFAULT, "align.engines.hf"))
    register(vllm_env.KIND)


PLUGIN_ERRORS: list[str] = []
"""Engine modules named in ALIGN_ENGINE_MODULES that failed to import: the CLI refuses to start with them (this
module is imported with align.config, before any command could report an error)."""


def _register_from_environment() -> None:
    for name in filter(None, (n.strip() for n in os.environ.get(ENGINE_MODULES_ENV, "").split(","))):
        try:
            importlib.import_module(name)
        except Exception as exc:  # any failure of a user's module: reported by the CLI in one line
            PLUGIN_ERRORS.append(f"{ENGINE_MODULES_ENV}: cannot import engine module '{name}' "
                                 f"({type(exc).__name__}: {exc}); fix the module, its path (PYTHONPATH), or the variable")


_register_builtin()
_register_from_environment()

"""What the warm-start server (align/orchestrator/warm.py) imports once, so that every stage forked from it starts with these
modules loaded. Imports only: nothing here may start a thread, touch a device or read a file of a run (a forked
process keeps its parent's threads' locks but not the threads).

Each import below is one a stage process would make anyway; a module left out is imported by the stage that
needs it, as in a fresh process."""

# ruff: noqa: F401
import importlib

import datasets
import peft
import torch
import transformers
from transformers import (AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer,
                          TrainerCallback)
from trl import (DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, RewardConfig, RewardTrainer, RLOOConfig,
                 RLOOTrainer, SFTConfig, SFTTrainer)

import align.runtime.context
from align.config import stage_types

for _type in stage_types().values():  # every built-in stage type's module (one from outside loads in its stage)
    if _type.stage_module().startswith("align."):
        importlib.import_module(_type.stage_module())

"""What the warm-start server (align/orchestrator/warm.py) imports once, so that every stage forked from it starts with these
modules loaded. Imports only: nothing here may start a thread, touch a device or read a file of a run (a forked
process keeps its parent's threads' locks but not the threads).

Each import below is one a stage process would make anyway; a module left out is imported by the stage that
needs it, as in a fresh process."""

# ruff: noqa: F401
import datasets
import peft
import torch
import transformers
from transformers import (AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer,
                          TrainerCallback)
from trl import (DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, RewardConfig, RewardTrainer, RLOOConfig,
                 RLOOTrainer, SFTConfig, SFTTrainer)

import align.runtime.context
import align.stages.dpo
import align.stages.evaluate
import align.stages.grpo
import align.stages.ppo
import align.stages.preferences
import align.stages.reward
import align.stages.rloo
import align.stages.sft

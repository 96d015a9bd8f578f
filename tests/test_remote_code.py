"""A model that ships its own Python code (config.json `auto_map`), run with `trust_remote_code: true`: every stage
loads it, and what the stages before it saved (which keeps the auto_map and copies the code), with the user's
opt-in. The first stage did; every later stage loaded its input's tokenizer without it and refused the model the user
had trusted ("ships its own Python code ... set trust_remote_code: true")."""

from __future__ import annotations

import json

import pytest
import yaml

from conftest import REPO, run_align

SEED = 11
CONFIG_CODE = '''from transformers import LlamaConfig


class TinyConfig(LlamaConfig):
    model_type = "tiny_remote"
'''
MODEL_CODE = '''from torch import nn
from transformers import LlamaForCausalLM, LlamaForSequenceClassification, LlamaModel, LlamaPreTrainedModel

from .configuration_tiny import TinyConfig


class TinyModel(LlamaModel):  # what a sequence-classification class builds its backbone from (AutoModel)
    config_class = TinyConfig


class TinyForCausalLM(LlamaForCausalLM):
    config_class = TinyConfig


class TinyForSequenceClassification(LlamaForSequenceClassification):
    config_class = TinyConfig

    def __init__(self, config):  # its own backbone: transformers' generic class asks AutoModel, untrusted
        LlamaPreTrainedModel.__init__(self, config)
        self.num_labels = config.num_labels
        self.model = TinyModel(config)
        self.score = nn.Linear(config.hidden_size, self.num_labels, bias=False)
        self.post_init()
'''


def _remote_code_model(root):
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    model_dir = root / "tiny_remote"
    shutil.copytree(REPO / "tokenizers" / "gpt2", model_dir)
    torch.manual_seed(SEED)
    config = LlamaConfig(vocab_size=50257, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=50256, eos_token_id=50256, tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(model_dir)
    (model_dir / "configuration_tiny.py").write_text(CONFIG_CODE)
    (model_dir / "modeling_tiny.py").write_text(MODEL_CODE)
    raw = json.loads((model_dir / "config.json").read_text())
    raw.update(model_type="tiny_remote", architectures=["TinyForCausalLM"], auto_map={
        "AutoConfig": "configuration_tiny.TinyConfig", "AutoModel": "modeling_tiny.TinyModel",
        "AutoModelForCausalLM": "modeling_tiny.TinyForCausalLM",
        "AutoModelForSequenceClassification": "modeling_tiny.TinyForSequenceClassification"})
    (model_dir / "config.json").write_text(json.dumps(raw))
    return model_dir


def test_a_trusted_remote_code_model_runs_through_every_stage_that_loads_it(tmp_path):
    print(f"seed {SEED}")
    model_dir = _remote_code_model(tmp_path)
    pairs = str(REPO / "data_cards" / "hh_rlhf_harmless_pairs.yaml")
    common = {"per_device_batch_size": 4, "max_steps": 2, "logging_steps": 1, "save_steps": 2, "max_length": 256,
              "max_truncated_fraction": 1.0}
    pipeline = {"name": "remote", "base_model": str(model_dir), "trust_remote_code": True, "chat_template": None,
                "seed": SEED, "tracking": {"wandb": "disabled"},
                "stages": {"sft": {"type": "sft", "data": str(REPO / "data_cards" / "movie_review_snippets.yaml"),
                                   "max_train_examples": 64, "eval_split": None, **common},
                           "reward": {"type": "reward", "init": "sft", "data": pairs, **common},
                           "dpo": {"type": "dpo", "policy": "sft", "data": pairs, **common}}}
    (tmp_path / "remote.yaml").write_text(yaml.safe_dump(pipeline))
    env = {"HF_MODULES_CACHE": str(tmp_path / "modules")}  # where transformers copies the trusted code
    proc = run_align("run", "remote.yaml", cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = tmp_path / "runs" / "remote" / "main"
    for stage in ("sft", "reward", "dpo"):
        manifest = json.loads((run / stage / "manifest.json").read_text())
        assert manifest["status"] == "completed", stage
    saved = json.loads((run / "sft" / "model" / "config.json").read_text())
    assert saved["auto_map"]["AutoModelForCausalLM"] == "modeling_tiny.TinyForCausalLM"  # what later stages load
    # without the opt-in the same model is refused before anything runs, naming the fix
    pipeline["trust_remote_code"] = False
    (tmp_path / "remote.yaml").write_text(yaml.safe_dump(pipeline))
    proc = run_align("validate", "remote.yaml", cwd=tmp_path, env=env)
    assert proc.returncode == 2 and "trust_remote_code: true" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


@pytest.fixture(autouse=True)
def _no_hub(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_an_engine_that_loads_its_own_copy_is_refused_for_a_remote_code_model(tmp_path, capsys):
    """The vLLM engine starts without remote code: a remote-code policy failed when the engine started."""
    from conftest import refused, validate

    model_dir = _remote_code_model(tmp_path)
    rc, out = validate(capsys, str(REPO / "pipelines" / "online_rl.yaml"), f"base_model={model_dir}",
                       "trust_remote_code=true", "chat_template=null", "grpo.generation.engine=vllm",
                       "sft.lora.enabled=false")
    refused(out, rc, "stages.grpo.generation.engine: 'vllm' keeps its own copy", "use generation.engine: hf")

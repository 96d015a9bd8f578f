"""LoRA on a TRL stage: adapters train, are merged on save, and model/ is a plain checkpoint."""

from __future__ import annotations

import pytest
import torch

from conftest import TINY, run_align

pytestmark = pytest.mark.slow


def test_sft_lora_merges_into_a_plain_model(workdir):
    proc = run_align("run", "pipelines/default.yaml", "--run-id", "lora", "--only", "sft", "tracking.wandb=disabled",
                     *TINY, "sft.lora.enabled=true", "sft.lora.target_modules=[q_proj,v_proj]", cwd=workdir)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    model_dir = workdir / "runs" / "default" / "lora" / "sft" / "model"
    assert not (model_dir / "adapter_config.json").exists()

    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from align.config import BuiltinModel
    from align.models import build_builtin

    merged = load_file(str(model_dir / "model.safetensors"))
    assert not [k for k in merged if "lora" in k]
    size = BuiltinModel(vocab_size=512, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                        max_position_embeddings=96)
    initial = build_builtin(size, AutoTokenizer.from_pretrained(model_dir), seed=17).state_dict()
    changed = {k for k, v in merged.items() if not torch.equal(v, initial[k])}
    assert changed == {k for k in merged if "q_proj" in k or "v_proj" in k}  # only the adapted projections

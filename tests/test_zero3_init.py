"""Models loaded after the stage's DeepSpeed config, so ZeRO-3's partitioned initialisation applies: under 2-process
ZeRO-3 each rank then holds its share of the weights as it loads them, not a whole copy first. Shown with the
stages' own loader on a 57M-parameter Llama (228 MB in fp32): the growth of each rank's resident memory from just
before the load to just after, with every weight it holds read (tests/probes/zero3_init_rss.py), the TRL config
built before the load (what the stages do now) against after it (what they did)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from align.orchestrator.launch import free_port
from conftest import REPO

pytestmark = pytest.mark.distributed
SEED = 0


def test_a_rank_holds_its_share_when_the_config_comes_first(tmp_path):
    import torch
    import transformers as t

    torch.manual_seed(SEED)
    print(f"seed {SEED}")
    config = t.LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                           num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False)
    t.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "model")
    out = tmp_path / "rss.json"
    proc = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                           str(REPO / "pipelines" / "accelerate" / "zero3.yaml"), "--num_processes", "2",
                           "--main_process_port", str(free_port()), str(REPO / "tests" / "probes" / "zero3_init_rss.py"),
                           str(tmp_path / "model"), str(out)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    whole = 4 * result["before"]["params"]  # fp32 bytes of the whole model
    assert result["before"]["params"] == result["after"]["params"] == 56_893_952
    print({k: [round(g / 1e6) for g in result[k]["rss_growth_bytes"]] for k in ("before", "after")},
          "MB per rank; whole model", round(whole / 1e6), "MB")
    assert not result["before"]["partitioned"] and result["after"]["partitioned"]
    for grown in result["before"]["rss_growth_bytes"]:
        assert grown > 0.9 * whole  # config after the load: every rank held the whole model
    for grown in result["after"]["rss_growth_bytes"]:
        assert grown < 0.7 * whole  # config first: each rank holds about its half (plus what the load keeps)

"""`align estimate` against hand arithmetic on a tiny Llama whose parameter count is known in closed form, and
the memory preflight of `align run`."""

from __future__ import annotations

import json

import pytest

from conftest import REPO, TINY, run_align

H, LAYERS, HEADS, INTER, VOCAB = 32, 2, 2, 64, 512
# Llama, tied embeddings, no biases: embedding V*h; per layer q,k,v,o 4h^2 + MLP 3*h*i + two RMSNorms 2h;
# final norm h. The reward/value model drops the (tied) LM head and adds a score head of h weights.
P_LM = VOCAB * H + LAYERS * (4 * H * H + 3 * H * INTER + 2 * H) + H
P_RM = P_LM + H
LARGEST = VOCAB * H  # the embedding is the largest single layer


@pytest.fixture(scope="module")
def tiny_cfg():
    from align.config import load_pipeline

    return load_pipeline(REPO / "pipelines" / "default.yaml", [f"builtin.vocab_size={VOCAB}", f"builtin.hidden_size={H}",
                                f"builtin.num_layers={LAYERS}", f"builtin.num_heads={HEADS}",
                                f"builtin.intermediate_size={INTER}", "builtin.max_position_embeddings=96",
                                "sft.accelerate=zero2", "ppo.accelerate=zero3", "dpo.accelerate=zero3_offload",
                                "hardware.gpus_per_node=8", "hardware.gpu_memory_gb=80"])


def test_parameter_counts_match_closed_form(tiny_cfg):
    from align.estimate import model_shapes

    assert P_LM == 37024 and P_RM == 37056
    shapes = model_shapes(tiny_cfg, REPO / "pipelines" / "default.yaml")
    assert shapes["lm"].params == P_LM and shapes["scalar"].params == P_RM
    assert shapes["lm"].largest_layer == LARGEST


def test_per_gpu_bytes_follow_deepspeed_arithmetic(tiny_cfg):
    from align.estimate import OVERHEAD_BYTES, estimate_pipeline, hardware

    est = {e.name: e for e in estimate_pipeline(tiny_cfg, REPO / "pipelines" / "default.yaml", hardware(tiny_cfg))}
    sft, ppo, dpo = est["sft"], est["ppo"], est["dpo"]
    assert (sft.mode, sft.gpus, ppo.mode, dpo.mode) == ("zero2", 8, "zero3", "zero3_offload")
    # trained model states: ZeRO-2 2P + 18P/N, ZeRO-3 4L + 18P/N, ZeRO-3 + offload 4L
    assert sft.parts["zero2"]["trained_states"] == 2 * P_LM + int(18 * P_LM / 8)
    assert sft.parts["zero3"]["trained_states"] == 4 * LARGEST + int(18 * P_LM / 8)
    assert sft.parts["zero3_offload"]["trained_states"] == 4 * LARGEST
    # PPO trains policy + value as one engine; the reference (LM) and reward model (scalar) are frozen,
    # float32 (the pipeline dtype): whole under ZeRO-2, sharded plus one gathered layer under ZeRO-3
    both = P_LM + P_RM
    assert ppo.parts["zero3"]["trained_states"] == 4 * LARGEST + int(18 * both / 8)
    assert ppo.parts["zero2"]["frozen_weights"] == 4 * P_LM + 4 * P_RM
    assert ppo.parts["zero3"]["frozen_weights"] == (int(4 * P_LM / 8) + 4 * LARGEST) + (int(4 * P_RM / 8) + 4 * LARGEST)
    # SFT activations (default.yaml: micro-batch b = 32, max_length s = 96), Korthikanti et al. eq. 1:
    # s*b*h*(34 + 5*a*s/h) = 96*32*32*(34 + 30) per layer, plus fp32 logits and their gradient 8*s*b*V
    assert sft.parts["zero2"]["activations"] == 2 * 96 * 32 * 32 * 64 + 8 * 96 * 32 * VOCAB == 25_165_824
    assert sft.bytes_by_mode["zero2"] == sum(sft.parts["zero2"].values())
    assert sft.parts["zero2"]["overhead"] == OVERHEAD_BYTES


def test_hh_recipe_estimate_prints_every_mode_and_fits_the_declared_node(workdir):
    proc = run_align("estimate", "pipelines/hh_rlhf.yaml", cwd=workdir)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "| zero2 | zero3 | zero3_offload |" in out and "8 GPU(s), 80 GB each (declared)" in out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ") and "GPUs" not in line}
    assert set(rows) >= {"sft", "reward", "ppo", "dpo", "evaluate"}
    assert "policy* 1,011.8M" in rows["sft"]  # pythia-1b: 1,011,781,632 parameters
    assert "value*" in rows["ppo"] and "reference" in rows["ppo"] and "reward " in rows["ppo"]
    assert all(line.rstrip().endswith("| yes |") for line in rows.values())
    small = run_align("estimate", "pipelines/hh_rlhf.yaml", "--gpu-memory-gb", "16", cwd=workdir)
    assert "does not fit: stage 'ppo' (zero3, 8 GPUs)" in small.stdout


@pytest.mark.slow
def test_run_refuses_a_stage_that_does_not_fit_unless_told_to_ignore(workdir):
    args = ["run", "pipelines/default.yaml", "--run-id", "mem", "--only", "sft", "tracking.wandb=disabled", *TINY,
            "sft.max_steps=2", "sft.save_steps=5", "sft.max_train_examples=200", "sft.eval_split=null",
            "hardware.gpus_per_node=1", "hardware.gpu_memory_gb=0.5"]
    refused = run_align(*args, cwd=workdir)
    assert refused.returncode == 2
    assert "memory preflight: stage 'sft' (ddp, 1 GPUs) needs ~" in refused.stderr
    assert "a GPU has 0.47 GiB" in refused.stderr and "--ignore-memory-check" in refused.stderr
    assert not (workdir / "runs").exists()  # refused before anything was written or launched
    forced = run_align(*args, "--ignore-memory-check", cwd=workdir)
    assert forced.returncode == 0, forced.stdout[-2000:] + forced.stderr[-2000:]
    assert "warning (--ignore-memory-check): stage 'sft'" in forced.stdout
    m = json.loads((workdir / "runs" / "default" / "mem" / "sft" / "manifest.json").read_text())
    assert m["status"] == "completed"


def test_gradient_checkpointing_is_counted_and_recommended_when_it_makes_a_stage_fit(tiny_cfg):
    """Full recomputation keeps each layer's 16-bit input (2sbh per layer) and one layer's activations while it is
    recomputed: 2 * (2*96*32*32) + 96*32*32*64, plus the same fp32 logits 8*s*b*V."""
    from align.estimate import Hardware, estimate_pipeline, hardware, too_big

    source = REPO / "pipelines" / "default.yaml"
    est = {e.name: e for e in estimate_pipeline(tiny_cfg, source, hardware(tiny_cfg))}
    sft = est["sft"]
    with_ckpt = 2 * (2 * 96 * 32 * 32) + 96 * 32 * 32 * 64 + 8 * 96 * 32 * VOCAB
    saved = sft.parts["zero2"]["activations"] - with_ckpt
    assert saved == 2 * 96 * 32 * 32 * 64 - (2 * 2 * 96 * 32 * 32 + 96 * 32 * 32 * 64) > 0
    assert sft.with_checkpointing == sft.chosen_bytes - saved
    between = (sft.with_checkpointing + sft.chosen_bytes) // 2  # fits with checkpointing only
    hw = Hardware(gpus_per_node=8, gpu_memory=between, nodes=1, detected=False)
    (line,) = too_big([sft], hw)
    assert "set stages.sft.gradient_checkpointing: true" in line
    tiny_cfg.stages["sft"].gradient_checkpointing = True
    try:
        on = {e.name: e for e in estimate_pipeline(tiny_cfg, source, hardware(tiny_cfg))}["sft"]
    finally:
        tiny_cfg.stages["sft"].gradient_checkpointing = False
    assert on.parts["zero2"]["activations"] == with_ckpt and on.with_checkpointing is None
    assert too_big([on], hw) == []

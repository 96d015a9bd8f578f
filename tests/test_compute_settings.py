"""Compute settings that a GPU run would reject hours in, or that the memory estimate misread (a probe of the compute
settings, 2026-11-29): each is now refused at `align validate` naming the setting, or estimated as it runs."""

from __future__ import annotations

import json

import pytest

from align.orchestrator.launch import accelerate_mode
from align.core.errors import PipelineError
from conftest import REPO, refused, validate

DEFAULT = str(REPO / "pipelines" / "default.yaml")
ONLINE = str(REPO / "pipelines" / "online_rl.yaml")


def test_dtype_auto_is_sized_as_the_precision_loads_it():
    """`precision: float32` loads every frozen model in fp32 (align/runtime/context.py weights_dtype); the estimate
    sized them in bf16 and said an 8B evaluate on 80 GB fits (it needs ~88 GiB of weights)."""
    from align.orchestrator.estimate import dtype_bytes

    assert dtype_bytes("auto", True) == dtype_bytes("auto", True, "bfloat16") == 2
    assert dtype_bytes("auto", True, "float32") == dtype_bytes("auto", True, "float16") == 4
    assert dtype_bytes("auto", False, "bfloat16") == 4 and dtype_bytes("bfloat16", False, "float32") == 2


def test_the_zero_stage_is_read_where_the_config_writes_it(tmp_path):
    (tmp_path / "ds3.json").write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                                                         "offload_optimizer": {"device": "cpu"}}}))
    head = "compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\nnum_processes: 8\n"
    cases = {"file.yaml": (head + "deepspeed_config:\n  deepspeed_config_file: ds3.json\n", "zero3_offload"),
             "default.yaml": (head + "deepspeed_config:\n  zero-stage: 3\n", "zero2"),  # a typo: accelerate's default
             "inline.yaml": (head + "deepspeed_config:\n  zero_stage: 1\n", "zero1")}
    for name, (text, mode) in cases.items():
        (tmp_path / name).write_text(text)
        assert accelerate_mode(tmp_path / name) == (mode, 8), name
    (tmp_path / "auto.yaml").write_text(head + "deepspeed_config:\n  zero_stage: auto\n")
    with pytest.raises(PipelineError, match=r"ZeRO stage 'auto'.*write 0, 1, 2 or 3"):
        accelerate_mode(tmp_path / "auto.yaml")
    (tmp_path / "fsdp.yaml").write_text("distributed_type: FSDP\nnum_processes: 8\n")
    with pytest.raises(PipelineError, match=r"distributed_type: FSDP.*DeepSpeed ZeRO"):
        accelerate_mode(tmp_path / "fsdp.yaml")


@pytest.mark.parametrize("pipeline, overrides, needles", [
    # transformers refuses a device map under ZeRO-3 as the model loads: the QLoRA base never loaded
    (DEFAULT, ["sft.lora.enabled=true", "sft.lora.quantize=4bit", "sft.accelerate=zero3"],
     ["stages.sft: lora.quantize: 4bit under ZeRO-3 (zero3.yaml)", "use accelerate: zero2"]),
    # refused when PPO started, after the stages before it had trained
    (DEFAULT, ["ppo.fused_head=on", "ppo.accelerate=zero3"], ["stages.ppo: fused_head: on under ZeRO-3"]),
    # the whole-group rule with one process per GPU (3) and per node x nodes
    (ONLINE, ["grpo.per_device_batch_size=1", "grpo.accelerate=ddp", "hardware.gpus_per_node=3"],
     ["1 x 3 x 4 = 12 completions per generation round) must be divisible by num_generations (8)"]),
    # fp16 weights trained outside DeepSpeed: the loss scaler refuses fp16 gradients at the first step
    (DEFAULT, ["dtype=float16"], ["stages.sft: dtype: float16 trains the model's own fp16 weights outside DeepSpeed"]),
])
def test_compute_settings_a_gpu_run_would_reject_are_refused(pipeline, overrides, needles, capsys):
    rc, out = validate(capsys, pipeline, *overrides)
    refused(out, rc, *needles)


def test_the_world_is_processes_per_node_times_nodes_and_a_tied_head_is_no_lora_target(capsys):
    rc, out = validate(capsys, ONLINE, "grpo.num_processes=3", "hardware.nodes=2", "grpo.accelerate=ddp",
                       "grpo.per_device_batch_size=1")  # 1 x 6 x 4 = 24 completions: whole groups of 8
    assert rc == 0, out[-2000:]
    rc, out = validate(capsys, DEFAULT, "sft.lora.enabled=true", "sft.lora.target_modules=[lm_head]")
    assert "Traceback" not in out, out[-2000:]  # was max() of an empty sequence
    # the builtin model ties its head to its embeddings: an adapter on it would be merged into both, and a vLLM
    # engine drops a tied head (it sampled with the un-adapted one); refused (a probe of LoRA, 2026-11-30)
    refused(out, rc, "stages.sft.lora.target_modules: lm_head is the policy model's output head, tied to its input "
                     "embeddings", "leave lm_head out")


def test_flash_attention_with_fp32_compute_is_refused(capsys, monkeypatch):
    """flash-attn takes 16-bit inputs only; precision: float32 keeps fp32 weights and no autocast."""
    from align.orchestrator import validate as validate_module

    monkeypatch.setattr(validate_module, "flash_attention_problem", lambda name: None)  # as with flash-attn installed
    rc, out = validate(capsys, DEFAULT, "attn_implementation=flash_attention_2", "precision=float32")
    assert rc == 2 and "flash-attention computes in 16 bits only" in out, out[-2000:]


@pytest.mark.parametrize("params, gpus, nodes", [(8_030_261_248, 8, 1), (70_553_706_496, 8, 1), (70_553_706_496, 8, 2),
                                                 (1_000_000, 1, 1)])
def test_host_memory_of_offload_modes_is_deepspeeds_own_estimate(params, gpus, nodes):
    """`zero3_offload would fit` said nothing of the host: a 70B model's offloaded states need ~1.8 TB of RAM per node
    (DeepSpeed's own estimator). The CPU figures are written out as the GPU ones are, and held equal to DeepSpeed's."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    from align.orchestrator.memory import host_state_bytes

    per_node = gpus
    ds2 = estimate_zero2_model_states_mem_needs(params, num_gpus_per_node=per_node, num_nodes=nodes, cpu_offload=True)
    ds3 = estimate_zero3_model_states_mem_needs(params, 1, num_gpus_per_node=per_node, num_nodes=nodes)
    ds3_opt = estimate_zero3_model_states_mem_needs(params, 1, num_gpus_per_node=per_node, num_nodes=nodes,
                                                    cpu_offload_params=False)
    assert host_state_bytes("zero2_offload", params, per_node * nodes, nodes) == ds2[0]
    assert host_state_bytes("zero3_offload", params, per_node * nodes, nodes) == ds3[0]
    assert host_state_bytes("zero3_offload_optimizer", params, per_node * nodes, nodes) == ds3_opt[0]
    assert host_state_bytes("zero3", params, per_node * nodes, nodes) == 0


def test_a_lora_dropout_the_trainer_turns_off_is_said_not_applied(capsys):
    """TRL's preference and RL trainers set every dropout to 0 (the adapters' too): a dpo.lora.dropout of 0.5 was
    accepted without a word (PPO refuses one for the same reason)."""
    rc, out = validate(capsys, str(REPO / "pipelines" / "smollm2_hh.yaml"), "dpo.lora.dropout=0.5")
    assert rc == 0 and "warning: stages.dpo.lora.dropout 0.5 is not applied: a dpo stage trains with dropout off" in out
    assert "stages.sft.lora.dropout" not in out  # SFT's trainer keeps the model's dropout: applied


def test_a_lora_base_loads_in_bf16_on_a_bf16_gpu_in_or_outside_deepspeed():
    """A LoRA base is frozen: `dtype: auto` loads it in bf16 on a bf16 GPU as peers do, outside DeepSpeed too (it was
    loaded in fp32 there as a model trained whole is: ~30 GiB at Llama-3.1-8B); fp32 on a CPU and with `dtype:
    float32`. The decision alone (a GPU's own device placement is not taken here)."""
    from types import SimpleNamespace

    import torch

    from align.runtime.context import StageContext

    def dtype(device="cuda", distributed="MULTI_GPU", pipeline_dtype="auto", **kind):
        ctx = SimpleNamespace(pipeline=SimpleNamespace(dtype=pipeline_dtype), state=SimpleNamespace(
            distributed_type=distributed), compute=SimpleNamespace(device=torch.device(device), mixed_precision="bf16"))
        return StageContext.weights_dtype(ctx, **kind)

    assert dtype(frozen=False, lora=True) == dtype(frozen=True) == "bfloat16"
    assert dtype(frozen=False) == "float32" and dtype(frozen=False, distributed="DistributedType.DEEPSPEED") == "bfloat16"
    assert dtype("cpu", frozen=False, lora=True) == "float32"
    assert dtype(frozen=False, lora=True, pipeline_dtype="float32") == "float32"

"""DeepSpeed settings that cannot disagree: the shipped accelerate configs leave accumulation, clipping and precision
to the stage (DeepSpeed's `auto`), so gradient accumulation > 1 runs under every DeepSpeed config; a config that
fixes one of them to another value than the stage's is refused by `align validate`, naming both files and values,
before anything launches."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from conftest import REPO, TINY, run_align


@pytest.mark.parametrize("name", ["zero1", "zero2", "zero3", "zero3_offload"])
def test_shipped_deepspeed_configs_leave_the_stage_its_own_settings(name):
    raw = yaml.safe_load((REPO / "pipelines" / "accelerate" / f"{name}.yaml").read_text())
    ds = raw["deepspeed_config"]
    assert not {"gradient_accumulation_steps", "gradient_clipping"} & set(ds)
    assert "mixed_precision" not in raw


def test_zero_buffers_are_sized_from_the_width_and_a_value_the_config_sets_is_kept():
    """Hand values for Llama-3-8B's width (h = 4096): reduce bucket h^2 = 16,777,216 elements (DeepSpeed's default is
    500,000,000), under ZeRO-3 prefetch int(0.9 h^2) = 15,099,494 and persistence 10 h = 40,960. A value the config
    sets, as a number or under DeepSpeed's other spelling, stays (both spellings at once is an error in DeepSpeed);
    `auto` is filled; a model without a width changes nothing."""
    from align.runtime.zero_buffers import widest, width_sized

    config: dict = {"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 1234,
                                          "param_persistence_threshold": 99, "reduce_bucket_size": "auto"}}
    assert width_sized(config, 4096) == ["reduce_bucket_size"]
    assert config["zero_optimization"] == {"stage": 3, "stage3_prefetch_bucket_size": 1234,
                                           "param_persistence_threshold": 99, "reduce_bucket_size": 16_777_216}
    fresh: dict = {"zero_optimization": {"stage": 3}}
    assert width_sized(fresh, None) == [] and fresh == {"zero_optimization": {"stage": 3}}
    width_sized(fresh, 4096)
    assert fresh["zero_optimization"] == {"stage": 3, "reduce_bucket_size": 16_777_216,
                                          "stage3_prefetch_bucket_size": 15_099_494,
                                          "stage3_param_persistence_threshold": 40_960}
    zero2: dict = {"zero_optimization": {"stage": 2}}  # the stage-3 keys mean nothing there
    assert width_sized(zero2, 4096) == ["reduce_bucket_size"]

    class Model:  # a policy of width 2048 and a value model of width 4096 (one DeepSpeed engine serves both)
        def __init__(self, h):
            self.config = type("Config", (), {"hidden_size": h})()

    assert widest(Model(2048), None, Model(4096)) == 4096 and widest(object()) is None
    composite = Model(0)
    composite.config = type("Config", (), {"text_config": Model(3072).config})()  # a vision-language model's
    assert widest(composite) == 3072


def _config(tmp_path: Path, **ds) -> Path:
    raw = yaml.safe_load((REPO / "pipelines" / "accelerate" / "zero2.yaml").read_text())
    raw["deepspeed_config"].update(ds)
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.parametrize("ds,stage_values,message", [
    ({"gradient_accumulation_steps": 1}, ["sft.gradient_accumulation_steps=2"],
     r"mine\.yaml sets gradient_accumulation_steps: 1, but the stage's gradient_accumulation_steps is 2 \(in "
     r"pipelines/default\.yaml\); remove gradient_accumulation_steps from mine\.yaml .* or set "
     r"stages\.sft\.gradient_accumulation_steps: 1"),
    ({"gradient_clipping": 1.0}, ["sft.max_grad_norm=0.5"],
     r"mine\.yaml sets gradient_clipping: 1\.0, but the stage's max_grad_norm is 0\.5"),
    ({"gradient_clipping": 1.0}, ["sft.max_grad_norm=null"],
     r"sets gradient_clipping: 1\.0, but the stage's max_grad_norm is None"),
    ({"zero_stage": 3}, [],  # accelerate's default is false: Trainer then saves ZeRO shards as model/ and completes
     r"mine\.yaml: ZeRO-3 without zero3_save_16bit_model: true .*no later stage can load.*set it to true"),
])
def test_validate_refuses_a_config_that_fixes_a_stage_setting_to_another_value(tmp_path, workdir, ds, stage_values,
                                                                               message):
    config = _config(tmp_path, **ds)
    proc = run_align("validate", "pipelines/default.yaml", *TINY, f"sft.accelerate={config}", *stage_values,
                     cwd=workdir)
    assert proc.returncode == 2, proc.stdout
    assert "stages.sft: " in proc.stderr
    import re

    assert re.search(message, proc.stderr), proc.stderr


def test_validate_accepts_matching_values_and_refuses_mixed_precision_the_pipeline_does_not_set(tmp_path, workdir):
    same = _config(tmp_path, gradient_accumulation_steps=2, gradient_clipping=1.0)
    ok = run_align("validate", "pipelines/default.yaml", *TINY, f"sft.accelerate={same}",
                   "sft.gradient_accumulation_steps=2", cwd=workdir)
    assert ok.returncode == 0, ok.stderr
    raw = yaml.safe_load(same.read_text())
    raw["mixed_precision"] = "bf16"
    same.write_text(yaml.safe_dump(raw))
    refused = run_align("validate", "pipelines/default.yaml", *TINY, f"sft.accelerate={same}",
                        "sft.gradient_accumulation_steps=2", cwd=workdir)
    assert refused.returncode == 2
    assert "sets mixed_precision bf16, but the pipeline's precision is 'auto'" in refused.stderr
    assert "`precision: bfloat16`" in refused.stderr
    accepted = run_align("validate", "pipelines/default.yaml", *TINY, f"sft.accelerate={same}", "precision=bfloat16",
                         "sft.gradient_accumulation_steps=2", cwd=workdir)
    assert accepted.returncode == 0, accepted.stderr


def test_a_deepspeed_json_file_is_read_too(tmp_path, workdir):
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 4,
                                                  "train_micro_batch_size_per_gpu": "auto"}))
    config = tmp_path / "file.yaml"
    config.write_text(yaml.safe_dump({"compute_environment": "LOCAL_MACHINE", "distributed_type": "DEEPSPEED",
                                      "deepspeed_config": {"deepspeed_config_file": "ds.json"}, "num_processes": 1}))
    proc = run_align("validate", "pipelines/default.yaml", *TINY, f"dpo.accelerate={config}", cwd=workdir)
    assert proc.returncode == 2
    assert f"{tmp_path / 'ds.json'} sets gradient_accumulation_steps: 4, but the stage's gradient_accumulation_steps" \
           " is 1" in proc.stderr


@pytest.mark.distributed
def test_accumulation_two_under_zero2_completes_and_a_resume_under_another_layout_is_refused(workdir):
    """The first-hour failure, as a user typed it: SFT under ZeRO-2 with gradient accumulation 2 (one process).
    DeepSpeed counts micro-batches: 4 optimiser steps of 2 micro-batches each."""
    proc = run_align("run", "pipelines/default.yaml", "--only", "sft", "sft.accelerate=zero2", "sft.num_processes=1",
                     "sft.gradient_accumulation_steps=2", "tracking.wandb=disabled", *TINY, "sft.max_steps=4",
                     "sft.logging_steps=2", "sft.save_steps=4", "sft.max_train_examples=200", "sft.eval_split=null",
                     cwd=workdir)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    m = json.loads((workdir / "runs" / "default" / "main" / "sft" / "manifest.json").read_text())
    assert m["status"] == "completed" and m["zero_stage"] == 2 and m["global_step"] == 4
    assert m["config"]["gradient_accumulation_steps"] == 2
    # DeepSpeed's buckets as the engine took them: sized from the model's width (DeepSpeed's own default, with the
    # shipped configs' keys absent, was a 5e8-element reduce bucket: 1 GB per trained model per GPU in bf16)
    h = json.loads((workdir / "runs" / "default" / "main" / "sft" / "model" / "config.json").read_text())["hidden_size"]
    assert m["deepspeed_buffers"] == {"reduce_bucket_size": h * h}, (h, m["deepspeed_buffers"])  # ZeRO-2: that one
    # A resume under another process layout is refused before anything loads, with the fix named: here the
    # checkpoints say 2 processes wrote them (as after a job on more GPUs), and the manifest says the stage was cut.
    stage = workdir / "runs" / "default" / "main" / "sft"
    assert json.loads((stage / "checkpoints" / "LAYOUT.json").read_text()) == {"world_size": 1, "zero_stage": 2}
    (stage / "checkpoints" / "LAYOUT.json").write_text(json.dumps({"world_size": 2, "zero_stage": 2}))
    m["status"] = "interrupted"
    (stage / "manifest.json").write_text(json.dumps(m))
    again = run_align("run", "pipelines/default.yaml", "--only", "sft", "sft.accelerate=zero2", "sft.num_processes=1",
                      "sft.gradient_accumulation_steps=2", "tracking.wandb=disabled", *TINY, "sft.max_steps=4",
                      "sft.logging_steps=2", "sft.save_steps=4", "sft.max_train_examples=200", "sft.eval_split=null",
                      cwd=workdir)
    assert again.returncode == 2
    assert "were written by 2 process(es) under ZeRO-2, and this run has 1 under ZeRO-2" in again.stderr
    assert "stages.sft.num_processes=2" in again.stderr and "Traceback" not in again.stderr


def test_a_deepspeed_json_whose_16bit_save_is_auto_is_refused_under_zero3(tmp_path):
    """In a DeepSpeed JSON, stage3_gather_16bit_weights_on_model_save: "auto" takes accelerate's
    zero3_save_16bit_model, false unless an accelerate config section sets it: shards would be published."""
    import json

    from align.orchestrator.launch import _deepspeed_values

    for value, whole in (("auto", False), (True, True), (False, False)):
        (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {
            "stage": 3, "stage3_gather_16bit_weights_on_model_save": value}}))
        fixed, _ = _deepspeed_values(tmp_path / "acc.yaml", {"deepspeed_config": {"deepspeed_config_file": "ds.json"}})
        assert fixed["zero3_saves_whole"] is whole, value

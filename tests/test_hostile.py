"""Hostile and careless inputs (issue 12): each must end with exit code 2, one paragraph naming the field or
path, no traceback, and nothing previously produced changed.

Cases knowable without training go through `align validate` in-process (fast). Cases that need a run share
one tiny completed run of a three-stage pipeline (sft -> preferences -> evaluate), built once per module by
two concurrent runners after a third was SIGKILLed holding the lock (acceptance 2); tests that mutate a run
work on their own copy. The seed of the one random choice (when the kill lands) is printed; replay with
ALIGN_HOSTILE_SEED.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from align.cli import main as cli
from conftest import REPO, align_cmd, refused, run_align, validate

SEED = int(os.environ.get("ALIGN_HOSTILE_SEED", time.time_ns() % 100_000))
CARD = str(REPO / "data_cards" / "movie_review_snippets.yaml")
DEFAULT = str(REPO / "pipelines" / "default.yaml")
PIPELINE = {  # three stages, tiny: sft trains 6 steps, preferences samples 128 prompts (VADER ties most), evaluate 8
    "name": "hostile", "base_model": "builtin:tiny-llama", "seed": 17, "tracking": {"wandb": "disabled"},
    "builtin": {"vocab_size": 512, "hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64,
                "max_position_embeddings": 96},
    "stages": {
        "sft": {"data": CARD, "max_steps": 6, "per_device_batch_size": 8, "max_length": 96, "max_train_examples": 200,
                "max_truncated_fraction": 0.1, "logging_steps": 2, "save_steps": 4, "eval_split": None},
        "preferences": {"policy": "sft", "prompts": CARD, "max_prompts": 128, "samples_per_prompt": 2,
                        "drop_unfinished": False,  # 6 steps of SFT rarely end a review within 8 tokens
                        "min_margin": 0.0, "test_fraction": 0.25, "generation": {"max_new_tokens": 8, "batch_size": 32}},
        "evaluate": {"policies": ["sft"], "baseline": "sft", "reference": "sft", "reward": None, "preferences": None,
                     "prompts": CARD, "max_prompts": 8, "bootstrap_samples": 100, "generation": {"max_new_tokens": 8}},
    },
}


def write_pipeline(root: Path, edit=None, name: str = "hostile.yaml") -> Path:
    raw = json.loads(json.dumps(PIPELINE))
    if edit:
        edit(raw)
    path = root / name
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


# --------------------------------------------------------------------------------------------- validate: overrides
@pytest.mark.parametrize("override, needles", [
    ("sft.epochs=-1", ["stages.sft.epochs", "-1.0", "> 0"]),
    ("sft.epochs=0", ["stages.sft.epochs", "> 0"]),
    ("sft.max_steps=-1", ["stages.sft.max_steps", "-1", "null"]),
    ("dpo.beta=-0.5", ["stages.dpo.beta", "-0.5", "reversed"]),
    ("variants={dpo: 5}", ["override 'variants=...'", "written by align from a stage's `sweep:`", "dpo.sweep="]),
    ("dpo.learning_rate=1e5", ["stages.dpo.learning_rate", "100000.0", "in (0, 1]", "did you mean 1e-5?"]),
    ("evaluate.max_prompts=-975", ["stages.evaluate.max_prompts", "-975", "null for all"]),
    ("sft.max_train_examples=-90", ["stages.sft.max_train_examples", "-90"]),
    ("sft.max_train_examples=0", ["stages.sft.max_train_examples", ">= 1", "null for all"]),
    ("evaluate.policies=[sft,reward,dpo]", ["stages.evaluate.policies", "'reward' is a reward stage", "sft or ppo or dpo"]),
    ("evaluate.reference=reward", ["stages.evaluate.reference", "needs a policy"]),
    ("dpo.policy=reward", ["stages.dpo.policy", "'reward' is a reward stage"]),
    ("ppo.policy=preferences", ["stages.ppo.policy", "'preferences' is a preferences stage", "sft or dpo"]),
    ("reward.data=dpo", ["stages.reward.data", "needs preference pairs"]),
    ("evaluate.reward=dpo", ["stages.evaluate.reward", "needs a reward model", "use reward"]),
    ("sft.epochs=[1", ["sft.epochs=[1", "not valid YAML"]),
    ("ppo.kl.coef=-1", ["stages.ppo.kl.coef", "-1.0", ">= 0"]),
    ("ppo.kl.coef=0", ["stages.ppo", "kl.coef: 0 with kl.controller: ziegler", "never leaves 0", "kl.adaptive: false"]),
    ("ppo.kl.max=3", ["stages.ppo", "kl.target: 4 is not below kl.max: 3", "set kl.target below kl.max"]),
    ("seed=4294967296", ["seed", "4294967296", "a seed below 2**31"]),
    ("dpo.seed=2147483648", ["stages.dpo.seed", "2147483648", "a seed below 2**31"]),
    ("evaluate.generation.max_new_tokens=0", ["stages.evaluate.generation.max_new_tokens", ">= 1"]),
    ("evaluate.bootstrap_samples=0", ["stages.evaluate.bootstrap_samples", ">= 100"]),
    ("dtype=int8", ["dtype", "'int8'", "float32, bfloat16, float16"]),
    ("sft.lr_scheduler=cosin", ["stages.sft.lr_scheduler", "'cosin'", "cosine"]),
    ("dpo.loss_type=sigmod", ["stages.dpo.loss_type", "'sigmod'", "sigmoid"]),
    ("sft.num_processes=0", ["stages.sft.num_processes", ">= 1"]),
    ("ppo.generation.top_p=1.5", ["stages.ppo.generation.top_p", "1.5", "(0, 1]"]),
    ("dpo.label_smoothing=0.1", ["stages.dpo", "label_smoothing: 0.1 with loss_type: sigmoid", "loss_type: robust"]),
    ("dpo.loss_type=exo_pair", ["stages.dpo", "exo_pair with label_smoothing: 0", "1.0e-3"]),
    # settings that train what another value trains (a sweep over them trained twins): robust DPO at epsilon 0 is
    # the sigmoid loss, a centring penalty of 0 adds nothing, cosine_with_restarts at transformers' one cycle is cosine
    ("dpo.loss_type=robust", ["stages.dpo", "robust with label_smoothing: 0 is the sigmoid (DPO) loss", "0.1"]),
    ("reward.center_rewards_coefficient=0", ["stages.reward.center_rewards_coefficient", "> 0", "use null for none"]),
    ("sft.lr_scheduler=cosine_with_restarts", ["stages.sft.lr_scheduler", "with transformers' one cycle it is cosine"]),
    ("evaluate.generation.top_p=0.9", ["stages.evaluate", "top_p 0.9", "report's KL", "leave top_k null and top_p 1.0"]),
    ("ppo.generation.top_k=50", ["stages.ppo", "top_k 50", "held-out KL (kl.max)", "top_p 1.0"]),
    ("preferences.generation.temperature=0", ["stages.preferences.generation.temperature", "> 0"]),
    ("preferences.generation.top_k=0", ["stages.preferences.generation.top_k", "null"]),
    ("dpo.accelerate=zer2", ["stages.dpo.accelerate", "'zer2' not found"]),
    ("sft.max_length=4096", ["stages.sft.max_length", "4096", "128 positions"]),
    ("reward.max_length=200", ["stages.reward.max_length", "200"]),
    ("run_id=../../x", ["run_id", "'../../x'", "plain name"]),
    ("run_id=''", ["run_id", "plain name"]),
    ("name=../..", ["name", "'../..'", "plain name"]),
    ("name=" + "n" * 300, ["name", "1 to 100 characters"]),
    ("sft=[1,2]", ["stages.sft", "expected a mapping", "list"]),
    ("sft=3", ["stages.sft", "expected a mapping", "int"]),
    ("ppo.value_init=value", ["stages.ppo.value_init", "reward, policy"]),
    ("tracking.wandb=yes", ["tracking.wandb"]),
    ("builtin.num_heads=3", ["builtin.hidden_size", "num_heads"]),
    ("sft.sweep={learning_rate: [0.1, 0.2], max_variants: true}", ["stages.sft.sweep.max_variants", "True",
                                                                  "positive whole number"]),
], ids=lambda v: v if isinstance(v, str) else None)
def test_validate_refuses_override(override, needles, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, out = validate(capsys, DEFAULT, override)
    refused(out, rc, *needles)
    assert list(tmp_path.iterdir()) == []  # validation writes nothing


def test_the_declared_choices_still_exist_upstream():
    """LR_SCHEDULERS and DPO_LOSSES are copies of transformers / TRL vocabulary: they must not drift."""
    import dataclasses

    from transformers import SchedulerType
    from trl import DPOConfig

    from align.config import LR_SCHEDULERS
    from align.config.dpo import DPO_LOSSES

    assert set(LR_SCHEDULERS) <= {s.value for s in SchedulerType}
    help_text = next(f for f in dataclasses.fields(DPOConfig) if f.name == "loss_type").metadata["help"]
    assert all(f"'{loss}'" in help_text for loss in DPO_LOSSES)


def test_every_default_is_inside_its_declared_range():
    import dataclasses

    import align.config as C
    from align.config.ppo import KLSettings
    from align.core.schema import check_rule

    classes = [C.BuiltinModel, C.LoraSettings, C.Generation, KLSettings, C.Tracking, C.Hardware,
               C.PipelineConfig, *C.stage_types().values()]
    declared = 0
    for cls in classes:
        obj = cls()
        for f in dataclasses.fields(obj):
            declared += "rule" in f.metadata
            check_rule(f, getattr(obj, f.name), f"{cls.__name__}.{f.name}")
    assert declared >= 60  # every numeric and enumerated field declares its range


# --------------------------------------------------------------------------------------------- validate: files
def _tok_without_eos(root: Path) -> str:
    tok = root / "tok"
    shutil.copytree(REPO / "tokenizers" / "gpt2", tok)
    cfg = json.loads((tok / "tokenizer_config.json").read_text())
    cfg.update(eos_token=None, bos_token=None, pad_token="<|endoftext|>")
    (tok / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tok / "special_tokens_map.json").write_text(json.dumps({"pad_token": "<|endoftext|>"}))
    return "tok"


def _card(root: Path, name: str, fmt: str, data_file: str, produces: str, splits: str = "{train: 0.8, test: 0.2}",
          columns: str = "") -> str:
    (root / name).write_text(f"name: {name}\nsource: {{path: {data_file}}}\nlicense: MIT\nformat: {fmt}\n"
                             f"produces: {produces}\nsplits: {splits}\n{columns}")
    return str(root / name)


def _pairs(root: Path, n: int) -> str:
    rows = [{"prompt": f"p{i}", "chosen": " good", "rejected": " bad"} for i in range(n)]
    (root / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return "pairs.jsonl"


def _with_dpo(raw: dict, data: str) -> None:
    raw["stages"]["dpo"] = {"policy": "sft", "data": data, "max_length": 96}


def _case_duplicate_key(root):
    text = write_pipeline(root).read_text().replace("seed: 17\n", "seed: 17\nseed: 18\n")
    (root / "hostile.yaml").write_text(text)
    return ["hostile.yaml"], ["key 'seed' is given twice", "line 4"]


def _case_not_utf8(root):
    (root / "hostile.yaml").write_bytes(write_pipeline(root).read_bytes().replace(b"hostile", b"host\xffile", 1))
    return ["hostile.yaml"], ["hostile.yaml", "not UTF-8"]


def _case_accelerate_not_a_config(root):
    (root / "notes.txt").write_text("just some notes\n")
    write_pipeline(root, lambda r: r["stages"]["sft"].update(accelerate=str(root / "notes.txt")))
    return ["hostile.yaml"], ["stages.sft.accelerate", "notes.txt", "not an accelerate config"]


def _case_accelerate_type_in_lower_case(root):
    """accelerate reads distributed_type case-sensitively: `deepspeed` passed validate (sized as zero2) and was
    refused only when its stage launched, after the stages before it had trained."""
    (root / "ds.yaml").write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: deepspeed\n"
                                  "deepspeed_config: {zero_stage: 2}\nnum_processes: 2\n")
    write_pipeline(root, lambda r: r["stages"]["sft"].update(accelerate=str(root / "ds.yaml")))
    return ["hostile.yaml"], ["stages.sft.accelerate", "distributed_type: 'deepspeed'", "write DEEPSPEED"]


def _case_parquet_not_parquet(root):
    (root / "rows.parquet").write_text("prompt,completion\na,b\n")
    card = _card(root, "pq.yaml", "parquet", "rows.parquet", "prompt_completion")
    write_pipeline(root, lambda r: r["stages"]["sft"].update(data=card))
    return ["hostile.yaml"], ["rows.parquet", "not a readable parquet file"]


def _case_truncated_gz(root):
    src = REPO / "data_cards" / "data" / "movie_review_snippets" / "movie_review_snippets.tsv.gz"
    (root / "cut.tsv.gz").write_bytes(src.read_bytes()[: src.stat().st_size // 2])
    card = _card(root, "gz.yaml", "tsv", "cut.tsv.gz", "prompt_completion",
                 columns="columns: {prompt: 2, completion: 2}\n")
    write_pipeline(root, lambda r: r["stages"]["sft"].update(data=card))
    return ["hostile.yaml"], ["cut.tsv.gz", "not a complete gzip file"]


def _case_missing_local_model(root):
    (root / "models").mkdir()
    write_pipeline(root, lambda r: r.update(base_model="models/tiny-llama"))
    return ["hostile.yaml"], ["base_model", "'models/tiny-llama' not found", "never looked up on the hub"]


def _case_corrupt_model_config(root):
    (root / "mymodel").mkdir()
    (root / "mymodel" / "config.json").write_text('{"model_type": "llama", ')
    write_pipeline(root, lambda r: r.update(base_model="./mymodel"))
    return ["hostile.yaml"], ["base_model", "config.json", "cannot be read as JSON"]


def _case_tokenizer_without_eos(root):
    tok = _tok_without_eos(root)
    write_pipeline(root, lambda r: r.update(tokenizer=tok))
    return ["hostile.yaml"], ["tokenizer", "no EOS token"]


def _case_pairs_without_test_split(root):
    card = _card(root, "pairs.yaml", "jsonl", _pairs(root, 40), "preference", splits="{train: 1.0}")
    write_pipeline(root, lambda r: _with_dpo(r, card))
    return ["hostile.yaml"], ["pairs.yaml", "no split 'test'"]


def _case_single_pair(root):
    card = _card(root, "pairs.yaml", "jsonl", _pairs(root, 1), "preference")
    write_pipeline(root, lambda r: _with_dpo(r, card))
    return ["hostile.yaml"], ["pairs.yaml", "is empty"]


def _case_every_prompt_empty(root):
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": " " * (i % 2)}) + "\n" for i in range(40)))
    card = _card(root, "prompts.yaml", "jsonl", "prompts.jsonl", "prompt")
    write_pipeline(root, lambda r: r["stages"]["preferences"].update(prompts=card))
    return ["hostile.yaml"], ["prompts.yaml", "40 rows (0, 1, 2", "no visible text in 'prompt'", "That is every row, so no setting can help"]


def _case_stage_is_a_list(root):
    write_pipeline(root, lambda r: r["stages"].update(preferences=["policy", "sft"]))
    return ["hostile.yaml"], ["stages.preferences", "expected a mapping", "list"]


def _case_pairs_empty_or_only_whitespace_apart(root):
    rows = [{"prompt": f"p{i}", "chosen": " good", "rejected": " bad"} for i in range(40)]
    rows[3]["chosen"] = ""
    rows[7]["rejected"] = "   "
    rows[11].update(chosen=" so  good", rejected="so good\n")
    rows[15].update(chosen=" good\u200b", rejected="\ufeffgood")  # zero-width space, a BOM: invisible
    (root / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    card = _card(root, "pairs.yaml", "jsonl", "pairs.jsonl", "preference")
    write_pipeline(root, lambda r: _with_dpo(r, card))
    return ["hostile.yaml"], ["pairs.yaml", "2 rows (3, 7) with no visible text in 'chosen' or 'rejected'",
                              "2 rows (11, 15) whose 'chosen' and 'rejected' differ at most in whitespace or invisible characters"]


def _case_chat_rows_without_an_assistant_turn(root):
    rows = [{"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": "hello"}]}
            for i in range(40)]
    rows[5]["messages"] = rows[5]["messages"][:1]
    rows[9]["messages"][1]["content"] = " "
    rows[12]["messages"] = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""},
                            {"role": "user", "content": "hello?"}, {"role": "assistant", "content": "hello"}]
    (root / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    card = _card(root, "chat.yaml", "jsonl", "chat.jsonl", "messages")
    write_pipeline(root, lambda r: r["stages"]["sft"].update(data=card))
    return ["hostile.yaml"], ["chat.yaml", "2 rows (5, 9) with no assistant turn with visible text",
                              "1 row (12) with an empty assistant turn among others"]


def _case_transform_drops_every_row(root):
    (root / "hh.jsonl").write_text("".join(json.dumps({"chosen": "no markers", "rejected": "x"}) + "\n"
                                           for _ in range(40)))
    card = _card(root, "hh.yaml", "jsonl", "hh.jsonl", "preference", columns="transform: {hh_transcript: {}}\n")
    write_pipeline(root, lambda r: _with_dpo(r, card))
    return ["hostile.yaml"], ["hh.yaml", "transform hh_transcript dropped every one of the 40 rows",
                              "40 unparseable transcript"]


def _model_dir(root, **config) -> str:
    (root / "mymodel").mkdir()
    (root / "mymodel" / "config.json").write_text(json.dumps({"model_type": "llama", **config}))
    return "./mymodel"


def _case_model_directory_without_weights(root):
    write_pipeline(root, lambda r: r.update(base_model=_model_dir(root)))
    return ["hostile.yaml"], ["base_model", "mymodel has a config.json but no weights", "save_pretrained"]


def _case_model_with_its_own_code(root):
    model = _model_dir(root, auto_map={"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"})
    (root / "mymodel" / "model.safetensors").write_bytes((2).to_bytes(8, "little") + b"{}")  # whole, with no tensor
    write_pipeline(root, lambda r: r.update(base_model=model))
    return ["hostile.yaml"], ["base_model", "ships its own Python code", "AutoModelForCausalLM",
                              "trust_remote_code: true"]


def _case_lora_target_the_model_lacks(root):
    write_pipeline(root, lambda r: r["stages"]["sft"].update(lora={"enabled": True, "target_modules": [
        "q_proj", "self_attn.v_proj", "qkv_proj"]}))  # a dotted suffix matches, as in peft
    return ["hostile.yaml"], ["stages.sft.lora.target_modules", "['qkv_proj'] name no linear layer", "'o_proj'"]


def _case_eval_split_the_card_lacks(root):
    write_pipeline(root, lambda r: r["stages"]["sft"].update(eval_split="validation"))
    return ["hostile.yaml"], ["stages.sft", "eval_split: 'validation'", "no split 'validation'", "eval_split: null"]


def _case_stage_name_not_an_identifier(root):
    write_pipeline(root, lambda r: r.update(stages={("sft.v2" if k == "sft" else k): v
                                                    for k, v in r["stages"].items()}))
    return ["hostile.yaml"], ["stages.sft.v2", "plain identifier", "sft_v2"]


def _case_sweep_past_its_bound(root):
    write_pipeline(root, lambda r: r["stages"]["sft"].update(
        sweep={"learning_rate": [1e-4 + i * 1e-6 for i in range(100)], "max_length": [64, 96]}))
    return ["hostile.yaml"], ["stages.sft.sweep", "200 variants (100 x 2 values)", "bound of 64",
                              "max_variants: 200"]


@pytest.mark.parametrize("case", [
    _case_pairs_empty_or_only_whitespace_apart, _case_chat_rows_without_an_assistant_turn,
    _case_transform_drops_every_row, _case_model_directory_without_weights, _case_model_with_its_own_code,
    _case_lora_target_the_model_lacks, _case_eval_split_the_card_lacks, _case_stage_name_not_an_identifier,
    _case_sweep_past_its_bound,
    _case_duplicate_key, _case_not_utf8, _case_accelerate_not_a_config, _case_accelerate_type_in_lower_case,
    _case_parquet_not_parquet, _case_truncated_gz,
    _case_missing_local_model, _case_corrupt_model_config, _case_tokenizer_without_eos,
    _case_pairs_without_test_split, _case_single_pair, _case_every_prompt_empty, _case_stage_is_a_list,
], ids=lambda f: f.__name__[6:])
def test_validate_refuses_file(case, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args, needles = case(tmp_path)
    before = snapshot(tmp_path)
    rc, out = validate(capsys, *args)
    refused(out, rc, *needles)
    assert snapshot(tmp_path) == before


def test_the_hostile_pipeline_itself_validates(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, out = validate(capsys, str(write_pipeline(tmp_path)))
    assert rc == 0, out


def test_yaml_merge_keys_share_settings_and_the_stage_wins(capsys, tmp_path, monkeypatch):
    """`<<: *anchor` (YAML 1.1 merge) works; the stage's own keys override the merged ones."""
    from align.config import load_pipeline

    monkeypatch.chdir(tmp_path)
    text = write_pipeline(tmp_path).read_text().replace("  sft:\n", "  sft: &small\n", 1).replace(
        "  evaluate:\n", "  sft2:\n    <<: *small\n    type: sft\n    max_length: 64\n  evaluate:\n", 1)
    (tmp_path / "hostile.yaml").write_text(text)
    rc, out = validate(capsys, "hostile.yaml")
    assert rc == 0, out
    cfg = load_pipeline("hostile.yaml", [])
    assert (cfg.stages["sft2"].max_steps, cfg.stages["sft2"].max_length, cfg.stages["sft"].max_length) == (6, 64, 96)


@pytest.mark.parametrize("run_id", ["../../x", "", "a/b", "." * 2])
def test_run_ids_that_are_not_plain_names(run_id, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_pipeline(tmp_path)
    rc = cli(["run", "hostile.yaml", "--run-id", run_id])
    cap = capsys.readouterr()
    refused(cap.out + cap.err, rc, "run_id", "plain name")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hostile.yaml"]  # no directory anywhere
    assert not (tmp_path.parent / "x").exists()


def test_a_role_no_stage_produces_and_stages_that_are_not_a_mapping_are_said_plainly(capsys, tmp_path, monkeypatch):
    """`evaluate.reward=sft` with no reward stage ended "...needs a reward model: use (no such stage in this
    pipeline)"; `stages: [sft, dpo]` was told "(none given)"."""
    monkeypatch.chdir(tmp_path)
    write_pipeline(tmp_path)
    rc, out = validate(capsys, "hostile.yaml", "evaluate.reward=sft")
    refused(out, rc, "stages.evaluate.reward: 'sft' is a sft stage", "no stage of this pipeline produces", "add one")
    assert "use (" not in out
    write_pipeline(tmp_path, lambda raw: raw.update(stages=["sft", "dpo"]))
    rc, out = validate(capsys, "hostile.yaml")
    refused(out, rc, "`stages` must map stage names to their settings", "got a list: \"['sft', 'dpo']\"")


@pytest.mark.parametrize("overrides, needles", [
    (["ppo.lora.enabled=true", "ppo.lora.target_modules=[qproj]"],
     ["stages.ppo.lora.target_modules: ['qproj'] name no linear layer of the policy model", "q_proj"]),
    (["sft.lora.enabled=true", "sft.lora.r=100000"],
     ["stages.sft.lora.r: 100000 is above the rank any targeted layer of the policy model can have (128"]),
])
def test_lora_targets_and_rank_are_checked_for_every_trained_stage_ppo_included(overrides, needles, capsys):
    """PPO's LoRA targets were never checked at validate (only TRL stages' were): a misspelt target failed when PPO
    started, after SFT and the reward model had trained. A rank above every targeted layer's in/out features
    passed too."""
    rc, out = validate(capsys, DEFAULT, *overrides)
    refused(out, rc, *needles)


def test_a_base_model_config_beside_the_builtin_model_is_said_to_be_unread(capsys):
    """base_model_config was silently ignored for the builtin model (a user who meant it for a real model learns
    nothing): validate says it is not read."""
    rc, out = validate(capsys, DEFAULT, "base_model_config=nosuch.json")
    assert rc == 0 and "warning: base_model_config 'nosuch.json' is not read" in out, out


def test_a_stage_whose_type_defaults_to_itself_says_which_setting(capsys):
    """`sft.type=dpo` on the default pipeline said only "a stage cannot depend on itself": a dpo stage's policy is
    `sft` unless set, which the stage named sft then is."""
    rc, out = validate(capsys, DEFAULT, "sft.type=dpo")
    refused(out, rc, "stages.sft.policy: a stage cannot depend on itself", "a dpo stage's policy is 'sft' unless set",
            "set stages.sft.policy, or rename the stage")


@pytest.mark.parametrize("override, needles", [
    ("sft.max_steps=", ["override 'sft.max_steps=': no value after '='", "sft.max_steps=null"]),
    ("=x", ["override '=x': no key before '='"]),
    ("tracking.wandb=yes", ["tracking.wandb: expected a string, got True", "quote the word"]),
])
def test_overrides_with_no_value_no_key_or_a_yaml_boolean_say_so(override, needles, capsys, tmp_path, monkeypatch):
    """`sft.max_steps=` quietly became null (training by epochs instead); `=x` was an unknown key '' blamed on the
    file; `tracking.wandb=yes` was "expected a string, got True" with no word on YAML's booleans."""
    monkeypatch.chdir(tmp_path)
    write_pipeline(tmp_path)
    rc, out = validate(capsys, "hostile.yaml", override)
    refused(out, rc, *needles)


@pytest.mark.parametrize("override, needles", [
    ("base_model=''", ["base_model: empty; name a model"]),
    ("tokenizer=' '", ["tokenizer: empty; name a tokenizer", "remove the field"]),
    ("evaluate.policies=[sft, sft]", ["stages.evaluate: policies: ['sft', 'sft'] names sft more than once"]),
])
def test_empty_model_names_and_a_policy_listed_twice_are_refused(override, needles, capsys, tmp_path, monkeypatch):
    """base_model: '' was looked for in the working directory ("holds no tokenizer files (found: .ci, .git, ...)"),
    tokenizer: '' passed, and evaluate compared a policy listed twice with itself."""
    monkeypatch.chdir(tmp_path)
    write_pipeline(tmp_path)
    rc, out = validate(capsys, "hostile.yaml", override)
    refused(out, rc, *needles)


@pytest.mark.parametrize("where", ["afile", "afile/sub"])
def test_a_runs_dir_that_is_a_file_or_under_one_is_refused_at_validate(where, capsys, tmp_path, monkeypatch):
    """runs_dir naming a file (or a path under one) passed validate; the run failed making its directory."""
    monkeypatch.chdir(tmp_path)
    write_pipeline(tmp_path)
    (tmp_path / "afile").write_text("not a directory")
    rc, out = validate(capsys, "hostile.yaml", f"runs_dir={tmp_path / where}")
    refused(out, rc, "runs_dir:", f"{tmp_path / 'afile'} is a file, not a directory")


@pytest.mark.parametrize("override, needles", [
    ("sft.lora.enabled=true", ["stages.sft: lora.target_modules: [] names no layer", "no adapter would train"]),
    ("sft.eval_split=train", ["eval_split: 'train' is the split SFT trains on", "would not be held out"]),
    ("evaluate.pairwise=[{name: j, model: m, base_url: 'localhost:8000/v1'}]",
     ["base_url: 'localhost:8000/v1' is not an http(s) URL", "base_url: http://localhost:8000/v1"]),
    ("evaluate.pairwise=[{name: j, model: m, base_url: 'ftp://host/v1'}]", ["'ftp://host/v1' is not an http(s) URL"]),
])
def test_settings_that_would_do_nothing_or_reach_nothing_are_refused(override, needles, capsys, tmp_path,
                                                                     monkeypatch):
    """LoRA with no target modules passed validate (peft refuses it when the stage starts), and SFT evaluated on its
    own training split (a held-out loss that is not held out); a judge's base_url
    without a scheme was probed and reported as "unknown url type: localhost", ftp:// as a refused connection."""
    monkeypatch.chdir(tmp_path)
    write_pipeline(tmp_path)
    extra = ["sft.lora.target_modules=[]"] if override.startswith("sft.lora") else []
    rc, out = validate(capsys, "hostile.yaml", override, *extra)
    refused(out, rc, *needles)


@pytest.mark.parametrize("body", ["{{ m.content / 0 }}", "{{ m.nosuch.attr }}"])
def test_a_chat_template_that_parses_but_fails_on_a_conversation_is_named(body, capsys, tmp_path, monkeypatch):
    """A template that is valid Jinja but fails when rendered ended `align validate` in the helper's traceback
    (TypeError, jinja2's UndefinedError) without naming chat_template or its file."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.jinja").write_text("{% for m in messages %}" + body + "{% endfor %}")
    write_pipeline(tmp_path, lambda raw: raw.update(
        tokenizer=str(REPO / "tokenizers" / "gpt2"), chat_template="bad.jinja",
        stages={"sft": {"data": str(REPO / "data_cards" / "hh_rlhf_harmless_sft.yaml"), "max_length": 96,
                        "max_truncated_fraction": 1.0}}))
    rc, out = validate(capsys, "hostile.yaml")
    refused(out, rc, "chat_template (file:", "bad.jinja): rendering a conversation failed", "fix the template")


@pytest.mark.parametrize("run_id", ["123", "2024-06-01", "true", "1e3"])
def test_a_run_id_that_yaml_would_read_as_a_number_or_date_is_the_name_typed(run_id, tmp_path, monkeypatch):
    """`--run-id 123` became the override run_id=123, which YAML reads as an int (a date, a bool, a float) and the
    pipeline refused with an error blaming the file; the flag's value is a string as typed."""
    import align.cli

    monkeypatch.chdir(tmp_path)
    write_pipeline(tmp_path)
    seen = []
    monkeypatch.setattr(align.cli, "run", lambda cfg, *a, **k: seen.append(cfg.run_id))
    assert cli(["run", "hostile.yaml", "--run-id", run_id]) == 0
    assert seen == [run_id]


@pytest.mark.parametrize("flags,said", [(["--gpu-memory-gb", "nan"], "nan: give a size above 0 GB"),
                                        (["--gpu-memory-gb", "inf"], "inf: give a size above 0 GB"),
                                        (["--gpu-memory-gb", "-80"], "-80: give a size above 0 GB"),
                                        (["--gpus", "0"], "--gpus: 0: give 1 or more"),
                                        (["--nodes", "-3"], "--nodes: -3: give 1 or more")])
def test_estimate_flags_out_of_range_are_refused_by_name(flags, said, capsys):
    """--gpu-memory-gb nan ended in a ValueError traceback, inf in an OverflowError; 0 GPUs or nodes were quietly
    ignored ("no GPU present or declared") and -80 GB printed a negative GPU."""
    with pytest.raises(SystemExit) as exc:
        cli(["estimate", DEFAULT, *flags])
    assert exc.value.code == 2 and said in capsys.readouterr().err


# --------------------------------------------------------------------------------------------- zero results
class _State:
    global_step = 0


class _Trainer:
    """A Trainer that trains nothing, outside DeepSpeed (no plugin, no engine)."""

    state = _State()
    accelerator = type("Accelerator", (), {"state": type("State", (), {"deepspeed_plugin": None})()})()
    deepspeed = None
    model = None  # a model trained whole: no LoRA parameters to upcast

    def add_callback(self, callback):
        pass

    def train(self, resume_from_checkpoint=None):
        return type("Out", (), {"training_loss": 0.0, "metrics": {"train_runtime": 0.0}})()


class _Ctx:
    name = "sft"
    is_main = True

    def __init__(self, root: Path, kind: str = "sft"):
        from align.config import stage_types

        self.dir = root
        self.extra_manifest: dict = {}
        self.cfg = stage_types()[kind]()

    def last_checkpoint(self):
        return None


def test_zero_steps_zero_prompts_and_empty_outputs_are_failures(tmp_path):
    from align.runtime.context import StageError
    from align.runtime.process import check_produced
    from align.runtime.trl import train_with_resume

    with pytest.raises(StageError, match="trained 0 optimiser steps"):
        train_with_resume(_Ctx(tmp_path), _Trainer())
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    check_produced(_Ctx(tmp_path), ["model"], {"train/global_step": 6})  # a real output passes
    # each stage type's work metric, as its config class declares it
    with pytest.raises(StageError, match="did no work: train/global_step is 0"):
        check_produced(_Ctx(tmp_path, "dpo"), ["model"], {"train/global_step": 0})
    with pytest.raises(StageError, match="did no work: eval/prompts is 0"):
        check_produced(_Ctx(tmp_path, "evaluate"), ["model"], {"eval/prompts": 0})
    with pytest.raises(StageError, match="did no work: ppo/iterations_run is 0"):
        check_produced(_Ctx(tmp_path, "ppo"), ["model"], {"ppo/iterations_run": 0})
    with pytest.raises(StageError, match="did no work: preferences/prompts is 0"):
        check_produced(_Ctx(tmp_path, "preferences"), ["model"], {"preferences/prompts": 0})
    check_produced(_Ctx(tmp_path, "ppo"), ["model"], {"eval/prompts": 0})  # another type's metric is not PPO's work
    (tmp_path / "data").mkdir()
    with pytest.raises(StageError, match="produced nothing: .*data is missing or empty"):
        check_produced(_Ctx(tmp_path), ["data"], {})


# --------------------------------------------------------------------------------------------- shared run
def _lock_holder(run: Path) -> dict:
    try:
        text = (run / ".align.lock").read_text()
        return json.loads(text) if text.strip() else {}
    except (OSError, json.JSONDecodeError):
        return {}


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """A runner is SIGKILLed while it holds the lock; then two runners start at once on the same run id."""
    print(f"hostile-test seed {SEED} (replay with ALIGN_HOSTILE_SEED={SEED})")
    rng = random.Random(SEED)
    root = tmp_path_factory.mktemp("hostile")
    write_pipeline(root)
    run = root / "runs" / "hostile" / "main"
    args = ["run", "hostile.yaml"]
    killed = subprocess.Popen(align_cmd(*args), cwd=root, start_new_session=True, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        t0 = time.time()
        while _lock_holder(run).get("pid") != killed.pid:
            assert killed.poll() is None and time.time() - t0 < 60, "the first runner never took the lock"
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 1.0))
    finally:
        os.killpg(killed.pid, signal.SIGKILL)
        killed.wait()
    assert _lock_holder(run).get("pid") == killed.pid  # the record survives the kill: a stale lock
    started, procs, ended = time.time(), [], {}
    for i in range(2):  # output to files: a full pipe would block a runner
        log = open(root / f"runner{i}.log", "w")
        procs.append((subprocess.Popen(align_cmd(*args), cwd=root, stdout=log, stderr=subprocess.STDOUT,
                                       env=os.environ.copy()), log, root / f"runner{i}.log"))
    while len(ended) < 2:
        for p, _, _ in procs:
            if p.pid not in ended and p.poll() is not None:
                ended[p.pid] = time.time() - started
        assert time.time() - started < 300
        time.sleep(0.1)
    results = []
    for p, log, path in procs:
        log.close()
        results.append({"pid": p.pid, "rc": p.returncode, "out": path.read_text(), "seconds": ended[p.pid]})
    return {"root": root, "run": run, "killed": killed.pid, "runners": results}


def _winner_loser(shared):
    runners = sorted(shared["runners"], key=lambda r: r["rc"])
    assert [r["rc"] for r in runners] == [0, 2], [r["out"][-2000:] for r in runners]
    return runners


def test_second_runner_fails_at_once_naming_the_holder(shared):
    import socket

    winner, loser = _winner_loser(shared)
    refused(loser["out"], loser["rc"], "is in use by another align runner", f"PID {winner['pid']}",
            f"host {socket.gethostname()}")
    assert loser["seconds"] < 30  # at once: validation and start-up, no training (the winner trains ~20 s more)
    assert loser["seconds"] < winner["seconds"]


def test_runner_killed_with_sigkill_leaves_a_stale_lock_that_is_taken_over(shared):
    winner, _ = _winner_loser(shared)
    assert "took over a stale lock" in winner["out"] and f"PID {shared['killed']}" in winner["out"]
    assert _lock_holder(shared["run"]) == {}  # released on a clean exit
    for stage in ("sft", "preferences", "evaluate"):
        assert json.loads((shared["run"] / stage / "manifest.json").read_text())["status"] == "completed"


def test_metrics_have_no_duplicated_rows(shared):
    rows = [json.loads(x) for x in (shared["run"] / "sft" / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if "train/loss" in r]
    assert steps == [2, 4, 6]


def _copy(shared, tmp_path: Path, run_id: str = "main") -> tuple[Path, Path]:
    root = tmp_path / "project"
    root.mkdir()
    write_pipeline(root)
    run = root / "runs" / "hostile" / run_id
    shutil.copytree(shared["run"], run)
    return root, run


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(path.rglob("*")):
        if f.is_file():
            h.update(f.relative_to(path).as_posix().encode() + f.read_bytes())
    return h.hexdigest()


def test_deleting_an_upstream_model_reruns_it_and_every_dependant(shared, tmp_path):
    root, run = _copy(shared, tmp_path)
    shutil.rmtree(run / "sft" / "model")
    proc = run_align("run", "hostile.yaml", cwd=root)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ran = {s for s in ("sft", "preferences", "evaluate") if f"{s} ({s}): running" in proc.stdout}
    assert ran == {"sft", "preferences", "evaluate"}
    consumed = json.loads((run / "preferences" / "manifest.json").read_text())["input_digests"]["sft"]
    assert consumed == json.loads((run / "sft" / "manifest.json").read_text())["output_digests"]
    again = run_align("run", "hostile.yaml", cwd=root)
    assert again.returncode == 0 and again.stdout.count("skipped") == 3 and "running" not in again.stdout


def test_full_disk_during_a_stage_keeps_the_previous_output_and_records_the_failure(shared, tmp_path):
    root, run = _copy(shared, tmp_path)
    model_before = _digest(run / "sft" / "model")
    proc = run_align("run", "hostile.yaml", "--only", "sft", "--force", cwd=root,
                     env={"ALIGN_INJECT_OSERROR": f"ENOSPC:{run / 'sft' / 'model'}"})
    refused(proc.stdout + proc.stderr, proc.returncode, "No space left on device", str(run / "sft" / "model"),
            "written before the disk filled", "(the output it replaces)", "free there")
    manifest = json.loads((run / "sft" / "manifest.json").read_text())
    assert manifest["status"] == "failed" and "No space left on device" in manifest["error"]
    assert _digest(run / "sft" / "model") == model_before
    leftovers = [p for p in run.rglob("*") if ".tmp-" in p.name or p.name.endswith((".staging", ".old"))]
    assert leftovers == []


def test_read_only_run_directory_even_when_everything_is_up_to_date(shared, tmp_path, capsys, monkeypatch):
    """Tests run as root, which ignores file modes: a read-only filesystem is injected (EROFS) instead."""
    root, run = _copy(shared, tmp_path)
    monkeypatch.chdir(root)
    monkeypatch.setenv("ALIGN_INJECT_OSERROR", f"EROFS:{run}")
    before = snapshot(run)
    rc = cli(["run", "hostile.yaml"])
    cap = capsys.readouterr()
    refused(cap.out + cap.err, rc, "Read-only file system", str(run))
    assert snapshot(run) == before


@pytest.mark.parametrize("content, needles", [
    ("[1, 2]", ["preferences/manifest.json", "not a stage manifest"]),
    ('{"status": ', ["preferences/manifest.json", "cannot be read as JSON"]),
], ids=["wrong-type", "truncated"])
def test_malformed_manifest(content, needles, shared, tmp_path, capsys, monkeypatch):
    root, run = _copy(shared, tmp_path)
    monkeypatch.chdir(root)
    (run / "preferences" / "manifest.json").write_text(content)
    before = snapshot(run)
    rc = cli(["run", "hostile.yaml"])
    cap = capsys.readouterr()
    refused(cap.out + cap.err, rc, *needles)
    assert snapshot(run) == before


@pytest.mark.parametrize("edit, field", [
    (lambda m: m.update(final_metrics="x"), "field 'final_metrics' is a str, not a dict"),
    (lambda m: m.update(output_digests={**m["output_digests"], "data": "x"}), "field 'output_digests.data'"),
    (lambda m: m["output_digests"]["data"].update(files={"train.jsonl": "abc"}), "field 'output_digests.data'"),
    (lambda m: m["output_digests"]["data"].update(files={"train.jsonl": [712, 5]}), "field 'output_digests.data'"),
    (lambda m: m["output_digests"]["data"].update(stamps=5), "field 'output_digests.data'"),
    (lambda m: m["output_digests"]["data"].update(publication=["x"]), "field 'output_digests.data'"),
], ids=["metrics-a-string", "digest-a-string", "file-entry-a-string", "file-entry-sha-a-number", "stamps-a-number",
        "publication-a-list"])
def test_a_manifest_field_edited_to_the_wrong_type_is_one_line_everywhere(edit, field, shared, tmp_path, capsys,
                                                                           monkeypatch):
    """Hand-edited manifests whose fields had the wrong type ended `status`, `verify` and `run` in tracebacks
    (AttributeError, ValueError, TypeError) where a malformed JSON file was already one line."""
    root, run = _copy(shared, tmp_path)
    monkeypatch.chdir(root)
    path = run / "preferences" / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))
    before = snapshot(run)
    for command in (["status", str(run)], ["verify", str(run)], ["run", "hostile.yaml"]):
        rc = cli(command)
        cap = capsys.readouterr()
        refused(cap.out + cap.err, rc, "preferences/manifest.json", field, "delete the manifest to rerun the stage")
    assert snapshot(run) == before


def test_a_stage_made_from_an_input_republished_since_is_stale_and_only_refuses_to_build_on_it(shared, tmp_path,
                                                                                              capsys, monkeypatch):
    """After `--only sft --force` republished sft, `align status` still called preferences (made from the old sft)
    "current", and `--only <a stage reading preferences>` trained on it without a word; the guide says a retrained
    upstream reruns its dependants."""
    root, run = _copy(shared, tmp_path)
    proc = run_align("run", "hostile.yaml", "--only", "sft", "--force", cwd=root)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    monkeypatch.chdir(root)
    assert cli(["status", str(run)]) == 0
    table = capsys.readouterr().out
    assert "| preferences | preferences | completed | stale (input 'sft' republished since) |" in table, table
    # a stage reading preferences (this pipeline's evaluate reads sft alone: a consumer stands in) is refused
    from types import SimpleNamespace

    from align.config import load_pipeline
    from align.core.errors import PipelineError
    from align.orchestrator.plan import build_plan
    from align.orchestrator.runner import _check_inputs

    plans = build_plan(load_pipeline("hostile.yaml", []), "hostile.yaml")
    consumer = SimpleNamespace(name="dpo", deps=["preferences"])
    with pytest.raises(PipelineError, match=r"stage 'dpo' needs stage 'preferences', but 'preferences' was made from "
                                            r"an earlier publication of 'sft' .* --from preferences"):
        _check_inputs(consumer, plans, run, "hostile.yaml", trust_completed_inputs=False)
    _check_inputs(SimpleNamespace(name="dpo", deps=["sft"]), plans, run, "hostile.yaml", False)  # sft itself: current


def test_stage_process_refuses_a_bad_spec_at_start(shared, tmp_path):
    """The stage process re-parses its spec through the same checks as `align validate`."""
    root, run = _copy(shared, tmp_path)
    spec = json.loads((run / "sft" / "spec.json").read_text())
    spec["stage_dir"] = str(run / "sft")
    spec["stage"]["epochs"] = -1.0
    (run / "sft" / "spec.json").write_text(json.dumps(spec))
    model_before = _digest(run / "sft" / "model")
    proc = subprocess.run(align_cmd("stage", str(run / "sft" / "spec.json")), cwd=root, capture_output=True,
                          text=True, timeout=120)
    refused(proc.stdout + proc.stderr, proc.returncode, "stages.sft.epochs", "-1.0", "> 0")
    manifest = json.loads((run / "sft" / "manifest.json").read_text())
    assert manifest["status"] == "failed" and "stages.sft.epochs" in manifest["error"]
    assert _digest(run / "sft" / "model") == model_before


def test_report_on_a_copied_run_reads_and_writes_only_the_copy(shared, tmp_path):
    elsewhere = tmp_path / "elsewhere" / "copy-of-main"
    shutil.copytree(shared["run"], elsewhere)
    original = snapshot(shared["run"])
    old = (elsewhere / "report" / "metrics.json").stat().st_mtime_ns
    proc = run_align("report", str(elsewhere), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert snapshot(shared["run"]) == original
    assert (elsewhere / "report" / "metrics.json").stat().st_mtime_ns > old
    assert json.loads((elsewhere / "pipeline.json").read_text())["run_id"] == "copy-of-main"


def test_status_reads_a_hand_edited_run_directory_as_it_is(shared, tmp_path):
    """A manifest edited to list no outputs is not a completed stage; a pipeline.json of another shape is one line."""
    from align.core.errors import PipelineError
    from align.orchestrator.status import status_table

    _, run = _copy(shared, tmp_path)
    manifest = json.loads((run / "sft" / "manifest.json").read_text())
    assert "| sft | sft | completed |" in status_table(run)
    manifest.pop("outputs")
    (run / "sft" / "manifest.json").write_text(json.dumps(manifest))
    assert "| sft | sft | completed, output missing |" in status_table(run)
    (run / "pipeline.json").write_text(json.dumps({"stages": {"sft": {"type": "sft"}}}))
    with pytest.raises(PipelineError, match=r"pipeline.json: not a pipeline manifest.*rerun `align run`"):
        status_table(run)


def test_status_calls_a_running_stage_whose_runner_died_interrupted(shared, tmp_path):
    """A runner that dies where it cannot write its manifests (full disk, SIGKILL) leaves `running`: status asks the
    run lock's holder record whether that runner lives, and says how to resume when it does not."""
    import socket
    import sys

    from align.orchestrator.status import status_table

    _, run = _copy(shared, tmp_path)
    manifest = json.loads((run / "sft" / "manifest.json").read_text())
    manifest["status"] = "running"
    (run / "sft" / "manifest.json").write_text(json.dumps(manifest))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    lock = run / ".align.lock"
    for pid, expect in ((os.getpid(), "| sft | sft | running |"),
                        (dead, f"| sft | sft | interrupted (its runner PID {dead} died before the stage ended); resume: "
                               "align run")):
        lock.write_text(json.dumps({"pid": int(pid), "host": socket.gethostname(), "since": "x"}))
        assert expect in status_table(run)
    lock.write_text("")  # a clean exit empties the record
    assert "interrupted (its runner has exited before the stage ended)" in status_table(run)
    lock.write_text(json.dumps({"pid": int(dead), "host": "another-host", "since": "x"}))
    assert "| sft | sft | running |" in status_table(run)  # another host's PID cannot be checked from here
    # the resume hint is the command as the run was typed (its overrides, --only), which the runner records: the
    # pipeline file alone planned other fingerprints, retrained from scratch and ran stages never asked for
    record = json.loads((run / "pipeline.json").read_text())
    assert record["resume"].startswith("align run ") and "hostile.yaml" in record["resume"]
    record["resume"] = "align run hostile.yaml --run-id main sft.max_steps=3000 --only sft"
    (run / "pipeline.json").write_text(json.dumps(record))
    lock.write_text(json.dumps({"pid": int(dead), "host": socket.gethostname(), "since": "x"}))
    assert "resume: align run hostile.yaml --run-id main sft.max_steps=3000 --only sft |" in status_table(run)
    (run / "sft" / "manifest.json").write_text(json.dumps({**manifest, "status": "completed"}))
    (run / "sft" / "model" / "config.json").write_text("{}")
    assert "rerun it: align run hostile.yaml --run-id main sft.max_steps=3000 --from sft" in status_table(run)
    # a copied (or renamed) run: its hints named the original's --run-id, which retrains that one instead
    copy = run.parent / "copied"
    shutil.copytree(run, copy)
    (copy / ".align.lock").write_text("")
    assert "rerun it: align run hostile.yaml --run-id copied sft.max_steps=3000 --from sft" in status_table(copy)


@pytest.mark.parametrize("record, problem", [
    ({"config": {}, "stages": [{"name": 1, "type": None}]}, "stage entry 0 has no plain-name `name`"),
    ({"config": {}, "stages": [{"name": "../sft", "type": "sft"}]}, "stage entry 0 has no plain-name `name`"),
    ({"config": 7, "stages": [{"name": "sft", "type": "sft"}]}, "`config` is not a mapping (it holds int data)"),
    ({"config": {}, "run_id": ["x"], "stages": []}, "`run_id` is not text"),
    ({"config": {}, "resume": "align run p.yaml 'unclosed", "stages": []}, "`resume` is not a command line (No closing"),
])
def test_a_pipeline_json_with_fields_of_the_wrong_type_is_one_line_for_status_verify_and_report(tmp_path, record,
                                                                                              problem):
    """Every field the three commands read is checked for its type before use (a stage name that is a number gave
    `align status` a TypeError): one line naming the file, what is wrong and the fix, exit 2, no traceback."""
    run = tmp_path / "runs" / "p" / "main"
    run.mkdir(parents=True)
    (run / "pipeline.json").write_text(json.dumps(record))
    for command in ("status", "verify", "report"):
        proc = run_align(command, str(run), cwd=tmp_path)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, (command, proc.stderr)
        assert "pipeline.json: not a pipeline manifest" in proc.stderr and problem in proc.stderr, (command, proc.stderr)


@pytest.mark.parametrize("stage, split", [("evaluate", "test"), ("ppo", "train")])
def test_a_conversation_card_as_prompts_is_refused_at_validate_even_without_the_hub(stage, split, capsys):
    """Evaluate's or PPO's prompts pointed at UltraFeedback's SFT card (its test split is `test_sft`: a natural slip)
    passed validate where the hub was not reachable (compute nodes) and failed as KeyError: 'prompt' when the stage
    started, after SFT, the reward model and PPO had trained; with the hub, validate said every prompt was empty.
    The card's declared form refuses it at validate, hub or not. (Offline, validation reads the card's cached copy
    since 2026-11-30, and the hub's own split name is refused first, naming the card's.)"""
    pipeline = str(REPO / "pipelines" / "llama3_8b_ultrafeedback.yaml")
    rc, out = validate(capsys, pipeline, f"{stage}.prompts=../data_cards/ultrafeedback_binarized_sft.yaml",
                       f"{stage}.split={split}_sft")
    refused(out, rc, f"stages.{stage}.prompts (split '{split}_sft')", f"no split '{split}_sft'; the card defines "
            "['test', 'train']")
    rc, out = validate(capsys, pipeline, f"{stage}.prompts=../data_cards/ultrafeedback_binarized_sft.yaml",
                       f"{stage}.split={split}")
    refused(out, rc, f"stages.{stage}.prompts: ultrafeedback_binarized_sft.yaml produces 'messages'",
            "use a card with prompts")


def test_a_hub_model_that_ships_its_own_code_is_refused_as_a_local_one_is(tmp_path, monkeypatch):
    """check_remote_code read `<id>/config.json` as a local path: a hub id's auto_map was never seen, transformers
    loaded its generic class for the model_type, the first stage trained it, and the next stage refused the
    directory it published (its config.json keeps the auto_map) after that stage's compute was spent."""
    from huggingface_hub import constants

    from align.core.errors import ModelError
    from align.modeling.models import check_remote_code

    snapshot = tmp_path / "models--acme--m" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({"model_type": "llama", "auto_map": {
        "AutoModelForCausalLM": "modeling_acme.AcmeForCausalLM"}}))
    (tmp_path / "models--acme--m" / "refs").mkdir()
    (tmp_path / "models--acme--m" / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # never the network from a test
    with pytest.raises(ModelError, match=r"acme/m: this model ships its own Python code \(config.json auto_map\)"):
        check_remote_code("acme/m", False)
    check_remote_code("acme/m", True)  # opted in
    check_remote_code("acme/not-cached", False)  # offline and not cached: the load says what is wrong

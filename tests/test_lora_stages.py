"""LoRA on the stages that start from a trained model, run in-process on a tiny Llama.

PPO: only adapters (and the value head's trained copy) change, one base copy serves policy and reference (and the
value model's base serves the reward model), the first-step ratio is exactly 1, a checkpoint holds only the trained
weights and resumes, and model/ is the merged plain policy. Reward and DPO: `lora.enabled` trains, DPO loads no
reference of its own, and model/ reloads with the Auto classes with only the adapted weights (and the reward head)
changed."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from align.config import BuiltinModel, Generation, LoraSettings, PipelineConfig, StageBase, Tracking, to_dict
from align.config.dpo import DPOStage
from align.config.ppo import PPOStage
from align.config.reward import RewardStage
from align.core.rundir import StageSpec

REPO = Path(__file__).resolve().parent.parent
SEED = 4321
SIZE = BuiltinModel(vocab_size=300, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                    max_position_embeddings=96)
TARGETS = ("q_proj", "v_proj")


@pytest.fixture(scope="module")
def upstream(tmp_path_factory) -> Path:
    """sft/model (a tiny random Llama + BPE tokenizer), reward/model (its backbone with a scalar head) and
    pairs/data (preference pairs: a review's own continuation chosen over another's)."""
    from align.data.cards import load_split
    from align.modeling.models import build_builtin, load_scalar_model, train_tokenizer

    print(f"seed {SEED}")
    root = tmp_path_factory.mktemp("lora_ppo")
    rows = load_split(REPO / "data_cards" / "movie_review_snippets.yaml", "train").rows[:400]
    tok = train_tokenizer((r["prompt"] + r["completion"] for r in rows), SIZE.vocab_size, SIZE.max_position_embeddings)
    build_builtin(SIZE, tok, seed=SEED).save_pretrained(root / "sft" / "model")
    tok.save_pretrained(root / "sft" / "model")
    torch.manual_seed(SEED)
    load_scalar_model(str(root / "sft" / "model"), tok.pad_token_id).save_pretrained(root / "reward" / "model")
    tok.save_pretrained(root / "reward" / "model")
    (root / "pairs" / "data").mkdir(parents=True)
    for split, part in {"train": rows[:64], "test": rows[64:80]}.items():
        pairs = [{"prompt": a["prompt"], "chosen": a["completion"], "rejected": b["completion"]}
                 for a, b in zip(part, part[1:] + part[:1])]
        (root / "pairs" / "data" / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pairs))
    return root


def _stage_context(root: Path, cfg: StageBase, dirname: str, inputs: list[str], **numerics: str):
    from align.runtime.context import StageContext

    pipeline = to_dict(PipelineConfig(name="t", seed=SEED, tracking=Tracking(wandb="disabled"), **numerics))
    pipeline.pop("stages")
    stage_dir = root / dirname
    stage_dir.mkdir(exist_ok=True)
    spec = StageSpec(stage_name=cfg.type, stage_dir=str(stage_dir), fingerprint="test-fp", stage=to_dict(cfg),
                     pipeline=pipeline, inputs={n: str(root / n) for n in inputs},
                     input_fingerprints={n: None for n in inputs})
    ctx = StageContext(spec)
    ctx.start_tracking()
    return ctx


def _context(root: Path, lora: bool):
    cfg = PPOStage(type="ppo", policy="sft", reward="reward", value_init="reward",
                   prompts=str(REPO / "data_cards" / "movie_review_snippets.yaml"), iterations=3,
                   rollout_batch_size=8, mini_batch_size=4, ppo_epochs=2, learning_rate=1e-2, value_learning_rate=1e-2,
                   reward_normalization_samples=8, max_prompt_length=64, save_every=2, sample_every=100,
                   generation=Generation(max_new_tokens=8, batch_size=8),
                   lora=LoraSettings(enabled=lora, r=4, alpha=8, dropout=0.0, target_modules=list(TARGETS), merge=True))
    return _stage_context(root, cfg, "ppo_lora" if lora else "ppo_full", ["sft", "reward"])


def _run_recording(ctx, monkeypatch) -> dict:
    """Run the stage, recording how many models were loaded before training and the objects it trained with."""
    import align.modeling.models as models
    import align.stages.ppo as ppo

    seen: dict = {"loads": [], "updates": 0}
    for name in ("load_causal_lm", "load_scalar_model"):  # every stage loads through these (StageContext.load_*)
        real = getattr(models, name)
        monkeypatch.setattr(models, name, lambda *a, _real=real, _name=name, **k: (seen["loads"].append(_name), _real(*a, **k))[1])
    real_frozen, real_update = ppo.load_frozen, ppo.ppo_update

    def load_frozen(*args, **kwargs):
        seen["trained"] = args[3]
        seen["reference"], seen["reward_fns"] = real_frozen(*args, **kwargs)
        return seen["reference"], seen["reward_fns"]

    def ppo_update(*args, **kwargs):
        if seen["updates"] == 0:
            seen["loads_before_training"] = list(seen["loads"])
            seen["adapters_at_start"] = {n: p.detach().clone() for n, p in seen["trained"].named_parameters()
                                         if p.requires_grad}
        seen["updates"] += 1
        return real_update(*args, **kwargs)

    monkeypatch.setattr(ppo, "load_frozen", load_frozen)
    monkeypatch.setattr(ppo, "ppo_update", ppo_update)
    seen["final"] = ppo.run(ctx)
    return seen


def _saved_at_iteration_2(ctx) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    with safe_open(str(ctx.checkpoints / "iter-2" / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _resumes_from_iteration_2(ctx, monkeypatch) -> dict:
    """Rerun the stage (its first model/ set aside): it resumes from the iter-2 checkpoint, runs the last
    iteration only, and starts from exactly the trained weights saved there. Returns the rerun's recording."""
    at_2 = _saved_at_iteration_2(ctx)
    (ctx.dir / "model").rename(ctx.dir / "model.first")
    monkeypatch.undo()
    again = _run_recording(ctx, monkeypatch)
    assert again["final"]["ppo/resumed_from_iteration"] == 2 and again["updates"] == 1
    assert again["adapters_at_start"].keys() == at_2.keys()
    assert all(torch.equal(again["adapters_at_start"][k], at_2[k]) for k in at_2)
    return again


def _logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    from align.modeling.generation import sequence_logprobs

    with torch.no_grad():
        return sequence_logprobs(model, ids, torch.ones_like(ids), 4)


def test_ppo_with_lora_trains_only_adapters_over_one_shared_base(upstream, monkeypatch):
    from transformers import AutoModelForCausalLM

    from align.modeling.models import load_scalar_model

    ctx = _context(upstream, lora=True)
    seen = _run_recording(ctx, monkeypatch)
    trained, reference = seen["trained"], seen["reference"]
    # one copy of each base: the policy's (also the reference) and the value model's (also the reward model)
    assert seen["loads_before_training"] == ["load_causal_lm", "load_scalar_model"]
    policy_base = {p.data_ptr() for n, p in trained.policy.named_parameters() if "lora_" not in n}
    assert policy_base <= {p.data_ptr() for p in reference.parameters()}

    sft = AutoModelForCausalLM.from_pretrained(upstream / "sft" / "model")
    rm = load_scalar_model(str(upstream / "reward" / "model"), None)
    sft_state, rm_state = sft.state_dict(), rm.state_dict()
    # the frozen bases are bit-for-bit the starting models; the adapters moved from their zero-initialised B
    for n, p in trained.policy.named_parameters():
        if "lora_" not in n:
            assert torch.equal(p, sft_state[n.removeprefix("base_model.model.").replace(".base_layer", "")]), n
    for n, p in trained.value.named_parameters():
        key = n.removeprefix("base_model.model.").replace(".base_layer", "").replace(".original_module", "")
        if "lora_" not in n and "modules_to_save" not in n:
            assert torch.equal(p, rm_state[key]), n
    lora_b = [p for n, p in trained.policy.named_parameters() if "lora_B" in n]
    assert len(lora_b) == 2 * SIZE.num_layers and all(p.abs().sum() > 0 for p in lora_b)
    head = dict(trained.value.named_parameters())["base_model.model.score.modules_to_save.default.weight"]
    assert not torch.equal(head, rm_state["score.weight"])
    # trainable = adapters + the value head copy, nothing else
    assert {n.split(".")[-3] if "lora_" in n else "head" for n, p in trained.named_parameters() if p.requires_grad} \
        == {"lora_A", "lora_B", "head"}

    # the reference is the starting policy exactly (adapters off), the reward model the reward stage's exactly
    g = torch.Generator().manual_seed(SEED)
    ids = torch.randint(2, SIZE.vocab_size, (3, 10), generator=g)
    assert torch.equal(_logprobs(reference, ids), _logprobs(sft, ids))
    assert not torch.equal(_logprobs(trained.policy, ids), _logprobs(sft, ids))
    from align.modeling.generation import scalar_outputs

    with torch.no_grad():
        assert torch.equal(seen["reward_fns"]["reward"](ids, torch.ones_like(ids)), scalar_outputs(rm, ids, torch.ones_like(ids)))

    # ratio exactly 1 on the first mini-batch of every iteration (no dropout, LoRA's included)
    rows = [json.loads(line) for line in (ctx.dir / "metrics.jsonl").read_text().splitlines()]
    ratios = [r["policy/ratio_first"] for r in rows if "policy/ratio_first" in r]
    assert ratios == [1.0, 1.0, 1.0]

    # the checkpoint holds the trained weights only
    assert set(_saved_at_iteration_2(ctx)) == {n for n, p in trained.named_parameters() if p.requires_grad}

    # model/ (lora.merge) is the merged plain policy: untouched weights equal the SFT model's, adapted ones W + (alpha/r) B A
    merged = AutoModelForCausalLM.from_pretrained(ctx.dir / "model")
    assert not list((ctx.dir / "model").glob("adapter_*"))
    params = dict(trained.policy.named_parameters())
    for key, w in merged.state_dict().items():
        if any(t in key for t in TARGETS):
            stem = "base_model.model." + key.removesuffix(".weight")
            delta = params[stem + ".lora_B.default.weight"] @ params[stem + ".lora_A.default.weight"] * (8 / 4)
            assert torch.allclose(w, sft_state[key] + delta, atol=1e-6), key
            assert not torch.equal(w, sft_state[key]), key
        else:
            assert torch.equal(w, sft_state[key]), key

    # resume from iter-2: the adapters come back as saved, the base from the starting model, ratio still 1
    again = _resumes_from_iteration_2(ctx, monkeypatch)
    for n, p in again["trained"].policy.named_parameters():
        if "lora_" not in n:
            assert torch.equal(p, sft_state[n.removeprefix("base_model.model.").replace(".base_layer", "")]), n


def test_the_control_full_ppo_loads_its_own_reference_and_reward_model(upstream, monkeypatch):
    seen = _run_recording(_context(upstream, lora=False), monkeypatch)
    assert seen["loads_before_training"] == ["load_causal_lm", "load_scalar_model", "load_causal_lm",
                                             "load_scalar_model"]
    assert all(p.requires_grad for p in seen["trained"].parameters())
    rows = [json.loads(line) for line in (upstream / "ppo_full" / "metrics.jsonl").read_text().splitlines()]
    assert [r["policy/ratio_first"] for r in rows if "policy/ratio_first" in r] == [1.0, 1.0, 1.0]


def test_lora_settings_for_ppo_are_checked():
    import yaml

    from align.config import parse_pipeline
    from align.core.errors import PipelineError
    from align.orchestrator.validate import validate

    raw = yaml.safe_load((REPO / "pipelines" / "default.yaml").read_text())
    raw["stages"]["ppo"]["lora"] = {"enabled": True, "target_modules": ["q_proj"]}
    cfg = parse_pipeline(raw, "default.yaml")
    assert cfg.stages["ppo"].lora.dropout == 0.0 and cfg.stages["dpo"].lora.dropout == 0.05  # PPO's own default
    validate(cfg, REPO / "pipelines" / "default.yaml", verbose=False)
    raw["stages"]["ppo"]["lora"]["dropout"] = 0.1
    with pytest.raises(PipelineError, match=r"stages.ppo: lora.dropout: 0.1; PPO runs every model without dropout"):
        validate(parse_pipeline(raw, "default.yaml"), REPO / "pipelines" / "default.yaml", verbose=False)


TRL_COMMON = dict(max_steps=2, logging_steps=1, save_steps=2, per_device_batch_size=8, max_length=96,
                  learning_rate=1e-2, max_truncated_fraction=1.0,
                  lora=LoraSettings(enabled=True, r=4, alpha=8, target_modules=list(TARGETS)))


@pytest.mark.parametrize("kind", ["reward", "dpo"])
def test_reward_and_dpo_accept_lora_and_publish_the_adapter_alone(upstream, monkeypatch, kind):
    """model/ holds the adapters (and, for a reward model, its trained scalar head: peft's modules_to_save) beside
    the name of their base, not a merged copy of the base; align's loader merges them into that base."""
    from transformers import AutoModelForCausalLM

    import align.modeling.models as models
    import align.stages.dpo as dpo
    import align.stages.reward as reward

    module = {"reward": reward, "dpo": dpo}[kind]
    loads = []
    for name in ("load_causal_lm", "load_scalar_model"):  # every stage loads through these (StageContext.load_*)
        real = getattr(models, name)
        monkeypatch.setattr(models, name, lambda *a, _real=real, **k: (loads.append(a[0]), _real(*a, **k))[1])
    cfg = (RewardStage(type="reward", init="sft", data="pairs", **TRL_COMMON) if kind == "reward"
           else DPOStage(type="dpo", policy="sft", data="pairs", **TRL_COMMON))
    ctx = _stage_context(upstream, cfg, f"{kind}_lora", ["sft", "pairs"])
    final = module.run(ctx)
    assert final["train/pairs"] == 64
    # one load of the starting model (DPO: no reference copy; the base with adapters off serves); reward then
    # scores its held-out pairs with the saved model/: the adapter, merged into its base (the SFT model)
    sft = str(upstream / "sft" / "model")
    assert loads == [sft] + ([str(ctx.dir / "model"), sft] if kind == "reward" else [])
    published = sorted(p.name for p in (ctx.dir / "model").iterdir())
    assert {"adapter_config.json", "adapter_model.safetensors", "align_adapter.json"} <= set(published)
    assert "model.safetensors" not in published  # no copy of the base
    record = json.loads((ctx.dir / "model" / "align_adapter.json").read_text())
    assert (record["base_model"], record["task"]) == (sft, "SEQ_CLS" if kind == "reward" else "CAUSAL_LM")
    assert record["config"]["pad_token_id"] == AutoModelForCausalLM.from_pretrained(sft).config.pad_token_id
    monkeypatch.undo()
    load = (lambda p: models.load_scalar_model(p, None)) if kind == "reward" else models.load_causal_lm
    merged = load(str(ctx.dir / "model")).state_dict()
    start = AutoModelForCausalLM.from_pretrained(upstream / "sft" / "model").state_dict()
    changed = {k for k, v in merged.items() if k not in start or not torch.equal(v, start[k])}
    adapted = {k for k in merged if any(t in k for t in TARGETS)}
    assert changed == adapted | ({"score.weight"} if kind == "reward" else set())


def test_ppo_lora_adapters_start_the_same_in_every_run(upstream, monkeypatch):
    """peft initialises lora_A from torch's global generator; the PPO stage seeds it from the stage's seed before
    building its models, so two runs of one config start from the same adapters whatever the generator's state
    (before the fix, two runs of the SmolLM2 pipeline's PPO drew different adapters and diverged)."""
    import random

    import align.stages.ppo as ppo

    seed = 20261126
    print(f"seed {seed}")
    rng = random.Random(seed)
    starts = []
    real_load = ppo.load_trained
    for name in ("ppo_seed_a", "ppo_seed_b"):
        torch.manual_seed(rng.randrange(2**31))  # a different global state before each run
        cfg = PPOStage(type="ppo", policy="sft", reward="reward", value_init="reward",
                       prompts=str(REPO / "data_cards" / "movie_review_snippets.yaml"), iterations=1,
                       rollout_batch_size=8, mini_batch_size=4, ppo_epochs=1, reward_normalization_samples=8,
                       max_prompt_length=64, save_every=100, sample_every=100,
                       generation=Generation(max_new_tokens=8, batch_size=8),
                       lora=LoraSettings(enabled=True, r=4, alpha=8, dropout=0.0, target_modules=list(TARGETS)))
        ctx = _stage_context(upstream, cfg, name, ["sft", "reward"])
        seen = {}

        def load_trained(*args, _seen=seen, **kwargs):
            model = real_load(*args, **kwargs)
            _seen.update({n: p.detach().clone() for n, p in model.named_parameters() if "lora_A" in n})
            return model

        monkeypatch.setattr(ppo, "load_trained", load_trained)
        ppo.run(ctx)
        starts.append(seen)
    assert starts[0] and starts[0].keys() == starts[1].keys()
    assert any(v.abs().sum() > 0 for v in starts[0].values())  # real, random adapters, not zeros
    for n in starts[0]:
        assert torch.equal(starts[0][n], starts[1][n]), n


def test_ppo_with_a_shared_value_head_trains_the_policy_and_its_head_only_and_resumes(upstream, monkeypatch):
    """value_init: shared: no value model is loaded (the policy's base serves the reference, the reward model is
    loaded once), the trained weights are the policy's adapters and the value head, one forward gives log-probs and
    values (ratio 1 at the first step), the checkpoint holds exactly those weights and resumes, model/ is the plain
    merged policy (no value head in it)."""
    from transformers import AutoModelForCausalLM

    cfg = PPOStage(type="ppo", policy="sft", reward="reward", value_init="shared",
                   prompts=str(REPO / "data_cards" / "movie_review_snippets.yaml"), iterations=3,
                   rollout_batch_size=8, mini_batch_size=4, ppo_epochs=2, learning_rate=1e-2, value_learning_rate=1e-2,
                   vf_coef=0.5, reward_normalization_samples=8, max_prompt_length=64, save_every=2, sample_every=100,
                   generation=Generation(max_new_tokens=8, batch_size=8),
                   lora=LoraSettings(enabled=True, r=4, alpha=8, dropout=0.0, target_modules=list(TARGETS)))
    ctx = _stage_context(upstream, cfg, "ppo_shared", ["sft", "reward"])
    seen = _run_recording(ctx, monkeypatch)
    trained = seen["trained"]
    assert trained.value is None
    assert seen["loads_before_training"] == ["load_causal_lm", "load_scalar_model"]  # policy, then the reward model
    trainable = {n for n, p in trained.named_parameters() if p.requires_grad}
    assert {n.split(".")[-3] if "lora_" in n else n for n in trainable} == {"lora_A", "lora_B", "value_head.weight",
                                                                             "value_head.bias"}
    start = seen["adapters_at_start"]
    assert not start["value_head.weight"].any()  # V = 0 before the first update
    assert trained.value_head.weight.abs().sum() > 0  # ...and it learned
    rows = [json.loads(line) for line in (ctx.dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["policy/ratio_first"] for r in rows if "policy/ratio_first" in r] == [1.0, 1.0, 1.0]
    assert all(math.isfinite(r["value/loss"]) for r in rows if "value/loss" in r)

    assert set(_saved_at_iteration_2(ctx)) == trainable
    # model/ holds the policy's adapters alone (no value head); align's loader merges them into the SFT model
    from align.modeling.models import load_causal_lm

    assert (ctx.dir / "model" / "adapter_config.json").is_file() and not (ctx.dir / "model" / "model.safetensors").exists()
    merged = load_causal_lm(str(ctx.dir / "model"))
    sft_state = AutoModelForCausalLM.from_pretrained(upstream / "sft" / "model").state_dict()
    assert set(merged.state_dict()) == set(sft_state)
    params = dict(trained.policy.named_parameters())
    for key, w in merged.state_dict().items():
        if any(t in key for t in TARGETS):
            stem = "base_model.model." + key.removesuffix(".weight")
            delta = params[stem + ".lora_B.default.weight"] @ params[stem + ".lora_A.default.weight"] * (8 / 4)
            assert torch.allclose(w, sft_state[key] + delta, atol=1e-6), key
        else:
            assert torch.equal(w, sft_state[key]), key

    _resumes_from_iteration_2(ctx, monkeypatch)


def test_every_parameter_lora_trains_over_a_16_bit_base_is_fp32(upstream, monkeypatch):
    """A LoRA base loads in bf16 on a bf16 GPU (weights_dtype); peft upcasts the adapters but not a modules_to_save
    copy (the reward or value model's scalar head), which outside DeepSpeed would take Adam's steps in bf16. Both
    ways a LoRA model is built: PPO's add_adapters, and a TRL trainer's own (the reward stage), seen as its optimiser
    is built. `dtype: bfloat16` and `precision: bfloat16` stand in for a GPU's auto here; without autocast the copy
    keeps its base's dtype (its inputs')."""
    from transformers import Trainer

    import align.stages.reward as reward
    from align.modeling.lora import add_adapters, fp32_trainables, merged_for_saving
    from align.modeling.models import load_scalar_model

    lora = LoraSettings(enabled=True, r=4, alpha=8, target_modules=list(TARGETS))

    def value(autocast):
        model = load_scalar_model(str(upstream / "reward" / "model"), None, "bfloat16")
        return add_adapters(model, lora, "SEQ_CLS", autocast=autocast)

    trained = {n: p.dtype for n, p in value(True).named_parameters() if p.requires_grad}
    assert any("score" in n for n in trained) and set(trained.values()) == {torch.float32}, trained
    assert {p.dtype for p in value(True).parameters() if not p.requires_grad} == {torch.bfloat16}
    assert {p.dtype for n, p in value(False).named_parameters() if "score" in n} == {torch.bfloat16}
    # model/ in one dtype: the fp32 head copy merged beside the bf16 base made a mix
    merged = merged_for_saving(value(True), lora, "bfloat16")
    assert {p.dtype for p in merged.parameters()} == {torch.bfloat16}
    # QLoRA: TRL casts the adapters to bf16 on purpose (kept), the head copy too (upcast: Adam on it in fp32)
    qlora = value(False)
    qlora.base_model.model.is_loaded_in_4bit = True
    for param in qlora.parameters():
        param.data = param.data.to(torch.bfloat16) if param.requires_grad else param.data  # as TRL leaves QLoRA's
    kinds = {("score" if "modules_to_save" in n else "lora"): p.dtype
             for n, p in fp32_trainables(qlora).named_parameters() if p.requires_grad}
    assert kinds == {"score": torch.float32, "lora": torch.bfloat16}, kinds

    seen = {}
    real = Trainer.create_optimizer

    def create_optimizer(self, *args, **kwargs):
        seen.update({n: p.dtype for n, p in self.model.named_parameters() if p.requires_grad})
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "create_optimizer", create_optimizer)
    cfg = RewardStage(type="reward", init="sft", data="pairs", **TRL_COMMON)
    from accelerate.state import AcceleratorState

    try:
        reward.run(_stage_context(upstream, cfg, "reward_lora_bf16", ["sft", "pairs"], dtype="bfloat16",
                                  precision="bfloat16"))
    finally:  # the next stage of this process may compute in fp32: accelerate refuses another precision otherwise
        AcceleratorState._reset_state()
    assert any("score" in n for n in seen) and set(seen.values()) == {torch.float32}, seen


def test_a_merged_model_keeps_the_weights_its_class_keeps_in_fp32(tmp_path):
    """model/ in one dtype (in_one_dtype) cast every fp32 weight to the base's 16-bit dtype, a MoE router's gate too,
    which transformers keeps in fp32 in a bf16 model (DeepSeek-V3's `_keep_in_fp32_modules_strict`): its routing
    then ran on bf16-rounded weights. The trained fp32 head copy is cast; the gate stays fp32."""
    import warnings

    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from align.modeling.lora import add_adapters, merged_for_saving
    from align.modeling.models import load_causal_lm

    torch.manual_seed(0)
    print("seed 0")
    cfg = DeepseekV3Config(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                           num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16,
                           q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                           tie_word_embeddings=False)
    DeepseekV3ForCausalLM(cfg).save_pretrained(tmp_path / "ds")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = load_causal_lm(str(tmp_path / "ds"), "bfloat16")
    gate = "model.layers.1.mlp.gate.weight"
    assert {n for n, p in model.named_parameters() if p.dtype == torch.float32} == {gate}  # as transformers loads it
    lora = LoraSettings(enabled=True, r=4, alpha=8, target_modules=["o_proj"])
    peft_model = add_adapters(model, lora, "CAUSAL_LM", autocast=True)
    peft_model.get_base_model().lm_head.weight.data = peft_model.get_base_model().lm_head.weight.data.float()  # a copy
    merged = merged_for_saving(peft_model, lora, "bfloat16")
    dtypes = {n: p.dtype for n, p in merged.named_parameters()}
    assert dtypes.pop(gate) == torch.float32 and set(dtypes.values()) == {torch.bfloat16}, dtypes


def test_a_qlora_scalar_head_computes_in_fp32_compute_too(upstream):
    """TRL casts every parameter a 4-bit model trains to bf16, whatever the precision; with `precision: float32` (no
    autocast) the fp32 hidden states of QLoRA's base (its non-quantized weights fp32: prepare_model_for_kbit_training)
    then met a bf16 scalar head: "expected m1 and m2 to have the same dtype". The rule the TRL stages read
    (upcasts_trainables) now upcasts a quantized model's head copies in fp32 compute too. 4-bit weights need a GPU:
    an fp32 model marked 4-bit stands in, its trainables cast as TRL leaves them."""
    from align.modeling.lora import add_adapters, fp32_trainables, upcasts_trainables
    from align.modeling.models import load_scalar_model

    torch.manual_seed(0)
    print("seed 0")
    lora = LoraSettings(enabled=True, r=4, alpha=8, target_modules=list(TARGETS))
    model = add_adapters(load_scalar_model(str(upstream / "reward" / "model"), None, "float32"), lora, "SEQ_CLS")
    model.base_model.model.is_loaded_in_4bit = True
    for param in model.parameters():
        param.data = param.data.to(torch.bfloat16) if param.requires_grad else param.data  # as TRL leaves QLoRA's
    assert upcasts_trainables(None, None, quantized=True) and not upcasts_trainables(None, None)
    assert not upcasts_trainables(torch.bfloat16, object(), quantized=True)  # DeepSpeed casts them itself
    ids = torch.randint(0, 100, (2, 6))
    with pytest.raises(RuntimeError, match="dtype"):
        model(input_ids=ids)
    scores = fp32_trainables(model)(input_ids=ids).logits
    assert scores.dtype == torch.float32 and torch.isfinite(scores).all()

"""LoRA on the TRL stages: adapters train, are merged on save, and model/ is a plain checkpoint; QLoRA is refused
where it cannot run, and its merge (into a fresh unquantized load) equals an in-place merge. PPO with LoRA:
tests/test_lora_ppo.py."""

from __future__ import annotations

import pytest
import torch

from conftest import TINY, run_align

SEED = 2024


@pytest.mark.slow
@pytest.mark.parametrize("zero3", [False, True], ids=["one-process", "zero3-2-processes"])
def test_sft_lora_merges_into_a_plain_model(workdir, zero3):
    """The adapters merged into model/, a plain checkpoint whose adapted projections alone changed. Under 2-process
    ZeRO-3 each process holds a partition of every weight: merging in place added B A to empty tensors (a save of
    nothing, or a shape error after all training); the whole state is gathered onto the main process and merged there."""
    dist = ["sft.accelerate=zero3", "sft.num_processes=2", "sft.max_steps=10", "sft.save_steps=10"] if zero3 else []
    proc = run_align("run", "pipelines/default.yaml", "--run-id", "lora", "--only", "sft", "tracking.wandb=disabled",
                     *TINY, "sft.lora.enabled=true", "sft.lora.target_modules=[q_proj,v_proj]", *dist, cwd=workdir)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    model_dir = workdir / "runs" / "default" / "lora" / "sft" / "model"
    assert not (model_dir / "adapter_config.json").exists()

    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from align.config import BuiltinModel
    from align.modeling.models import build_builtin

    merged = load_file(str(model_dir / "model.safetensors"))
    assert not [k for k in merged if "lora" in k]
    size = BuiltinModel(vocab_size=512, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                        max_position_embeddings=96)
    initial = build_builtin(size, AutoTokenizer.from_pretrained(model_dir), seed=17).state_dict()
    changed = {k for k, v in merged.items() if not torch.equal(v, initial[k])}
    assert changed == {k for k in merged if "q_proj" in k or "v_proj" in k}  # only the adapted projections


def test_qlora_is_refused_with_the_field_and_the_fix_where_it_cannot_run(workdir, monkeypatch):
    import importlib.util

    from align.config import LoraSettings

    with pytest.raises(ValueError, match=r"lora.quantize: '4bit' quantizes the frozen base under LoRA adapters; set "
                                         r"lora.enabled: true"):
        LoraSettings(quantize="4bit").check()
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    with pytest.raises(ValueError, match=r"needs the bitsandbytes package.*pip install 'align\[qlora\]'"):
        LoraSettings(enabled=True, quantize="4bit").check()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "bitsandbytes" else real(name, *a))
    import align.config.settings as settings

    monkeypatch.setattr(settings, "has_gpu", lambda: False)  # /dev/nvidia<N> absent
    with pytest.raises(ValueError, match=r"runs only on a CUDA GPU .* set lora.quantize: none"):
        LoraSettings(enabled=True, quantize="4bit").check()
    LoraSettings(enabled=True).check()  # plain LoRA needs neither
    monkeypatch.undo()

    if importlib.util.find_spec("bitsandbytes") is None or not torch.cuda.is_available():
        for stage in ("sft", "reward", "dpo", "ppo"):  # every trained stage reads the same setting
            proc = run_align("validate", "pipelines/default.yaml", f"{stage}.lora.enabled=true",
                             f"{stage}.lora.quantize=4bit", cwd=workdir)
            assert proc.returncode == 2, proc.stdout[-1000:]
            assert f"stages.{stage}: lora.quantize: '4bit'" in proc.stderr and "lora.quantize: none" in proc.stderr


@pytest.mark.parametrize("grown", [False, True], ids=["same-vocab", "template-tokens-added"])
@pytest.mark.parametrize("task", ["CAUSAL_LM", "SEQ_CLS"])
def test_the_qlora_merge_into_a_fresh_load_equals_the_in_place_merge(tmp_path, task, grown):
    """QLoRA's training copy of the base is 4-bit, so model/ merges the adapters into a fresh unquantized load of
    the same checkpoint (merged_for_saving). On CPU the 4-bit flag is set by hand on a plain model: the merge that
    reloads must give the model the in-place merge gives, and must differ from the base (the adapters moved).
    `grown`: a chat template's tokens grew the embeddings and set EOS before training (fit_model_to_tokenizer); the
    fresh load had the old vocabulary and EOS, so model/ lacked rows its tokenizer produces."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from align.config import LoraSettings
    from align.modeling.models import load_causal_lm, load_scalar_model
    from align.modeling.lora import add_adapters, merged_for_saving

    print(f"seed {SEED}")
    torch.manual_seed(SEED)
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                      pad_token_id=0)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "base")
    load = (lambda: load_scalar_model(str(tmp_path / "base"), 0)) if task == "SEQ_CLS" else \
        (lambda: load_causal_lm(str(tmp_path / "base")))
    lora = LoraSettings(enabled=True, r=2, alpha=4, target_modules=["q_proj", "v_proj"])
    models = []
    for flagged in (True, False):
        torch.manual_seed(SEED)
        base = load()
        if grown:
            base.resize_token_embeddings(68, mean_resizing=False)
            base.config.eos_token_id = 66
            if getattr(base, "generation_config", None) is not None:  # as fit_model_to_tokenizer sets both
                base.generation_config.eos_token_id = 66
        base.is_loaded_in_4bit = flagged  # only what merged_for_saving reads
        peft = add_adapters(base, lora, task)
        torch.manual_seed(SEED + 1)
        with torch.no_grad():
            for _name, p in peft.named_parameters():
                if p.requires_grad:
                    p.add_(torch.randn_like(p))  # "trained" adapters (B starts at zero) and head copy
        models.append(merged_for_saving(peft, lora, "float32"))
    assert models[0].config.eos_token_id == models[1].config.eos_token_id == (66 if grown else cfg.eos_token_id)
    if getattr(models[0], "generation_config", None) is not None:  # what outside generate() and vLLM stop on
        assert models[0].generation_config.eos_token_id == models[1].generation_config.eos_token_id
    reloaded, in_place = (m.state_dict() for m in models)
    assert reloaded.keys() == in_place.keys() and not [k for k in reloaded if "lora" in k]
    assert all(reloaded[k].shape == in_place[k].shape for k in reloaded)
    assert all(torch.allclose(reloaded[k], in_place[k], atol=1e-6) for k in reloaded)
    untouched = load().state_dict()
    assert any(not torch.allclose(reloaded[k], untouched[k]) for k in reloaded if "q_proj" in k)
    assert reloaded["model.embed_tokens.weight"].size(0) == (68 if grown else 64)


def test_an_adapter_alone_is_published_only_when_it_gives_the_trained_model_back():
    """A LoRA stage publishes its adapter alone unless the base it would be merged into is not the model it trained:
    none to load (a builtin model built in the stage), or embeddings the stage grew (a chat template's new tokens,
    trained rows that no adapter holds): then the merged model."""
    from types import SimpleNamespace

    from transformers import LlamaConfig, LlamaForCausalLM

    from align.config import LoraSettings
    from align.modeling.lora import add_adapters
    from align.runtime.context import StageContext

    torch.manual_seed(SEED)
    print(f"seed {SEED}")
    base = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2))
    peft = add_adapters(base, LoraSettings(enabled=True, r=2, alpha=4, target_modules=["q_proj"]), "CAUSAL_LM")
    ctx = SimpleNamespace(trained_from="/models/base", trained_vocab=64)
    assert StageContext.adapter_alone_suffices(ctx, peft)
    assert not StageContext.adapter_alone_suffices(SimpleNamespace(trained_from=None, trained_vocab=64), peft)
    base.resize_token_embeddings(66)  # the template's two new tokens
    assert not StageContext.adapter_alone_suffices(ctx, peft)


def test_a_policy_adapter_loads_merged_as_a_causal_lm_and_as_a_scalar_model(tmp_path):
    """A LoRA policy published alone (its adapter beside the name of its base) is what the next stages start from:
    a causal LM (DPO, PPO) or, for a reward model, the same transformer under a fresh scalar head."""
    import json

    from transformers import LlamaConfig, LlamaForCausalLM

    from align.config import LoraSettings
    from align.modeling.models import ADAPTER_BASE, load_causal_lm, load_scalar_model
    from align.modeling.lora import add_adapters

    torch.manual_seed(SEED)
    print(f"seed {SEED}")
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      pad_token_id=0)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "base")
    peft = add_adapters(LlamaForCausalLM.from_pretrained(tmp_path / "base"),
                        LoraSettings(enabled=True, r=2, alpha=4, target_modules=["q_proj"]), "CAUSAL_LM")
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_B" in n:
                p.normal_()  # a trained adapter: B moved from zero
    peft.save_pretrained(tmp_path / "sft")
    (tmp_path / "sft" / ADAPTER_BASE).write_text(json.dumps({"base_model": str(tmp_path / "base"), "task": "CAUSAL_LM",
                                                             "config": {"pad_token_id": 0}, "generation": {}}))
    expected = peft.merge_and_unload().state_dict()
    lm = load_causal_lm(str(tmp_path / "sft"))
    assert set(lm.state_dict()) == set(expected)
    assert all(torch.equal(v, expected[k]) for k, v in lm.state_dict().items())
    base = LlamaForCausalLM.from_pretrained(tmp_path / "base").state_dict()
    assert not torch.equal(expected["model.layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.weight"])
    scalar = load_scalar_model(str(tmp_path / "sft"), 0)
    state = scalar.state_dict()
    assert set(state) == {k for k in expected if not k.startswith("lm_head")} | {"score.weight"}
    assert all(torch.equal(state[k], expected[k]) for k in state if k != "score.weight")
    assert scalar.config.pad_token_id == 0 and scalar.score.weight.shape == (1, 16)


@pytest.mark.parametrize("loader", ["causal", "scalar"])
def test_a_published_adapter_is_refused_as_qloras_4bit_base_before_any_load(tmp_path, loader):
    """A published adapter directory named as a 4-bit base: refused with the fix (merging needs full weights),
    by both loaders, before its base (a hub id that does not exist here) is looked for."""
    import json

    from align.core.errors import ModelError
    from align.modeling.models import ADAPTER_BASE, load_causal_lm, load_scalar_model

    (tmp_path / ADAPTER_BASE).write_text(json.dumps({"base_model": "no-such-org/no-such-model", "task": "CAUSAL_LM"}))
    load = (lambda: load_causal_lm(str(tmp_path), quantize="4bit")) if loader == "causal" else \
        (lambda: load_scalar_model(str(tmp_path), 0, quantize="4bit"))
    with pytest.raises(ModelError, match=r"cannot be the 4-bit base of QLoRA .*lora.merge: true"):
        load()


@pytest.mark.slow
@pytest.mark.parametrize("padded", [False, True], ids=["rows-grown", "rows-of-a-padded-vocabulary"])
def test_sft_lora_trains_the_rows_of_the_tokens_its_chat_template_adds(tmp_path, padded):
    """A pretrained model without the chat template's tokens (here a tiny Llama, untied head, and `chatml`): the
    template adds <|im_start|> and <|im_end|>, the end-of-turn token every response must end with. LoRA froze the
    embeddings and the head, so their rows stayed as resize_token_embeddings drew them, whatever SFT trained: the
    same after 1 step as after 4. peft trains those embedding rows now (its trainable tokens) and a copy of the
    whole head (TRL's fused head reads the head's weight), as TRL does, and model/ holds them merged; the other
    embedding rows are untouched. `padded`: the model has 8 rows past its tokenizer (as Qwen2.5's 152,064 rows for
    151,665 tokens): the new tokens take never-trained rows without growing anything, and were missed at first."""
    import json
    import subprocess
    import sys

    from transformers import AutoTokenizer

    import families
    from align.modeling.models import load_causal_lm
    from conftest import REPO

    print(f"seed {families.SEED}")
    base, tok_dir = families.build("llama", tmp_path)
    if padded:
        import torch as torch_
        from transformers import AutoModelForCausalLM

        config = families.config("llama", AutoTokenizer.from_pretrained(tok_dir))
        config.vocab_size += 8
        torch_.manual_seed(families.SEED)
        AutoModelForCausalLM.from_config(config).save_pretrained(base)
    card = REPO / "data_cards" / "hh_rlhf_harmless_chat_sft.yaml"
    (tmp_path / "p.yaml").write_text(f"""\
name: added
base_model: {base}
tokenizer: {tok_dir}
chat_template: chatml
seed: {families.SEED}
tracking: {{wandb: disabled}}
stages:
  sft: {{data: {card}, per_device_batch_size: 4, max_length: 128, max_train_examples: 32, max_truncated_fraction: 1.0,
        eval_split: null, logging_steps: 1, save_steps: 10, learning_rate: 3.0e-2, warmup_ratio: 0.0,
        lora: {{enabled: true, r: 4, alpha: 8, target_modules: [q_proj, v_proj]}}}}
""")
    rows = {}
    for steps in (1, 4):
        proc = subprocess.run([sys.executable, "-m", "align.cli", "run", str(tmp_path / "p.yaml"), "--run-id",
                               f"s{steps}", f"sft.max_steps={steps}"], cwd=tmp_path, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        stage = tmp_path / "runs" / "added" / f"s{steps}" / "sft"
        tok = AutoTokenizer.from_pretrained(stage / "model")
        new = [tok.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>")]
        manifest = json.loads((stage / "manifest.json").read_text())
        assert manifest["lora_new_tokens"] == {"rows": [min(new), max(new)], "embeddings": "embed_tokens",
                                               "head_trained_whole": "lm_head"}
        rows[steps] = load_causal_lm(str(stage / "model")).state_dict()  # merged, or (padded) the adapter on its base
    for key in ("model.embed_tokens.weight", "lm_head.weight"):
        moved = (rows[4][key][new] - rows[1][key][new]).abs().amax(dim=1)
        assert (moved > 1e-4).all(), (key, moved)  # trained: frozen rows are equal however long SFT runs
    embed = "model.embed_tokens.weight"
    assert torch.equal(rows[4][embed][:min(new)], rows[1][embed][:min(new)])  # the base's input rows stay frozen


@pytest.mark.parametrize("family, extra, refused", [
    ("gemma3", [], "whose output head is tied to its embeddings: LoRA cannot train their rows there"),
    ("llama", ["sft.accelerate=zero3", "sft.num_processes=2"], "which it cannot do on ZeRO-3's partitions; set "
                                                               "stages.sft.accelerate: zero2"),
    ("llama", [], None)])
def test_validate_refuses_lora_where_it_cannot_train_the_rows_a_template_adds(tmp_path, family, extra, refused):
    """Where peft cannot train the rows of the tokens a chat template adds (a head tied to the embeddings, ZeRO-3's
    partitions), `align validate` says so; the stage found it only once the model had loaded."""
    import subprocess
    import sys

    import families
    from conftest import REPO

    base, tok_dir = families.build(family, tmp_path)
    card = REPO / "data_cards" / "hh_rlhf_harmless_chat_sft.yaml"
    (tmp_path / "p.yaml").write_text(f"""\
name: added
base_model: {base}
tokenizer: {tok_dir if tok_dir != base else "null"}
chat_template: chatml
stages:
  sft: {{data: {card}, max_length: 128, max_train_examples: 32, max_truncated_fraction: 1.0,
        lora: {{enabled: true, r: 4, alpha: 8, target_modules: [q_proj, v_proj]}}}}
""")
    proc = subprocess.run([sys.executable, "-m", "align.cli", "validate", str(tmp_path / "p.yaml"), *extra],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    if refused is None:
        assert proc.returncode == 0, proc.stdout[-1500:] + proc.stderr[-1500:]
    else:
        assert proc.returncode == 2 and "stages.sft: the chat template adds 2 tokens to the model" in proc.stderr, \
            proc.stdout[-1500:] + proc.stderr[-1500:]
        assert refused in proc.stderr, proc.stderr


def test_a_qlora_stage_over_a_stage_that_publishes_adapters_alone_is_refused_at_validate():
    """QLoRA loads its input 4-bit; an upstream stage that publishes adapters alone cannot be that base. The stage
    said so when it loaded, after every stage before it had trained (a probe of LoRA, 2026-11-30)."""
    from types import SimpleNamespace

    from align.config import LoraSettings
    from align.orchestrator.memory import qlora_base_problems

    def stage(lora, **inputs):
        return SimpleNamespace(lora=lora, references=lambda role: inputs.get(role, []))

    alone, merged = LoraSettings(enabled=True, merge=False), LoraSettings(enabled=True, merge=True)
    qlora = LoraSettings(enabled=True, quantize="4bit", merge=True)
    stages = {"sft": stage(alone), "reward": stage(merged), "dpo": stage(qlora, policy=["sft"]),
              "ppo": stage(qlora, policy=["dpo"], reward_model=["reward"]), "plain": stage(alone, policy=["sft"]),
              "rm2": stage(alone)}
    assert qlora_base_problems(stages) == [
        "stages.dpo: lora.quantize: 4bit loads stage 'sft''s model as its 4-bit base, and 'sft' publishes LoRA "
        "adapters alone (merging needs full weights); set stages.sft.lora.merge: true"]
    ppo = stage(qlora, policy=["dpo"], judge=["rm2"])  # PPO's value model starts from its reward stage, 4-bit too
    assert qlora_base_problems({**stages, "ppo": ppo}) == qlora_base_problems(stages)  # value_init: policy
    ppo.value_init = "reward"
    assert qlora_base_problems({**stages, "ppo": ppo})[-1].startswith("stages.ppo: lora.quantize: 4bit loads stage "
                                                                      "'rm2''s model")

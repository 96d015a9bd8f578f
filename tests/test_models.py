"""Real tokenizers and model-loading guards; PPO misconfigurations that must fail before any rollout."""

import json
import logging
from pathlib import Path

import pytest
import yaml

from align.config import parse_pipeline
from align.modeling.models import check_remote_code, default_chat_template, load_tokenizer, train_tokenizer
from align.core.errors import ModelError
from align.core.errors import PipelineError
from align.orchestrator.validate import validate

REPO = Path(__file__).resolve().parent.parent
GPT2 = REPO / "tokenizers" / "gpt2"


def test_gpt2_tokenizer_gets_pad_and_the_plan_gives_it_the_default_chat_template(caplog, tmp_path):
    from align import templates

    with caplog.at_level(logging.WARNING):
        tok = load_tokenizer(str(GPT2))
        planned = templates.resolve(None, tmp_path / "p.yaml", str(GPT2))  # chat_template: null, no template
    assert len(tok) == 50257
    assert tok.pad_token == tok.eos_token == "<|endoftext|>"
    assert planned.source == "shipped:default" and planned.text == default_chat_template()
    assert "no pad token" in caplog.text and "ships no chat template" in caplog.text
    templates.install(tok, planned)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "user: hi<|endoftext|>\nassistant:"


def test_a_tokenizer_naming_no_pad_pads_with_its_vocabularys_pad_token_so_a_reward_reads_at_the_final_eos(tmp_path):
    """Llama 3.1 (Instruct: EOS <|eot_id|>) names no pad token but holds <|finetune_right_pad_id|> for padding.
    With EOS as pad, a reward model's rule (the last token that is not the pad) read an ended reply's score on its
    last word, exactly where a reply cut at max_new_tokens is read: the two could not differ. Now the reply that
    ended is read at its EOS. (GPT-2's vocabulary holds no pad: EOS stays, test above.)"""
    import torch
    from transformers import AutoTokenizer

    from align.modeling.losses import last_token_index
    from shapealike import LLAMA3_SPECIALS, _bpe

    _bpe(LLAMA3_SPECIALS, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>").save_pretrained(tmp_path)
    assert AutoTokenizer.from_pretrained(tmp_path).pad_token is None
    tok = load_tokenizer(str(tmp_path))
    assert tok.pad_token == "<|finetune_right_pad_id|>" and tok.pad_token_id != tok.eos_token_id
    words = tok("a good film", add_special_tokens=False)["input_ids"]
    ended, cut = words + [tok.eos_token_id], words + tok("it was", add_special_tokens=False)["input_ids"]
    width = max(len(ended), len(cut)) + 2
    ids = torch.tensor([r + [tok.pad_token_id] * (width - len(r)) for r in (ended, cut)])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in (ended, cut)])
    assert last_token_index(ids, mask, tok.pad_token_id).tolist() == [len(ended) - 1, len(cut) - 1]
    assert ids[0, len(ended) - 1] == tok.eos_token_id


def test_trained_tokenizer_is_deterministic():
    texts = ["a good film", "a bad film", "the plot was thin"] * 20
    a, b = train_tokenizer(texts, 300, 64), train_tokenizer(texts, 300, 64)
    assert a.get_vocab() == b.get_vocab()
    assert a.pad_token_id != a.eos_token_id


def test_remote_code_refused_unless_opted_in(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"auto_map": {"AutoModel": "modeling_x.X"}}))
    with pytest.raises(ModelError, match="trust_remote_code: true"):
        check_remote_code(str(tmp_path), trust_remote_code=False)
    check_remote_code(str(tmp_path), trust_remote_code=True)  # the user opted in


class _Ctx:
    name = "ppo"
    is_main = True

    def __init__(self):
        self.extra_manifest = {}


def test_ppo_refuses_a_mismatched_reward_tokenizer_and_drops_long_prompts_up_to_a_fraction():
    from align.config.ppo import PPOStage
    from align.data.lengths import LengthError
    from align.stages.ppo.rollouts import usable_prompts

    gpt2 = load_tokenizer(str(GPT2))
    small = train_tokenizer(["a good film", "a bad film"] * 10, 300, 64)
    cfg = PPOStage(type="ppo", max_prompt_length=4, max_truncated_fraction=0.3)
    with pytest.raises(ValueError, match="reward model's tokenizer .* differs"):
        usable_prompts(_Ctx(), cfg, gpt2, {"reward": small}, ["a film"])
    long = "this prompt is clearly longer than four tokens"
    ctx = _Ctx()
    kept = usable_prompts(ctx, cfg, gpt2, {"reward": gpt2}, ["short", "a film", "one two", long])
    assert kept == ["short", "a film", "one two"]  # the long one dropped, not the run refused
    check = ctx.extra_manifest["length_check"]
    assert (check["examples"], check["dropped"], check["longest"]) == (4, 1, len(gpt2(long)["input_ids"]))
    with pytest.raises(LengthError, match=r"stages\.ppo\.max_prompt_length=4: 1 of 2 examples .* Raise max_prompt_length"):
        usable_prompts(_Ctx(), cfg, gpt2, {"reward": gpt2}, ["short", long])  # 50% > 30%


def _default_with(**ppo):
    raw = yaml.safe_load((REPO / "pipelines" / "default.yaml").read_text())
    raw["stages"]["ppo"].update(ppo)
    return parse_pipeline(raw, str(REPO / "pipelines" / "default.yaml"))


def test_ppo_batch_not_divisible_is_a_validation_error():
    cfg = _default_with(rollout_batch_size=60, mini_batch_size=16)
    with pytest.raises(PipelineError, match=r"rollout_batch_size \(60\) must be divisible"):
        validate(cfg, REPO / "pipelines" / "default.yaml", verbose=False)


def test_ppo_without_reward_stage_is_a_validation_error():
    raw = yaml.safe_load((REPO / "pipelines" / "default.yaml").read_text())
    del raw["stages"]["reward"]
    raw["stages"]["evaluate"]["reward"] = None
    with pytest.raises(PipelineError, match=r"stages.ppo: reward: 'reward' is not a judge: use a reward stage"):
        validate(parse_pipeline(raw, "default.yaml"), REPO / "pipelines" / "default.yaml", verbose=False)


def test_evaluation_prompts_overlapping_training_prompts_are_an_error():
    raw = yaml.safe_load((REPO / "pipelines" / "default.yaml").read_text())
    raw["stages"]["evaluate"]["split"] = "train"
    with pytest.raises(PipelineError, match="evaluation prompts .* also occur in the training prompts"):
        validate(parse_pipeline(raw, "default.yaml"), REPO / "pipelines" / "default.yaml", verbose=False)


def test_evaluation_prompts_in_another_form_of_the_training_prompts_are_an_error():
    """A text card and a chat card over the same HH transcripts key their prompts differently (the text, the
    messages), so they split differently and the overlap check compared keys that never meet: SFT on the text card
    and evaluate on the chat card's test split passed validate with every one of its 10 prompts trained on. The
    check now compares prompts by their turns, whatever their form (the splits are unchanged)."""
    raw = {"name": "hh_mixed", "base_model": "builtin:tiny-llama", "tokenizer": "../tokenizers/gpt2",
           "chat_template": "chatml", "seed": 17,
           "builtin": {"hidden_size": 32, "intermediate_size": 64, "max_position_embeddings": 192, "num_heads": 2,
                       "num_layers": 2},
           "stages": {"sft": {"data": "../data_cards/hh_rlhf_harmless_sft.yaml", "max_length": 192, "max_steps": 2},
                      "evaluate": {"policies": ["sft"], "baseline": "sft", "reference": "sft", "judges": [],
                                   "reward": None, "preferences": None, "max_prompts": 8, "split": "test",
                                   "prompts": "../data_cards/hh_rlhf_harmless_chat_pairs.yaml"}}}
    with pytest.raises(PipelineError, match="evaluation prompts .* also occur in the training prompts of stage 'sft'"):
        validate(parse_pipeline(raw, "hh_mixed.yaml"), REPO / "pipelines" / "hh_mixed.yaml", verbose=False)
    raw["stages"]["evaluate"]["prompts"] = "../data_cards/movie_review_snippets.yaml"  # prompts no stage trains on
    validate(parse_pipeline(raw, "hh_mixed.yaml"), REPO / "pipelines" / "hh_mixed.yaml", verbose=False)


def test_in_offline_mode_validation_reads_a_hub_cards_cached_copy_and_checks_the_overlap(tmp_path, monkeypatch):
    """A review (2026-11-30): with the hub out of reach, validation treated a hub card as unreadable, and so never
    compared its evaluation prompts with the training prompts, although in offline mode (HF_HUB_OFFLINE=1, as on
    clusters) the stages read datasets' cached copy. Offline, validation now reads that copy too (here: a mirror
    standing in for datasets' cache) and refuses the evaluation on the training split of UltraFeedback."""
    import os

    from align.orchestrator import validate as validation
    from shapealike import hub_mirror

    mirror, real = str(hub_mirror(tmp_path / "hub")), validation.load_split

    def cached_copy(card, split):  # what datasets gives offline from its cache
        os.environ["ALIGN_HUB_MIRROR"] = mirror
        try:
            return real(card, split)
        finally:
            del os.environ["ALIGN_HUB_MIRROR"]

    monkeypatch.delenv("ALIGN_HUB_MIRROR", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(validation, "load_split", cached_copy)
    source = REPO / "pipelines" / "llama3_8b_ultrafeedback.yaml"
    raw = yaml.safe_load(source.read_text())
    raw["stages"]["evaluate"]["split"] = "train"
    with pytest.raises(PipelineError, match="evaluation prompts .* also occur in the training prompts of stage"):
        validate(parse_pipeline(raw, source.name), source, verbose=False)
    raw["stages"]["evaluate"]["split"] = "test"
    validate(parse_pipeline(raw, source.name), source, verbose=False)


@pytest.mark.parametrize("stage", ["dpo", "reward"])
def test_evaluation_prompts_a_preference_stage_trained_on_are_an_error(stage):
    raw = yaml.safe_load((REPO / "pipelines" / "default.yaml").read_text())
    pairs = "../data_cards/hh_rlhf_harmless_pairs.yaml"
    raw["stages"][stage]["data"] = pairs  # learns from the card's train split
    raw["stages"]["evaluate"].update(prompts=pairs, split="train")
    with pytest.raises(PipelineError, match=f"also occur in the training prompts of stage '{stage}'"):
        validate(parse_pipeline(raw, "default.yaml"), REPO / "pipelines" / "default.yaml", verbose=False)
    raw["stages"]["evaluate"]["split"] = "test"
    validate(parse_pipeline(raw, "default.yaml"), REPO / "pipelines" / "default.yaml", verbose=False)


def test_a_fresh_scalar_head_depends_on_the_stage_seed_only(tmp_path):
    """StageContext.load_scalar on a language-model checkpoint (a reward or value model's start): the new score
    head is the same whatever the global RNG did before, differs for another seed, and the global stream is left
    as it was (the reward stage was not reproducible before: its head was drawn from an unseeded stream)."""
    import gc
    from types import MethodType, SimpleNamespace

    import torch

    from align.config import BuiltinModel
    from align.modeling.models import build_builtin
    from align.runtime.context import StageContext

    tok = train_tokenizer(["a small corpus for a tiny tokenizer, nothing more"] * 4, 300, 64)
    size = BuiltinModel(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, max_position_embeddings=32)
    build_builtin(size, tok, seed=0).save_pretrained(tmp_path / "lm")
    tok.save_pretrained(tmp_path / "lm")

    def head(seed: int, draws: int) -> torch.Tensor:
        ctx = SimpleNamespace(seed=seed, pipeline=SimpleNamespace(dtype="float32", trust_remote_code=False),
                              compute=SimpleNamespace(model_kwargs=lambda: {}, device="cpu", distributed_zero3=False),
                              weights_dtype=lambda frozen, lora: "float32", extra_manifest={})
        ctx._loaded = MethodType(StageContext._loaded, ctx)
        torch.manual_seed(1234)
        torch.rand(draws)  # the stage's global stream in another state each time
        before = torch.random.get_rng_state()
        gc.disable()  # as a stage process starts (align/runtime/process.py main)
        try:
            model = StageContext.load_scalar(ctx, str(tmp_path / "lm"), tok.pad_token_id)
            assert gc.isenabled()  # the first model load ends the start-up window: training collects garbage
        finally:
            gc.enable()
        assert torch.equal(torch.random.get_rng_state(), before)  # not consumed, not reseeded
        return model.score.weight.detach().clone()

    seed = 17
    print(f"seed {seed}")
    assert torch.equal(head(seed, 0), head(seed, 5))
    assert not torch.equal(head(seed, 0), head(seed + 1, 0))

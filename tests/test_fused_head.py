"""The fused LM head (align/modeling/fused_head.py): its equations against hand-computed values, PPO's log-probs,
entropies, values and gradients equal to the logits path for every model family (padded and padding-free, several
chunks), no (tokens x vocabulary) tensor kept for the backward pass, and the families and heads it must refuse."""

from __future__ import annotations

import math

import pytest
import torch

from align.modeling import fused_head
from align.modeling.fused_head import fused_head_blocker, head_logprobs, set_fused_head, use_fused_head

from families import FAMILIES, RESPONSES, TEXTS, _rollout, build, ppo_loss_and_grads

SEED = 29


@pytest.fixture(autouse=True)
def fused_off_afterwards():
    yield
    set_fused_head("off")  # the process-wide setting's default: other tests in this worker compute logits


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("fused")
    return {family: build(family, root / family) for family in FAMILIES}


def test_head_logprobs_and_entropy_equal_hand_computed_values():
    """h = (1, 0) and (0, 2); W rows (1, 0), (0, 1), (1, 1); T = 2: z = (0.5, 0, 0.5) and (0, 1, 1).
    log p(y) = z_y - log sum exp z; H = log sum exp z - sum softmax(z) z."""
    hidden = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    weight = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    lse1, lse2 = math.log(2 * math.exp(0.5) + 1), math.log(1 + 2 * math.e)
    want_lp = [0.5 - lse1, 1.0 - lse2]  # targets 0 and 2
    want_h = [lse1 - (2 * 0.5 * math.exp(0.5)) / (2 * math.exp(0.5) + 1), lse2 - (2 * math.e) / (1 + 2 * math.e)]
    for chunk in (1, 2):
        lp, ent = head_logprobs(hidden, weight, None, torch.tensor([0, 2]), temperature=2.0, with_entropy=True,
                                chunk=chunk)
        assert lp.tolist() == pytest.approx(want_lp, abs=1e-6)
        assert ent.tolist() == pytest.approx(want_h, abs=1e-6)


def _ppo_forward(model, r, fused: str):
    """PPO's training forward and a loss over every output (families.ppo_loss_and_grads) under fused_head `fused`."""
    set_fused_head(fused)
    return ppo_loss_and_grads(model, r)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("padded", [False, True], ids=["padding-free", "padded"])
def test_fused_log_probs_entropies_values_and_gradients_equal_the_logits_path(models, family, padded, monkeypatch):
    """fp32 on CPU, chunks of 5 tokens (several per batch): PPO's forward with the fused head gives the logits path's
    loss, log-probs, entropies and values within 1e-5 relative, and the same gradients, for a separate value model
    and for the shared value head (which reads the head's input the fused head captures)."""
    from align.modeling.models import load_causal_lm, load_scalar_model, load_tokenizer
    from align.modeling.packing import padded_forwards
    from align.stages.ppo.models import PolicyAndValue

    torch.manual_seed(SEED)
    print("seed", SEED)
    monkeypatch.setattr(fused_head, "CHUNK_TOKENS", 5)
    base, tok_dir = models[family]
    tok = load_tokenizer(str(tok_dir))
    policy = load_causal_lm(str(base))
    r = _rollout(tok, TEXTS, RESPONSES)
    assert r.response_mask.sum() > 3 * 5
    head = torch.nn.Linear(policy.config.get_text_config().hidden_size, 1)
    for model in (PolicyAndValue(policy, load_scalar_model(str(base), tok.pad_token_id)),
                  PolicyAndValue(policy, value_head=head)):
        with padded_forwards() if padded else torch.enable_grad():
            fused, fused_grads = _ppo_forward(model, r, "on")
            plain, plain_grads = _ppo_forward(model, r, "off")
        for a, b, what in zip(fused, plain, ("loss", "log-probs", "entropies", "values")):
            assert torch.allclose(a, b, rtol=1e-5, atol=2e-6), (family, what, (a - b).abs().max())
        assert fused_grads.keys() == plain_grads.keys() and len(fused_grads) > 10
        for name, g in fused_grads.items():
            ref = plain_grads[name]
            assert (g - ref).norm() <= 1e-5 * ref.norm() + 1e-8, (family, name, (g - ref).norm(), ref.norm())


def test_lora_policy_and_its_adapter_free_reference_give_the_logits_paths_results(models, monkeypatch):
    """PPO with LoRA: the policy is a peft model (adapters on q and v, trained), the reference its base with the
    adapters off (FrozenView): the fused head gives both models' log-probs and the adapters' gradients as the logits
    path does."""
    from peft import LoraConfig, get_peft_model

    from align.modeling.generation import response_logprobs
    from align.modeling.models import load_causal_lm, load_tokenizer
    from align.stages.ppo.models import PolicyAndValue
    from align.stages.ppo.rewards import FrozenView

    torch.manual_seed(SEED)
    print("seed", SEED)
    monkeypatch.setattr(fused_head, "CHUNK_TOKENS", 5)
    base, tok_dir = models["llama"]
    tok = load_tokenizer(str(tok_dir))
    policy = get_peft_model(load_causal_lm(str(base)), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    for name, p in policy.named_parameters():
        if "lora_B" in name:  # peft starts B at 0: give the adapters an effect
            torch.nn.init.normal_(p, std=0.5)
    r = _rollout(tok, TEXTS, RESPONSES)
    model = PolicyAndValue(policy, value_head=torch.nn.Linear(32, 1))
    fused, fused_grads = _ppo_forward(model, r, "on")
    plain, plain_grads = _ppo_forward(model, r, "off")
    for a, b, what in zip(fused, plain, ("loss", "log-probs", "entropies", "values")):
        assert torch.allclose(a, b, rtol=1e-5, atol=2e-6), (what, (a - b).abs().max())
    assert any("lora_A" in n for n in fused_grads) and fused_grads.keys() == plain_grads.keys()
    for name, g in fused_grads.items():
        assert (g - plain_grads[name]).norm() <= 1e-5 * plain_grads[name].norm() + 1e-8, name
    reference, real = FrozenView(policy), r.response_mask.bool()
    refs = {}
    for mode in ("on", "off"):
        set_fused_head(mode)
        with torch.no_grad():
            refs[mode] = response_logprobs(reference, r, 0.7)[real]
    assert torch.allclose(refs["on"], refs["off"], rtol=1e-5, atol=2e-6)
    assert (refs["on"] - fused[1][real]).abs().max() > 1e-3  # the adapters were off: another model's log-probs


def test_no_tokens_by_vocabulary_tensor_is_kept_for_the_backward_pass(models, monkeypatch):
    """The memory claim, counted: with the fused head (chunks of 5 tokens, recomputed) autograd saves no activation
    over the vocabulary for the backward of PPO's log-probs; without it, at least the whole batch's logits (tokens x
    vocabulary)."""
    from align.modeling.generation import response_scores
    from align.modeling.models import load_causal_lm, load_tokenizer

    torch.manual_seed(SEED)
    base, tok_dir = models["llama"]
    tok = load_tokenizer(str(tok_dir))
    policy = load_causal_lm(str(base))
    r = _rollout(tok, TEXTS, RESPONSES)
    monkeypatch.setattr(fused_head, "CHUNK_TOKENS", 5)
    tokens, vocab = int(r.response_mask.sum()), policy.config.vocab_size
    weights = {p.untyped_storage().data_ptr() for p in policy.parameters()}
    largest = {}

    def saved(t):
        if t.untyped_storage().data_ptr() not in weights and t.dim() and t.size(-1) == vocab:
            sizes.append(t.numel())
        return t

    for mode in ("on", "off"):
        set_fused_head(mode)
        sizes: list[int] = []
        with torch.autograd.graph.saved_tensors_hooks(saved, lambda t: t):
            lp, ent, _ = response_scores(policy, r.input_ids, r.attention_mask, r.query_ids.size(1), 1.0, True)
        largest[mode] = max(sizes, default=0)
    print("tokens", tokens, "vocab", vocab, "largest activation over the vocabulary saved", largest)
    assert largest["off"] >= tokens * vocab
    assert largest["on"] == 0


def test_a_family_that_changes_logits_after_its_head_keeps_the_logits_path(models, tmp_path):
    """Gemma with logit soft-capping: its head's input alone gives other log-probs (so fusing would be wrong); auto
    keeps the model's own logits, and `on` is refused with the setting named."""
    from transformers import AutoModelForCausalLM

    from align.modeling.generation import response_scores
    from align.modeling.models import load_tokenizer

    torch.manual_seed(SEED)
    base, tok_dir = models["gemma3"]
    tok = load_tokenizer(str(tok_dir))
    policy = AutoModelForCausalLM.from_pretrained(str(base), final_logit_softcapping=0.05)
    r = _rollout(tok, TEXTS, RESPONSES)
    q, real = r.query_ids.size(1), r.response_mask.bool()
    head = policy.get_output_embeddings()
    assert "final_logit_softcapping: 0.05" in fused_head_blocker(policy, head)
    set_fused_head("off")
    own = response_scores(policy, r.input_ids, r.attention_mask, q)[0][real]
    set_fused_head("auto")
    assert not use_fused_head(policy, head)
    assert torch.equal(response_scores(policy, r.input_ids, r.attention_mask, q)[0][real], own)
    set_fused_head("on")
    with pytest.raises(ValueError, match="fused_head: on, but the model's config sets final_logit_softcapping"):
        response_scores(policy, r.input_ids, r.attention_mask, q)
    set_fused_head("off")  # what fusing would have computed: far from the capped model's own
    from align.modeling.generation import response_logits
    _, hidden = response_logits(policy, r.input_ids, r.attention_mask, q, head_inputs=True)
    fused = head_logprobs(hidden[real], head.weight, head.bias, r.input_ids[:, q:][real])[0]
    assert (fused - own).abs().max() > 1e-3  # the equality tests hold the fused head to 1e-5


def test_auto_fuses_on_a_gpu_where_exact_and_on_fuses_on_a_cpu(models, monkeypatch):
    from align.modeling.models import load_causal_lm

    policy = load_causal_lm(str(models["llama"][0]))
    head = policy.get_output_embeddings()
    set_fused_head("auto")
    assert not use_fused_head(policy, head)  # a CPU: the logits path (faster there)
    set_fused_head("on")
    assert use_fused_head(policy, head)
    set_fused_head("auto")
    monkeypatch.setattr(fused_head, "on_gpu", lambda weight: True)
    assert use_fused_head(policy, head)
    policy.config.final_logit_softcapping = 30.0
    assert not use_fused_head(policy, head)
    set_fused_head("off")
    monkeypatch.setattr(fused_head, "on_gpu", lambda weight: True)
    assert not use_fused_head(policy, head)


def test_a_lora_adapted_head_is_refused_by_name():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    model = get_peft_model(LlamaForCausalLM(cfg), LoraConfig(r=2, target_modules=["lm_head", "q_proj"]))
    head = model.get_output_embeddings()
    assert "not a plain Linear" in fused_head_blocker(model.get_base_model(), head)
    set_fused_head("auto")
    assert not use_fused_head(model.get_base_model(), head)
    with pytest.raises(ValueError, match="fused_head: 'sometimes'"):
        set_fused_head("sometimes")


def test_the_stages_probe_keeps_the_logits_path_for_a_family_the_blocker_list_misses(models, monkeypatch):
    """A family that changes its logits after the head in a way no config field names (here: a forward that halves
    them): the stage's probe finds the fused head's log-probs off by far more than rounding, so auto keeps the logits
    path for that model (the other keeps the fused head), and `on` is refused naming the gap; an exact family probes at
    rounding level. Nested configs are read too (a multimodal wrapper's text config)."""
    from types import SimpleNamespace

    from transformers.modeling_outputs import CausalLMOutputWithPast

    from align.modeling.generation import fused_head_gap
    from align.modeling.models import load_causal_lm
    from align.runtime.context import StageError
    from align.stages.ppo import fused_head as resolve

    torch.manual_seed(SEED)
    exact = load_causal_lm(str(models["llama"][0]))
    odd = load_causal_lm(str(models["llama"][0]))
    forward = odd.forward

    def halved(*args, **kwargs):
        out = forward(*args, **kwargs)
        return CausalLMOutputWithPast(logits=out.logits * 0.5)

    monkeypatch.setattr(odd, "forward", halved)
    assert fused_head_gap(exact) < 1e-5
    assert fused_head_gap(odd) > 1e-2
    monkeypatch.setattr(fused_head, "on_gpu", lambda weight: True)  # auto fuses only on a GPU
    monkeypatch.setattr(fused_head, "_EXCLUDED", set())
    assert resolve(SimpleNamespace(fused_head="auto"), exact, odd) == {"policy": True, "reference": False}
    assert not use_fused_head(odd, odd.get_output_embeddings())
    monkeypatch.setattr(fused_head, "_EXCLUDED", set())
    with pytest.raises(StageError, match="fused_head: on, but the reference's log-probs from it differ"):
        resolve(SimpleNamespace(fused_head="on"), exact, odd)
    # a probe in half precision (flash attention) is judged with its own, looser tolerance, which this small change
    # (0.12 nats in a tiny random model) passes
    monkeypatch.setattr(fused_head, "_EXCLUDED", set())
    assert resolve(SimpleNamespace(fused_head="auto"), exact, odd, fused_head.HALF_TOLERANCE) == {"policy": True,
                                                                                                 "reference": True}
    nested = SimpleNamespace(get_text_config=lambda: SimpleNamespace(final_logit_softcapping=30.0))
    assert "final_logit_softcapping: 30.0" in fused_head_blocker(SimpleNamespace(config=nested),
                                                                 exact.get_output_embeddings())


def test_evaluation_scores_a_batch_a_slice_of_rows_at_a_time_with_the_same_log_probs(models, monkeypatch):
    """Evaluate scored a whole generation batch's logits at once (~8 bytes per response token per vocabulary entry:
    31 GiB for 32 replies of 1024 tokens at Llama-3's vocabulary, which no estimate counted). It scores slices of rows
    within SCORING_BYTES now; the log-probs are those of the whole batch."""
    from align.config import evaluate as settings
    from align.modeling.generation import response_logprobs
    from align.modeling.models import load_causal_lm, load_tokenizer
    from align.stages.evaluate import scored_logprobs

    torch.manual_seed(SEED)
    print("seed", SEED)
    base, tok_dir = models["llama"]
    model, r = load_causal_lm(str(base)).eval(), _rollout(load_tokenizer(str(tok_dir)), TEXTS, RESPONSES)
    with torch.no_grad():
        whole = response_logprobs(model, r, 0.7)
    vocab, length = model.get_output_embeddings().weight.size(0), r.response_ids.size(1)
    monkeypatch.setattr(settings, "SCORING_BYTES", 8 * length * vocab)  # one row a slice
    assert settings.scoring_rows(length, vocab) == 1 and r.response_ids.size(0) > 1
    real = r.response_mask.bool()
    assert torch.allclose(scored_logprobs(model, r, 0.7)[real], whole[real], atol=1e-5)
    monkeypatch.undo()
    assert settings.scoring_rows(1024, 128_256) == 2  # Llama-3: two replies of 1024 tokens a slice, 2 GiB of logits

"""Padding-free forward passes (align/modeling/packing.py, align/modeling/generation.py): the packing itself, packed
log-probs, values and gradients equal to the padded path's for every model family, and the GPU fault it removes
(NaN gradients from query rows that attend to nothing) reproduced on CPU with a stand-in of the CUDA kernels'
backward."""

from __future__ import annotations

import random

import pytest
import torch

from align.modeling.packing import pack

from families import FAMILIES, RESPONSES, TEXTS, _rollout, build, ppo_loss_and_grads

SEED = 23


def test_first_fit_decreasing_packs_longest_first_into_the_first_bin_with_room():
    from align.modeling.packing import first_fit_decreasing

    # by hand: lengths 5,4,3,3,2,1 into bins of 8: 5 -> A; 4 -> B; 3 -> A (8); 3 -> B (7); 2 -> C; 1 -> B (8)
    assert first_fit_decreasing([3, 5, 1, 4, 2, 3], 8) == [[1, 0], [3, 5, 2], [4]]
    assert first_fit_decreasing([9, 2], 8) == [[0], [1]]  # longer than a bin: a bin of its own
    assert first_fit_decreasing([], 8) == []


def test_pack_keeps_every_real_token_once_with_restarting_positions_and_unpacks_to_the_padded_layout():
    from align.modeling.packing import pack, padding_fraction

    print("seed", SEED)
    g = torch.Generator().manual_seed(SEED)
    b, t = 7, 12
    ids = torch.randint(3, 50, (b, t), generator=g)
    mask = torch.zeros(b, t, dtype=torch.long)
    for i in range(b):  # left-padded prompts and right-padded responses, as PPO's batches
        left = int(torch.randint(0, 4, (1,), generator=g))
        right = int(torch.randint(0, 5, (1,), generator=g))
        mask[i, left:t - right] = 1
    mask[2] = 0
    mask[2, 5] = 1  # a one-token sequence
    p = pack(ids, mask, pad_id=0)
    assert p.ids.size(1) == t and p.rows.numel() == int(mask.sum())
    assert torch.equal(p.ids[p.where], ids[p.rows, p.cols])
    for i in range(b):  # each sequence's positions run 0..n-1 in its packed row
        sel = p.rows == i
        assert torch.equal(p.position_ids[p.where[0][sel], p.where[1][sel]], torch.arange(int(mask[i].sum())))
    back = p.unpack(p.ids, fill=-1)
    assert torch.equal(back[mask.bool()], ids[mask.bool()]) and bool((back[~mask.bool()] == -1).all())
    assert p.ids.size(0) < b and p.padding_fraction < padding_fraction(mask)


def _lse_attention():
    """A stand-in, on CPU, for what CUDA's memory-efficient and flash SDPA kernels do with a query row that attends
    to nothing: the forward keeps each row's log-sum-exp and returns 0 for such a row (lse = -inf, as torch >= 2.5's
    kernels do); the backward recomputes the weights as exp(scores - lse), which is exp(-inf + inf) = NaN there.
    The row's output gets no gradient (0), and 0 x NaN is NaN: the loss is finite, every gradient upstream is not,
    which is what PPO met on an H100 in bf16 with SDPA (docs/benchmarks.md "GPU")."""

    class LseAttention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, mask, scale):
            s = (q @ k.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
            lse = torch.logsumexp(s, -1, keepdim=True)
            out = torch.exp(s - lse).nan_to_num(0.0) @ v
            ctx.save_for_backward(q, k, v, mask, lse, out)
            ctx.scale = scale
            return out

        @staticmethod
        def backward(ctx, g):
            q, k, v, mask, lse, out = ctx.saved_tensors
            p = torch.exp((q @ k.transpose(-1, -2) * ctx.scale).masked_fill(~mask, float("-inf")) - lse)
            ds = p * (g @ v.transpose(-1, -2) - (g * out).sum(-1, keepdim=True))
            return ds @ k * ctx.scale, ds.transpose(-1, -2) @ q * ctx.scale, p.transpose(-1, -2) @ g, None, None

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        from transformers.integrations.sdpa_attention import repeat_kv

        groups = query.size(1) // key.size(1)
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
        q_len, k_len = query.size(2), key.size(2)
        if attention_mask is None:  # transformers skips the mask for unpadded causal batches
            attention_mask = torch.ones(q_len, k_len, dtype=torch.bool).tril(k_len - q_len)[None, None]
        scale = scaling if scaling is not None else query.size(-1) ** -0.5
        out = LseAttention.apply(query, key, value, attention_mask.expand(-1, query.size(1), -1, -1), scale)
        return out.transpose(1, 2).contiguous(), None

    return attention


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {family: build(family, root / family) for family in FAMILIES}


def _loss_and_grads(policy, value, r):
    """families.ppo_loss_and_grads for a policy and a separate value model: loss, log-probs, values, gradients."""
    from align.stages.ppo.models import PolicyAndValue

    (loss, logprobs, _, values), grads = ppo_loss_and_grads(PolicyAndValue(policy, value), r)
    return loss, logprobs, values, grads


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_log_probs_values_and_gradients_equal_the_padded_path(models, family):
    """fp32 on CPU: PPO's training forward over a left-/right-padded batch, padding-free and padded, gives the same
    loss, log-probs, values and gradients within 1e-5 relative; a family whose forward does not read packed
    positions (OPT builds its mask without them) is found by the probe and stays on the padded path."""
    from align.modeling.packing import computed_padding_fraction, packs, padded_forwards
    from align.modeling.models import load_causal_lm, load_scalar_model, load_tokenizer

    torch.manual_seed(SEED)
    print("seed", SEED)
    base, tok_dir = models[family]
    tok = load_tokenizer(str(tok_dir))
    policy = load_causal_lm(str(base))
    value = load_scalar_model(str(base), tok.pad_token_id)
    r = _rollout(tok, TEXTS, RESPONSES)
    packed = _loss_and_grads(policy, value, r)
    with padded_forwards():
        padded = _loss_and_grads(policy, value, r)
    assert packs(policy, r.attention_mask) == (family != "opt")
    for a, b, what in zip(packed[:3], padded[:3], ("loss", "log-probs", "values")):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (family, what, (a - b).abs().max())
    assert packed[3].keys() == padded[3].keys() and len(packed[3]) > 10
    for name, g in packed[3].items():
        ref = padded[3][name]
        assert (g - ref).norm() <= 1e-5 * ref.norm() + 1e-8, (family, name, (g - ref).norm(), ref.norm())
    with padded_forwards():
        unpacked = computed_padding_fraction(policy, r.attention_mask)
    assert unpacked == pytest.approx(1 - r.attention_mask.sum().item() / r.attention_mask.numel())
    if family != "opt":
        assert computed_padding_fraction(policy, r.attention_mask) < unpacked


def test_query_rows_that_attend_to_nothing_give_nan_gradients_padded_and_none_packed(models):
    """The bf16 + SDPA NaN of PPO's H100 run, reproduced on CPU: with the stand-in kernel (_lse_attention), PPO's
    padded batch (left-padded prompts: rows that attend to nothing) gives a finite loss and non-finite gradients;
    padding-free, the same batch gives finite gradients equal to SDPA's. Before packing, PPO's forwards were the
    padded ones, so this test fails on that code."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    from align.modeling.packing import padded_forwards
    from align.modeling.models import load_causal_lm, load_scalar_model, load_tokenizer

    AttentionInterface.register("lse_standin", _lse_attention())
    ALL_MASK_ATTENTION_FUNCTIONS.register("lse_standin", sdpa_mask)
    torch.manual_seed(SEED)
    random.seed(SEED)
    print("seed", SEED)
    base, tok_dir = models["llama"]
    tok = load_tokenizer(str(tok_dir))
    r = _rollout(tok, TEXTS, RESPONSES)
    assert bool((r.query_mask[:, 0] == 0).any())  # some prompt is left-padded: its first rows attend to nothing
    policy, value = load_causal_lm(str(base)), load_scalar_model(str(base), tok.pad_token_id)
    reference = _loss_and_grads(policy, value, r)  # SDPA, packed
    for m in (policy, value):
        m.set_attn_implementation("lse_standin")
    with padded_forwards():
        loss, _, _, grads = _loss_and_grads(policy, value, r)
    assert torch.isfinite(loss)
    bad = [n for n, g in grads.items() if not torch.isfinite(g).all()]
    assert bad, "the stand-in must reproduce the fault on the padded layout"
    loss, _, _, grads = _loss_and_grads(policy, value, r)
    assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads.values())
    for name, g in grads.items():
        ref = reference[3][name]
        assert (g - ref).norm() <= 1e-5 * ref.norm() + 1e-8, (name, (g - ref).norm(), ref.norm())


@pytest.mark.parametrize("device, padding_free, family, leaves", [
    ("cuda", False, "llama", True), ("cuda", True, "opt", True),  # padded: off, or a family that cannot pack
    ("cuda", True, "llama", False), ("cpu", False, "llama", False)])  # packed; a CPU's SDPA has no such backward
def test_ppo_leaves_sdpa_for_eager_only_where_its_gpu_forwards_run_padded(models, device, padding_free, family,
                                                                          leaves):
    """Where PPO's forwards would run padded under SDPA on a GPU (the fault above, which packing removes), the policy
    and the value model switch to eager attention (the device is named, not present: the decision is what is
    tested), whose padded gradients equal SDPA's (packed; OPT, which cannot pack: padded). On a CPU SDPA's own
    backward is finite, so the fault itself is the stand-in test's above."""
    from align.modeling.compute import leave_sdpa_if_padded
    from align.modeling.packing import attention_kernel, packing_works, padded_forwards
    from align.modeling.models import load_causal_lm, load_scalar_model, load_tokenizer

    torch.manual_seed(SEED)
    print("seed", SEED)
    base, tok_dir = models[family]
    tok = load_tokenizer(str(tok_dir))
    policy, value = load_causal_lm(str(base), attn_implementation="sdpa"), load_scalar_model(str(base),
                                                                                              tok.pad_token_id)
    value.set_attn_implementation("sdpa")
    r = _rollout(tok, TEXTS, RESPONSES)
    reference = _loss_and_grads(policy, value, r)
    whys = [leave_sdpa_if_padded(m, device, padding_free and packing_works(m), "PPO") for m in (policy, value)]
    why = next((w for w in whys if w), None)  # as PPO calls it
    assert bool(why) == leaves and (attention_kernel(policy), attention_kernel(value)) == (
        ("eager", "eager") if leaves else ("sdpa", "sdpa"))
    if leaves:
        with padded_forwards():
            loss, _, _, grads = _loss_and_grads(policy, value, r)
        assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads.values())
        for name, g in grads.items():
            ref = reference[3][name]
            assert (g - ref).norm() <= 1e-5 * ref.norm() + 1e-8, (name, (g - ref).norm(), ref.norm())


@pytest.mark.parametrize("device, padding_free, family, leaves", [
    ("cuda", False, "llama", True), ("cuda", True, "opt", True), ("cuda", True, "llama", False),
    ("cpu", False, "llama", False)])
def test_grpo_and_rloo_policies_leave_sdpa_as_ppos_do_and_right_padded_stages_keep_it(models, device, padding_free,
                                                                                    family, leaves):
    """GRPO's and RLOO's prompts are left-padded as PPO's are, so their policy takes PPO's rule through the TRL
    stages' padding-free setup (runtime/trl.padding_free, left_padded); the same model in a right-padded stage (DPO,
    KTO, reward, SFT: every row attends to something) stays on SDPA. Before, only PPO left SDPA."""
    from types import SimpleNamespace

    from align.modeling.models import load_causal_lm
    from align.modeling.packing import attention_kernel, set_padding_free
    from align.runtime.trl import padding_free as setup

    print("seed", SEED)
    base, _ = models[family]
    notes: dict = {}
    ctx = SimpleNamespace(cfg=SimpleNamespace(padding_free=padding_free), extra_manifest={}, name="grpo",
                          compute=SimpleNamespace(device=torch.device(device)), is_main=True,
                          note=lambda **kw: notes.update(kw))
    policy, offline = (load_causal_lm(str(base), attn_implementation="sdpa") for _ in range(2))
    try:
        setup(ctx, policy, left_padded=True)
        setup(ctx, offline)
    finally:
        set_padding_free(True)
    assert attention_kernel(policy) == ("eager" if leaves else "sdpa"), ctx.extra_manifest
    assert ("attention_left_sdpa" in notes) == leaves, notes
    assert attention_kernel(offline) == "sdpa"
    assert ctx.extra_manifest["padding_free"].startswith("off" if leaves or not padding_free else "packed")


def test_flash_attention_packs_one_row_and_dense_kernels_rows_of_the_padded_width():
    """Flash-attention's varlen path reads sequence boundaries from one row's positions: several rows would each be
    read as one causal sequence. SDPA and eager get rows of the padded width (no more attention per row than a
    padded row)."""
    from types import SimpleNamespace

    from align.modeling.packing import pack_capacity

    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1]])
    for attn, expect in (("sdpa", None), ("eager", None), ("flash_attention_2", 9), ("flash_attention_3", 9)):
        model = SimpleNamespace(config=SimpleNamespace(_attn_implementation=attn))
        assert pack_capacity(model, mask) == expect, attn


@pytest.mark.parametrize("family, loss_on", [("llama", "completion"), ("gpt2", "every token"),
                                             ("gemma3", "every token")])
def test_sft_packed_batches_give_the_padded_loss_and_gradients(models, family, loss_on):
    """SFT's collator (TRL's, then RowPackingCollator): the same examples, packed into rows, give the causal-LM
    loss and gradients of the padded batch within 1e-5 relative (fp32), prompt tokens masked as TRL masks them; and
    fewer tokens are computed."""
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    from align.modeling.models import load_causal_lm, load_tokenizer
    from align.modeling.packing import RowPackingCollator

    torch.manual_seed(SEED)
    print("seed", SEED)
    base, tok_dir = models[family]
    tok = load_tokenizer(str(tok_dir))
    model = load_causal_lm(str(base))
    examples = []
    for prompt, completion in zip(TEXTS * 2, RESPONSES + RESPONSES[::-1]):
        p_ids = tok(prompt)["input_ids"]
        c_ids = tok(completion, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        labels = [-100] * len(p_ids) + c_ids if loss_on == "completion" else p_ids + c_ids
        examples.append({"input_ids": p_ids + c_ids, "labels": labels})
    inner = DataCollatorForLanguageModeling(pad_token_id=tok.pad_token_id)
    packer = RowPackingCollator(inner, tok.pad_token_id)
    out = []
    for batch in (inner(examples), packer(examples)):
        model.zero_grad()
        loss = model(**batch, use_cache=False).loss
        loss.backward()
        out.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (padded_loss, padded), (packed_loss, packed) = out
    real, computed, held = packer.count_first(1)
    assert "attention_mask" not in packer(examples) and real < computed < held
    assert real == sum(len(e["input_ids"]) for e in examples) and held == inner(examples)["attention_mask"].numel()
    assert torch.allclose(packed_loss, padded_loss, rtol=1e-5), (packed_loss, padded_loss)
    for name, g in packed.items():
        assert (g - padded[name]).norm() <= 1e-5 * padded[name].norm() + 1e-8, (family, name)


def _pairs_batch(tok):
    """A DPO-style batch: chosen and rejected completions of the same prompts, right-padded (TRL's layout), labels
    -100 on the prompt and the padding."""
    rows, labels = [], []
    for prompt, completion in zip(TEXTS * 2, RESPONSES + RESPONSES[::-1]):
        p_ids = tok(prompt)["input_ids"]
        c_ids = tok(completion, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        rows.append(p_ids + c_ids)
        labels.append([-100] * len(p_ids) + c_ids)
    width = max(map(len, rows))
    ids = torch.tensor([r + [tok.pad_token_id] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    lab = torch.tensor([x + [-100] * (width - len(x)) for x in labels])
    return ids, mask, lab


@pytest.mark.parametrize("family", FAMILIES)
def test_the_backbone_packed_inside_its_forward_gives_trl_and_the_classifier_the_padded_results(models, family,
                                                                                               monkeypatch):
    """install_padding_free (reward, DPO, KTO, GRPO, RLOO): TRL's fused LM head (the call DPO and KTO make:
    `model(..., labels=..., fused_lm_head=True).log_probs`) and a reward model's pooled score (last non-pad token,
    the classifier's own rule) give the padded path's values and gradients within 1e-5 relative in fp32; generation
    (a cache) takes the original forward; OPT is not packed."""
    from trl.trainer.utils import add_fused_lm_head

    from align.modeling import packing
    from align.modeling.packing import install_padding_free, padded_forwards

    packed_calls = []
    monkeypatch.setattr(packing, "pack", lambda *a, **k: packed_calls.append(1) or pack(*a, **k))
    from align.modeling.models import load_causal_lm, load_scalar_model, load_tokenizer

    torch.manual_seed(SEED)
    print("seed", SEED)
    base, tok_dir = models[family]
    tok = load_tokenizer(str(tok_dir))
    ids, mask, labels = _pairs_batch(tok)
    policy = load_causal_lm(str(base))
    add_fused_lm_head(policy)
    scorer = load_scalar_model(str(base), tok.pad_token_id)
    assert install_padding_free(policy) == install_padding_free(scorer) == (family != "opt")

    def run(model, call):
        model.zero_grad()
        out = call(model)
        out.sum().backward()
        return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    calls = {policy: lambda m: m(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True,
                                 use_cache=False).log_probs,
             scorer: lambda m: m(input_ids=ids, attention_mask=mask).logits}
    for model, call in calls.items():
        before = len(packed_calls)
        packed = run(model, call)
        assert len(packed_calls) == before + (family != "opt")  # the backbone ran packed, once
        with padded_forwards():
            padded = run(model, call)
        assert torch.allclose(packed[0], padded[0], rtol=1e-5, atol=1e-6), (family, (packed[0] - padded[0]).abs().max())
        for name, g in packed[1].items():
            assert (g - padded[1][name]).norm() <= 1e-5 * padded[1][name].norm() + 1e-8, (family, name)
    assert len(packed_calls) == 2 * (family != "opt")  # the padded runs did not pack
    q = tok(TEXTS[0], return_tensors="pt")
    with torch.no_grad():  # generation: a cache, so the original forward (greedy tokens equal the padded path's)
        new = policy.generate(**q, max_new_tokens=3, do_sample=False, pad_token_id=tok.pad_token_id)
        with padded_forwards():
            assert torch.equal(new, policy.generate(**q, max_new_tokens=3, do_sample=False,
                                                    pad_token_id=tok.pad_token_id))
    assert len(packed_calls) == 2 * (family != "opt")  # generation took the original forward


def test_a_stage_that_turns_padding_free_off_computes_the_padded_batch(models):
    """`padding_free: false` (PPO's setting: set_padding_free for its process): packs() is off, and the padding
    fraction PPO reports is the padded batch's."""
    from align.modeling.models import load_causal_lm, load_tokenizer
    from align.modeling.packing import computed_padding_fraction, packs, set_padding_free

    base, tok_dir = models["llama"]
    tok = load_tokenizer(str(tok_dir))
    policy = load_causal_lm(str(base))
    mask = _rollout(tok, TEXTS, RESPONSES).attention_mask
    on = computed_padding_fraction(policy, mask)
    set_padding_free(False)
    try:
        assert not packs(policy, mask)
        off = computed_padding_fraction(policy, mask)
        assert off == pytest.approx(1 - mask.sum().item() / mask.numel()) and off > on
    finally:
        set_padding_free(True)
    assert packs(policy, mask)


def test_an_engine_wrapped_model_packs_as_its_kernel_asks(models, tmp_path):
    """TRL wraps GRPO's and RLOO's reference in a DeepSpeed engine (DDP here: the same `.module` wrapping), whose
    `config` is not the model's: the kernel, and so a flash kernel's one-row packs, must be read through it."""
    import torch.distributed as dist

    from align.modeling.models import load_causal_lm
    from align.modeling.packing import attention_kernel, pack_capacity

    base, _ = models["llama"]
    model = load_causal_lm(str(base))
    model.config._attn_implementation = "flash_attention_2"  # read, not run: flash needs a GPU
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
        mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
        assert attention_kernel(wrapped) == "flash_attention_2"
        assert pack_capacity(wrapped, mask) == 5  # one row of every real token
    finally:
        if started:
            dist.destroy_process_group()


def _moe_config(family: str, **big):
    """A tiny mixture-of-experts config of `family` (transformers' Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE)."""
    import transformers as T

    common = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, num_experts_per_tok=2, max_position_embeddings=32, pad_token_id=0)
    experts = {"mixtral": dict(num_local_experts=4), "olmoe": dict(num_experts=4),
               "qwen2_moe": dict(num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=16),
               "qwen3_moe": dict(num_experts=4, moe_intermediate_size=16, head_dim=8)}[family]
    cls = {"mixtral": T.MixtralConfig, "olmoe": T.OlmoeConfig, "qwen2_moe": T.Qwen2MoeConfig,
           "qwen3_moe": T.Qwen3MoeConfig}[family]
    return cls(**{**common, **experts, **big})


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"])
def test_a_mixture_of_experts_asked_for_router_logits_packs_with_the_padded_loss_aux_loss_and_gradients(family):
    """TRL's MoE auxiliary loss asks every training forward for the router logits: the packed forward gives them
    back in the padded layout, and the loss, the auxiliary loss and every gradient equal the padded path's (fp32).
    Before, such a call ran padded (and under SDPA on a GPU, GRPO's left padding gave NaN gradients)."""
    from transformers import AutoModelForCausalLM

    from align.modeling.packing import backbone_counts, install_padding_free

    torch.manual_seed(SEED)
    print("seed", SEED)
    cfg = _moe_config(family)
    padded = AutoModelForCausalLM.from_config(cfg)
    packed = AutoModelForCausalLM.from_config(cfg)
    packed.load_state_dict(padded.state_dict())
    assert install_padding_free(packed)
    ids = torch.randint(1, 64, (3, 8))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # a left-padded row (5 tokens)
    mask[2, 3:] = 0  # a right-padded one (3 tokens): packed with the first
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, 3] = -100  # a left-padded row's first token is not predicted (a padding position would predict it)
    outs = [m(input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=True) for m in (padded, packed)]
    assert backbone_counts(packed)[1] == 2 * 8 < ids.numel()  # packed: two rows of 8 for three padded rows
    want, got = outs
    for a, b in zip(got.router_logits, want.router_logits):
        assert a.shape == b.shape == (3 * 8, 4) and torch.allclose(a[mask.flatten().bool()], b[mask.flatten().bool()],
                                                                   atol=1e-5)
    assert got.aux_loss is not None and torch.allclose(got.aux_loss, want.aux_loss, rtol=1e-5)
    for o in outs:
        o.loss.backward()
    assert torch.allclose(got.loss, want.loss, rtol=1e-5)
    for (name, a), b in zip(packed.named_parameters(), padded.parameters()):
        if b.grad is not None:
            assert (a.grad - b.grad).norm() <= 1e-5 * b.grad.norm() + 1e-7, (family, name)


def test_the_packing_probe_of_a_mixture_of_experts_builds_few_narrow_experts():
    """The probe that decides whether a family packs builds one layer from the model's config: of a mixture of
    experts, few and narrow experts (128 experts at full width are GBs in every process)."""
    from transformers import Qwen3MoeModel

    from align.modeling.packing import _probe_packing

    built = []

    class Counting(Qwen3MoeModel):
        def __init__(self, config):
            super().__init__(config)
            built.append(sum(p.numel() for p in self.parameters()))

    big = _moe_config("qwen3_moe", hidden_size=64, num_experts=64, moe_intermediate_size=1024, num_experts_per_tok=8)
    assert _probe_packing(Counting, big, "sdpa")
    assert built and built[0] < 1_000_000, built  # 64 experts x 3 x 1024 x 64 alone would be 12.6M


def test_a_mixture_of_experts_whose_router_logits_cannot_be_unpacked_does_not_pack(monkeypatch):
    """The packing probe asks a mixture of experts for its router logits too: a family giving them in a layout the
    unpacking does not know cannot pack (its stages then run padded from the start, with eager attention where
    they are left-padded on a GPU, as the estimate counts), instead of packing until TRL's auxiliary loss asks for
    them and then falling back to the padded forward under SDPA."""
    from transformers import MixtralModel

    import align.modeling.packing as packing

    cfg = _moe_config("mixtral")
    known, seen = packing._router_layout_known, []
    monkeypatch.setattr(packing, "_router_layout_known", lambda logits, tokens: seen.append(len(logits)) or known(
        logits, tokens))
    assert packing._probe_packing(MixtralModel, cfg, "sdpa") and seen == [1]  # the probe's one layer's logits checked
    monkeypatch.setattr(packing, "_router_layout_known", lambda logits, tokens: False)
    assert not packing._probe_packing(MixtralModel, cfg, "sdpa")
    monkeypatch.undo()
    assert packing._router_layout_known([torch.zeros(5, 4)] * 2, 5)
    assert not packing._router_layout_known([torch.zeros(5, 4), torch.zeros(1, 5, 4)], 5)


def test_router_logits_of_an_unknown_layout_a_cache_or_padding_free_off_keep_the_padded_forward(monkeypatch):
    """Router logits in a layout the unpacking does not know send the call to the padded forward; a call with a
    cache, or a stage with padding_free: false (the stage's switch), is not packed."""
    from types import SimpleNamespace

    from transformers import DynamicCache, MixtralForCausalLM

    import align.modeling.packing as packing
    from align.modeling.packing import backbone_counts, install_padding_free, packs, set_padding_free
    from align.runtime.trl import padding_free

    torch.manual_seed(SEED)
    print("seed", SEED)
    cfg = _moe_config("mixtral")
    padded, packed = MixtralForCausalLM(cfg).eval(), MixtralForCausalLM(cfg).eval()
    packed.load_state_dict(padded.state_dict())
    assert install_padding_free(packed)
    ids = torch.randint(1, 64, (3, 8))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with torch.no_grad():
        monkeypatch.setattr(packing, "_unpack_router_logits", lambda out, p: False)
        want = padded(input_ids=ids, attention_mask=mask, output_router_logits=True)
        got = packed(input_ids=ids, attention_mask=mask, output_router_logits=True)
        monkeypatch.undo()
        assert backbone_counts(packed)[1] == 0  # not packed
        for a, b in zip(got.router_logits, want.router_logits):
            assert a.shape == b.shape == (3 * 8, 4) and torch.allclose(a, b, atol=1e-6)
        packed.model(input_ids=ids, attention_mask=mask, cache=DynamicCache(config=cfg))
        assert backbone_counts(packed)[1] == 0
        packed(input_ids=ids, attention_mask=mask)  # nothing asked beyond the hidden state: packed
        assert backbone_counts(packed)[1] > 0
    from align.modeling.packing import _asks_router_logits

    asks = SimpleNamespace(config=SimpleNamespace(output_router_logits=True))  # the config asks; the call says None
    assert _asks_router_logits({"output_router_logits": None}, asks) and _asks_router_logits({}, asks)
    assert not _asks_router_logits({"output_router_logits": False}, asks)
    try:
        padding_free(SimpleNamespace(cfg=SimpleNamespace(padding_free=False), extra_manifest={}), packed)
        assert not packs(packed, mask)  # align's own forwards (GRPO's check, reward judges) follow the setting
    finally:
        set_padding_free(True)


def test_a_composite_model_is_not_probed_at_full_size():
    """Gemma 3's checkpoints load as a composite model (a vision tower beside the text model): the probe's shrink
    reaches only top-level fields, so it would build the model at full size; it stays padded instead."""
    from transformers import Gemma3Config

    from align.modeling.packing import _probe_packing

    built: list[int] = []

    class Recorder:  # what the probe would build, and how many text layers it would have
        def __init__(self, config):
            built.append(config.get_text_config().num_hidden_layers)
            raise RuntimeError("not built here")

    assert _probe_packing(Recorder, Gemma3Config(), "sdpa") is False and built == []


def test_ppos_padding_fraction_counts_each_mini_batch_packed_on_its_own(models):
    """PPO scores (and trains on) mini_batch_size sequences a forward, each mini-batch packed on its own, so each can
    end in a part-filled row: the reported fraction is of those forwards, not of one packing of the whole rollout.
    Sequences of 6, 6, 4 and 4 tokens in rows of 10 (sdpa: the padded width): packed whole, two full rows (no
    padding); two a forward, [6, 6] takes two rows and [4, 4] one, 30 tokens computed for 20 real (1/3)."""
    import torch

    from align.modeling.models import load_causal_lm
    from align.modeling.packing import attention_kernel, computed_padding_fraction

    base, _ = models["llama"]
    policy = load_causal_lm(str(base))
    assert attention_kernel(policy) == "sdpa"
    mask = torch.zeros(4, 10, dtype=torch.long)
    for i, n in enumerate((6, 6, 4, 4)):
        mask[i, :n] = 1
    assert computed_padding_fraction(policy, mask) == pytest.approx(0.0)
    assert computed_padding_fraction(policy, mask, rows=2) == pytest.approx(1 / 3)
    assert computed_padding_fraction(policy, mask, rows=4) == pytest.approx(0.0)


@pytest.mark.parametrize("router_logits", [True, False])
def test_sft_trains_a_mixture_of_experts_with_its_auxiliary_loss_padded(router_logits):
    """TRL adds a mixture of experts' load-balancing loss (output_router_logits) over every token of a batch it is
    given without an attention mask, as packed rows are: the filler at a row's end would be balanced too. Such a
    model trains padded under SDPA, and says why; without the auxiliary loss it packs."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    from align.config.sft import SFTStage
    from align.modeling.packing import RowPackingCollator
    from align.stages.sft import collator

    torch.manual_seed(SEED)
    print("seed", SEED)
    model = AutoModelForCausalLM.from_config(_moe_config("mixtral", output_router_logits=router_logits))
    ctx = SimpleNamespace(extra_manifest={}, is_main=True, name="sft")
    args = SimpleNamespace(packing=False)
    cfg = SFTStage(type="sft", data="d.yaml", padding_free=True)
    made = collator(ctx, cfg, args, model, SimpleNamespace(pad_token_id=0))
    if router_logits:
        assert made is None and ctx.extra_manifest["padding_free"].startswith("off (a mixture of experts'")
    else:
        assert isinstance(made, RowPackingCollator) and ctx.extra_manifest["padding_free"] == "rows of the batch width"

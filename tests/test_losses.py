"""Loss math against values computed by hand (the derivation is in each docstring)."""

import math

import pytest
import torch

from align.modeling import losses as L


def test_sequence_kl_hand_value():
    """Two responses, the second one token shorter (mask 0 on its last position, whose log-probs must not count):
    row 0: (-1 - -2) + (-0.5 - -0.25) = 1 - 0.25 = 0.75; row 1: (-3 - -1) = -2 (k1 can be negative per sample)."""
    lp = torch.tensor([[-1.0, -0.5], [-3.0, -9.0]])
    ref = torch.tensor([[-2.0, -0.25], [-1.0, 5.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    assert L.sequence_kl(lp, ref, mask).tolist() == pytest.approx([0.75, -2.0], abs=1e-6)


def test_kl_estimators_hand_values():
    """p = 0.5, ref = 0.25: log r = log(ref/p) = -ln 2. k1 = ln 2 = 0.693147;
    k2 = (ln 2)^2 / 2 = 0.240227; k3 = (r - 1) - log r = -0.5 + ln 2 = 0.193147."""
    lp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    assert L.kl_estimate(lp, ref, "k1").item() == pytest.approx(math.log(2), abs=1e-6)
    assert L.kl_estimate(lp, ref, "k2").item() == pytest.approx(math.log(2) ** 2 / 2, abs=1e-6)
    assert L.kl_estimate(lp, ref, "k3").item() == pytest.approx(-0.5 + math.log(2), abs=1e-6)
    # equal distributions: every estimator is exactly 0
    for kind in ("k1", "k2", "k3"):
        assert L.kl_estimate(lp, lp, kind).item() == 0.0
    with pytest.raises(ValueError, match="k1, k2 or k3"):
        L.kl_estimate(lp, ref, "k4")


def test_gae_hand_values():
    """rewards [0, 0, 1], values [0.5, 0.6, 0.7], gamma 0.9, lambda 0.5:
    d2 = 1 - 0.7 = 0.3, A2 = 0.3; d1 = 0.9*0.7 - 0.6 = 0.03, A1 = 0.03 + 0.45*0.3 = 0.165;
    d0 = 0.9*0.6 - 0.5 = 0.04, A0 = 0.04 + 0.45*0.165 = 0.11425. Returns = A + V."""
    r = torch.tensor([[0.0, 0.0, 1.0]])
    v = torch.tensor([[0.5, 0.6, 0.7]])
    adv, ret = L.gae(r, v, torch.ones(1, 3), gamma=0.9, lam=0.5)
    assert adv[0].tolist() == pytest.approx([0.11425, 0.165, 0.3], abs=1e-6)
    assert ret[0].tolist() == pytest.approx([0.61425, 0.765, 1.0], abs=1e-6)
    # gamma = lambda = 1: advantage = (sum of future rewards) - V
    adv, _ = L.gae(r, v, torch.ones(1, 3), gamma=1.0, lam=1.0)
    assert adv[0].tolist() == pytest.approx([0.5, 0.4, 0.3], abs=1e-6)


def _gae_loop(rewards, values, length, gamma, lam):
    """A plain per-example loop: the textbook recursion over the first `length` tokens only."""
    adv = [0.0] * len(rewards)
    last = 0.0
    for t in reversed(range(length)):
        next_v = values[t + 1] if t + 1 < length else 0.0
        delta = rewards[t] + gamma * next_v - values[t]
        last = delta + gamma * lam * last
        adv[t] = last
    return adv


def test_gae_vectorised_equals_loop_with_padding():
    torch.manual_seed(0)
    b, t = 6, 9
    rewards, values = torch.randn(b, t), torch.randn(b, t)
    lengths = [9, 1, 4, 7, 2, 5]
    mask = torch.tensor([[1.0] * n + [0.0] * (t - n) for n in lengths])
    adv, ret = L.gae(rewards, values, mask, gamma=0.97, lam=0.9)
    for i, n in enumerate(lengths):
        expected = _gae_loop(rewards[i].tolist(), values[i].tolist(), n, 0.97, 0.9)
        assert adv[i].tolist() == pytest.approx(expected, abs=1e-5)
        assert ret[i, n:].abs().sum().item() == 0.0  # nothing leaks past the end of a response


def test_masked_whiten_hand_values():
    """x = [1, 2, 3, 4] (+ a masked 100): mean 2.5, unbiased var 5/3, std 1.290994."""
    x = torch.tensor([1.0, 2.0, 3.0, 4.0, 100.0])
    mask = torch.tensor([1, 1, 1, 1, 0])
    w = L.masked_whiten(x, mask)
    s = math.sqrt(5 / 3)
    assert w.tolist() == pytest.approx([-1.5 / s, -0.5 / s, 0.5 / s, 1.5 / s, 0.0], abs=1e-5)
    kept = L.masked_whiten(x, mask, shift_mean=False)
    assert kept[:4].tolist() == pytest.approx([2.5 - 1.5 / s, 2.5 - 0.5 / s, 2.5 + 0.5 / s, 2.5 + 1.5 / s], abs=1e-5)


def test_masked_whiten_over_two_processes_is_the_whole_batchs():
    """Each PPO process whitened its own slice: with one global batch the advantages differed by the number of
    processes, and a process whose responses all scored well still got half of them negative. With `total` (an
    all-reduce sum) two processes holding [1, 2] and [3, 4] (+ a masked 100) get what one holding all four gets."""
    import threading

    barrier, posted = threading.Barrier(2), {}

    def total_for(rank):
        calls = [0]

        def total(t):  # an all-reduce between two threads: each posts its term, waits for the other's, adds both
            k = calls[0]
            calls[0] += 1
            posted[(k, rank)] = t
            barrier.wait()
            return posted[(k, 0)] + posted[(k, 1)]
        return total

    slices = {0: (torch.tensor([1.0, 2.0]), torch.tensor([1, 1])),
              1: (torch.tensor([3.0, 4.0, 100.0]), torch.tensor([1, 1, 0]))}
    out = {}
    threads = [threading.Thread(target=lambda r=r: out.update({r: L.masked_whiten(*slices[r], total=total_for(r))}))
               for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    whole = L.masked_whiten(torch.tensor([1.0, 2.0, 3.0, 4.0, 100.0]), torch.tensor([1, 1, 1, 1, 0]))
    assert torch.cat([out[0], out[1]]).tolist() == pytest.approx(whole.tolist(), abs=1e-6)
    assert out[0].tolist() == pytest.approx([-1.5 / math.sqrt(5 / 3), -0.5 / math.sqrt(5 / 3)], abs=1e-5)


def test_ppo_policy_loss_hand_values():
    """A = +1 on both tokens. Token 1: ratio 1.5 -> losses -1.5 and clip -1.2 -> max -1.2 (clipped).
    Token 2: ratio 0.5 -> losses -0.5 and clip(0.8) -0.8 -> max -0.5 (not clipped). Mean -0.85, clipfrac 0.5."""
    old = torch.zeros(1, 3)
    new = torch.tensor([[math.log(1.5), math.log(0.5), 5.0]])  # third token masked out
    adv = torch.ones(1, 3)
    loss, m = L.ppo_policy_loss(new, old, adv, torch.tensor([[1, 1, 0]]), clip_range=0.2)
    assert loss.item() == pytest.approx(-0.85, abs=1e-6)
    assert m["policy/clipfrac"].item() == pytest.approx(0.5)
    assert m["policy/approx_kl"].item() == pytest.approx(0.25 * (math.log(1.5) ** 2 + math.log(0.5) ** 2), abs=1e-6)


def test_ppo_value_loss_hand_values():
    """V = 2, V_old = 1, R = 3, eps = 0.2: unclipped (2-3)^2 = 1, clipped (1.2-3)^2 = 3.24 -> 0.5*3.24 = 1.62."""
    loss, m = L.ppo_value_loss(torch.tensor([[2.0]]), torch.tensor([[1.0]]), torch.tensor([[3.0]]),
                               torch.ones(1, 1), clip_range=0.2)
    assert loss.item() == pytest.approx(1.62, abs=1e-6)
    assert m["value/clipfrac"].item() == 1.0


def test_eos_masking_and_first_true():
    eos = 9
    resp = torch.tensor([[4, 9, 5, 9], [4, 5, 6, 7], [9, 1, 1, 1]])
    assert L.first_true_indices(resp == eos).tolist() == [1, 4, 0]
    assert L.response_mask_after_eos(resp, eos).tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]


def test_last_token_index_left_and_right_padding():
    pad = 0
    right = torch.tensor([[5, 6, 7, 0, 0]])
    left = torch.tensor([[0, 0, 5, 6, 7]])
    assert L.last_token_index(right, torch.tensor([[1, 1, 1, 0, 0]]), pad).item() == 2
    assert L.last_token_index(left, torch.tensor([[0, 0, 1, 1, 1]]), pad).item() == 4
    # left-padded query + right-padded response, as PPO builds them
    seq = torch.tensor([[0, 3, 4, 8, 9, 0, 0]])
    assert L.last_token_index(seq, torch.tensor([[0, 1, 1, 1, 1, 0, 0]]), pad).item() == 4
    # pad == eos (GPT-2 style): the score is read at the token before EOS, as transformers' classifier does
    eos = 9
    assert L.last_token_index(seq, torch.tensor([[0, 1, 1, 1, 1, 0, 0]]), eos).item() == 3


def test_token_rewards_put_score_on_last_token():
    kl = torch.tensor([[0.1, 0.2, 0.3]])
    mask = torch.tensor([[1, 1, 0]])
    r = L.token_rewards(torch.tensor([2.0]), kl, mask, kl_coef=0.5, score_index=torch.tensor([1]))
    assert r[0].tolist() == pytest.approx([-0.05, -0.1 + 2.0, 0.0])


def test_logprobs_and_entropy_by_hand():
    from align.modeling.losses import logprobs_and_entropy

    logits = torch.tensor([[[0.0, math.log(3.0)], [2.0, 2.0]]])  # p = (1/4, 3/4), then (1/2, 1/2)
    lp, ent = logprobs_and_entropy(logits, torch.tensor([[1, 0]]))
    assert lp[0].tolist() == pytest.approx([math.log(0.75), math.log(0.5)], abs=1e-6)
    assert ent[0].tolist() == pytest.approx([-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), math.log(2.0)], abs=1e-6)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_sequence_logprobs_keeps_only_the_response_logits_and_matches_the_full_forward(family):
    """sequence_logprobs asks the model for the response positions' logits only (logits_to_keep); the log-probs and
    entropies equal those read from the full forward's logits, for left-padded prompts."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from align.modeling.generation import position_ids, sequence_logprobs, takes_logits_to_keep
    from align.modeling.losses import logprobs_from_logits

    seed = 11
    print(f"seed {seed}")
    torch.manual_seed(seed)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                             intermediate_size=64, max_position_embeddings=64)).eval()
    else:
        model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=64)).eval()
    assert takes_logits_to_keep(model)
    ids = torch.randint(1, 64, (3, 12))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding in the prompt part
    lq = 5
    with torch.no_grad():
        lp, ent = sequence_logprobs(model, ids, mask, lq, temperature=0.7, with_entropy=True)
        full = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)).logits[:, lq - 1:-1] / 0.7
    assert lp.shape == (3, 7)
    assert torch.allclose(lp, logprobs_from_logits(full, ids[:, lq:]), atol=1e-5)
    assert torch.allclose(ent, -(full.softmax(-1) * full.log_softmax(-1)).sum(-1), atol=1e-5)


def test_finish_rollout_masks_after_eos_and_beyond_engine_lengths():
    """Both engines build their Rollout with finish_rollout: tokens after the first EOS, and (vLLM) columns beyond a
    row's reported length, are masked and set to padding; a row of length 0 is EOS alone, as when every row stopped
    at once (it was masked whole: its score and missing-EOS penalty fell on no token, and GAE dropped them)."""
    from align.modeling.generation import finish_rollout

    eos, pad = 2, 0
    q = torch.ones(3, 2, dtype=torch.long)
    resp = torch.tensor([[5, 2, 7, 7], [5, 6, 7, 8], [9, 9, 9, 9]])
    r = finish_rollout(q, q, resp, eos, pad)
    assert r.response_mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]]
    assert r.response_ids.tolist() == [[5, 2, 0, 0], [5, 6, 7, 8], [9, 9, 9, 9]]
    assert r.eos_found.tolist() == [True, False, False]
    r = finish_rollout(q, q, resp, eos, pad, lengths=torch.tensor([4, 3, 0]))
    assert r.response_mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0]]
    assert r.response_ids.tolist() == [[5, 2, 0, 0], [5, 6, 7, 0], [2, 0, 0, 0]]
    assert r.eos_found.tolist() == [True, False, True]
    assert resp[2, 0] == 9  # the caller's tensor is not changed
    empty = finish_rollout(q, q, torch.zeros(3, 0, dtype=torch.long), eos, pad)
    assert empty.response_ids.shape == (3, 1) and empty.response_mask.tolist() == [[1], [1], [1]]


def test_tempered_logits_are_divided_in_fp32_and_an_fp32_input_is_left_alone():
    """Log-probs at a sampling temperature: a bf16 logit divided in bf16 is rounded twice (the sampler and the fused
    head divide in fp32), so the two paths' log-probs drift apart by ~1e-2 nats at T 0.7. tempered() divides the fp32
    copy; an fp32 tensor (the model's own output) is not changed in place."""
    import torch

    from align.modeling.generation import tempered

    seed = 23
    print("seed", seed)
    g = torch.Generator().manual_seed(seed)
    fp32 = 8 * torch.randn(4, 6, 50, generator=g)
    bf16 = fp32.to(torch.bfloat16)
    got = tempered(bf16, 0.7)
    assert got.dtype == torch.float32 and torch.equal(got, bf16.float() / 0.7)
    twice = (bf16 / 0.7).float()  # the old way
    assert (got - twice).abs().max().item() > 1e-3
    before = fp32.clone()
    assert torch.equal(tempered(fp32, 0.7), before / 0.7) and torch.equal(fp32, before)


def test_a_bf16_models_response_logits_are_its_own_logits_divided_in_fp32_padded_or_packed():
    """response_logits (the log-probs of PPO, GRPO and the engine check) divides a bf16 model's logits by the
    temperature in fp32 on both of its paths: the padded forward of an unpadded batch and the padding-free one of a
    padded batch. What it returns is exactly some bf16 logits divided in fp32 (dividing in bf16, the old way, returns
    bf16 quotients that are not), and they are the model's own logits at the response positions (a forward of each
    sequence alone, within bf16's noise: a position off by one would be off by ~10)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from align.modeling.generation import response_logits
    from align.modeling.packing import packs

    seed = 29
    print("seed", seed)
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(40)  # logits of ~10: where a second bf16 rounding shows
    q, t = 3, 0.7
    ids = torch.randint(1, 64, (2, 7))
    for mask in (torch.ones_like(ids), torch.tensor([[0, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1]])):
        with torch.no_grad():
            got, _ = response_logits(model, ids * mask, mask, q, temperature=t)
            assert got.dtype == torch.float32 and packs(model, mask) == bool((mask == 0).any())
            for b in range(2):
                n = int(mask[b, q:].sum())  # real response tokens (right padding last)
                have = got[b, :n]
                assert torch.equal((have * t).to(torch.bfloat16).float() / t, have)  # bf16 logits / t, in fp32
                real = mask[b].bool()
                start = int((~real[:q]).sum())  # left padding inside the prompt
                own = model(input_ids=ids[b][real][None]).logits[0].float()  # the sequence alone
                want = own[q - 1 - start:q - 1 - start + n] / t
                assert (have - want).abs().max() < 0.25, (mask.tolist(), (have - want).abs().max())
                assert have.abs().max() > 5  # large enough logits for the exactness check above to bite


def test_an_entropy_kept_as_a_metric_keeps_no_graph_and_the_same_values():
    """PPO computed the entropy with a graph although entropy_coef is 0 by default: autograd kept p = exp(log p) for
    the backward, ~24 bytes per response token per vocabulary entry at its peak instead of ~16 (CPU, bf16 logits)."""
    torch.manual_seed(7)
    print("seed", 7)
    logits = torch.randn(2, 3, 11, requires_grad=True)
    labels = torch.randint(0, 11, (2, 3))
    lp, ent = L.logprobs_and_entropy(logits, labels)
    lp2, metric = L.logprobs_and_entropy(logits, labels, grad=False)
    assert ent.requires_grad and not metric.requires_grad and lp2.requires_grad
    assert torch.equal(lp, lp2) and torch.allclose(ent, metric)

"""PPO state objects: the adaptive KL controller's beta trace by hand, running moments, data position."""

import math

import pytest
import torch

from align.stages.ppo.budget import HeldoutKL, PolicySnapshot, split_heldout
from align.stages.ppo.state import (AdaptiveKLController, FixedKLController, PIKLController, PromptStream,
                                    RunningMoments)


def test_adaptive_kl_beta_trace_by_hand():
    """Ziegler et al.: e = clip(KL/target - 1, -0.2, 0.2); beta <- beta * (1 + e * n / horizon).
    target 4, horizon 100, n = 10 episodes per update, beta0 = 0.1:
    KL 8   -> e = +0.2 (clipped from 1.0)  -> 0.1 * 1.02        = 0.102
    KL 2   -> e = -0.2 (clipped from -0.5) -> 0.102 * 0.98      = 0.09996
    KL 4   -> e = 0                        -> 0.09996
    KL 5   -> e = +0.2 (clipped from 0.25) -> 0.09996 * 1.02    = 0.1019592
    KL 4.4 -> e = +0.1                     -> 0.1019592 * 1.01  = 0.102978792"""
    ctl = AdaptiveKLController(0.1, target=4.0, horizon=100)
    trace = []
    for kl in (8.0, 2.0, 4.0, 5.0, 4.4):
        ctl.update(kl, n_steps=10)
        trace.append(ctl.value)
    assert trace == pytest.approx([0.102, 0.09996, 0.09996, 0.1019592, 0.102978792], rel=1e-9)


def test_pi_kl_beta_trace_by_hand():
    """Stooke et al. 2020, PID Lagrangian without D: e = KL - target; I = max(0, I + e);
    beta = coef + max(0, kp * e + ki * I). coef 0.1, target 4, kp 0.1, ki 0.05:
    KL 2   -> e = -2,   I = 0,   lambda = max(0, -0.2)          = 0     -> 0.1
    KL 5   -> e = +1,   I = 1,   lambda = 0.1 + 0.05            = 0.15  -> 0.25
    KL 6   -> e = +2,   I = 3,   lambda = 0.2 + 0.15            = 0.35  -> 0.45
    KL 4   -> e = 0,    I = 3,   lambda = 0 + 0.15              = 0.15  -> 0.25
    KL 3   -> e = -1,   I = 2,   lambda = -0.1 + 0.1            = 0     -> 0.1
    KL 3.5 -> e = -0.5, I = 1.5, lambda = -0.05 + 0.075         = 0.025 -> 0.125
    KL 1   -> e = -3,   I = 0,   lambda = max(0, -0.3)          = 0     -> 0.1"""
    ctl = PIKLController(0.1, target=4.0, kp=0.1, ki=0.05)
    trace = []
    for kl in (2.0, 5.0, 6.0, 4.0, 3.0, 3.5, 1.0):
        ctl.update(kl, n_steps=64)  # the PI rule ignores episode counts: its horizon is iterations
        trace.append(ctl.value)
    assert trace == pytest.approx([0.1, 0.25, 0.45, 0.25, 0.1, 0.125, 0.1], abs=1e-12)
    assert ctl.integral == 0.0


def test_pi_kl_acts_within_iterations_where_ziegler_drifts():
    """The issue-39 trace (SmolLM2, training KL per iteration, target 4, 64 episodes, horizon 256): Ziegler's beta
    only drifts (+5% per iteration at most), the PI rule's triples within three iterations over target."""
    kls = [0.0, 0.41, 0.49, 1.25, 1.21, 2.24, 3.19, 3.56, 5.01, 5.67]
    z, pi = AdaptiveKLController(0.1, 4.0, 256), PIKLController(0.1, 4.0, kp=0.1, ki=0.1)
    for kl in kls:
        z.update(kl, 64)
        pi.update(kl, 64)
    assert z.value < 0.1  # mostly under target: Ziegler lowered beta, and two iterations over could not undo it
    # by hand: 5.01 -> e 1.01, I 1.01, lambda 0.202; 5.67 -> e 1.67, I 2.68, lambda 0.167 + 0.268 = 0.435
    assert pi.value == pytest.approx(0.1 + 0.435, abs=1e-9)
    resumed = PIKLController(0.1, 4.0, kp=0.1, ki=0.1)
    resumed.load_state_dict(pi.state_dict())
    resumed.update(4.5, 64)
    pi.update(4.5, 64)
    assert (resumed.value, resumed.integral) == (pi.value, pi.integral)


def test_one_reading_far_over_target_does_not_hold_beta_up_for_many_iterations():
    """A review's probe (2026-11-30): coef 0.05, target 4, kp = ki = 0.1; one held-out reading of 30 nats (a
    degenerate response), then 2 nats an iteration. Stooke et al.'s integral took 26 and unwound 2 an iteration:
    beta stayed above coef for 13 iterations after the spike. Clipped to +-target it takes 4: by hand, 30 -> e 26,
    I 4, beta 0.05 + 2.6 + 0.4 = 3.05; 2 -> e -2, I 2, lambda max(0, -0.2 + 0.2) = 0: coef at once."""
    pi = PIKLController(0.05, target=4.0, kp=0.1, ki=0.1)
    pi.update(30.0, 64)
    assert (pi.value, pi.integral) == (pytest.approx(3.05), 4.0)
    raised = 0
    for _ in range(20):
        pi.update(2.0, 64)
        raised += pi.value > 0.05 + 1e-12
    assert raised == 0 and pi.integral == 0.0
    # a stretch over target still winds it up, one clipped step an iteration: 3 readings of 10 -> I = 12
    for _ in range(3):
        pi.update(10.0, 64)
    assert pi.integral == 12.0 and pi.value == pytest.approx(0.05 + 0.6 + 1.2)


def test_heldout_kl_upper_bound_by_hand():
    """KLs 1, 2, 3, 6: mean 3, sample std sqrt(14/3) = 2.1602; with 3 degrees of freedom Student's t gives 2.353,
    upper = 3 + 2.353 * 2.1602 / 2 = 5.5415 (the normal's 1.645 gave 4.7768: a bound four prompts do not support).
    Two prompts, KLs 1 and 5: 3 + 6.314 * 2.8284 / 1.4142 = 15.63 (1.645 gave 6.29); one prompt: no bound."""
    m = HeldoutKL.of(torch.tensor([1.0, 2.0, 3.0, 6.0]))
    assert (m.mean, m.n) == (3.0, 4)
    assert m.upper == pytest.approx(3 + 2.353 * math.sqrt(14 / 3) / 2, rel=1e-12)
    assert m.within(5.6) and not m.within(5.5) and m.within(None)
    assert HeldoutKL.of(torch.tensor([1.0, 5.0])).upper == pytest.approx(3 + 6.314 * math.sqrt(8) / math.sqrt(2))
    assert HeldoutKL.of(torch.tensor([3.0])).upper == math.inf and not HeldoutKL.of(torch.tensor([3.0])).within(99)
    from align.stages.ppo.budget import t95

    assert t95(60) == pytest.approx(1.671, abs=1e-3) and t95(120) == pytest.approx(1.658, abs=1e-3)
    assert not HeldoutKL.of(torch.tensor([1.0, float("nan")])).within(100.0)
    assert HeldoutKL.from_metrics(m.metrics()) == m


def test_split_heldout_is_seeded_disjoint_and_refuses_too_few():
    prompts = [f"p{i}" for i in range(20)]
    train, held = split_heldout("ppo", prompts, 5, seed=11, required=True)
    assert len(held) == 5 and len(train) == 15 and set(train).isdisjoint(held) and set(train) | set(held) == set(prompts)
    assert split_heldout("ppo", prompts, 5, seed=11, required=True) == (train, held)
    assert split_heldout("ppo", prompts, 5, seed=12, required=True)[1] != held
    assert split_heldout("ppo", prompts, 0, seed=11, required=False) == (prompts, [])
    with pytest.raises(ValueError, match=r"kl.heldout_prompts: 11 of 20 .* at most 10"):
        split_heldout("ppo", prompts, 11, seed=11, required=True)  # kl.max needs it: refused
    assert split_heldout("ppo", prompts, 11, seed=11, required=False) == (prompts, [])  # measurement only: none


def test_policy_snapshot_restores_whole_and_partitioned_parameters():
    """A plain parameter is restored in place; a ZeRO-3 one (data empty, its partition in ds_tensor) through its
    partition."""
    torch.manual_seed(0)
    whole = torch.nn.Parameter(torch.randn(3, 2))
    part = torch.nn.Parameter(torch.empty(0))
    part.ds_tensor = torch.randn(4)
    snap = PolicySnapshot([whole, part])
    snap.take(3, None)
    before = (whole.detach().clone(), part.ds_tensor.clone())
    with torch.no_grad():
        whole.add_(1.0)
        part.ds_tensor.mul_(-2.0)
    assert not torch.equal(whole, before[0])
    snap.restore()
    assert torch.equal(whole, before[0]) and torch.equal(part.ds_tensor, before[1]) and snap.iteration == 3


def test_controller_state_round_trip_and_fixed():
    a = AdaptiveKLController(0.2, 6.0, 1000)
    a.update(12.0, 64)
    b = AdaptiveKLController(0.2, 6.0, 1000)
    b.load_state_dict(a.state_dict())
    assert b.value == a.value != 0.2
    f = FixedKLController(0.3)
    f.update(100.0, 64)
    assert f.value == 0.3


def test_running_moments_match_batch_statistics():
    """[1, 2, 3] then [4, 5]: mean 3, population variance 2."""
    m = RunningMoments()
    m.update(torch.tensor([1.0, 2.0, 3.0]))
    m.update(torch.tensor([4.0, 5.0]))
    assert m.mean == pytest.approx(3.0)
    assert m.std == pytest.approx(math.sqrt(2.0))
    m2 = RunningMoments()
    m2.load_state_dict(m.state_dict())
    assert (m2.mean, m2.std) == (m.mean, m.std)


def test_running_normalisation_of_scores_that_barely_vary_only_centres_them():
    """`reward_normalization: running` divided by a std of 7e-6 (64 scores of 0.5, then 0.5 + 1e-5 noise): the
    scorer's noise came out as rewards of 1 to 5. As `initial` does, a spread under 1e-4 of max(1, |mean|) only
    centres; [1, 2, 3] then [4, 5] (mean 3, std sqrt 2) is scaled by hand: 5 -> (5 - 3) / sqrt(2)."""
    seed = 20261202
    print(f"seed {seed}")
    flat = RunningMoments()
    flat.update(torch.full((64,), 0.5))
    noise = 0.5 + 1e-5 * torch.randn(64, generator=torch.Generator().manual_seed(seed))
    flat.update(noise)
    assert torch.allclose(flat.normalise(noise).double(), noise.double() - flat.mean, atol=1e-7)
    assert flat.normalise(noise).abs().max() < 1e-4
    m = RunningMoments()
    m.update(torch.tensor([1.0, 2.0, 3.0]))
    m.update(torch.tensor([4.0, 5.0]))
    assert m.normalise(torch.tensor([5.0])).item() == pytest.approx(2 / math.sqrt(2.0))


def test_prompt_stream_covers_each_epoch_and_resumes_identically():
    s = PromptStream(10, seed=3)
    first = s.take(6) + s.take(4)
    assert sorted(first) == list(range(10))  # one epoch = every prompt once
    state = s.state_dict()
    ahead = s.take(7)
    t = PromptStream(10, seed=3)
    t.load_state_dict(state)
    assert t.take(7) == ahead
    u = PromptStream(10, seed=3)
    assert u.take(10) == first


def test_ziegler_beta_never_crosses_zero_however_short_the_horizon():
    """coef 0.2, target 4, 128 episodes an update, horizon 10: the rule as written multiplies beta by
    1 - 0.2 * 12.8 = -1.56 (beta -0.312, then a KL over target pushed it further down: a bonus for drifting). Capped
    at K_beta = 1, beta moves 20% at most: 0.2 -> 0.16 (KL under target) -> 0.192 (over)."""
    ctl = AdaptiveKLController(0.2, target=4.0, horizon=10)
    ctl.update(1.0, 128)
    assert ctl.value == pytest.approx(0.16)
    ctl.update(9.0, 128)
    assert ctl.value == pytest.approx(0.192)
    slow = AdaptiveKLController(0.2, target=4.0, horizon=1000)
    slow.update(1.0, 128)
    assert slow.value == pytest.approx(0.2 * (1 - 0.2 * 0.128))  # Ziegler's rule unchanged below the cap


def test_reward_scale_only_centres_scores_that_barely_vary():
    """A judge scoring every initial response alike (std 5e-6 around 3): 1/std made a score of 2.0 into -200,000."""
    from align.stages.ppo.state import RewardScale

    flat = RewardScale()
    assert flat.fit(torch.tensor([3.0, 3.0 + 1e-5] * 64)) is False
    assert flat.gain == 1.0 and flat(torch.tensor([2.0])).item() == pytest.approx(2.0 - (3.0 + 5e-6))
    spread = RewardScale()
    assert spread.fit(torch.tensor([1.0, 3.0] * 64)) is True
    assert (spread.gain, spread.bias) == (pytest.approx(1.0), pytest.approx(-2.0))


def test_heldout_kl_counts_distinct_prompts_not_repeats():
    """Fewer held-out prompts than processes repeat some: eight KLs of two prompts are a bound of two (t with 1 degree
    of freedom, 6.314), not of eight (1.895), and its spread is the two prompts' (each prompt's responses averaged
    first): the spread of all eight rows over a count of two made the bound too tight (1, 3, 1, 3 gave 7.16 where
    the prompts' own 1 and 3 give 8.31)."""
    kls = torch.tensor([1.0, 5.0] * 4)
    m = HeldoutKL.of(kls, prompts=[0, 1] * 4)
    assert m.n == 2 and m.upper == pytest.approx(3 + 6.314 * math.sqrt(8) / math.sqrt(2))
    assert HeldoutKL.of(kls).n == 8
    m = HeldoutKL.of(torch.tensor([1.0, 3.0, 1.0, 3.0]), prompts=[0, 1, 0, 1])
    assert m.upper == pytest.approx(2 + 6.314 * math.sqrt(2) / math.sqrt(2))  # 8.31
    m = HeldoutKL.of(torch.tensor([1.0, 2.0, 5.0, 6.0]), prompts=[0, 0, 1, 1])  # a prompt's two draws differ
    assert (m.mean, m.n) == (pytest.approx(3.5), 2) and m.std == pytest.approx(math.sqrt(8))


def test_each_process_measures_an_equal_share_and_the_gathered_rows_name_their_prompts():
    from align.stages.ppo.budget import heldout_shares

    assert heldout_shares(2, 4) == [[0], [1], [0], [1]]  # fewer prompts than processes: repeated
    assert heldout_shares(7, 2) == [[0, 2, 4], [1, 3, 5]]  # an equal share each: the odd one left out
    assert heldout_shares(5, 1) == [[0, 1, 2, 3, 4]]


def test_a_kl_that_is_not_finite_leaves_beta_as_it_was():
    """A NaN KL made Ziegler's beta NaN, and reset the PI controller's integral and beta to coef (max(0, nan) is 0 in
    Python), silently; both keep beta now."""
    pi = PIKLController(0.1, target=4.0, kp=0.1, ki=0.1)
    pi.update(10.0, 64)
    before = (pi.value, pi.integral)
    assert before == (pytest.approx(0.1 + 0.6 + 0.4), 4.0)  # the integral takes at most target (4) a reading
    for kl in (float("nan"), float("inf")):
        pi.update(kl, 64)
        assert (pi.value, pi.integral) == before
    ziegler = AdaptiveKLController(0.1, target=4.0, horizon=64)
    ziegler.update(8.0, 64)
    assert ziegler.value == pytest.approx(0.12)
    ziegler.update(float("nan"), 64)
    assert ziegler.value == pytest.approx(0.12)


def test_objective_kl_is_the_sequence_kl_in_nats_whatever_estimator_the_penalty_takes(monkeypatch):
    """objective/kl summed the penalty's per-token estimator; under k2 (biased: E[k2] = 0.31 nats where the KL is
    0.64 for a peaked policy) the controller without held-out prompts steered that to kl.target, and kl_last
    understated the KL. It is the summed log-ratio (k1) now, as the held-out KL and the evaluation measure it; the
    non-score reward stays the penalty's own."""
    from types import SimpleNamespace

    import align.stages.ppo.metrics as metrics
    from align.modeling.losses import kl_estimate

    torch.manual_seed(0)
    print("seed 0")
    monkeypatch.setattr(metrics, "computed_padding_fraction", lambda *a: 0.0)
    logprobs, ref = torch.randn(4, 5) - 1.0, torch.randn(4, 5) - 2.0
    rmask = torch.ones(4, 5)
    rmask[0, 3:] = 0
    accelerator = SimpleNamespace(gather=lambda t: t, device=torch.device("cpu"), reduce=lambda t, op: t,
                                  unwrap_model=lambda m: m)
    s = SimpleNamespace(accelerator=accelerator, cfg=SimpleNamespace(rollout_batch_size=4, mini_batch_size=2), world=1,
                        model=SimpleNamespace(policy=None), optimizer=SimpleNamespace(param_groups=[{"lr": 1e-6}]))
    rollout = SimpleNamespace(eos_found=torch.ones(4, dtype=torch.bool), attention_mask=torch.ones(4, 8))
    b = SimpleNamespace(rollout=rollout, rmask=rmask, scores=torch.zeros(4), scores_used=torch.zeros(4),
                        penalties=torch.zeros(4), logprobs=logprobs, ref_logprobs=ref, t_gen=0.0, gap=None)
    k1 = ((logprobs - ref) * rmask).sum(1).mean().item()
    for estimator in ("k1", "k2", "k3"):
        kl = kl_estimate(logprobs, ref, estimator) * rmask
        row = metrics.iteration_metrics(s, b, kl, 0.1, {}, None, 0.0, 0.0, {})
        assert math.isclose(row["objective/kl"], k1, rel_tol=1e-6), estimator
        assert math.isclose(row["objective/non_score_reward"], (-0.1 * kl).sum(1).mean().item(), rel_tol=1e-6)
    assert not math.isclose(kl_estimate(logprobs, ref, "k2").mul(rmask).sum(1).mean().item(), k1, rel_tol=1e-3)
    one = SimpleNamespace(**{**vars(b), "rmask": rmask[:1], "scores": torch.ones(1), "scores_used": torch.ones(1),
                             "penalties": torch.zeros(1), "logprobs": logprobs[:1], "ref_logprobs": ref[:1],
                             "rollout": SimpleNamespace(eos_found=torch.ones(1, dtype=torch.bool),
                                                        attention_mask=torch.ones(1, 8))})
    row = metrics.iteration_metrics(s, one, kl[:1], 0.1, {}, None, 0.0, 0.0, {})  # one episode (rollout_batch_size 1):
    assert row["objective/scores_std"] == 0.0  # was NaN in every row (the unbiased std of one score)
    assert all(math.isfinite(v) for v in row.values() if isinstance(v, float)), row


def test_publishing_outside_zero3_copies_no_whole_state_on_any_process(tmp_path):
    """A review (2026-11-30): publish_policy called accelerate's get_state_dict on every process, which outside
    ZeRO-3 (ZeRO-1/2 under DeepSpeed) clones the whole policy and value model to host memory on each (~32 GB per
    process at 8B), where only the main process writes, from weights it holds whole. Now only ZeRO-3 gathers; the
    published weights are the policy's either way."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from align.stages.ppo import publish_policy

    torch.manual_seed(7)
    print("seed 7")
    policy = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=1))
    both = torch.nn.Module()
    both.policy, both.value = policy, torch.nn.Linear(16, 1)
    calls = []

    class Accelerator:
        def __init__(self, main):
            self.is_main_process = main

        def get_state_dict(self, model):
            calls.append(self.is_main_process)
            return {k: v.clone() for k, v in model.state_dict().items()}

        def unwrap_model(self, model):
            return model

    for zero3 in (False, True):
        calls.clear()
        out = tmp_path / f"zero3_{zero3}"
        for main in (False, True):
            s = SimpleNamespace(ctx=SimpleNamespace(compute=SimpleNamespace(distributed_zero3=zero3)), model=both,
                                cfg=SimpleNamespace(lora=SimpleNamespace(enabled=False)), accelerator=Accelerator(main),
                                tokenizer=SimpleNamespace(save_pretrained=lambda path: None))
            publish_policy(s, out)
        assert calls == ([False, True] if zero3 else []), (zero3, calls)  # under ZeRO-3 a collective: every process
        loaded = AutoModelForCausalLM.from_pretrained(out)
        for name, tensor in policy.state_dict().items():
            assert torch.equal(loaded.state_dict()[name], tensor), name

"""PPO state objects: the adaptive KL controller's beta trace by hand, running moments, data position."""

import math

import pytest
import torch

from align.stages.ppo.state import AdaptiveKLController, FixedKLController, PromptStream, RunningMoments


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

"""Online-RL settings that trained something other than asked (a probe of the RL settings, 2026-11-29): each passed
`align validate` and is now refused naming the field and the fix, or set as the setting's own docs say."""

from __future__ import annotations

import pytest

from conftest import REPO, refused, validate

ONLINE = str(REPO / "pipelines" / "online_rl.yaml")
DEFAULT = str(REPO / "pipelines" / "default.yaml")


@pytest.mark.parametrize("pipeline, overrides, needles", [
    # RLOO/GRPO sampled with top_k/top_p while their KL to the reference read the whole distribution (PPO refused it)
    (ONLINE, ["rloo.generation.top_p=0.5"], ["generation.top_k null / top_p 0.5: RLOO's KL to the reference"]),
    (ONLINE, ["grpo.generation.top_k=5"], ["generation.top_k 5", "GRPO's KL to the reference"]),
    # a ratio clip of 1 or more never binds below (1 - epsilon <= 0)
    (ONLINE, ["grpo.epsilon=3"], ["stages.grpo.epsilon", "lower clip 1 - epsilon must stay above 0"]),
    (DEFAULT, ["ppo.clip_range=1.5"], ["stages.ppo.clip_range", "lower clip 1 - clip_range"]),
    # the value model never learns at vf_coef 0, and GAE reads its initial values
    (DEFAULT, ["ppo.vf_coef=0"], ["stages.ppo.vf_coef", "the value model never learns"]),
    # an adaptive beta that can never move
    (DEFAULT, ["ppo.kl.controller=pi", "ppo.kl.kp=0", "ppo.kl.ki=0"], ["kl.kp and kl.ki: both 0 with kl.controller: pi"]),
    # k2/k3 in the reward: their policy gradient is not the KL's, and ~0 near the reference (a review, 2026-11-30)
    (DEFAULT, ["ppo.kl.estimator=k3"], ["stages.ppo.kl.estimator: 'k3' is not allowed: must be one of k1",
                                         "not its gradient", "grad KL(pi||ref) - grad KL(ref||pi)", "use k1"]),
    # one held-out prompt has no spread: no upper bound exists
    (DEFAULT, ["ppo.kl.max=10", "ppo.kl.heldout_prompts=1", "ppo.kl.target=5", "ppo.kl.controller=pi"],
     ["kl.max: 10 with kl.heldout_prompts: 1", "needs at least 2"]),
    # sweeps over settings the stage leaves unread trained identical variants
    (DEFAULT, ["ppo.sweep={kl.kp: [0.1, 0.5]}", "ppo.kl.controller=ziegler"],
     ["stages.ppo.sweep.kl.kp: variants 'ppo-kl.kp_0.1' and 'ppo-kl.kp_0.5' differ only in kl.kp, which the stage does not read (kl.controller is ziegler)"]),
    (DEFAULT, ["ppo.sweep={kl.horizon: [100, 1000]}", "ppo.kl.controller=pi"],
     ["stages.ppo.sweep.kl.horizon:", "differ only in kl.horizon, which the stage does not read (kl.controller is pi)"]),
    (ONLINE, ["grpo.sweep={generation.batch_size: [8, 64]}"],
     ["stages.grpo.sweep.generation.batch_size:", "the stage does not read", "one call per process"]),
    # TRL 1.16's cispo caps the weights at epsilon_high alone, sapo's soft gate reads neither clip
    (ONLINE, ["grpo.loss_type=cispo", "grpo.sweep={epsilon: [0.1, 0.3]}"],
     ["stages.grpo.sweep.epsilon:", "differ only in epsilon", "(loss_type cispo does not read it)"]),
    (ONLINE, ["grpo.loss_type=sapo", "grpo.sweep={epsilon_high: [0.2, 0.28]}"],
     ["stages.grpo.sweep.epsilon_high:", "(loss_type sapo does not read it)"]),
    # a value model read off the reward model's raw scores, trained on running-normalised returns
    (DEFAULT, ["ppo.reward_normalization=running"],
     ["stages.ppo: value_init: 'reward' with reward_normalization: running", "value_init: policy"]),
    (DEFAULT, ["ppo.reward_normalization=none", "ppo.sweep={reward_normalization_samples: [64, 256]}"],
     ["differ only in reward_normalization_samples", "(reward_normalization is none)"]),
    # KL to the reference at two temperatures: PPO's budget (kl.max) and the report's "KL to sft" are two quantities
    (DEFAULT, ["ppo.generation.temperature=0.7"],
     ["sampling temperatures differ: stages.ppo.generation.temperature=0.7, stages.evaluate.generation.temperature=1",
      "PPO's KL to the reference (its penalty, and a kl budget) is taken at its own temperature", "Set them equal"]),
    (ONLINE, ["grpo.generation.temperature=0.9"],
     ["stages.grpo.generation.temperature=0.9, stages.evaluate.generation.temperature=1", "GRPO's KL"]),
    # DAPO's clip-higher habit under cispo caps every importance weight (about 1 on policy) at 0.28
    (ONLINE, ["grpo.loss_type=cispo", "grpo.epsilon_high=0.28"],
     ["stages.grpo: epsilon_high: 0.28 under loss_type: cispo caps the importance weights", "a cap above 1"]),
])
def test_rl_settings_that_would_not_train_as_asked_are_refused(pipeline, overrides, needles, capsys):
    rc, out = validate(capsys, pipeline, *overrides)
    refused(out, rc, *needles)


def test_swept_settings_the_stage_reads_still_expand(capsys):
    rc, out = validate(capsys, DEFAULT, "ppo.sweep={kl.kp: [0.1, 0.5]}", "ppo.kl.controller=pi")
    assert rc == 0 and "sweep ppo: 2 variants" in out, out[-2000:]
    # variants that differ in what the stage reads (the controller) are no twins, though one leaves kl.kp unread
    rc, out = validate(capsys, DEFAULT, "ppo.sweep={kl.controller: [pi, ziegler], kl.kp: [0.1]}")
    assert rc == 0 and "sweep ppo: 2 variants" in out, out[-2000:]
    for loss, key in (("dapo", "epsilon"), ("cispo", "epsilon_high")):  # the clips these losses read
        rc, out = validate(capsys, ONLINE, f"grpo.loss_type={loss}", f"grpo.sweep={{{key}: [0.1, 0.3]}}" if loss ==
                           "dapo" else f"grpo.sweep={{{key}: [2.0, 5.0]}}")
        assert rc == 0 and "sweep grpo: 2 variants" in out, out[-2000:]


def test_cispo_caps_importance_weights_at_its_own_epsilon_max_not_the_clip_range():
    """TRL's cispo clamps the importance weights at epsilon_high, which defaults to epsilon (0.2): every weight of
    ratio 0.9..1.1 became 0.2, the gradient a fifth and nearly every token 'clipped'."""
    import types

    from align.config.grpo import GRPOStage
    from align.stages import grpo, online_rl

    passed = {}

    def run(ctx, trainer, config, **algorithm_args):  # what the GRPO stage hands the shared run, and so TRL's config
        passed.update(algorithm_args)
        return {}

    for loss, given, expected in (("cispo", None, 5.0), ("cispo", 2.0, 2.0), ("dapo", None, None), ("dapo", 0.28, 0.28)):
        passed.clear()
        original, online_rl.run = online_rl.run, run
        try:
            grpo.run(types.SimpleNamespace(cfg=GRPOStage(loss_type=loss, epsilon_high=given)))
        finally:
            online_rl.run = original
        assert passed["epsilon_high"] == expected and passed["loss_type"] == loss, (loss, given, passed)


def test_a_conflicting_override_of_a_dotted_swept_key_names_a_fix_that_parses(capsys):
    """The fix named was `ppo.sweep.kl.target=[...]`, which is itself refused ('kl' is a group of settings)."""
    rc, out = validate(capsys, DEFAULT, "ppo.sweep={kl.target: [3, 5]}", "ppo.kl.target=4")
    assert rc == 2 and "e.g. 'ppo.sweep={kl.target: [3, 5]}' with kl.target's list edited" in out, out[-1500:]
    rc, out = validate(capsys, DEFAULT, "ppo.sweep={kl.target: [3, 5]}")  # the fix as named: it parses
    assert rc == 0, out[-1500:]

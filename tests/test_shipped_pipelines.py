"""Shipped pipelines whose claims are structural: iterated on-policy DPO chains its rounds; the PPO/GRPO/RLOO
comparison gives the three algorithms the same policy, reward model, prompts, episode budget, passes and length."""

from __future__ import annotations

from align.config import load_pipeline
from align.plan import build_plan
from conftest import REPO


def test_iterated_dpo_pipeline_chains_three_on_policy_rounds():
    path = REPO / "pipelines" / "iterated_dpo.yaml"
    plans = {p.name: p for p in build_plan(load_pipeline(path), path)}
    previous = "sft"
    for k in (1, 2, 3):
        pairs, dpo = plans[f"pairs{k}"], plans[f"dpo{k}"]
        assert pairs.cfg.type == "preferences" and pairs.deps == [previous]  # sampled from the previous policy
        assert dpo.cfg.type == "dpo" and dpo.cfg.policy == previous and dpo.cfg.data == f"pairs{k}"
        assert sorted(dpo.deps) == sorted([previous, f"pairs{k}"])
        previous = f"dpo{k}"
    assert plans["evaluate"].cfg.policies == ["sft", "dpo1", "dpo2", "dpo3"]
    # every round is its own stage with its own fingerprint (and run directory)
    assert len({p.fingerprint for p in plans.values()}) == len(plans)


def test_online_rl_pipeline_gives_ppo_grpo_and_rloo_the_same_budget():
    path = REPO / "pipelines" / "online_rl.yaml"
    stages = load_pipeline(path).stages
    ppo, grpo, rloo = stages["ppo"], stages["grpo"], stages["rloo"]
    episodes = {"ppo": ppo.iterations * ppo.rollout_batch_size}
    for name, st in (("grpo", grpo), ("rloo", rloo)):
        # TRL samples per_device_batch_size x steps_per_generation completions every steps_per_generation x
        # num_iterations micro-steps, so each episode is trained on num_iterations times
        episodes[name] = st.max_steps * st.gradient_accumulation_steps * st.per_device_batch_size // st.num_iterations
        assert st.num_iterations == ppo.ppo_epochs  # passes over each batch of samples
        assert (st.policy, st.reward, st.prompts) == (ppo.policy, ppo.reward, ppo.prompts)
        assert st.generation.max_new_tokens == ppo.generation.max_new_tokens
    assert len(set(episodes.values())) == 1, episodes
    assert stages["evaluate"].policies == ["sft", "ppo", "grpo", "rloo"]

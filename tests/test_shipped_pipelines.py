"""Shipped pipelines whose claims are structural: iterated on-policy DPO chains its rounds; the PPO/GRPO/RLOO
comparison gives the three algorithms the same policy, reward model, prompts, episode budget, passes and length."""

from __future__ import annotations

from align.config import load_pipeline
from align.orchestrator.plan import build_plan
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


def test_frontier_pipeline_sweeps_five_algorithms_over_four_kl_strengths_on_one_budget():
    """pipelines/frontier.yaml: shared sft/preferences/reward; PPO (reward model), PPO (gold judge), DPO, GRPO and
    RLOO each swept over >= 4 distinct KL strengths; the online ones with one episode budget, passes, optimiser
    step size and response length; evaluate takes every variant."""
    path = REPO / "pipelines" / "frontier.yaml"
    cfg = load_pipeline(path)
    plans = {p.name: p for p in build_plan(cfg, path)}
    strength = {"ppo_rm": "kl.coef", "ppo_gold": "kl.coef", "dpo": "beta", "grpo": "beta", "rloo": "beta"}
    by_group: dict[str, list] = {}
    for name, v in cfg.variants.items():
        by_group.setdefault(v["stage"], []).append((name, v["values"]))
    assert sorted(by_group) == sorted(strength)
    for group, variants in by_group.items():
        values = [vals[strength[group]] for _, vals in variants]
        assert len(set(values)) >= 4 and all(set(vals) == {strength[group]} for _, vals in variants), group
        for name, _ in variants:  # upstream is shared: the same sft (and reward) stage for every variant
            assert "sft" in plans[name].deps and not set(plans[name].deps) - {"sft", "reward", "preferences"}
    stages = cfg.stages
    assert {stages[n].type for n, _ in by_group["ppo_rm"] + by_group["ppo_gold"]} == {"ppo"}
    assert {stages[n].reward for n, _ in by_group["ppo_gold"]} == {"vader"}
    assert {stages[n].kl.adaptive for n, _ in by_group["ppo_rm"] + by_group["ppo_gold"]} == {False}
    budget, step, passes, length = set(), set(), set(), set()
    for group in ("ppo_rm", "ppo_gold", "grpo", "rloo"):
        for name, _ in by_group[group]:
            st = stages[name]
            if st.type == "ppo":
                budget.add(st.iterations * st.rollout_batch_size)
                step.add(st.mini_batch_size)
                passes.add(st.ppo_epochs)
            else:  # TRL: per_device_batch_size x steps_per_generation completions every (that x num_iterations) steps
                per_round = st.per_device_batch_size * (st.steps_per_generation or st.gradient_accumulation_steps)
                budget.add(st.max_steps * st.per_device_batch_size * st.gradient_accumulation_steps
                           // st.num_iterations)
                step.add(st.per_device_batch_size * st.gradient_accumulation_steps)
                passes.add(st.num_iterations)
                assert per_round == stages["ppo_rm-kl.coef_0.1"].rollout_batch_size
            length.add(st.generation.max_new_tokens)
    assert (len(budget), len(step), len(passes), len(length)) == (1, 1, 1, 1), (budget, step, passes, length)
    assert stages["evaluate"].policies == ["sft", *(n for g in ("ppo_rm", "ppo_gold", "dpo", "grpo", "rloo")
                                                    for n, _ in by_group[g])]

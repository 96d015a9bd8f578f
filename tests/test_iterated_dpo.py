"""The shipped iterated on-policy DPO pipeline: each round's pairs are sampled from the previous round's policy,
and each round's DPO starts from that policy (so its reference is the previous round)."""

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

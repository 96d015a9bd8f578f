"""The family matrix, part b: GPT-2, GPT-NeoX (Pythia) and OPT (learned or partial-rotary positions).

Each family's tiny model (its real config class, shrunk; tests/families.py) runs sft -> reward -> ppo -> dpo
-> evaluate through `align run`, and its reward and policy are read the same with left and right padding.
The matrix is split in two files so the suite's two workers run the halves side by side (test_families_a.py: Llama, Mistral, Qwen2 and Gemma 3).
"""

from __future__ import annotations

import pytest

from families import Runs, check_policy_padding_invariance, check_reward_padding_invariance, check_run

pytestmark = pytest.mark.slow

FAMILIES = ["gpt2", "gpt_neox", "opt"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.mktemp("families"))


@pytest.mark.parametrize("family", FAMILIES)
def test_every_stage_runs_and_reloads_with_auto_classes(runs, family):
    check_run(family, runs.run(family))


@pytest.mark.parametrize("family", FAMILIES)
def test_reward_read_at_the_same_token_with_left_and_right_padding(runs, family):
    check_reward_padding_invariance(*runs.base(family))


@pytest.mark.parametrize("family", FAMILIES)
def test_policy_logprobs_and_values_do_not_shift_under_left_padding(runs, family):
    check_policy_padding_invariance(*runs.base(family))

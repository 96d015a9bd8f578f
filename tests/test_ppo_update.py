"""PPO's update step in-process: dropout off gives ratio 1 at the first step; gradients of policy and value are
clipped separately (on CPU here, under DeepSpeed ZeRO-2 in a 2-process probe); judges as the reward; the
response-length consistency check; the reward gain and bias."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from align.config import parse_pipeline
from align.config.ppo import PPOStage
from align.core.errors import PipelineError
from align.orchestrator.validate import validate

REPO = Path(__file__).resolve().parent.parent
SEED = 1234


def _gpt2_pair(dropout: float):
    """A tiny GPT-2 (dropout in embeddings, attention and residuals) and a value model of the same config."""
    from transformers import GPT2Config, GPT2ForSequenceClassification, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=2, n_head=2, resid_pdrop=dropout,
                     embd_pdrop=dropout, attn_pdrop=dropout, num_labels=1, pad_token_id=0)
    torch.manual_seed(SEED)
    return GPT2LMHeadModel(cfg), GPT2ForSequenceClassification(cfg)


def _first_step_stats(disable: bool) -> dict[str, float]:
    from accelerate import Accelerator

    from align.modeling.models import disable_dropout
    from align.stages.ppo.update import ppo_update
    from align.stages.ppo.models import PolicyAndValue

    print(f"seed {SEED}")
    policy, value = _gpt2_pair(dropout=0.1)
    if disable:
        disable_dropout(policy), disable_dropout(value)
    model = PolicyAndValue(policy, value).train()  # train mode on purpose: only disable_dropout protects
    groups = {"policy": list(policy.parameters()), "value": list(value.parameters())}
    acc = Accelerator(cpu=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(SEED)
    ids = torch.randint(1, 64, (8, 12), generator=g)
    mask = torch.ones_like(ids)
    rmask = torch.ones(8, 6)
    with torch.no_grad():
        old_lp, _, old_v = model(ids, mask, 6, 1.0)  # the rollout's forward pass (step 3)
    cfg = PPOStage(type="ppo", ppo_epochs=1, mini_batch_size=4, rollout_batch_size=8)
    adv = torch.randn(8, 6, generator=g)
    return ppo_update(cfg, acc, model, opt, groups, ids, mask, rmask, 6, old_lp, old_v, adv, old_v + adv)


def test_gpt2_with_dropout_has_ratio_exactly_one_at_the_first_step():
    stats = _first_step_stats(disable=True)
    assert stats["policy/ratio_first"] == 1.0
    assert stats["policy/approx_kl_first"] == 0.0
    # the control: the same model with dropout left on disagrees with its own rollout at the first step
    control = _first_step_stats(disable=False)
    assert control["policy/ratio_first"] != 1.0 and control["policy/approx_kl_first"] > 0


class _RecordingSGD(torch.optim.SGD):
    """SGD that records each parameter group's gradient norm at the moment it steps (after clipping)."""

    def __init__(self, params, lr):
        super().__init__(params, lr=lr)
        self.seen: list[list[float]] = []

    def step(self, closure=None):
        self.seen.append([math.sqrt(sum(float(p.grad.pow(2).sum()) for p in g["params"] if p.grad is not None))
                          for g in self.param_groups])
        return super().step(closure)


def test_policy_and_value_gradients_are_clipped_separately_on_cpu():
    from accelerate import Accelerator

    from align.stages.ppo.optim import backward_and_step

    torch.manual_seed(SEED)
    policy, value = torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)
    groups = {"policy": list(policy.parameters()), "value": list(value.parameters())}
    opt = _RecordingSGD([{"params": groups["policy"]}, {"params": groups["value"]}], lr=0.0)
    x = torch.randn(16, 8)
    loss = 0.01 * policy(x).pow(2).mean() + 1000.0 * value(x).pow(2).mean()  # small policy, huge value grads
    norms = backward_and_step(Accelerator(cpu=True), policy, opt, loss, groups, max_norm=1.0)
    assert norms["policy"] < 1.0 < norms["value"]
    policy_seen, value_seen = opt.seen[-1]
    assert policy_seen == pytest.approx(norms["policy"], rel=1e-6)  # untouched: not shrunk by the value norm
    assert value_seen == pytest.approx(1.0, rel=1e-4)


def test_gradient_norms_and_skipped_steps_are_averaged_over_optimiser_steps_not_mini_batches(monkeypatch):
    """With gradient accumulation 2, 4 mini-batches make 2 optimiser steps: the logged gradient norms are the mean
    of the 2 steps' norms, and when every step is skipped the fraction is 1 and the iteration stops (averaged over
    the 4 mini-batches, as before, the fraction was 0.5 and the check never fired)."""
    from accelerate import Accelerator

    import importlib

    from align.modeling.models import disable_dropout
    from align.runtime.context import NonFiniteLossError
    from align.stages.ppo.models import PolicyAndValue

    update = importlib.import_module("align.stages.ppo.update")  # the package's `update` names a function

    def run(skip: bool) -> tuple[dict[str, float], list[dict[str, float]]]:
        print(f"seed {SEED}")
        policy, value = _gpt2_pair(dropout=0.0)
        disable_dropout(policy), disable_dropout(value)
        model = PolicyAndValue(policy, value)
        groups = {"policy": list(policy.parameters()), "value": list(value.parameters())}
        seen: list[dict[str, float]] = []

        def recording(*args, **kwargs):
            norms = real(*args, **kwargs)
            if norms:
                seen.append(dict(norms))
                if skip:
                    norms["skipped"] = 1.0
            return norms

        monkeypatch.setattr(update, "backward_and_step", recording)
        g = torch.Generator().manual_seed(SEED)
        ids = torch.randint(1, 64, (8, 12), generator=g)
        mask, rmask = torch.ones_like(ids), torch.ones(8, 6)
        with torch.no_grad():
            old_lp, _, old_v = model(ids, mask, 6, 1.0)
        cfg = PPOStage(type="ppo", ppo_epochs=1, mini_batch_size=2, rollout_batch_size=8, gradient_accumulation_steps=2)
        adv = torch.randn(8, 6, generator=g)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        out = update.ppo_update(cfg, Accelerator(cpu=True, gradient_accumulation_steps=2), model, opt, groups, ids,
                                mask, rmask, 6, old_lp, old_v, adv, old_v + adv)
        return out, seen

    real = update.backward_and_step
    out, seen = run(skip=False)
    assert len(seen) == 2  # 4 mini-batches, accumulation 2
    for group in ("policy", "value"):
        assert out[f"{group}/grad_norm"] == pytest.approx(sum(n[group] for n in seen) / 2, rel=1e-6)
    assert out["train/skipped_step_fraction"] == 0.0
    with pytest.raises(NonFiniteLossError, match="100% of this iteration's optimiser steps"):
        run(skip=True)


def test_under_deepspeed_a_non_finite_step_is_skipped_and_never_applied_silently():
    """PPO turns DeepSpeed's joint clipping off but keeps its non-finite check on whatever the config said; a step
    DeepSpeed skipped is counted, and one it applied although the norms were not finite stops the stage."""
    from types import SimpleNamespace

    from align.runtime.context import NonFiniteLossError
    from align.stages.ppo.optim import backward_and_step, disable_deepspeed_clipping

    config = {"gradient_clipping": 1.0, "bf16": {"enabled": True, "check_grad_overflow": False},
              "zero_optimization": {"stage": 2, "compute_grad_norm": False}}
    accelerator = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(deepspeed_config=config)),
                                  sync_gradients=True, device=torch.device("cpu"))
    disable_deepspeed_clipping(accelerator)
    assert config == {"gradient_clipping": 0.0, "bf16": {"enabled": True, "check_grad_overflow": True},
                      "zero_optimization": {"stage": 2}}
    legacy = {"bfloat16": {"enabled": True, "check_grad_overflow": False}}  # DeepSpeed's older name for the section
    disable_deepspeed_clipping(SimpleNamespace(state=SimpleNamespace(
        deepspeed_plugin=SimpleNamespace(deepspeed_config=legacy))))
    assert legacy["bfloat16"]["check_grad_overflow"] is True

    class Engine:  # DeepSpeed's engine as PPO calls it
        def __init__(self, applies: bool):
            self.applies = applies

        def set_gradient_accumulation_boundary(self, boundary):
            pass

        def backward(self, loss):
            loss.backward()

        def step(self):
            pass

        def was_step_applied(self):
            return self.applies

    for applies in (False, True):
        weight = torch.nn.Parameter(torch.ones(3))
        loss = (weight * torch.tensor([1.0, float("nan"), 1.0])).sum()
        groups = {"policy": [weight], "value": []}
        if not applies:
            norms = backward_and_step(accelerator, Engine(applies), None, loss, groups, max_norm=1.0)
            assert norms["skipped"] == 1.0 and math.isnan(norms["policy"])
        else:
            with pytest.raises(NonFiniteLossError, match="the weights are no longer finite"):
                backward_and_step(accelerator, Engine(applies), None, loss, groups, max_norm=1.0)


def test_under_offload_the_gradients_copies_land_before_their_norm_is_read():
    """ZeRO-1/2 with the optimiser offloaded copies each gradient into host memory asynchronously and waits for the
    copies only in its own step; align's per-group norm is read before that step, so it waits first: here the
    "copy" lands only when waited for, and the norm is that of the landed gradient (3), not of the zeros before it."""
    import math
    from types import SimpleNamespace

    import torch

    from align.stages.ppo.optim import backward_and_step

    weight = torch.nn.Parameter(torch.zeros(9))
    landed = torch.ones(9)

    class Offloading:  # DeepSpeed's ZeRO-2 optimiser with offload, as the clipping meets it
        def _wait_for_offload_copies(self):
            weight.grad.copy_(landed)

    class Engine:
        optimizer = Offloading()

        def set_gradient_accumulation_boundary(self, boundary):
            pass

        def backward(self, loss):
            weight.grad = torch.zeros(9)  # the copy still in flight

        def step(self):
            pass

        def was_step_applied(self):
            return True

    accelerator = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(deepspeed_config={})),
                                  sync_gradients=True, device=torch.device("cpu"))
    norms = backward_and_step(accelerator, Engine(), None, weight.sum(), {"policy": [weight], "value": []}, None)
    assert math.isclose(norms["policy"], 3.0)


def test_a_parameter_another_process_optimises_is_not_counted_here():
    """DeepSpeed's ZeRO-1/2 optimisers link every parameter of a group to a partition (`_hp_mapping`, None where
    another process's optimiser owns it). Where this process still holds such a parameter's whole gradient (ZeRO-1
    need not free it before the step), counting it as replicated added the other processes' parameters to this
    process's norm: each process clipped by a different, inflated norm."""
    import torch

    from align.stages.ppo.optim import _local_partitions

    theirs = torch.nn.Parameter(torch.ones(4))
    theirs.grad, theirs._hp_mapping = torch.ones(4), None
    assert _local_partitions(theirs) == (None, True)
    plain = torch.nn.Parameter(torch.ones(4))  # DeepSpeed without a ZeRO optimiser: every process the whole gradient
    plain.grad = torch.full((4,), 2.0)
    g, partitioned = _local_partitions(plain)
    assert g is plain.grad and partitioned is False


CLIP_PROBE = REPO / "tests" / "probes" / "clip_probe.py"


def clip_probe_runs(tmp_path, runs: dict[str, list[str]]) -> dict[str, dict]:
    """Each run: the command before the probe (a launcher and its flags; [] for a plain process) and the probe's
    arguments after its output file. Returns each run's JSON by name."""
    out = {}
    for name, (before, after) in runs.items():
        cmd = [*before, str(CLIP_PROBE), str(tmp_path / f"{name}.json"), *after]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        out[name] = json.loads((tmp_path / f"{name}.json").read_text())
    return out


def accelerate_config(name: str) -> str:
    return str(REPO / "pipelines" / "accelerate" / f"{name}.yaml")


@pytest.mark.distributed
def test_clipping_under_deepspeed_zero1_2_and_3_matches_cpu_without_gathering_a_gradient(tmp_path):
    """The same probe (seeded models and loss, SGD lr 1) on one CPU process and under 2-process ZeRO-1, 2 and 3: the
    step each group took (parameter change = clipped gradient) has norm min(pre-clip norm, 1) in all four, and the
    pre-clip norms agree (ZeRO-1 keeps every gradient whole on every process: only the process whose optimiser owns
    a parameter counts it, or each process's norm counted the others' parameters too). Under DeepSpeed the norms come from each process's own gradient partitions: no whole
    gradient is gathered (the old clipping called safe_get_full_grad once per parameter: 4 here, 582 at 8B). A NaN
    loss then skips the step everywhere, the weights untouched."""
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--config_file"]
    out = clip_probe_runs(tmp_path, {"cpu": ([sys.executable], []),
                                     **{z: ([*launch, accelerate_config(z)], []) for z in ("zero1", "zero2", "zero3")}})
    print({k: (v["gathers"], v["all_reduces_in_step"]) for k, v in out.items()})
    assert [out[k]["world"] for k in ("cpu", "zero1", "zero2", "zero3")] == [1, 2, 2, 2]
    for name, r in out.items():
        for group in ("policy", "value"):
            assert r["step_norm"][group] == pytest.approx(min(r["pre_norm"][group], 1.0), rel=1e-3), (name, group)
            assert r["pre_norm"][group] == pytest.approx(out["cpu"]["pre_norm"][group], rel=1e-4), (name, group)
        assert r["pre_norm"]["value"] > 1.0 > r["pre_norm"]["policy"], name  # one clipped, one not
        assert r["gathers"] == {"safe_get_full_grad": 0, "get_full_hp_grad": 0}, (name, r["gathers"])
        assert r["nan_skipped"] == 1.0 and r["nan_weights_unchanged"] is True, name


@pytest.mark.distributed
def test_clipping_under_deepspeed_bf16_matches_one_process_without_gathering_a_gradient(tmp_path):
    """The GPU default: bf16 weights under DeepSpeed. The same probe under 2-process ZeRO-1 and ZeRO-2 in bf16, and
    ZeRO-1 with fp32 gradient accumulation (DeepSpeed's BF16_Optimizer, which keeps a whole gradient buffer on
    every process: each process's own fragment is a slice of it), against one DeepSpeed process in bf16: the
    pre-clip norms agree, the clipped group's step has norm 1, no whole gradient is gathered, and a
    NaN loss is skipped. A norm that counted another process's fragment, or missed one, is off by far more than
    bf16's rounding (the groups' norms differ by 1e4)."""
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--mixed_precision", "bf16", "--config_file"]

    def bf16(zero: str, processes: int) -> list[str]:
        return [*launch, accelerate_config(zero), "--num_processes", str(processes)]

    out = clip_probe_runs(tmp_path, {"one": (bf16("zero2", 1), []), "zero1": (bf16("zero1", 2), []),
                                     "zero2": (bf16("zero2", 2), []), "zero1_fp32_accum": (bf16("zero1", 2), ["fp32"])})
    print({k: (v["world"], v["optimizer"], v["dtype"], v["pre_norm"]) for k, v in out.items()})
    assert [out[k]["world"] for k in ("one", "zero1", "zero2", "zero1_fp32_accum")] == [1, 2, 2, 2]
    assert out["zero1_fp32_accum"]["optimizer"] == "BF16_Optimizer"
    for name, r in out.items():
        assert r["dtype"] == "torch.bfloat16", name
        for group in ("policy", "value"):
            assert r["pre_norm"][group] == pytest.approx(out["one"]["pre_norm"][group], rel=2e-2), (name, group)
        # the clipped group's step; the other's (0.006) is within the bf16 weights' rounding (~3e-3 over 72 weights)
        assert r["step_norm"]["value"] == pytest.approx(1.0, rel=2e-2), name
        assert r["pre_norm"]["value"] > 1.0 > r["pre_norm"]["policy"], name
        assert r["gathers"] == {"safe_get_full_grad": 0, "get_full_hp_grad": 0}, (name, r["gathers"])
        assert r["nan_skipped"] == 1.0 and r["nan_weights_unchanged"] is True, name


# --------------------------------------------------------------------------------------------- judges
def test_user_judge_module_function_and_weighted_sum(tmp_path, monkeypatch):
    from align.judges import JudgeError, check_judges, vader
    from align.judges.pointwise import build_judge

    (tmp_path / "my_judges.py").write_text("def exclaim(prompts, responses):\n"
                                           "    return [float(r.count('!')) for r in responses]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    prompts, responses = ["The film", "The film"], ["is great!!", "is awful."]
    judge = build_judge({"my_judges:exclaim": 2.0, "vader": 1.0}, lambda name: None)
    v = vader(prompts, responses)
    assert judge(prompts, responses) == pytest.approx([2.0 * 2 + v[0], 2.0 * 0 + v[1]])
    check_judges({"my_judges:exclaim": 1.0}, set(), {})
    with pytest.raises(JudgeError, match="cannot import module 'nowhere'"):
        check_judges("nowhere:fn", set(), {})
    with pytest.raises(JudgeError, match="has no function 'missing'"):
        check_judges("my_judges:missing", set(), {})
    with pytest.raises(JudgeError, match="'dpo' is a dpo stage, not a reward stage"):
        check_judges("dpo", {"reward"}, {"dpo": "dpo", "reward": "reward"})


def _default_raw():
    return yaml.safe_load((REPO / "pipelines" / "default.yaml").read_text())


def test_validate_flags_the_old_default_response_length_mismatch():
    raw = _default_raw()
    raw["stages"]["ppo"]["generation"]["max_new_tokens"] = 24  # the default before issue 10
    with pytest.raises(PipelineError) as err:
        validate(parse_pipeline(raw, "default.yaml"), REPO / "pipelines" / "default.yaml", verbose=False)
    msg = str(err.value)
    for setting in ("stages.ppo.generation.max_new_tokens=24", "stages.preferences.generation.max_new_tokens=32",
                    "stages.evaluate.generation.max_new_tokens=32"):
        assert setting in msg


def test_ppo_with_a_judge_reward_validates_and_value_init_reward_needs_a_reward_model():
    raw = _default_raw()
    raw["stages"]["ppo"].update(reward="vader", value_init="policy")
    validate(parse_pipeline(raw, "default.yaml"), REPO / "pipelines" / "default.yaml", verbose=False)
    raw["stages"]["ppo"]["value_init"] = "reward"
    with pytest.raises(PipelineError, match="value_init: 'reward' starts the value model from the reward model"):
        validate(parse_pipeline(raw, "default.yaml"), REPO / "pipelines" / "default.yaml", verbose=False)


def test_ppo_in_float16_is_refused_by_validate():
    """PPO's per-model clipping and non-finite-step skip read unscaled gradients; float16's loss scale would leave
    them scaled: refused before anything starts, naming the setting and the fix."""
    raw = _default_raw()
    raw["precision"] = "float16"
    with pytest.raises(PipelineError, match=r"stages.ppo: precision: float16 .*use precision: bfloat16 .* or float32"):
        validate(parse_pipeline(raw, "default.yaml"), REPO / "pipelines" / "default.yaml", verbose=False)


def test_reward_scale_hand_values():
    """scores 1, 2, 3, 6: mean 3, population std sqrt(3.5) -> gain 1/sqrt(3.5), bias -3/sqrt(3.5); the fitted
    map sends them to mean 0 and std 1."""
    from align.stages.ppo.state import RewardScale

    s = RewardScale()
    s.fit(torch.tensor([1.0, 2.0, 3.0, 6.0]))
    assert (s.gain, s.bias) == pytest.approx((1 / math.sqrt(3.5), -3 / math.sqrt(3.5)))
    z = s(torch.tensor([1.0, 2.0, 3.0, 6.0]))
    assert z.mean().item() == pytest.approx(0.0, abs=1e-6) and z.std(unbiased=False).item() == pytest.approx(1.0)
    t = RewardScale()
    t.load_state_dict(s.state_dict())
    assert (t.gain, t.bias, t.fitted) == (s.gain, s.bias, True)


def test_shared_value_head_reads_the_policys_own_trunk_and_its_loss_trains_the_trunk():
    """value_init: shared: one forward gives the policy's log-probs (the same as sequence_logprobs on the policy)
    and values (the head on the last hidden state before each response token). With zero advantages the policy
    loss has no gradient, so what moves the trunk is the value loss alone: it moves with vf_coef > 0 and stays put
    with vf_coef = 0 (the control)."""
    from accelerate import Accelerator

    from align.modeling.generation import sequence_logprobs
    from align.modeling.models import disable_dropout
    from align.stages.ppo.update import ppo_update
    from align.stages.ppo.models import PolicyAndValue

    print(f"seed {SEED}")

    def build():
        policy, _ = _gpt2_pair(dropout=0.0)
        torch.manual_seed(SEED + 1)
        head = torch.nn.Linear(16, 1)
        return PolicyAndValue(disable_dropout(policy), value_head=head), policy, head

    model, policy, head = build()
    g = torch.Generator().manual_seed(SEED)
    ids = torch.randint(1, 64, (8, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # a left-padded prompt
    with torch.no_grad():
        lp, ent, values = model(ids, mask, 6, 0.7)
        want_lp, want_ent = sequence_logprobs(policy, ids, mask, 6, 0.7, with_entropy=True)
        trunk = getattr(policy, policy.base_model_prefix)  # the final layer norm included
        hidden = trunk(input_ids=ids, attention_mask=mask,
                       position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).last_hidden_state
    assert torch.allclose(lp, want_lp, atol=1e-5) and torch.allclose(ent, want_ent, atol=1e-5)
    assert values.shape == (8, 6)
    assert torch.allclose(values, head(hidden[:, 5:-1]).squeeze(-1), atol=1e-5)

    rmask = torch.ones(8, 6)
    moved = {}
    for vf_coef in (0.5, 0.0):
        model, policy, head = build()
        before = {n: p.detach().clone() for n, p in policy.named_parameters()}
        groups = model.trainable_groups()
        assert groups["value"] == list(head.parameters())
        opt = torch.optim.SGD([{"params": groups["policy"]}, {"params": groups["value"]}], lr=0.1)
        with torch.no_grad():
            old_lp, _, old_v = model(ids, mask, 6, 1.0)
        cfg = PPOStage(type="ppo", ppo_epochs=1, mini_batch_size=8, rollout_batch_size=8, vf_coef=vf_coef,
                       value_init="shared")
        stats = ppo_update(cfg, Accelerator(cpu=True), model, opt, groups, ids, mask, rmask, 6, old_lp, old_v,
                           torch.zeros(8, 6), old_v + 1.0)  # returns 1 above the values: a real value error
        assert stats["policy/ratio_first"] == 1.0
        moved[vf_coef] = max((p.detach() - before[n]).abs().max().item() for n, p in policy.named_parameters())
    assert moved[0.5] > 1e-4 and moved[0.0] == 0.0


def test_gradient_checkpointing_recomputes_and_leaves_the_update_unchanged():
    """PPO's gradient_checkpointing (policy and value): the same losses and updated weights as without it (fp32, CPU:
    1e-6), and it really recomputes: each decoder block of the policy runs twice per mini-batch (forward, and again in
    the backward pass) where it ran once. transformers recomputes only in training mode: ppo_update switches to
    train() for the update (dropout is 0) and back."""
    import copy

    from accelerate import Accelerator
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    from align.modeling.models import disable_dropout
    from align.stages.ppo.update import ppo_update
    from align.stages.ppo.models import PolicyAndValue, checkpointed

    print(f"seed {SEED}")
    cfg_model = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, num_labels=1, pad_token_id=0)
    torch.manual_seed(SEED)
    base_policy, base_value = LlamaForCausalLM(cfg_model), LlamaForSequenceClassification(cfg_model)
    g = torch.Generator().manual_seed(SEED)
    ids = torch.randint(1, 64, (8, 12), generator=g)
    mask, rmask = torch.ones_like(ids), torch.ones(8, 6)
    adv = torch.randn(8, 6, generator=g)
    results = {}
    for ckpt in (False, True):
        policy, value = copy.deepcopy(base_policy), copy.deepcopy(base_value)
        if ckpt:
            checkpointed(policy), checkpointed(value)
        model = PolicyAndValue(disable_dropout(policy), disable_dropout(value)).eval()
        calls = []
        # a block's inner modules start again when the backward pass recomputes it (its own forward is the checkpoint;
        # the recomputation stops once it has what the backward needs, so count starts, not ends)
        hook = policy.model.layers[0].mlp.register_forward_pre_hook(lambda *a: calls.append(1))  # noqa: B023
        with torch.no_grad():
            old_lp, _, old_v = model(ids, mask, 6, 1.0)
        calls.clear()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        groups = {"policy": list(policy.parameters()), "value": list(value.parameters())}
        cfg = PPOStage(type="ppo", ppo_epochs=1, mini_batch_size=4, rollout_batch_size=8, gradient_checkpointing=ckpt)
        torch.manual_seed(SEED)  # the mini-batch order
        stats = ppo_update(cfg, Accelerator(cpu=True), model, opt, groups, ids, mask, rmask, 6, old_lp, old_v, adv,
                           old_v + adv)
        hook.remove()
        assert not model.training  # back to eval for the next rollout
        results[ckpt] = (stats, len(calls), {k: v.detach().clone() for k, v in model.state_dict().items()})
    (plain, plain_calls, plain_w), (ck, ck_calls, ck_w) = results[False], results[True]
    assert plain_calls == 2 and ck_calls == 4  # 2 mini-batches: once each, or twice with recomputation
    for key in ("train/loss", "policy/loss", "value/loss"):
        assert ck[key] == pytest.approx(plain[key], rel=1e-6, abs=1e-7), key
    assert max((ck_w[k] - plain_w[k]).abs().max().item() for k in plain_w) < 1e-6
    assert any((plain_w[k] - base).abs().max() > 0 for k, base in
               PolicyAndValue(base_policy, base_value).state_dict().items())  # and the update moved the weights


def test_a_non_finite_loss_on_one_process_stops_every_process():
    """The PPO step's finiteness is every process's (finite_everywhere: one gather of a flag): a process whose loss is
    finite still stops when another's is not, so none is left waiting in the backward's collectives. A stand-in
    accelerator of two processes gives the other process's flag."""
    from align.stages.ppo.update import finite_everywhere

    class Accelerator:
        num_processes, other = 2, 0.0  # the other process's flag: 1.0 finite, 0.0 not

        def gather(self, flag):
            return torch.cat([flag, torch.tensor([self.other])])

    acc = Accelerator()
    assert not finite_everywhere(acc, torch.tensor(1.5))  # finite here, not there
    acc.other = 1.0
    assert finite_everywhere(acc, torch.tensor(1.5)) and not finite_everywhere(acc, torch.tensor(float("nan")))

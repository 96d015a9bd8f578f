"""The models PPO holds: the trainable policy and value (one module, one optimizer and DeepSpeed engine), the
frozen reference and reward models, and the policy as `generate` needs it under ZeRO-3."""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial

import torch

from align.config.ppo import PPOStage
from align.modeling.generation import scalar_outputs, sequence_logprobs
from align.modeling.models import add_adapters, disable_dropout, without_peft
from align.stages.context import StageContext
from align.stages.ppo.rewards import FrozenView


class PolicyAndValue(torch.nn.Module):
    """The two trainable models as one module, so one DeepSpeed engine (and optimizer) serves both.

    `value_affine` (gain, bias) reads the value head in the units of the normalised reward: a value model
    initialised from the reward model outputs raw reward-model scores, and PPO's returns are normalised."""

    def __init__(self, policy, value):
        super().__init__()
        self.policy, self.value = policy, value
        self.value_affine = (1.0, 0.0)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, query_len: int, temperature: float,
                with_entropy: bool = True):
        """Per-token log-probs, entropies (None unless asked) and values of the response part. ids, mask:
        (B, Lq + Lr)."""
        if with_entropy:
            logprobs, entropy = sequence_logprobs(self.policy, ids, mask, query_len, temperature, with_entropy=True)
        else:
            logprobs, entropy = sequence_logprobs(self.policy, ids, mask, query_len, temperature), None
        values = scalar_outputs(without_peft(self.value), ids, mask)[:, query_len - 1:-1]  # V(state before token t)
        gain, bias = self.value_affine
        return logprobs, entropy, values * gain + bias


def _zero3(accelerator) -> bool:
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    return plugin is not None and plugin.zero_stage == 3


def prepare_frozen(model, accelerator):
    """A frozen model for inference: sharded by DeepSpeed ZeRO-3 when that is the plan, else just moved."""
    disable_dropout(model).eval().requires_grad_(False)
    if not _zero3(accelerator):
        return model.to(accelerator.device)
    import deepspeed  # heavy: only under ZeRO-3

    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
           "bf16": {"enabled": accelerator.mixed_precision == "bf16"}}
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    return engine.module.eval()


@contextmanager
def policy_for_generation(model, accelerator):
    """The policy, ready for `generate`. Under ZeRO-3 its weights are gathered once per rollout and DeepSpeed's
    forward hooks are taken off for the duration (as TRL's unwrap_model_for_generation does): with the hooks
    on, every decoding step is a collective, and a process whose samples all end early would leave the
    others waiting forever."""
    unwrapped = accelerator.unwrap_model(model)
    if not _zero3(accelerator):
        yield unwrapped.policy
        return
    import deepspeed  # heavy: only under ZeRO-3
    from trl.models.utils import add_hooks, remove_hooks

    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        remove_hooks(model)
        try:
            yield unwrapped.policy
        finally:
            add_hooks(model)


def load_trained(ctx: StageContext, cfg: PPOStage, accelerator, pad_id: int, reward_stages: list[str]) -> PolicyAndValue:
    """Policy and value model, dropout off. With LoRA each gets adapters over its frozen base (the value model's
    scalar head is trained too), the base in 4-bit with `lora.quantize: 4bit`."""
    lora = cfg.lora
    quantize = lora.quantize if lora.enabled else "none"
    policy_path = ctx.input_model(cfg.policy)
    value_path = ctx.input_model(reward_stages[0]) if cfg.value_init == "reward" else policy_path
    policy = ctx.load_lm(policy_path, quantize=quantize)
    policy.generation_config.pad_token_id = pad_id
    value = ctx.load_scalar(value_path, pad_id, quantize=quantize)
    if lora.enabled:
        policy = add_adapters(policy, lora, "CAUSAL_LM", zero3=_zero3(accelerator))
        value = add_adapters(value, lora, "SEQ_CLS", zero3=_zero3(accelerator))
    return PolicyAndValue(disable_dropout(policy), disable_dropout(value))


def load_frozen(ctx: StageContext, cfg: PPOStage, accelerator, trained: PolicyAndValue, pad_id: int,
                reward_stages: list[str]):
    """The reference (a causal LM, called for log-probs) and each reward stage's scoring function. With LoRA the
    reference is the policy's base with adapters disabled, and with value_init: reward the reward model is the value
    model's base likewise (FrozenView): nothing is loaded twice."""
    lora = cfg.lora
    if lora.enabled:
        reference = FrozenView(trained.policy)
    else:
        reference = prepare_frozen(ctx.load_lm(ctx.input_model(cfg.policy)), accelerator)
    reward_fns = {}
    for name in reward_stages:
        if lora.enabled and cfg.value_init == "reward":  # then the one reward stage is the value model's start
            reward_fns[name] = FrozenView(trained.value).scalar_outputs
        else:
            rm = prepare_frozen(ctx.load_scalar(ctx.input_model(name), pad_id), accelerator)
            reward_fns[name] = partial(scalar_outputs, rm)
    return reference, reward_fns



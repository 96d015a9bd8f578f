"""The models PPO holds: the trainable policy and value (one module, one optimizer and DeepSpeed engine), the
frozen reference and reward models, and the policy as `generate` needs it under ZeRO-3."""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial

import torch

from align.config.ppo import PPOStage
from align.modeling.generation import response_scores, scalar_outputs
from align.modeling.models import disable_dropout
from align.modeling.lora import add_adapters, upcasts_trainables, without_peft
from align.runtime.context import StageContext
from align.runtime.zero_buffers import widest, width_sized
from align.stages.ppo.rewards import FrozenView


class PolicyAndValue(torch.nn.Module):
    """The two trainable models as one module, so one DeepSpeed engine (and optimizer) serves both.

    Two kinds of value model (`value_init`): a separate one (`value`, a scalar model started from the reward
    model or the policy: Stiennon et al. 2020 sec. 3.4 keep policy and value apart), or, with `value_init: shared`,
    none: `value_head`, a linear head on the policy's own last hidden state (the design of TRL 0.x's
    AutoModelForCausalLMWithValueHead), so one forward pass gives log-probs and values, and the value loss trains
    the policy's trunk too (scaled by vf_coef).

    `value_affine` (gain, bias) reads the value head in the units of the normalised reward: a value model
    initialised from the reward model outputs raw reward-model scores, and PPO's returns are normalised."""

    def __init__(self, policy, value=None, value_head: torch.nn.Linear | None = None):
        super().__init__()
        if (value is None) == (value_head is None):
            raise ValueError("PolicyAndValue: give a value model or a value head on the policy, not both or neither")
        self.policy, self.value, self.value_head = policy, value, value_head
        self.value_affine = (1.0, 0.0)

    def trainable_groups(self) -> dict[str, list[torch.nn.Parameter]]:
        """The parameters each optimiser group trains (LoRA: the adapters, and the value model's head): `policy`
        and `value` (the separate value model, or the shared trunk's value head)."""
        value = self.value if self.value is not None else self.value_head
        return {name: [p for p in part.parameters() if p.requires_grad]
                for name, part in (("policy", self.policy), ("value", value))}

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, query_len: int, temperature: float,
                with_entropy: bool = True, with_values: bool = True, entropy_grad: bool = True):
        """Per-token log-probs, entropies (None unless asked) and values (None unless asked: the held-out KL needs
        the policy alone, and a separate value model's forward costs as much as the policy's) of the response part.
        ids, mask: (B, Lq + Lr). The value at t is V(state before response token t). One forward of the policy gives
        its log-probs at the response positions (response_scores) and, with the shared head, the hidden state it reads.
        Through the DeepSpeed engine (ZeRO-3 included) a forward that skips the value model just leaves its
        partitions ungathered."""
        shared = self.value_head is not None and with_values
        logprobs, entropy, hidden = response_scores(self.policy, ids, mask, query_len, temperature, with_entropy,
                                                    with_hidden=shared, entropy_grad=entropy_grad)
        if shared:
            return logprobs, entropy, self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1).float()
        if not with_values:
            return logprobs, entropy, None
        values = scalar_outputs(without_peft(self.value), ids, mask)[:, query_len - 1:-1]
        gain, bias = self.value_affine
        return logprobs, entropy, values * gain + bias


def is_zero3(accelerator) -> bool:
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    return plugin is not None and plugin.zero_stage == 3


def prepare_frozen(model, accelerator):
    """A frozen model for inference: sharded by DeepSpeed ZeRO-3 when that is the plan, else just moved."""
    disable_dropout(model).eval().requires_grad_(False)
    if not is_zero3(accelerator):
        return model.to(accelerator.device)
    import deepspeed  # heavy: only under ZeRO-3

    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
           "bf16": {"enabled": accelerator.mixed_precision == "bf16"}}
    width_sized(cfg, widest(model))  # its prefetch bucket and persistence threshold (it has no reduce bucket in use)
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    return engine.module.eval()


@contextmanager
def policy_for_generation(model, accelerator, gather: str = "whole"):
    """The policy, ready for `generate` (or a weight sync). Under ZeRO-3 with `gather: whole` the policy's weights,
    and only the policy's (not the value model's or head's), are gathered once per rollout (all of its chunks: the
    engine's `holding`) and DeepSpeed's forward hooks are taken off for the duration (as TRL's
    unwrap_model_for_generation does): with the hooks on, every decoding step is a collective, and a process whose
    samples all end early would leave the others waiting forever. With `gather: layers` nothing is gathered here:
    the hooks fetch one layer at a time and the caller samples with synced_gpus (every process steps until all are
    done)."""
    unwrapped = accelerator.unwrap_model(model)
    if not is_zero3(accelerator) or gather == "layers":
        yield unwrapped.policy
        return
    import deepspeed  # heavy: only under ZeRO-3
    from trl.models.utils import add_hooks, remove_hooks

    with deepspeed.zero.GatheredParameters(list(unwrapped.policy.parameters())):
        remove_hooks(model)
        try:
            yield unwrapped.policy
        finally:
            add_hooks(model)


def load_trained(ctx: StageContext, cfg: PPOStage, accelerator, pad_id: int, reward_stages: list[str]) -> PolicyAndValue:
    """Policy and value model (or, with value_init: shared, the policy and a value head on its trunk), dropout
    off. With LoRA each model gets adapters over its frozen base (a value model's scalar head is trained too), the
    base in 4-bit with `lora.quantize: 4bit`."""
    lora = cfg.lora
    quantize = lora.quantize if lora.enabled else "none"
    policy_path = ctx.input_model(cfg.policy)
    mixed = upcasts_trainables(ctx.compute.dtype, accelerator.state.deepspeed_plugin, quantize != "none")  # in fp32
    policy = ctx.load_lm(policy_path, quantize=quantize, lora=lora.enabled)
    policy.generation_config.pad_token_id = pad_id
    if lora.enabled:
        policy = add_adapters(policy, lora, "CAUSAL_LM", zero3=is_zero3(accelerator), autocast=mixed)
    if cfg.gradient_checkpointing:
        checkpointed(policy)
    if cfg.value_init == "shared":  # a value head on the policy's trunk, starting at V = 0
        lm_head = without_peft(policy).get_output_embeddings()
        # float32, except under ZeRO-3, whose partitions are all of the model's dtype (the policy arrives partitioned)
        dtype = lm_head.weight.dtype if is_zero3(accelerator) else torch.float32
        head = torch.nn.Linear(lm_head.in_features, 1, dtype=dtype)
        torch.nn.init.zeros_(head.weight)
        torch.nn.init.zeros_(head.bias)
        return PolicyAndValue(disable_dropout(policy), value_head=head)
    value_path = ctx.input_model(reward_stages[0]) if cfg.value_init == "reward" else policy_path
    value = ctx.load_scalar(value_path, pad_id, quantize=quantize, lora=lora.enabled)
    if cfg.gradient_checkpointing:
        checkpointed(value)
    if lora.enabled:
        value = add_adapters(value, lora, "SEQ_CLS", zero3=is_zero3(accelerator), autocast=mixed)
    return PolicyAndValue(disable_dropout(policy), disable_dropout(value))


def checkpointed(model) -> None:
    """Gradient checkpointing on (transformers' own, non-reentrant: no input needs requires_grad, so it also works
    under LoRA with frozen embeddings). transformers recomputes only in training mode: PPO switches its models to
    train() for the update (ppo_update) and back to eval() for rollouts and scoring; dropout is 0 either way."""
    enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.24's name
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False


def load_frozen(ctx: StageContext, cfg: PPOStage, accelerator, trained: PolicyAndValue, pad_id: int,
                reward_stages: list[str]):
    """The reference (a causal LM, called for log-probs) and each reward stage's scoring function. With LoRA the
    reference is the policy's base with adapters disabled, and with value_init: reward the reward model is the value
    model's base likewise (FrozenView): nothing is loaded twice."""
    lora = cfg.lora
    if lora.enabled:
        reference = FrozenView(trained.policy)
    else:
        reference = prepare_frozen(ctx.load_lm(ctx.input_model(cfg.policy), frozen=True), accelerator)
    reward_fns = {}
    for name in reward_stages:
        if lora.enabled and cfg.value_init == "reward":  # then the one reward stage is the value model's start
            reward_fns[name] = FrozenView(trained.value).scalar_outputs
        else:
            rm = prepare_frozen(ctx.load_scalar(ctx.input_model(name), pad_id, frozen=True), accelerator)
            reward_fns[name] = partial(scalar_outputs, rm)
    return reference, reward_fns

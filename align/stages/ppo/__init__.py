"""PPO stage: RLHF against a frozen reward model or Python judges, with a KL penalty to the reference policy.

R(x, y) = score(x, y) - beta * log(pi(y|x) / pi_ref(y|x))   (Ziegler et al. 2019; Ouyang et al. 2022)

Before training, the reward's gain and bias are fixed from rollouts of the initial policy (Ziegler et al.
sec. 2.2). Each iteration, per process: (1) sample responses, (2) score them (reward model and/or judges),
(3) log-probs of the responses under policy and reference, and values, (4) per-token rewards with the KL
penalty, (5) GAE advantages, (6) PPO epochs over mini-batches. Dropout is off in every model, so old and new
log-probs agree at the first step. Algorithm code touches only `accelerator.*` and `optim.py`; DeepSpeed
choices live in the accelerate config. With `lora.enabled` only adapters train, and the reference (and with
value_init: reward, the reward model) is served by a trained model's base weights with adapters disabled.
"""

from __future__ import annotations

import time
from contextlib import closing, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from align.config.ppo import PPOStage
from align.runtime.rows import load_prompts
from align.engines.base import RolloutEngine, across_processes, check_rollout, nan_max, rest
from align.modeling.generation import Rollout, fused_head_gap
from align.modeling.compute import leave_sdpa_if_padded
from align.modeling.fused_head import FUSED_TOLERANCE, HALF_TOLERANCE, exclude, set_fused_head, use_fused_head
from align.modeling.packing import (attention_kernel, base_and_backbone, is_flash, packing_works, set_padding_free,
                                   unwrapped_model)
from align.judges import judge_weights
from align.modeling.losses import gae, kl_estimate, masked_whiten, token_rewards
from align.modeling.models import load_causal_lm, unsharded_loading
from align.modeling.lora import merged_lora_model
from align.runtime.context import StageContext, StageError
from align.runtime.zero_buffers import in_use, widest, width_sized
from align.stages.ppo.budget import HeldoutKL, PolicySnapshot, budget_summary, heldout_kl, split_heldout, stop_inside_budget
from align.stages.ppo.rollouts import fit_reward_scale, open_engine, rollout, scored, sync_engine, usable_prompts
from align.stages.ppo.checkpoint import resume, restore_history, save_checkpoint
from align.stages.ppo.optim import disable_deepspeed_clipping
from align.stages.ppo.update import ppo_update
from align.stages.ppo.metrics import iteration_metrics, summarise
from align.stages.ppo.models import load_frozen, load_trained
from align.judges.pointwise import RewardModelJudge, WeightedJudge, build_judge
from align.stages.ppo.state import (AdaptiveKLController, FixedKLController, PIKLController, PromptStream,
                                    RewardScale, RunningMoments)

OUTPUTS = ["model"]


def kl_controller(cfg: PPOStage):
    """The beta rule `kl` names (align/stages/ppo/state.py)."""
    if not cfg.kl.adaptive:
        return FixedKLController(cfg.kl.coef)
    if cfg.kl.controller == "ziegler":
        return AdaptiveKLController(cfg.kl.coef, cfg.kl.target, cfg.kl.horizon)
    return PIKLController(cfg.kl.coef, cfg.kl.target, cfg.kl.kp, cfg.kl.ki)


@dataclass
class PPORun:
    """What one PPO stage trains with, built once by `setup`: the models and optimiser, the prompts (and the
    held-out ones), the judges, the KL controller, the reward statistics and the data position."""

    ctx: StageContext
    cfg: PPOStage
    accelerator: Any
    tokenizer: Any
    policy_path: str
    prompts: list[str]
    heldout: list[str]
    model: Any  # PolicyAndValue under accelerate / DeepSpeed
    optimizer: Any
    groups: dict[str, list[torch.nn.Parameter]]
    reference: Any
    scorer: WeightedJudge
    kl_ctl: Any
    reward_stages: list[str] = field(default_factory=list)  # the reward models among `cfg.reward`'s judges
    moments: RunningMoments = field(default_factory=RunningMoments)
    scale: RewardScale = field(default_factory=RewardScale)
    stream: PromptStream | None = None
    progress: dict[str, int] = field(default_factory=lambda: {"iteration": 0})
    start: int = 0
    engine: RolloutEngine | None = None

    @property
    def world(self) -> int:
        return self.accelerator.num_processes


@dataclass
class Batch:
    """One iteration's rollouts, scored (steps 1-3): what the advantages and the update consume."""

    prompts: list[str]
    rollout: Rollout
    scores: torch.Tensor  # the reward models' / judges' scores as given
    scores_used: torch.Tensor  # normalised, less the missing-EOS penalty: the score in the reward
    penalties: torch.Tensor
    logprobs: torch.Tensor  # (B, Lr) under the policy that sampled, with values from the same forward pass
    ref_logprobs: torch.Tensor
    values: torch.Tensor
    gap: dict[str, float] | None  # engine vs trainer log-probs (an engine that reports its own)
    t_gen: float  # seconds sampling (step 1)
    t_score: float  # seconds scoring: reward, policy and reference log-probs, values (steps 2-3)

    @property
    def rmask(self) -> torch.Tensor:
        return self.rollout.response_mask.float()


def make_accelerator(ctx: StageContext, cfg: PPOStage):
    from accelerate import Accelerator  # heavy: stage processes only

    ctx.extra_manifest["attn_implementation"] = ctx.compute.attn_implementation or "auto"
    accelerator = Accelerator(gradient_accumulation_steps=cfg.gradient_accumulation_steps,
                              mixed_precision=ctx.compute.mixed_precision)
    plugin = accelerator.state.deepspeed_plugin
    if plugin is not None:  # no dataloader goes through prepare(), so DeepSpeed is told the micro-batch here
        plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = cfg.mini_batch_size
        plugin.deepspeed_config["gradient_accumulation_steps"] = cfg.gradient_accumulation_steps
    disable_deepspeed_clipping(accelerator)
    return accelerator


def training_prompts(ctx: StageContext, cfg: PPOStage, tokenizer, reward_stages: list[str]) -> tuple[list[str], list[str]]:
    """The prompts PPO trains on and those it holds out for the KL after each update (split before any model
    loads: a held-out share that leaves too little to train on is refused here)."""
    prompts = load_prompts(ctx, cfg.prompts, cfg.split, tokenizer=tokenizer)  # chat: rendered; empty ones dropped
    prompts = usable_prompts(ctx, cfg, tokenizer, {n: ctx.load_tokenizer(ctx.input_model(n)) for n in reward_stages},
                             prompts)
    try:
        prompts, heldout = split_heldout(ctx.name, prompts, cfg.kl.heldout_prompts, ctx.seed + 7_368_787,
                                         required=cfg.kl.max is not None)
    except ValueError as e:
        raise StageError(str(e)) from None
    if cfg.kl.heldout_prompts and not heldout:  # too few prompts to set any aside, and no budget needs them
        ctx.note(heldout={"prompts": 0, "why": f"{len(prompts)} usable prompts, fewer than 2 x kl.heldout_prompts "
                                                f"({cfg.kl.heldout_prompts}): all train, no held-out KL is measured"})
        if ctx.is_main:
            print(f"[align] {ctx.name}: no held-out KL: {len(prompts)} usable prompts are fewer than 2 x "
                  f"kl.heldout_prompts ({cfg.kl.heldout_prompts}); all of them train (lower kl.heldout_prompts to "
                  "measure it)", flush=True)
    return prompts, heldout


def setup(ctx: StageContext) -> PPORun:
    """Prompts, then models (trained: policy and value; frozen: reference and reward models), optimiser, the KL
    controller, and the state of a resumed run."""
    cfg: PPOStage = ctx.cfg  # type: ignore[assignment]
    set_padding_free(cfg.padding_free)  # every forward of this stage process (align/modeling/packing.py)
    accelerator = make_accelerator(ctx, cfg)
    policy_path = ctx.input_model(cfg.policy)
    reward_stages = [n for n in judge_weights(cfg.reward) if n in ctx.inputs]
    tokenizer = ctx.load_tokenizer(policy_path)
    prompts, heldout = training_prompts(ctx, cfg, tokenizer, reward_stages)
    pad_id = tokenizer.pad_token_id
    # peft draws the LoRA adapters' initial weights from torch's global generator, which nothing else seeds here:
    # seeded, two runs of one config start from the same adapters (a resumed run loads them from its checkpoint)
    torch.manual_seed(ctx.seed)
    model = load_trained(ctx, cfg, accelerator, pad_id, reward_stages)
    groups = model.trainable_groups()  # LoRA: the adapters (and value head) only
    optimizer = torch.optim.AdamW([{"params": groups["policy"], "lr": cfg.learning_rate},
                                   {"params": groups["value"], "lr": cfg.value_learning_rate}], eps=1e-5)
    if accelerator.state.deepspeed_plugin is not None:  # buckets sized from the wider model (runtime/zero_buffers.py)
        width_sized(accelerator.state.deepspeed_plugin.deepspeed_config, widest(model.policy, model.value))
    model, optimizer = accelerator.prepare(model, optimizer)
    if (buffers := in_use(model)) is not None:
        ctx.extra_manifest["deepspeed_buffers"] = buffers
    trained = accelerator.unwrap_model(model)
    reference, reward_fns = load_frozen(ctx, cfg, accelerator, trained, pad_id, reward_stages)
    policy = trained.policy
    whys = [leave_sdpa_if_padded(m, ctx.compute.device.type, cfg.padding_free and packing_works(m), "PPO")
            for m in (policy, trained.value) if m is not None]  # each model packs (or not) by its own family
    if why := next((w for w in whys if w), None):
        ctx.note(attention_left_sdpa=why)
        if ctx.is_main:
            print(f"[align] {ctx.name}: {why}", flush=True)
    # flash attention runs in half precision only, and a head of 16-bit weights (a LoRA base, DeepSpeed's bf16 cast)
    # computes in it: their probe under the training autocast, its tolerance a bf16 rounding; else fp32 (exact)
    half = is_flash(attention_kernel(policy)) or policy.get_output_embeddings().weight.dtype != torch.float32
    with accelerator.autocast() if half else nullcontext():
        heads = fused_head(cfg, policy, reference, HALF_TOLERANCE if half else FUSED_TOLERANCE)
    # as resolved on this machine: the attention kernel the policy runs (attn_implementation auto: transformers' pick)
    ctx.note(kernels={"fused_head": heads, "attention": attention_kernel(policy),
                      "autocast": ctx.compute.mixed_precision})
    scorer = build_judge(cfg.reward, lambda n: RewardModelJudge(  # scored in the training precision (a value head
        n, reward_fns[n], tokenizer, autocast=accelerator.autocast) if n in reward_fns else None)  # trained: fp32)
    s = PPORun(ctx, cfg, accelerator, tokenizer, policy_path, prompts, heldout, model, optimizer, groups, reference,
               scorer, kl_controller(cfg), reward_stages, stream=PromptStream(len(prompts), ctx.seed))
    s.start = resume(ctx, accelerator, s.kl_ctl, s.moments, s.scale, s.stream, s.progress,
                     trainable_only=cfg.lora.enabled)
    trained.eval()  # dropout is off anyway; eval() keeps train-only code out of the forward
    return s


def fused_head(cfg: PPOStage, policy, reference, tolerance: float = FUSED_TOLERANCE) -> dict[str, bool]:
    """Resolve the `fused_head` setting for the policy and the reference (align/modeling/fused_head.py), refusing
    `on` where it is not exact before any rollout: what each model's log-probs are computed with. Where it would be
    used, a probe compares it with the model's own logits first; a family that changes them after its head in a way
    the blocker list does not know (by more than `tolerance` nats) keeps the logits path (or, with `on`, is
    refused)."""
    set_fused_head(cfg.fused_head)
    resolved = {}
    for name, m in (("policy", policy), ("reference", reference)):
        base, head = base_and_backbone(m)[0], unwrapped_model(m).get_output_embeddings()
        try:
            resolved[name] = use_fused_head(base, head)
        except ValueError as e:
            raise StageError(str(e)) from None
        gap = fused_head_gap(m) if resolved[name] else 0.0
        if gap > tolerance:
            if cfg.fused_head == "on":
                raise StageError(f"fused_head: on, but the {name}'s log-probs from it differ from the model's own by "
                                 f"{gap:.3g} nats (its forward changes the logits after the head); set fused_head: "
                                 "auto or off")
            exclude(base)
            resolved[name] = False
            print(f"fused_head: the {name}'s own logits differ from the fused head's by {gap:.3g} nats; its log-probs "
                  "come from the logits", flush=True)
    return resolved


def fix_reward_scale(s: PPORun) -> None:
    """Reward normalisation `initial`: fit the gain and bias once, on the starting policy (a resumed run restores
    them, never refits on a partly trained policy); a value model started from the reward model reads its head in
    the same units."""
    cfg = s.cfg
    if cfg.reward_normalization == "initial" and not s.scale.fitted:
        fit_reward_scale(s.ctx, cfg, s.accelerator, s.engine, s.tokenizer, s.scorer, s.prompts, s.scale)
    elif s.scale.fitted:
        s.ctx.note(reward_normalization={"gain": s.scale.gain, "bias": s.scale.bias, "restored_at_iteration": s.start})
    if cfg.value_init == "reward":
        w = judge_weights(cfg.reward)[s.reward_stages[0]]
        s.accelerator.unwrap_model(s.model).value_affine = (
            (s.scale.gain * w, s.scale.bias) if cfg.reward_normalization == "initial" else (w, 0.0))


def now(device) -> float:
    """time.time() once the device's queued work is done (GPU work is asynchronous: time what a phase really took)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.time()


def collect(s: PPORun, it: int, t0: float, t_sync: float) -> Batch:
    """Steps 1-3: every process samples its slice of the global batch, scores it (normalised, less the missing-EOS
    penalty), and takes log-probs under policy and reference and values by a forward pass."""
    cfg, accelerator = s.cfg, s.accelerator
    mine = s.stream.take(cfg.rollout_batch_size * s.world)[accelerator.process_index::s.world]
    prompts = [s.prompts[i] for i in mine]
    r = rollout(cfg, accelerator, s.engine, prompts, seed=s.ctx.seed * 7919 + it * s.world + accelerator.process_index,
                pad_id=s.tokenizer.pad_token_id)
    rest(s.engine)  # generation.sleep: the engine frees its memory while the batch is scored and trained on
    t_sampled = now(accelerator.device)  # the engine's time, its sleep included, counts as generation
    with torch.no_grad():
        scores = s.scorer.score_rollout(r, prompts, s.tokenizer)
        if cfg.reward_normalization == "initial":
            scores_used = s.scale(scores)
        elif cfg.reward_normalization == "running":
            s.moments.update(accelerator.gather(scores))
            scores_used = s.moments.normalise(scores)
        else:
            scores_used = scores
        penalties = torch.zeros_like(scores)
        if cfg.missing_eos_penalty is not None:
            penalties = cfg.missing_eos_penalty * (~r.eos_found).float()
    logprobs, values, ref_logprobs = scored(s.model, s.reference, r, cfg.generation.temperature, cfg.mini_batch_size,
                                            accelerator)
    # what the engine sampled with vs what PPO optimises (same tokens)
    gap = check_rollout(s.engine, r, logprobs, cfg.generation.max_logprob_gap,
                        f"stage '{s.ctx.name}' iteration {it + 1} (after a weight sync of {t_sync:.2f} s)",
                        reduce=across_processes(accelerator))
    return Batch(prompts, r, scores, scores_used - penalties, penalties, logprobs, ref_logprobs, values, gap,
                 t_sampled - t0, now(accelerator.device) - t_sampled)


def advantages(s: PPORun, b: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Steps 4-5: per-token rewards -beta * KL plus the score on the last response token [Z19], GAE advantages
    (whitened over the global batch, every process's responses) and returns = advantages + values [GAE]. Returns (per-token KL, advantages, returns)."""
    rmask = b.rmask
    with torch.no_grad():
        kl = kl_estimate(b.logprobs, b.ref_logprobs, s.cfg.kl.estimator) * rmask
        last = (rmask.sum(1) - 1).clamp(min=0).long()
        rewards = token_rewards(b.scores_used, kl, rmask, s.kl_ctl.value, last)
        adv, returns = gae(rewards, b.values, rmask, s.cfg.gamma, s.cfg.lam)
        total = (lambda t: s.accelerator.reduce(t, reduction="sum")) if s.world > 1 else None  # the whole batch's
        return kl, masked_whiten(adv, rmask, total=total), returns  # statistics, whatever the number of processes


def update(s: PPORun, it: int, b: Batch, adv: torch.Tensor, returns: torch.Tensor) -> dict[str, float]:
    """Step 6: PPO epochs over mini-batches (the learning rate decays linearly to 10%, a function of the iteration
    alone, so a resumed run continues the same schedule)."""
    for group, base in zip(s.optimizer.param_groups, [s.cfg.learning_rate, s.cfg.value_learning_rate]):
        group["lr"] = base * (1.0 - 0.9 * it / max(1, s.cfg.iterations))
    r = b.rollout
    return ppo_update(s.cfg, s.accelerator, s.model, s.optimizer, s.groups, r.input_ids, r.attention_mask, b.rmask,
                      r.query_ids.size(1), b.logprobs, b.values, adv, returns)


def after_iteration(s: PPORun, it: int, b: Batch) -> None:
    """Sample table to the tracker every `sample_every` iterations; a checkpoint every `save_every`."""
    cfg, ctx = s.cfg, s.ctx
    if cfg.sample_every and (it + 1) % cfg.sample_every == 0 and ctx.tracker is not None:
        texts = b.rollout.texts(s.tokenizer)[:8]
        ctx.tracker.table("samples", ["prompt", "response", "score"],
                          [[p, t, float(x)] for p, t, x in zip(b.prompts, texts, b.scores[:8].tolist())], it + 1)
    s.progress["iteration"] = it + 1
    if (it + 1) % cfg.save_every == 0 and it + 1 < cfg.iterations:
        save_checkpoint(ctx, s.accelerator, it + 1, trainable_only=cfg.lora.enabled, keep=cfg.save_total_limit)


def publish_policy(s: PPORun, path: Path) -> None:
    """model/: the policy alone (LoRA: its adapters beside the name of their base, or merged with lora.merge)."""
    ctx, cfg, accelerator = s.ctx, s.cfg, s.accelerator
    zero3 = ctx.compute.distributed_zero3  # a collective then: every process gathers; otherwise the main process
    # reads the weights in place (accelerate cloned the policy and value model whole to host memory on every process
    # under ZeRO-1/2: ~32 GB each at 8B, 8 of them at once)
    state = accelerator.get_state_dict(s.model) if zero3 else None
    if not accelerator.is_main_process:
        return
    policy = accelerator.unwrap_model(s.model).policy
    policy_state = ({k[len("policy."):]: v for k, v in state.items() if k.startswith("policy.")} if zero3
                    else policy.state_dict())
    if cfg.lora.enabled and not cfg.lora.merge:  # the adapters alone, beside the name of their base
        policy.save_pretrained(path, state_dict=policy_state)
        ctx.trained_from = s.policy_path
        ctx.write_adapter_base(path, policy)
        ctx.extra_manifest["lora_published"] = "adapter"
    elif cfg.lora.enabled:  # adapters merged into a fresh, unquantized load of the starting policy
        with unsharded_loading():  # main process only: no ZeRO-3 partitioning (a collective) here
            base = load_causal_lm(s.policy_path, ctx.weights_dtype(frozen=True), ctx.pipeline.trust_remote_code)
        merged = merged_lora_model(base, cfg.lora, "CAUSAL_LM", policy_state)
        merged.generation_config.pad_token_id = s.tokenizer.pad_token_id
        merged.save_pretrained(path)
    else:
        policy.save_pretrained(path, state_dict=policy_state)
    s.tokenizer.save_pretrained(path)


def run(ctx: StageContext) -> dict[str, Any]:
    """PPO: collect a batch, compute advantages, update, measure the held-out KL, log, keep inside kl.max."""
    s = setup(ctx)
    cfg, accelerator = s.cfg, s.accelerator
    with closing(open_engine(ctx, cfg, accelerator, s.model, s.tokenizer, s.policy_path, s.start)) as engine:
        s.engine = engine  # a vllm engine's process ends with the stage, also when it fails
        ctx.note_engine(engine)  # inside closing(): a manifest write that fails does not leave the engine behind
        t_sync = sync_engine(engine, s.model, accelerator, ctx)  # it starts from policy_path; a resumed one differs
        fix_reward_scale(s)
        history = restore_history(ctx, s.start)
        # kl.max: the last update's weights inside the budget (first: the starting or resumed policy, saved inside it)
        snapshot = PolicySnapshot(s.groups["policy"]) if cfg.kl.max is not None else None
        if snapshot is not None:
            snapshot.take(s.start, HeldoutKL.from_metrics(history[-1]) if history else None)
        synced, over = True, None  # synced: the engine holds the weights the next rollout must sample from
        for it in range(s.start, cfg.iterations):
            t0 = time.time()
            split = {"weight_sync": 0.0}
            if not synced:  # the engine samples from the weights the last update left
                t_sync = sync_engine(engine, s.model, accelerator)
                split["weight_sync"] = t_sync
            b = collect(s, it, now(accelerator.device), t_sync)  # 1-3
            t_trained = now(accelerator.device)
            kl, adv, returns = advantages(s, b)  # 4-5
            stats = update(s, it, b, adv, returns)  # 6
            split.update(generation=b.t_gen, scoring=b.t_score, training=now(accelerator.device) - t_trained)
            beta, measured, synced = s.kl_ctl.value, None, False
            if s.heldout:  # 7. the KL after this update, on prompts never trained on (align/stages/ppo/budget.py)
                t_heldout = time.time()
                t_sync, synced = sync_engine(engine, s.model, accelerator), True
                split["weight_sync"] += t_sync
                measured = heldout_kl(cfg, accelerator, engine, s.model, s.reference, s.heldout,
                                      ctx.seed * 7919 + 1_299_709, f"stage '{ctx.name}' iteration {it + 1}, held-out "
                                      f"KL (after a weight sync of {t_sync:.2f} s)")
                split["heldout"] = now(accelerator.device) - t_heldout - t_sync
            metrics = iteration_metrics(s, b, kl, beta, stats, measured, t0, t_sync, split)
            if snapshot is not None and measured is not None and not measured.within(cfg.kl.max):
                over, metrics["heldout/over_budget"] = (it + 1, measured), 1.0  # undone below, beta kept as it was
            else:
                s.kl_ctl.update(measured.mean if measured else metrics["objective/kl"], cfg.rollout_batch_size * s.world)
                if snapshot is not None and measured is not None:
                    snapshot.take(it + 1, measured)
            history.append(metrics)
            ctx.log(metrics, step=it + 1)
            ctx.progress(it + 1, cfg.iterations, score=metrics["objective/scores"],
                         kl=measured.mean if measured else metrics["objective/kl"], beta=beta)
            if over is not None:
                stop_inside_budget(ctx, cfg, snapshot, *over)
                break
            after_iteration(s, it, b)
        ctx.publish("model", lambda path: publish_policy(s, path))
        out = summarise(cfg, [h for h in history if not h.get("heldout/over_budget")], s.kl_ctl, s.start)
        if snapshot is not None:
            out.update(budget_summary(cfg, snapshot, over))
        gaps = [h["rollout/logprob_gap_max"] for h in history if "rollout/logprob_gap_max" in h]
        if gaps:  # every iteration's, those of an attempt killed before this one's resume too (the history's)
            out["rollout/logprob_gap_max"] = nan_max(gaps)
            out["perf/sync_seconds"] = sum(engine.sync_seconds) / max(1, len(engine.sync_seconds))
        return out

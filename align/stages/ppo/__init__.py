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
from contextlib import closing
from pathlib import Path
from typing import Any

import torch

from align.config.ppo import PPOStage
from align.stages.rows import load_rows, unique_prompts
from align.modeling.engines import RolloutEngine, check_gap, logprob_gap, make_engine, nan_max
from align.modeling.generation import Rollout, response_logprobs
from align.core.judges import judge_weights
from align.data.lengths import DROPS_LONG_PROMPTS, enforce
from align.modeling.losses import (gae, kl_estimate, masked_mean, masked_whiten, ppo_policy_loss, ppo_value_loss,
                                   sequence_kl, token_rewards)
from align.modeling.models import load_causal_lm, load_tokenizer, merged_lora_model, unsharded_loading
from align.stages.context import NonFiniteLossError, StageContext, StageError
from align.stages.ppo.budget import HeldoutKL, PolicySnapshot, split_heldout
from align.stages.ppo.checkpoint import resume, restore_history, save_checkpoint
from align.stages.ppo.optim import backward_and_step, disable_deepspeed_clipping
from align.stages.ppo.models import is_zero3, load_frozen, load_trained, policy_for_generation
from align.stages.judging import RewardModelJudge, WeightedJudge, build_judge, check_same_tokenizer
from align.stages.ppo.state import (AdaptiveKLController, FixedKLController, PIKLController, PromptStream,
                                    RewardScale, RunningMoments)

OUTPUTS = ["model"]


def usable_prompts(ctx: StageContext, cfg: PPOStage, tokenizer, reward_tokenizers: dict, prompts: list[str]) -> list[str]:
    """Before any rollout: the tokenizers must agree; prompts longer than max_prompt_length tokens are dropped and
    counted (the manifest's length_check), and the stage refuses to start when more than max_truncated_fraction of
    them would be (align/data/lengths.py), naming the longest."""
    check_same_tokenizer(ctx.name, cfg.policy, tokenizer, reward_tokenizers)
    lengths = [len(ids) for ids in tokenizer(prompts, add_special_tokens=True)["input_ids"]]
    report = DROPS_LONG_PROMPTS.measure(ctx.name, [{"prompt": p} for p in prompts], tokenizer, cfg.max_prompt_length)
    ctx.extra_manifest["length_check"] = report.as_dict()
    if ctx.is_main:
        print(f"[align] length check {report.summary()} (prompts over max_prompt_length are dropped)", flush=True)
    enforce(report, cfg.max_truncated_fraction)
    return [p for p, n in zip(prompts, lengths) if n <= cfg.max_prompt_length]


def rollout(cfg: PPOStage, accelerator, engine: RolloutEngine, prompts: list[str], seed: int) -> Rollout:
    """Sample one response per prompt through the stage's engine; the hf engine samples in the training precision
    (bf16 autocast when the stage uses it), so the samples are scored by the same numerics that produced them."""
    with torch.no_grad(), accelerator.autocast():
        return engine.generate(prompts, cfg.generation, seed=seed)


def open_engine(ctx: StageContext, cfg: PPOStage, accelerator, model, tokenizer, policy_path: str) -> RolloutEngine:
    """The rollout engine `generation.engine` names. hf: the policy itself (under ZeRO-3 gathered for each rollout).
    vllm: one engine per process, started from the starting policy's directory and synced before each rollout."""
    layers = is_zero3(accelerator) and cfg.generation.zero3_gather == "layers"
    engine = make_engine(cfg.generation, model=None, tokenizer=tokenizer, model_dir=policy_path,
                         fast=ctx.compute.fast_generation(cfg.generation.fast), synced_gpus=layers,
                         context=lambda: policy_for_generation(model, accelerator, cfg.generation.zero3_gather),
                         seed=ctx.seed * 7919 + accelerator.process_index, dtype=ctx.compute.engine_dtype(),
                         max_model_len=cfg.max_prompt_length + cfg.generation.max_new_tokens + 1,
                         log_path=ctx.dir / f"engine.rank{accelerator.process_index}.log",
                         rank=accelerator.process_index)
    described = engine.describe()
    if described:
        ctx.note(engine=described)
        if accelerator.is_main_process:
            print(f"[align] {ctx.name}: {engine.name} {described.get('version', '')} engine started in "
                  f"{described.get('startup_seconds', 0):.0f} s (log: {engine.log_path})", flush=True)
    return engine


def sync_engine(engine: RolloutEngine, model, accelerator) -> float:
    """Push the policy's current weights to an engine that holds its own copy (vllm); under ZeRO-3 every process
    gathers the parameters (a collective) and syncs its own engine. Returns the seconds it took."""
    if not engine.holds_own_weights:
        return 0.0
    with torch.no_grad(), policy_for_generation(model, accelerator) as policy:
        return engine.sync_weights(policy)


def fit_reward_scale(ctx: StageContext, cfg: PPOStage, accelerator, engine: RolloutEngine, tokenizer, scorer: WeightedJudge,
                     prompts: list[str], scale: RewardScale) -> None:
    """Ziegler et al. sec. 2.2: score `reward_normalization_samples` rollouts of the initial policy (a seeded
    sample of the prompts, split evenly over processes) and fix the gain and bias from them."""
    world, rank = accelerator.num_processes, accelerator.process_index
    n = max(world, cfg.reward_normalization_samples // world * world)
    g = torch.Generator().manual_seed(ctx.seed + 104_729)
    order = torch.randperm(len(prompts), generator=g).tolist()
    picked = [prompts[order[i % len(prompts)]] for i in range(n)][rank::world]
    scores = []
    for start in range(0, len(picked), cfg.generation.batch_size):
        batch = picked[start:start + cfg.generation.batch_size]
        r = rollout(cfg, accelerator, engine, batch, seed=ctx.seed * 31 + start * world + rank)
        scores.append(scorer.score_rollout(r, batch, tokenizer))
    all_scores = accelerator.gather(torch.cat(scores))
    scale.fit(all_scores)
    if accelerator.is_main_process:
        print(f"[align] {ctx.name}: reward normalisation from {all_scores.numel()} initial-policy rollouts: "
              f"mean {all_scores.mean().item():.4f}, std {all_scores.std(unbiased=False).item():.4f} -> "
              f"gain {scale.gain:.4f}, bias {scale.bias:.4f}", flush=True)
    ctx.note(reward_normalization={"gain": scale.gain, "bias": scale.bias, "samples": n, "fitted_at_iteration": 0})


def kl_controller(cfg: PPOStage):
    """The beta rule `kl` names (align/stages/ppo/state.py)."""
    if not cfg.kl.adaptive:
        return FixedKLController(cfg.kl.coef)
    if cfg.kl.controller == "ziegler":
        return AdaptiveKLController(cfg.kl.coef, cfg.kl.target, cfg.kl.horizon)
    return PIKLController(cfg.kl.coef, cfg.kl.target, cfg.kl.kp, cfg.kl.ki)


def heldout_kl(cfg: PPOStage, accelerator, engine: RolloutEngine, model, reference, heldout: list[str],
               seed: int, where: str) -> HeldoutKL:
    """Sequence KL(policy || reference) = sum over the response of log pi - log ref (k1, at the sampling temperature,
    as the evaluation measures it) of one response per held-out prompt, sampled with the same seeds every iteration
    (the iterations differ by the policy, not by the draw). Every process measures an equal share (so the
    collectives of ZeRO-3 generation line up) and the shares are gathered. These are the first samples after a
    weight sync: an engine that reports its own log-probs is checked against the policy here (`where` names the
    iteration), so a broken sync stops the stage before its KL can steer the controller or the budget."""
    world, rank = accelerator.num_processes, accelerator.process_index
    n = max(world, len(heldout) // world * world)
    mine = [heldout[i % len(heldout)] for i in range(n)][rank::world]
    kls = []
    for start in range(0, len(mine), cfg.generation.batch_size):
        r = rollout(cfg, accelerator, engine, mine[start:start + cfg.generation.batch_size], seed=seed + start * world + rank)
        with torch.no_grad(), accelerator.autocast():
            logprobs, _, _ = model(r.input_ids, r.attention_mask, r.query_ids.size(1), cfg.generation.temperature,
                                   with_entropy=False, with_values=False)
            ref_logprobs = response_logprobs(reference, r, cfg.generation.temperature)
        if r.engine_logprobs is not None:
            check_gap(logprob_gap(r.engine_logprobs, logprobs, r.response_mask)["max"], cfg.generation.max_logprob_gap,
                      where, engine.log_path)
        kls.append(sequence_kl(logprobs, ref_logprobs, r.response_mask))
    return HeldoutKL.of(accelerator.gather(torch.cat(kls)).cpu())


def stop_inside_budget(ctx: StageContext, cfg: PPOStage, snapshot: PolicySnapshot, iteration: int,
                       measured: HeldoutKL) -> None:
    """An update left kl.max: undo it (the weights of the last update inside the budget go back into the model, to
    be published) and say so. When no update of this run stayed inside, there is nothing to publish: refuse."""
    if snapshot.iteration == 0:
        raise StageError(f"stage '{ctx.name}': the first update already took the held-out KL to {measured.mean:.2f} "
                         f"nats (95% upper bound {measured.upper:.2f}), past kl.max: {cfg.kl.max:g}; nothing was learned "
                         "inside the budget. Lower learning_rate, raise kl.coef, or raise kl.max")
    snapshot.restore()
    kept = (f"held-out KL {snapshot.kl.mean:.2f}, bound {snapshot.kl.upper:.2f}" if snapshot.kl
            else "the checkpoint this run resumed from")
    if ctx.is_main:
        print(f"[align] {ctx.name}: iteration {iteration}'s update took the held-out KL to {measured.mean:.2f} nats "
              f"(95% upper bound {measured.upper:.2f}), past kl.max {cfg.kl.max:g}: undone, and training stops here. "
              f"Publishing the policy after iteration {snapshot.iteration} ({kept})", flush=True)


def budget_summary(cfg: PPOStage, snapshot: PolicySnapshot, over: tuple[int, HeldoutKL] | None) -> dict[str, Any]:
    """The manifest's account of kl.max: which iteration's policy is published and why."""
    out: dict[str, Any] = {"kl_budget/max": cfg.kl.max, "kl_budget/published_iteration": snapshot.iteration,
                           "kl_budget/stopped": over is not None}
    if snapshot.kl is not None:
        out.update({"kl_budget/heldout_kl": snapshot.kl.mean, "kl_budget/heldout_kl_upper": snapshot.kl.upper})
    if over is not None:
        out.update({"kl_budget/undone_iteration": over[0], "kl_budget/undone_heldout_kl": over[1].mean,
                    "kl_budget/undone_heldout_kl_upper": over[1].upper})
    return out


def run(ctx: StageContext) -> dict[str, Any]:
    from accelerate import Accelerator  # heavy: stage processes only

    cfg: PPOStage = ctx.cfg  # type: ignore[assignment]
    ctx.compute = ctx.compute.for_rl_training()  # eager attention on a GPU unless set (align/modeling/compute.py)
    ctx.extra_manifest["attn_implementation"] = ctx.compute.attn_implementation or "auto"
    accelerator = Accelerator(gradient_accumulation_steps=cfg.gradient_accumulation_steps,
                              mixed_precision=ctx.compute.mixed_precision)
    plugin = accelerator.state.deepspeed_plugin
    if plugin is not None:  # no dataloader goes through prepare(), so DeepSpeed is told the micro-batch here
        plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = cfg.mini_batch_size
        plugin.deepspeed_config["gradient_accumulation_steps"] = cfg.gradient_accumulation_steps
    disable_deepspeed_clipping(accelerator)
    policy_path = ctx.input_model(cfg.policy)
    weights = judge_weights(cfg.reward)
    reward_stages = [n for n in weights if n in ctx.inputs]
    tokenizer = load_tokenizer(policy_path)
    prompts = unique_prompts(load_rows(ctx, cfg.prompts, cfg.split, tokenizer=tokenizer))  # chat: rendered
    prompts = usable_prompts(ctx, cfg, tokenizer, {n: load_tokenizer(ctx.input_model(n)) for n in reward_stages},
                             prompts)
    try:  # before any model loads: a held-out share that leaves too little to train on is refused here
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

    pad_id = tokenizer.pad_token_id
    value_from_reward = cfg.value_init == "reward"
    # peft draws the LoRA adapters' initial weights from torch's global generator, which nothing else seeds here:
    # seeded, two runs of one config start from the same adapters (a resumed run loads them from its checkpoint)
    torch.manual_seed(ctx.seed)
    model = load_trained(ctx, cfg, accelerator, pad_id, reward_stages)
    groups = model.trainable_groups()  # LoRA: the adapters (and value head) only
    optimizer = torch.optim.AdamW([{"params": groups["policy"], "lr": cfg.learning_rate},
                                   {"params": groups["value"], "lr": cfg.value_learning_rate}], eps=1e-5)
    model, optimizer = accelerator.prepare(model, optimizer)
    base_lrs = [cfg.learning_rate, cfg.value_learning_rate]
    reference, reward_fns = load_frozen(ctx, cfg, accelerator, accelerator.unwrap_model(model), pad_id, reward_stages)
    scorer = build_judge(cfg.reward, lambda n: RewardModelJudge(n, reward_fns[n], tokenizer) if n in reward_fns else None)

    kl_ctl = kl_controller(cfg)
    moments, scale = RunningMoments(), RewardScale()
    stream = PromptStream(len(prompts), ctx.seed)
    progress = {"iteration": 0}
    start = resume(ctx, accelerator, kl_ctl, moments, scale, stream, progress, trainable_only=cfg.lora.enabled)
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.eval()  # dropout is off anyway; eval() also keeps train-only code paths out of the forward
    engine = open_engine(ctx, cfg, accelerator, model, tokenizer, policy_path)
    with closing(engine):  # a vllm engine's process ends with the stage, also when it fails
        gaps: list[float] = []
        t_sync = sync_engine(engine, model, accelerator)  # the engine starts from policy_path; a resumed policy differs
        if cfg.reward_normalization == "initial" and not scale.fitted:
            fit_reward_scale(ctx, cfg, accelerator, engine, tokenizer, scorer, prompts, scale)
        elif scale.fitted:  # restored with the checkpoint, never refitted on the partly trained policy
            ctx.note(reward_normalization={"gain": scale.gain, "bias": scale.bias, "restored_at_iteration": start})
        if value_from_reward:  # the value head starts as the reward head: read it in the normalised units
            w = weights[reward_stages[0]]
            unwrapped.value_affine = (scale.gain * w, scale.bias) if cfg.reward_normalization == "initial" else (w, 0.0)

        world = accelerator.num_processes
        history = restore_history(ctx, start)
        # kl.max: the weights of the last update inside the budget (at the start: the starting or resumed policy,
        # whose checkpoint was only written inside the budget)
        snapshot = PolicySnapshot(groups["policy"]) if cfg.kl.max is not None else None
        if snapshot is not None:
            snapshot.take(start, HeldoutKL.from_metrics(history[-1]) if history else None)
        synced, over = True, None  # synced: the engine holds the weights the next rollout must sample from
        for it in range(start, cfg.iterations):
            t0 = time.time()
            if not synced:  # the engine samples from the weights the last update left
                t_sync = sync_engine(engine, model, accelerator)
            synced = False
            # Every process takes its own slice of the same global batch.
            idx = stream.take(cfg.rollout_batch_size * world)
            mine = idx[accelerator.process_index::world]
            batch_prompts = [prompts[i] for i in mine]

            # 1. generate
            r = rollout(cfg, accelerator, engine, batch_prompts,
                        seed=ctx.seed * 7919 + it * world + accelerator.process_index)
            if accelerator.device.type == "cuda":
                torch.cuda.synchronize()  # GPU work is asynchronous: time what generation really took
            t_gen = time.time() - t0
            ids, mask, rmask = r.input_ids, r.attention_mask, r.response_mask.float()
            lq = r.query_ids.size(1)
            with torch.no_grad():
                # 2. score (reward model and/or judges), normalise, subtract the missing-EOS penalty
                scores = scorer.score_rollout(r, batch_prompts, tokenizer)
                all_scores = accelerator.gather(scores)
                if cfg.reward_normalization == "initial":
                    scores_used = scale(scores)
                elif cfg.reward_normalization == "running":
                    moments.update(all_scores)
                    scores_used = (scores - moments.mean) / moments.std
                else:
                    scores_used = scores
                penalties = torch.zeros_like(scores)
                if cfg.missing_eos_penalty is not None:
                    penalties = cfg.missing_eos_penalty * (~r.eos_found).float()
                scores_used = scores_used - penalties
                # 3. log-probs under policy and reference, and values, by a forward pass
                with accelerator.autocast():
                    logprobs, _, values = model(ids, mask, lq, cfg.generation.temperature, with_entropy=False)
                    ref_logprobs = response_logprobs(reference, r, cfg.generation.temperature)
                gap = None
                if r.engine_logprobs is not None:  # what the engine sampled with vs what PPO optimises (same tokens)
                    gap = logprob_gap(r.engine_logprobs, logprobs, rmask)
                    check_gap(gap["max"], cfg.generation.max_logprob_gap,
                              f"stage '{ctx.name}' iteration {it + 1} (after a weight sync of {t_sync:.2f} s)",
                              engine.log_path)
                # 4. per-token rewards: -beta * KL, plus the score on the last response token
                kl = kl_estimate(logprobs, ref_logprobs, cfg.kl.estimator) * rmask
                last = (rmask.sum(1) - 1).clamp(min=0).long()
                rewards = token_rewards(scores_used, kl, rmask, kl_ctl.value, last)
                # 5. advantages by GAE, whitened; returns = advantages + values
                advantages, returns = gae(rewards, values, rmask, cfg.gamma, cfg.lam)
                advantages = masked_whiten(advantages, rmask)

            # 6. PPO epochs over mini-batches with gradient accumulation (learning rate decays linearly to 10%,
            # a function of the iteration alone, so a resumed run continues the same schedule)
            for group, base in zip(optimizer.param_groups, base_lrs):
                group["lr"] = base * (1.0 - 0.9 * it / max(1, cfg.iterations))
            stats = ppo_update(cfg, accelerator, model, optimizer, groups, ids, mask, rmask, lq, logprobs, values,
                               advantages, returns)

            seq_kl = accelerator.gather(kl.sum(1)).mean().item()
            beta = kl_ctl.value
            measured = None
            if heldout:  # 7. the KL after this update, on prompts never trained on (align/stages/ppo/budget.py)
                t_sync, synced = sync_engine(engine, model, accelerator), True
                measured = heldout_kl(cfg, accelerator, engine, model, reference, heldout, ctx.seed * 7919 + 1_299_709,
                                      f"stage '{ctx.name}' iteration {it + 1}, held-out KL (after a weight sync of "
                                      f"{t_sync:.2f} s)")
            kl_ctl.update(measured.mean if measured else seq_kl, cfg.rollout_batch_size * world)
            non_score = accelerator.gather((-beta * kl).sum(1)).mean().item()
            used = accelerator.gather(scores_used).mean().item()
            elapsed = time.time() - t0
            metrics = {
                "objective/scores": all_scores.mean().item(), "objective/scores_std": all_scores.std().item(),
                "objective/normalized_scores": accelerator.gather(scores_used + penalties).mean().item(),
                "objective/penalties": accelerator.gather(penalties).mean().item(),
                "objective/kl": seq_kl, "objective/kl_coef": beta, "objective/non_score_reward": non_score,
                "objective/rlhf_reward": used + non_score,
                "rollout/response_length": accelerator.gather(rmask.sum(1)).mean().item(),
                "rollout/eos_fraction": accelerator.gather(r.eos_found.float()).mean().item(),
                "perf/episodes_per_s": cfg.rollout_batch_size * world / elapsed,
                "perf/tokens_per_s": accelerator.gather(rmask.sum()).sum().item() / elapsed,
                "perf/generation_fraction": t_gen / elapsed,
                "perf/sequence_tokens": accelerator.gather(mask.sum()).sum().item(),  # prompt + response, no padding
                "train/learning_rate": optimizer.param_groups[0]["lr"], **stats,
                **(measured.metrics() if measured else {}),
            }
            if gap is not None:
                metrics["rollout/logprob_gap_mean"] = accelerator.reduce(torch.tensor(gap["mean"]), "mean").item()
                metrics["rollout/logprob_gap_max"] = accelerator.reduce(torch.tensor(gap["max"]), "max").item()
                metrics["perf/sync_seconds"] = t_sync
                gaps.append(metrics["rollout/logprob_gap_max"])
            if snapshot is not None and measured is not None:
                if measured.within(cfg.kl.max):
                    snapshot.take(it + 1, measured)
                else:
                    over = (it + 1, measured)
                    metrics["heldout/over_budget"] = 1.0
            history.append(metrics)
            ctx.log(metrics, step=it + 1)
            ctx.progress(it + 1, cfg.iterations, score=metrics["objective/scores"],
                         kl=measured.mean if measured else seq_kl, beta=beta)
            if over is not None:
                stop_inside_budget(ctx, cfg, snapshot, *over)
                break
            if cfg.sample_every and (it + 1) % cfg.sample_every == 0 and ctx.tracker is not None:
                texts = r.texts(tokenizer)[:8]
                ctx.tracker.table("samples", ["prompt", "response", "score"],
                                  [[p, t, float(s)] for p, t, s in zip(batch_prompts, texts, scores[:8].tolist())], it + 1)
            progress["iteration"] = it + 1
            if (it + 1) % cfg.save_every == 0 and it + 1 < cfg.iterations:
                save_checkpoint(ctx, accelerator, it + 1, trainable_only=cfg.lora.enabled, keep=cfg.save_total_limit)

        def write(path: Path) -> None:
            state = accelerator.get_state_dict(model)  # collective under ZeRO-3: every process gathers
            if accelerator.is_main_process:
                policy_state = {k[len("policy."):]: v for k, v in state.items() if k.startswith("policy.")}
                if cfg.lora.enabled and not cfg.lora.merge:  # the adapters alone, beside the name of their base
                    accelerator.unwrap_model(model).policy.save_pretrained(path, state_dict=policy_state)
                    ctx.trained_from = policy_path
                    ctx.write_adapter_base(path, accelerator.unwrap_model(model).policy)
                    ctx.extra_manifest["lora_published"] = "adapter"
                elif cfg.lora.enabled:  # adapters merged into a fresh, unquantized load of the starting policy
                    with unsharded_loading():  # main process only: no ZeRO-3 partitioning (a collective) here
                        base = load_causal_lm(policy_path, ctx.weights_dtype(frozen=True))
                    merged = merged_lora_model(base, cfg.lora, "CAUSAL_LM", policy_state)
                    merged.generation_config.pad_token_id = pad_id
                    merged.save_pretrained(path)
                else:
                    accelerator.unwrap_model(model).policy.save_pretrained(path, state_dict=policy_state)
                tokenizer.save_pretrained(path)

        ctx.publish("model", write)
        out = summarise(cfg, [h for h in history if not h.get("heldout/over_budget")], kl_ctl, start)
        if snapshot is not None:
            out.update(budget_summary(cfg, snapshot, over))
        if gaps:
            out["rollout/logprob_gap_max"] = nan_max(gaps)
            out["perf/sync_seconds"] = sum(engine.sync_seconds) / max(1, len(engine.sync_seconds))
        return out


def ppo_update(cfg: PPOStage, accelerator, model, optimizer, groups, ids, mask, rmask, lq, old_logprobs, old_values,
               advantages, returns) -> dict[str, float]:
    """Step 6: clipped policy + value losses over shuffled mini-batches; after an epoch whose mean approximate
    KL exceeds `max_approx_kl`, stop. `policy/ratio_first` is the mean ratio on the first mini-batch of the
    first epoch: exactly 1 when rollout and update compute the same log-probs (no dropout)."""
    # transformers recomputes activations only in training mode (dropout is 0, so train() changes nothing else)
    unwrapped = accelerator.unwrap_model(model)
    mode = unwrapped.training
    if cfg.gradient_checkpointing:
        unwrapped.train()
    try:
        return _ppo_epochs(cfg, accelerator, model, optimizer, groups, ids, mask, rmask, lq, old_logprobs, old_values,
                           advantages, returns)
    finally:
        unwrapped.train(mode)


def _ppo_epochs(cfg: PPOStage, accelerator, model, optimizer, groups, ids, mask, rmask, lq, old_logprobs,
                old_values, advantages, returns) -> dict[str, float]:
    b = ids.size(0)
    sums: dict[str, float] = {}
    count = 0
    stop = False
    first_ratio = None
    for _ in range(cfg.ppo_epochs):
        order = torch.randperm(b)
        epoch_kl, epoch_n = 0.0, 0
        for start in range(0, b, cfg.mini_batch_size):
            mb = order[start:start + cfg.mini_batch_size]
            with accelerator.accumulate(model), accelerator.autocast():
                logprobs, entropy, values = model(ids[mb], mask[mb], lq, cfg.generation.temperature)
                pg_loss, pm = ppo_policy_loss(logprobs, old_logprobs[mb], advantages[mb], rmask[mb], cfg.clip_range)
                vf_loss, vm = ppo_value_loss(values, old_values[mb], returns[mb], rmask[mb], cfg.clip_range_value)
                ent = masked_mean(entropy, rmask[mb])
                loss = pg_loss + cfg.vf_coef * vf_loss - cfg.entropy_coef * ent
                if not torch.isfinite(loss):
                    parts = {"policy loss": pg_loss, "value loss": vf_loss, "entropy": ent, "log-probs": logprobs,
                             "rollout log-probs": old_logprobs[mb], "values": values, "advantages": advantages[mb],
                             "returns": returns[mb]}
                    bad = ", ".join(k for k, v in parts.items() if not torch.isfinite(v).all()) or "none"
                    raise NonFiniteLossError(f"PPO loss is {loss.item()} (non-finite parts: {bad}); stopping (lower "
                                             "the learning rate, or try precision: float32)")
                if first_ratio is None:
                    first_ratio = masked_mean(torch.exp(logprobs - old_logprobs[mb]), rmask[mb]).item()
                norms = backward_and_step(accelerator, model, optimizer, loss, groups, cfg.max_grad_norm)
            skipped = norms.pop("skipped", 0.0)
            step = {"train/skipped_step_fraction": skipped, "train/loss": loss.item(), "policy/loss": pg_loss.item(), "value/loss": vf_loss.item(),
                    "policy/entropy": ent.item(), **{k: v.item() for k, v in {**pm, **vm}.items()},
                    **{f"{k}/grad_norm": v for k, v in norms.items()}}
            if count == 0:
                step_first = {"policy/approx_kl_first": pm["policy/approx_kl"].item()}
            for k, v in step.items():
                sums[k] = sums.get(k, 0.0) + v
            count += 1
            epoch_kl, epoch_n = epoch_kl + pm["policy/approx_kl"].item(), epoch_n + 1
        # early stopping looks at this epoch alone (its mean over mini-batches, averaged over processes)
        approx_kl = accelerator.reduce(torch.tensor(epoch_kl / epoch_n, device=ids.device), "mean")
        if cfg.max_approx_kl is not None and approx_kl.item() > cfg.max_approx_kl:
            stop = True
            break
    out = {k: accelerator.reduce(torch.tensor(v / count, device=ids.device), "mean").item() for k, v in sums.items()}
    out["policy/early_stopped"] = float(stop)
    if out["train/skipped_step_fraction"] > 0.5:
        raise NonFiniteLossError(f"PPO: {out['train/skipped_step_fraction']:.0%} of this iteration's optimiser steps had "
                                 "non-finite gradients and were skipped; stopping (lower the learning rate, or try "
                                 "precision: float32)")
    out["policy/ratio_first"] = accelerator.reduce(torch.tensor(first_ratio, device=ids.device), "mean").item()
    out.update({k: accelerator.reduce(torch.tensor(v, device=ids.device), "mean").item() for k, v in step_first.items()})
    return out


def summarise(cfg: PPOStage, history: list[dict[str, float]], kl_ctl, start: int) -> dict[str, Any]:
    """Final figures for the manifest: score at the start and end of training (over the whole run, also after a
    resume: history is restored from metrics.jsonl), KL and beta."""
    if not history:
        raise RuntimeError(f"PPO ran no iteration (iterations={cfg.iterations}, resumed at {start})")
    k = max(1, len(history) // 5)
    first, last = history[:k], history[-k:]

    def avg(rows, key):
        rows = [r for r in rows if key in r]
        return sum(r[key] for r in rows) / len(rows) if rows else None

    return {"ppo/iterations_run": len(history), "ppo/resumed_from_iteration": start,
            "objective/scores_first": avg(first, "objective/scores"),
            "objective/scores_last": avg(last, "objective/scores"),
            "objective/kl_last": avg(last, "objective/kl"), "objective/kl_coef_final": kl_ctl.value,
            "heldout/kl_last": history[-1].get("heldout/kl"),
            "objective/kl_target": cfg.kl.target if cfg.kl.adaptive else None,
            "rollout/eos_fraction_last": avg(last, "rollout/eos_fraction"),
            "perf/episodes_per_s": avg(history, "perf/episodes_per_s"),
            "perf/generation_fraction": avg(history, "perf/generation_fraction"),
            "perf/tokens_per_s": avg(history, "perf/tokens_per_s"),
            "train/skipped_step_fraction": avg(history, "train/skipped_step_fraction")}

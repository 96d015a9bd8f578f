"""PPO stage: RLHF against a frozen reward model with a KL penalty to the reference policy.

R(x, y) = RM(x, y) - beta * log(pi(y|x) / pi_ref(y|x))   (Ziegler et al. 2019; Ouyang et al. 2022)

Each iteration, per process: (1) sample responses, (2) score them with the reward model, (3) log-probs of
the responses under policy and reference, and values, (4) per-token rewards with the KL penalty,
(5) GAE advantages, (6) PPO epochs over mini-batches. Algorithm code touches only `accelerator.*`;
DeepSpeed choices live in the accelerate config.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from align.config import PPOStage
from align.generation import Rollout, generate, position_ids, response_logprobs, scalar_outputs
from align.losses import (entropy_from_logits, gae, kl_estimate, last_token_index, logprobs_from_logits,
                          masked_mean, masked_whiten, ppo_policy_loss, ppo_value_loss, token_rewards)
from align.models import load_causal_lm, load_scalar_model, load_tokenizer
from align.stages.base import NonFiniteLossError, StageContext, load_rows, unique_prompts
from align.stages.ppo.state import AdaptiveKLController, FixedKLController, PromptStream, RunningMoments

OUTPUTS = ["model"]


class PolicyAndValue(torch.nn.Module):
    """The two trainable models as one module, so one DeepSpeed engine (and optimizer) serves both."""

    def __init__(self, policy, value):
        super().__init__()
        self.policy, self.value = policy, value

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, query_len: int, temperature: float):
        """Per-token log-probs, entropies and values of the response part. ids, mask: (B, Lq + Lr)."""
        pos = position_ids(mask)
        logits = self.policy(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        logits = logits[:, query_len - 1:-1] / temperature  # (B, Lr, V): logit t predicts token t + 1
        response = ids[:, query_len:]
        values = scalar_outputs(self.value, ids, mask)[:, query_len - 1:-1]  # V(state before token t)
        return logprobs_from_logits(logits, response), entropy_from_logits(logits), values


def check_models(ctx: StageContext, cfg: PPOStage, tokenizer, reward_tokenizer, prompts: list[str]) -> None:
    """Fail before any rollout: tokenizers must agree, prompts must fit (issue: misconfiguration early)."""
    if tokenizer.get_vocab() != reward_tokenizer.get_vocab():
        raise ValueError(f"stage '{ctx.name}': the reward model's tokenizer ({cfg.reward}) differs from the "
                         f"policy's ({cfg.policy}); PPO scores token ids directly, so both must share one "
                         "tokenizer (train the reward model from the same SFT checkpoint)")
    lengths = [len(ids) for ids in tokenizer(prompts, add_special_tokens=True)["input_ids"]]
    too_long = sum(n > cfg.max_prompt_length for n in lengths)
    if too_long:
        raise ValueError(f"stage '{ctx.name}': {too_long} of {len(prompts)} prompts are longer than "
                         f"max_prompt_length={cfg.max_prompt_length} tokens (longest {max(lengths)}); raise "
                         "max_prompt_length or shorten the prompts")


def _zero3(accelerator) -> bool:
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    return plugin is not None and plugin.zero_stage == 3


def prepare_frozen(model, accelerator):
    """A frozen model for inference: sharded by DeepSpeed ZeRO-3 when that is the plan, else just moved."""
    model.eval().requires_grad_(False)
    if not _zero3(accelerator):
        return model.to(accelerator.device)
    import deepspeed

    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
           "bf16": {"enabled": accelerator.mixed_precision == "bf16"}}
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    return engine.module.eval()


def gathered_for_generation(model, accelerator):
    """Under ZeRO-3, gather the policy's weights once per rollout (not once per token)."""
    if _zero3(accelerator):
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(model.parameters()))
    from contextlib import nullcontext

    return nullcontext()


def run(ctx: StageContext) -> dict[str, Any]:
    from accelerate import Accelerator

    cfg: PPOStage = ctx.cfg  # type: ignore[assignment]
    accelerator = Accelerator(gradient_accumulation_steps=cfg.gradient_accumulation_steps)
    plugin = accelerator.state.deepspeed_plugin
    if plugin is not None:  # no dataloader goes through prepare(), so DeepSpeed is told the micro-batch here
        plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = cfg.mini_batch_size
        plugin.deepspeed_config["gradient_accumulation_steps"] = cfg.gradient_accumulation_steps
    dtype = ctx.pipeline["dtype"]
    policy_path, reward_path = ctx.input_model(cfg.policy), ctx.input_model(cfg.reward)
    tokenizer, reward_tokenizer = load_tokenizer(policy_path), load_tokenizer(reward_path)
    prompts = unique_prompts(load_rows(ctx, cfg.prompts, cfg.split))
    check_models(ctx, cfg, tokenizer, reward_tokenizer, prompts)

    pad_id = tokenizer.pad_token_id
    policy = load_causal_lm(policy_path, dtype)
    policy.generation_config.pad_token_id = pad_id
    value = load_scalar_model(reward_path if cfg.value_init == "reward" else policy_path, pad_id, dtype)
    model = PolicyAndValue(policy, value)
    optimizer = torch.optim.AdamW([{"params": policy.parameters(), "lr": cfg.learning_rate},
                                   {"params": value.parameters(), "lr": cfg.value_learning_rate}], eps=1e-5)
    model, optimizer = accelerator.prepare(model, optimizer)
    base_lrs = [cfg.learning_rate, cfg.value_learning_rate]
    reference = prepare_frozen(load_causal_lm(policy_path, dtype), accelerator)
    reward_model = prepare_frozen(load_scalar_model(reward_path, pad_id, dtype), accelerator)

    kl_ctl = (AdaptiveKLController(cfg.kl.coef, cfg.kl.target, cfg.kl.horizon) if cfg.kl.adaptive
              else FixedKLController(cfg.kl.coef))
    moments = RunningMoments()
    stream = PromptStream(len(prompts), ctx.seed)
    progress = {"iteration": 0}
    start = resume(ctx, accelerator, kl_ctl, moments, stream, progress)

    world = accelerator.num_processes
    history: list[dict[str, float]] = []
    bar = tqdm(range(start, cfg.iterations), desc=f"{ctx.name}", disable=not accelerator.is_main_process,
               initial=start, total=cfg.iterations)
    for it in bar:
        t0 = time.time()
        # Every process takes its own slice of the same global batch.
        idx = stream.take(cfg.rollout_batch_size * world)
        mine = idx[accelerator.process_index::world]
        batch_prompts = [prompts[i] for i in mine]
        unwrapped = accelerator.unwrap_model(model)
        unwrapped.eval()

        # 1. generate
        with torch.no_grad(), gathered_for_generation(unwrapped.policy, accelerator):
            r: Rollout = generate(unwrapped.policy, tokenizer, batch_prompts, cfg.generation,
                                  seed=ctx.seed * 7919 + it * world + accelerator.process_index)
        ids, mask, rmask = r.input_ids, r.attention_mask, r.response_mask.float()
        lq = r.query_ids.size(1)
        with torch.no_grad():
            # 2. score at the last real token; penalise responses that never emitted EOS
            raw_scores = scalar_outputs(reward_model, ids, mask)
            scores = raw_scores[torch.arange(ids.size(0)), last_token_index(ids, mask, pad_id)]
            if cfg.missing_eos_penalty is not None:
                scores = scores - cfg.missing_eos_penalty * (~r.eos_found).float()
            all_scores = accelerator.gather(scores)
            if cfg.normalize_reward:
                moments.update(all_scores)
                scores_used = (scores - moments.mean) / moments.std
            else:
                scores_used = scores
            # 3. log-probs under policy and reference, and values, by a forward pass
            logprobs, _, values = model(ids, mask, lq, cfg.generation.temperature)
            ref_logprobs = response_logprobs(reference, r, cfg.generation.temperature)
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
        unwrapped.train()
        stats = ppo_update(cfg, accelerator, model, optimizer, ids, mask, rmask, lq, logprobs, values,
                           advantages, returns)

        seq_kl = accelerator.gather(kl.sum(1)).mean().item()
        kl_ctl.update(seq_kl, cfg.rollout_batch_size * world)
        non_score = accelerator.gather((-kl_ctl.value * kl).sum(1)).mean().item()
        metrics = {
            "objective/scores": all_scores.mean().item(), "objective/kl": seq_kl,
            "objective/kl_coef": kl_ctl.value, "objective/rlhf_reward": all_scores.mean().item() + non_score,
            "objective/non_score_reward": non_score,
            "rollout/response_length": accelerator.gather(rmask.sum(1)).mean().item(),
            "rollout/eos_fraction": accelerator.gather(r.eos_found.float()).mean().item(),
            "perf/episodes_per_s": cfg.rollout_batch_size * world / (time.time() - t0),
            "perf/tokens_per_s": accelerator.gather(rmask.sum()).sum().item() / (time.time() - t0),
            "train/learning_rate": optimizer.param_groups[0]["lr"], **stats,
        }
        history.append(metrics)
        ctx.log(metrics, step=it + 1)
        bar.set_postfix(score=f"{metrics['objective/scores']:.3f}", kl=f"{seq_kl:.2f}", beta=f"{kl_ctl.value:.3f}")
        if cfg.sample_every and (it + 1) % cfg.sample_every == 0 and ctx.tracker is not None:
            texts = tokenizer.batch_decode(r.response_ids[:8], skip_special_tokens=True)
            ctx.tracker.table("samples", ["prompt", "response", "score"],
                              [[p, t, float(s)] for p, t, s in zip(batch_prompts, texts, scores[:8].tolist())], it + 1)
        progress["iteration"] = it + 1
        if (it + 1) % cfg.save_every == 0 and it + 1 < cfg.iterations:
            save_checkpoint(ctx, accelerator, it + 1)

    def write(path: Path) -> None:
        state = accelerator.get_state_dict(model)  # collective under ZeRO-3: every process gathers
        if accelerator.is_main_process:
            policy_state = {k[len("policy."):]: v for k, v in state.items() if k.startswith("policy.")}
            accelerator.unwrap_model(model).policy.save_pretrained(path, state_dict=policy_state)
            tokenizer.save_pretrained(path)

    ctx.publish("model", write)
    return summarise(cfg, history, kl_ctl, start)


def ppo_update(cfg: PPOStage, accelerator, model, optimizer, ids, mask, rmask, lq, old_logprobs, old_values,
               advantages, returns) -> dict[str, float]:
    """Step 6: clipped policy + value losses over shuffled mini-batches; stop early on a large approx KL."""
    b = ids.size(0)
    sums: dict[str, float] = {}
    count = 0
    stop = False
    for _ in range(cfg.ppo_epochs):
        order = torch.randperm(b)
        for start in range(0, b, cfg.mini_batch_size):
            mb = order[start:start + cfg.mini_batch_size]
            with accelerator.accumulate(model):
                logprobs, entropy, values = model(ids[mb], mask[mb], lq, cfg.generation.temperature)
                pg_loss, pm = ppo_policy_loss(logprobs, old_logprobs[mb], advantages[mb], rmask[mb], cfg.clip_range)
                vf_loss, vm = ppo_value_loss(values, old_values[mb], returns[mb], rmask[mb], cfg.clip_range_value)
                ent = masked_mean(entropy, rmask[mb])
                loss = pg_loss + cfg.vf_coef * vf_loss - cfg.entropy_coef * ent
                if not torch.isfinite(loss):
                    raise NonFiniteLossError(f"PPO loss is {loss.item()}; stopping (lower the learning rate)")
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            step = {"train/loss": loss.item(), "policy/loss": pg_loss.item(), "value/loss": vf_loss.item(),
                    "policy/entropy": ent.item(), **{k: v.item() for k, v in {**pm, **vm}.items()}}
            for k, v in step.items():
                sums[k] = sums.get(k, 0.0) + v
            count += 1
        approx_kl = accelerator.reduce(torch.tensor(sums["policy/approx_kl"] / count, device=ids.device), "mean")
        if cfg.max_approx_kl is not None and approx_kl.item() > cfg.max_approx_kl:
            stop = True
            break
    out = {k: accelerator.reduce(torch.tensor(v / count, device=ids.device), "mean").item() for k, v in sums.items()}
    out["policy/early_stopped"] = float(stop)
    return out


# --------------------------------------------------------------------------------------------- checkpoints
def _register(accelerator, *objs) -> None:
    if not getattr(accelerator, "_align_registered", False):
        for o in objs:
            accelerator.register_for_checkpointing(o)
        accelerator._align_registered = True


def resume(ctx: StageContext, accelerator, kl_ctl, moments, stream, progress) -> int:
    """Restore the newest complete checkpoint of this fingerprint (models, optimizer, scheduler, RNG, KL
    controller, reward statistics, data position); return the iteration to continue from."""

    class Progress:
        def state_dict(self):
            return dict(progress)

        def load_state_dict(self, s):
            progress.update(s)

    _register(accelerator, kl_ctl, moments, stream, Progress())
    ckpts = ctx.checkpoints
    ctx.prepare_checkpoints()
    if accelerator.is_main_process:
        for partial in ckpts.glob(".iter-*"):  # a save that was killed mid-write
            shutil.rmtree(partial)
    accelerator.wait_for_everyone()
    done = sorted((p for p in ckpts.glob("iter-*") if (p / "COMPLETE").is_file()), key=lambda p: int(p.name[5:]))
    if not done:
        ctx.extra_manifest["resumed_from_iteration"] = 0
        return 0
    accelerator.load_state(str(done[-1]))
    if accelerator.is_main_process:
        print(f"[align] {ctx.name}: resuming from {done[-1]} (iteration {progress['iteration']}, "
              f"beta {kl_ctl.value:.4f})", flush=True)
    ctx.extra_manifest["resumed_from_iteration"] = progress["iteration"]
    return int(progress["iteration"])


def save_checkpoint(ctx: StageContext, accelerator, iteration: int) -> None:
    """accelerator.save_state into a hidden dir, then a rename + COMPLETE marker; keep the last two."""
    final = ctx.checkpoints / f"iter-{iteration}"
    tmp = ctx.checkpoints / f".iter-{iteration}"
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / "COMPLETE").write_text(json.dumps({"iteration": iteration}))
        tmp.rename(final)
        for old in sorted(ctx.checkpoints.glob("iter-*"), key=lambda p: int(p.name[5:]))[:-2]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()


def summarise(cfg: PPOStage, history: list[dict[str, float]], kl_ctl, start: int) -> dict[str, Any]:
    """Final figures for the manifest: reward-model score at the start and end of training, KL and beta."""
    if not history:
        return {"ppo/iterations": cfg.iterations}
    k = max(1, len(history) // 5)
    first, last = history[:k], history[-k:]

    def avg(rows, key):
        return sum(r[key] for r in rows) / len(rows)

    return {"ppo/iterations": cfg.iterations, "ppo/resumed_from_iteration": start,
            "objective/scores_first": avg(first, "objective/scores"),
            "objective/scores_last": avg(last, "objective/scores"),
            "objective/kl_last": avg(last, "objective/kl"), "objective/kl_coef_final": kl_ctl.value,
            "objective/kl_target": cfg.kl.target if cfg.kl.adaptive else None,
            "rollout/eos_fraction_last": avg(last, "rollout/eos_fraction"),
            "perf/episodes_per_s": avg(history, "perf/episodes_per_s")}

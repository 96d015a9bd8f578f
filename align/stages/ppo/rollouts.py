"""PPO's rollouts: the prompts it can use, the engine that samples (align/engines/), weight syncs, and
the initial-policy rollouts that fix the reward's gain and bias (Ziegler et al. 2019, sec. 2.2)."""

from __future__ import annotations

import torch

from align.config.ppo import PPOStage
from align.data.lengths import DROPS_LONG_PROMPTS, enforce
from align.engines import make_engine, start_seed
from align.engines.base import RolloutEngine, holding, rest
from align.modeling.generation import Rollout, concat_rollouts, sequence_logprobs
from align.runtime.context import StageContext
from align.judges.pointwise import WeightedJudge, check_same_tokenizer
from align.stages.ppo.models import is_zero3, policy_for_generation
from align.stages.ppo.state import RewardScale


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


def rollout(cfg: PPOStage, accelerator, engine: RolloutEngine, prompts: list[str], seed: int,
            pad_id: int | None = None) -> Rollout:
    """Sample one response per prompt through the stage's engine; the hf engine samples in the training precision
    (bf16 autocast when the stage uses it), so the samples are scored by the same numerics that produced them. With
    `pad_id`, the hf engine takes `generation.batch_size` prompts per call (the KV cache align estimate counts; each
    chunk seeded by chunk_seed) and the chunks' rollouts are joined, padded with it; a vllm engine takes them
    all at once and schedules them itself."""
    size = max(1, cfg.generation.batch_size if pad_id is not None and not engine.holds_own_weights else len(prompts))
    with torch.no_grad(), accelerator.autocast(), holding(engine):  # under ZeRO-3 the policy gathered once, not a chunk
        parts = [engine.generate(prompts[i:i + size], cfg.generation, seed=chunk_seed(seed, i // size))
                 for i in range(0, len(prompts), size)]
    return concat_rollouts(parts, pad_id)  # one part: itself


def rollouts_in_chunks(cfg: PPOStage, accelerator, engine: RolloutEngine, prompts: list[str], seed: int, world: int,
                       rank: int) -> list[Rollout]:
    """One rollout per `generation.batch_size` prompts (the one at `start` seeded seed + start x world + rank), the
    policy prepared once for all of them (base.holding: under ZeRO-3 one gather, not one a chunk)."""
    size = cfg.generation.batch_size
    with holding(engine):
        return [rollout(cfg, accelerator, engine, prompts[start:start + size], seed=seed + start * world + rank)
                for start in range(0, len(prompts), size)]


def chunk_seed(seed: int, chunk: int) -> int:
    """The seed of a rollout's chunk: the first keeps the rollout's own (one call's stream, as before chunking); the
    others get seeds no other chunk of any iteration or process takes (PPO's rollout seeds are below 2**40)."""
    return seed if chunk == 0 else 2 ** 40 + seed * 1_000_003 + chunk


def scored(model, reference, r: Rollout, temperature: float, rows: int, accelerator, with_values: bool = True):
    """PPO's step 3 over a rollout, `rows` sequences at a time (the mini-batch, whose logits align estimate counts:
    64 sequences of 1,024 tokens over a 128k vocabulary at once would hold about 39 GiB of logits): the policy's
    log-probs and values (None without `with_values`: the held-out KL) and the reference's log-probs, each (B, Lr).
    Every process has as many rows, so ZeRO-3's gathers line up."""
    parts = []
    lq, all_ids, all_mask = r.query_ids.size(1), r.input_ids, r.attention_mask  # each property concatenates anew
    with torch.no_grad(), accelerator.autocast():
        for i in range(0, all_ids.size(0), rows):
            ids, mask = all_ids[i:i + rows], all_mask[i:i + rows]
            logprobs, _, values = model(ids, mask, lq, temperature, with_entropy=False, with_values=with_values)
            parts.append((logprobs, values, sequence_logprobs(reference, ids, mask, lq, temperature)))
    return tuple(None if t[0] is None else torch.cat(t) for t in zip(*parts))


def open_engine(ctx: StageContext, cfg: PPOStage, accelerator, model, tokenizer, policy_path: str,
                start: int) -> RolloutEngine:
    """The rollout engine `generation.engine` names. hf: the policy itself (under ZeRO-3 gathered for each rollout).
    vllm: one engine per process, started from the starting policy's directory (seeded per process and per the
    iteration a resumed run `start`s at: engines.start_seed) and synced before each rollout."""
    layers = is_zero3(accelerator) and cfg.generation.zero3_gather == "layers"
    engine = make_engine(cfg.generation, model=None, tokenizer=tokenizer, model_dir=policy_path,
                         fast=ctx.compute.fast_generation(cfg.generation.fast), synced_gpus=layers,
                         context=lambda: policy_for_generation(model, accelerator, cfg.generation.zero3_gather),
                         seed=start_seed(ctx.seed, accelerator.process_index, start), dtype=ctx.compute.engine_dtype(),
                         max_model_len=cfg.max_prompt_length + cfg.generation.max_new_tokens + 1,
                         log_path=ctx.dir / f"engine.rank{accelerator.process_index}.log",
                         rank=accelerator.process_index, device=accelerator.device,
                         lora_rank=cfg.lora.r if cfg.lora.enabled else None)
    return engine


def sync_engine(engine: RolloutEngine, model, accelerator, ctx: StageContext | None = None) -> float:
    """Push the policy's current weights to an engine that holds its own copy (vllm); under ZeRO-3 every process
    gathers the parameters one layer at a time as it sends them (align/engines/weight_sync.py: a collective per layer,
    in the same order everywhere), or writes its own into the node's bucket (node_bucket.py), and syncs its own engine.
    Returns the seconds it took. `ctx` (the first sync): the manifest records how the weights travelled."""
    if not engine.holds_own_weights:
        return 0.0
    with torch.no_grad():
        seconds = engine.sync_weights(accelerator.unwrap_model(model).policy)
    if ctx is not None:
        ctx.note_engine(engine, synced=True)
    return seconds


def fit_reward_scale(ctx: StageContext, cfg: PPOStage, accelerator, engine: RolloutEngine, tokenizer, scorer: WeightedJudge,
                     prompts: list[str], scale: RewardScale) -> None:
    """Ziegler et al. sec. 2.2: score `reward_normalization_samples` rollouts of the initial policy (a seeded
    sample of the prompts, split evenly over processes) and fix the gain and bias from them."""
    world, rank = accelerator.num_processes, accelerator.process_index
    n = max(world, cfg.reward_normalization_samples // world * world)
    g = torch.Generator().manual_seed(ctx.seed + 104_729)
    order = torch.randperm(len(prompts), generator=g).tolist()
    picked = [prompts[order[i % len(prompts)]] for i in range(n)][rank::world]
    starts = range(0, len(picked), cfg.generation.batch_size)
    rollouts = rollouts_in_chunks(cfg, accelerator, engine, picked, ctx.seed * 31, world, rank)
    rest(engine)  # generation.sleep: asleep before any model computes (align estimate counts it so)
    scores = [scorer.score_rollout(r, picked[start:start + cfg.generation.batch_size], tokenizer)
              for start, r in zip(starts, rollouts)]
    all_scores = accelerator.gather(torch.cat(scores))
    scaled = scale.fit(all_scores)
    if accelerator.is_main_process:
        print(f"[align] {ctx.name}: reward normalisation from {all_scores.numel()} initial-policy rollouts: "
              f"mean {all_scores.mean().item():.4f}, std {all_scores.std(unbiased=False).item():.4g} -> "
              f"gain {scale.gain:.4f}, bias {scale.bias:.4f}"
              + ("" if scaled else " (the scores barely vary: centred only, not scaled)"), flush=True)
    ctx.note(reward_normalization={"gain": scale.gain, "bias": scale.bias, "samples": n, "fitted_at_iteration": 0,
                                   "scaled": scaled})

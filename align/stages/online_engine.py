"""GRPO and RLOO sampling through an align engine that holds its own copy of the policy (`generation.engine: vllm`):
one engine per process, synced to the trained policy once per optimiser step, its samples checked against the
trainer's log-probs. GRPO through TRL's `rollout_func` (experimental in TRL 1.16), RLOO, which has no such argument
in 1.16, through its one sampling method `_generate_single_turn`, overridden in a subclass; TRL computes every loss
term as it does for its own samples. The rest of the two stages: align/stages/online_rl.py."""

from __future__ import annotations

from typing import Any

from align.config.online_rl import OnlineRLStage
from align.runtime.context import StageContext, StageError, checkpoint_step


CHECKED_ROWS = 8
"""Rows of each sampling round whose engine log-probs are compared with the trainer's (one forward pass of them)."""


class EngineRollouts:
    """A TRL online trainer's sampling through an align engine that holds its own copy of the policy (vllm): one
    engine per process, synced to the trained policy before the first round after each optimiser step (under ZeRO-3
    every process gathers a layer at a time as it sends, the same collectives everywhere), its samples checked."""

    def __init__(self, ctx: StageContext, cfg: OnlineRLStage, engine, tokenizer):
        self.ctx, self.cfg, self.engine, self.tokenizer = ctx, cfg, engine, tokenizer
        self.synced_step = -1
        self.round = (-1, 0)  # (the optimiser step a round was sampled at, its count at that step)
        self.gap_max = 0.0  # the largest log-prob gap of this attempt's rounds

    def next_seed(self, step: int) -> int:
        """The seed of the round sampled at optimiser step `step`: distinct per process (a prompt's group may be split
        over processes) and per round, and the same in a resumed run as in one never stopped (a count of rounds
        since the attempt began restarted at every resume, so a resumed run replayed the first attempt's seeds)."""
        self.round = (step, self.round[1] + 1 if self.round[0] == step else 0)
        return ((self.ctx.seed * 7919 + step) * 31 + self.round[1]) * 1009 + self.ctx.state.process_index

    def rollout_func(self, prompts: list, trainer) -> dict[str, list]:
        """TRL GRPOTrainer's `rollout_func`: this process's prompts (each repeated num_generations times by TRL's
        sampler) -> one completion each, with the prompt ids it was sampled from and the engine's log-probs."""
        from align.modeling.generation import tokenize_prompts

        q_ids, q_mask = tokenize_prompts(self.tokenizer, list(prompts))
        r = self.sample(q_ids, q_mask, trainer)
        return {"prompt_ids": [row[m.bool()].tolist() for row, m in zip(r.query_ids, r.query_mask)],
                "completion_ids": completions(r), "logprobs": [lp[m.bool()].tolist() for lp, m in
                                                               zip(r.engine_logprobs, r.response_mask)]}

    def completion_ids(self, prompt_ids: list[list[int]], trainer) -> list[list[int]]:
        """RLOOTrainer's `_generate_single_turn`: prompt ids (unpadded lists) -> completion ids."""
        import torch  # heavy: stage processes only

        pad = self.tokenizer.pad_token_id
        width = max(len(p) for p in prompt_ids)
        q_ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompt_ids], dtype=torch.long)
        q_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids], dtype=torch.long)
        return completions(self.sample(q_ids, q_mask, trainer))

    def sample(self, q_ids, q_mask, trainer):
        """One round: sync if an optimiser step passed, sample (B, Lq) left-padded prompt ids, check the first rows."""
        import torch  # heavy: stage processes only

        from align.engines import EngineError
        from align.engines.base import across_processes, check_rollout, rest
        from align.modeling.generation import response_logprobs

        acc = trainer.accelerator
        policy = acc.unwrap_model(trainer.model)
        if trainer.state.global_step != self.synced_step:
            with torch.no_grad():
                self.engine.sync_weights(policy)
            if self.synced_step == -1:  # the manifest says how the weights travelled
                self.ctx.note_engine(self.engine, synced=True)
            self.synced_step = trainer.state.global_step
        # for an engine that takes a seed per call (vLLM takes none: each process's engine started with its own,
        # engines.start_seed)
        r = self.engine.generate_ids(q_ids, q_mask, self.cfg.generation, seed=self.next_seed(trainer.state.global_step))
        if r.engine_logprobs is None:  # TRL's rollout_func requires them, and the check below compares them
            raise EngineError(f"stage '{self.ctx.name}': generation.engine '{self.engine.name}' returned no log-probs "
                              "of its own samples; GRPO and RLOO on an engine with its own copy of the policy need them "
                              "(EngineKind.token_ids); use generation.engine: hf, or make the engine return them")
        rest(self.engine)  # generation.sleep: the engine frees its memory before any model computes, while it trains
        n = min(CHECKED_ROWS, q_ids.size(0))  # the same count on every process: a forward under ZeRO-3 is collective
        head = type(r)(r.query_ids[:n], r.query_mask[:n], r.response_ids[:n], r.response_mask[:n], r.eos_found[:n],
                       r.engine_logprobs[:n])
        was_training = policy.training
        policy.eval()
        try:
            with torch.no_grad(), self.ctx.compute.autocast():
                lp = response_logprobs(policy, head, temperature=self.cfg.generation.temperature)
        finally:
            policy.train(was_training)
        gap = check_rollout(self.engine, head, lp, self.cfg.generation.max_logprob_gap,
                            f"stage '{self.ctx.name}', step {trainer.state.global_step} (after a weight sync)",
                            reduce=across_processes(acc))
        if gap is not None:  # None: an engine that reports no log-probs of its own
            self.gap_max = max(self.gap_max, gap["max"])
            keep_window_max(trainer._metrics["train" if trainer.model.training else "eval"][GAP], gap["max"])
        return r


GAP = "rollout/logprob_gap_max"


def keep_window_max(window: list[float], value: float) -> None:
    """TRL logs the mean of a metric's list over its logging window (and then clears it): the list holds one entry,
    the window's largest so far, so the logged figure is a maximum (each round's appended, one bad round of 5 nats
    among nine of 0.001 logged as 0.5)."""
    window[:] = [max(window + [value])]


def run_gap_max(rollouts: EngineRollouts, log_history: list[dict]) -> float:
    """The largest engine-trainer log-prob gap of the run: the logged windows' (before a resume too: TRL restores
    its log history) and this attempt's rounds (those after the last logged window included)."""
    logged = [row[GAP] for row in log_history if GAP in row]
    return max([rollouts.gap_max, *logged])


def completions(r) -> list[list[int]]:
    """Each row's sampled ids up to and including its first EOS (what TRL's own samplers return)."""
    return [ids[m.bool()].tolist() for ids, m in zip(r.response_ids, r.response_mask)]


def trainer_with_engine(trainer_cls, rollouts: EngineRollouts | None) -> tuple[type, dict[str, Any]]:
    """The trainer class and the extra keyword arguments that make it sample through `rollouts` (None: TRL's own
    generate). GRPO: TRL's `rollout_func`; RLOO (no rollout_func in TRL 1.16): a subclass whose one sampling method
    asks the engine."""
    import inspect

    if rollouts is None:
        return trainer_cls, {}
    if "rollout_func" in inspect.signature(trainer_cls.__init__).parameters:
        return trainer_cls, {"rollout_func": rollouts.rollout_func}
    method = getattr(trainer_cls, "_generate_single_turn", None)
    if method is None or list(inspect.signature(method).parameters)[:2] != ["self", "prompt_ids"]:
        import trl

        raise StageError(f"{trainer_cls.__name__} in TRL {trl.__version__} has neither a rollout_func argument nor "
                         "the _generate_single_turn(prompt_ids, ...) method align samples through (TRL 1.16's): set "
                         "generation.engine: hf, or install trl 1.16")

    class EngineSampled(trainer_cls):
        def _generate_single_turn(self, prompt_ids, *args, **kwargs):
            return rollouts.completion_ids(prompt_ids, self)

    EngineSampled.__name__ = f"{trainer_cls.__name__}WithEngine"
    return EngineSampled, {}


class _AlignSyncs:
    """Stands for TRL's vLLM client where TRL would sync it before a rollout_func round: align's EngineRollouts
    syncs its engine itself, once per optimiser step."""

    def sync_weights(self) -> None:
        pass


def correct_for_the_engine(trainer, gen) -> str | None:
    """GRPO sampling through rollout_func: TRL corrects for an engine that samples with other numerics than the
    trainer (bf16 kernels, prefix caching) only where it drives vLLM itself (`use_vllm`): it then recomputes the
    trainer's log-probs of every round and weighs the loss by its importance-sampling ratio over the engine's
    (`vllm_importance_sampling_*` of GRPOConfig, grpo_trainer.py `_generate_and_score_completions`). Turned on for
    align's engine too, TRL's own sync a no-op. Not under `top_k`/`top_p` (`gen`): the engine's log-probs are then
    those of the truncated distribution it sampled, the trainer's of the whole one, so every ratio would be below 1
    and a sequence's product of them would all but erase its policy loss. Returns the mode, or why it is off (None:
    a trainer without that machinery)."""
    args = trainer.args
    if not getattr(args, "vllm_importance_sampling_correction", False) or not hasattr(trainer, "use_vllm"):
        return None
    if gen.top_k or gen.top_p < 1.0:
        return (f"off: top_k {gen.top_k} / top_p {gen.top_p} truncate what the engine samples, so its log-probs are "
                "not comparable with the trainer's")
    trainer.use_vllm, trainer.vllm_generation, trainer._last_loaded_step = True, _AlignSyncs(), -1
    return f"{args.vllm_importance_sampling_mode} (ratio bounds {args.vllm_importance_sampling_clip_min}, " \
           f"{args.vllm_importance_sampling_clip_max})"


def open_engine(ctx: StageContext, cfg: OnlineRLStage, tokenizer, path: str) -> EngineRollouts | None:
    """This process's engine when `generation.engine` names one with its own copy of the policy (else None: TRL
    samples with its own generate), started from the policy's directory."""
    from align.engines import kind, make_engine, start_seed

    if not kind(cfg.generation.engine).own_copy:
        return None
    rank = ctx.state.process_index  # (the trainer resumes from the same checkpoint: ctx chooses it once)
    seed = start_seed(ctx.seed, rank, checkpoint_step(ctx.last_checkpoint()))
    engine = make_engine(cfg.generation, model=None, tokenizer=tokenizer, model_dir=path, seed=seed,
                         dtype=ctx.compute.engine_dtype(), max_model_len=cfg.max_length + 1,
                         log_path=ctx.dir / f"engine.rank{rank}.log", rank=rank, device=ctx.state.device,
                         lora_rank=cfg.lora.r if cfg.lora.enabled else None)
    try:
        ctx.note_engine(engine)
        return EngineRollouts(ctx, cfg, engine, tokenizer)
    except BaseException:  # not yet in run()'s try: closed here
        engine.close()
        raise

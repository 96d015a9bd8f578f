"""The `ppo` stage type: PPO with a KL penalty to the reference (align/stages/ppo/)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from align.engines import engine_names, holds_own_copy
from align.config.contract import HeldModel, POLICY, PROMPTS_ONLY, REWARD_MODEL, CheckContext, StageBase
from align.config.online import lora_sync_problem, response_length_problems, reward_length_problems, reward_stages
from align.config.settings import Generation, LoraSettings
from align.judges import judge_weights
from align.data.lengths import DROPS_LONG_PROMPTS, LengthRule
from align.core.schema import one_of, ranged, step_size

FUSED_HEAD_CHUNK = 1024
"""Tokens per chunk of PPO's fused head (align/modeling/fused_head.py), here so the estimate reads it without torch."""


@dataclass
class KLSettings:
    """KL penalty to the reference policy (Ziegler et al. 2019)."""

    coef: float = ranged(0.05, ge=0, fix="a negative coefficient rewards moving away from the reference")
    """Initial beta of the per-token penalty -beta * KL."""
    adaptive: bool = True
    """Adapt beta towards `target` with `controller`; false: beta stays at coef."""
    controller: str = one_of("pi", "pi", "ziegler")
    """pi: beta = coef + a Lagrange multiplier set by a PI rule on the KL's excess over target, per iteration (Stooke
    et al. 2020; gains `kp`, `ki`): it acts within the iterations a run has. ziegler: Ziegler et al. 2019's
    proportional rule, beta moved by at most 20% x min(1, episodes-per-iteration / `horizon`) per iteration (the
    cap is align's: a shorter horizon would take beta through zero)."""
    target: float = ranged(4.0, gt=0)
    """Target KL (nats per response) for the adaptive controller."""
    kp: float = ranged(0.1, ge=0)
    """pi: beta added per nat of KL over target in this iteration (proportional gain)."""
    ki: float = ranged(0.1, ge=0)
    """pi: beta added per nat of KL over target accumulated over iterations (integral gain; the sum never goes
    below 0, and each iteration adds at most `target` either way: align/stages/ppo/state.py)."""
    horizon: int = ranged(10000, ge=1)
    """ziegler: controller horizon in episodes (Ziegler et al. used 10000 with 512 episodes per update over
    thousands of updates; a short run needs a short horizon for beta to move at all)."""
    max: float | None = ranged(None, gt=0, fix="use null for no budget")
    """A hard budget, nats per response against the reference, that the published policy is kept inside: after every
    update the KL is measured on `heldout_prompts` prompts PPO never trains on; when its one-sided 95% upper bound
    (mean + Student's t x standard error, at least 2 prompts) passes `max`, that update is undone and training stops, and the policy of the
    last update inside the budget is published (the summary says which iteration and why). null: no budget."""
    heldout_prompts: int = ranged(64, ge=0)
    """Prompts set aside from `prompts` (a seeded sample, never trained on) on which the KL to the reference is
    measured after every update, as the evaluation measures it (sum over the response of log pi - log ref, at the
    sampling temperature): `heldout/kl` in the metrics, what `max` and the pi controller read. 0: not measured
    (the controller then reads the KL of each iteration's rollout, measured before its update)."""
    estimator: str = one_of("k1", "k1", fix=(
        "k2 and k3 (Schulman 2020) estimate the KL's value, not its gradient: as a reward the policy gradient takes "
        "E[k grad log pi], which for k3 is grad KL(pi||ref) - grad KL(ref||pi) and for k2 of second order, both ~0 "
        "near the reference (measured: under 5% of k1's pull, the wrong way), so beta would not hold the policy "
        "back; use k1"))
    """Per-token KL estimator in the reward: k1, the log-ratio log pi - log ref (the only one whose policy gradient
    is the KL's). `objective/kl` reports its sum over the response, in nats."""


@dataclass
class PPOLoraSettings(LoraSettings):
    """LoRA for PPO: as for every trained stage, but without adapter dropout by default (see `PPOStage.check`)."""

    dropout: float = ranged(0.0, ge=0, lt=1)
    """Dropout on the adapter input: must stay 0 in PPO."""


@dataclass
class PPOStage(StageBase):
    """PPO against a frozen reward model or Python judges, with a KL penalty to the reference (align's own)."""

    LEFT_PADDED: ClassVar[bool] = True

    ENGINES: ClassVar[tuple[str, ...]] = engine_names()  # every engine (align/engines/)
    TYPE: ClassVar[str] = "ppo"
    PROMPTS: ClassVar[str] = "train"
    HEADLINE: ClassVar[tuple[str, ...]] = ("objective/scores_last", "objective/kl_last", "heldout/kl_last",
                                           "kl_budget/published_iteration", "kl_budget/undone_iteration")
    PRODUCES: ClassVar[str] = POLICY
    INPUTS: ClassVar[dict[str, tuple[str, bool]]] = {"policy": (POLICY, True), "reward": ("judge", False)}
    CARDS: ClassVar[dict[str, str]] = {"prompts": PROMPTS_ONLY}
    WORK: ClassVar[str] = "ppo/iterations_run"

    policy: str = "sft"
    """Stage whose model/ is the starting policy and the frozen reference."""
    reward: str | dict[str, float] = "reward"
    """What PPO maximises: a reward stage (frozen reward model), a Python judge (`vader`, or a user's
    `module:function` taking (prompts, responses) and returning floats), or a weighted sum of these as a
    mapping, e.g. {reward: 1.0, vader: 0.5}."""
    value_init: str = one_of("reward", "reward", "policy", "shared")
    """Initialise the value model from `reward` (the reward model with its head; needs a reward stage) or
    `policy` (the policy's transformer with a fresh scalar head); or `shared`: no value model of its own, a linear
    value head (starting at zero) on the policy's last hidden state, trained with the policy: the value loss, times
    vf_coef, trains the policy's weights too (that gradient is clipped with the policy's and stepped at
    learning_rate; value_learning_rate reaches the head only). One forward pass then gives log-probs and values:
    per iteration about 3 + 3 x ppo_epochs forward-equivalents instead of 4 + 6 x ppo_epochs (a backward counted
    as two), and one model less in memory."""
    prompts: str = ""
    """Data card path; its `prompt` column is used."""
    split: str = "train"
    """Split of the card to take prompts from."""
    iterations: int = ranged(40, ge=1)
    """PPO iterations (rollout + update)."""
    rollout_batch_size: int = ranged(64, ge=1)
    """Prompts per iteration per process."""
    mini_batch_size: int = ranged(16, ge=1)
    """Episodes per optimiser step (before accumulation)."""
    gradient_accumulation_steps: int = ranged(1, ge=1)
    """Mini-batches per optimiser step."""
    ppo_epochs: int = ranged(4, ge=1)
    """Passes over each rollout."""
    learning_rate: float = step_size(1e-6)
    """Policy learning rate: 1e-6, the order of published 7-8B PPO recipes (OpenRLHF's actor: 5e-7); a small model
    trained from scratch needs ~1e-4."""
    value_learning_rate: float = step_size(1e-5)
    """Value model learning rate (OpenRLHF's critic: 9e-6); with value_init: shared, the value head's only."""
    gamma: float = ranged(1.0, ge=0, le=1)
    """Discount."""
    lam: float = ranged(0.95, ge=0, le=1)
    """GAE lambda."""
    clip_range: float = ranged(0.2, gt=0, lt=1, fix="the ratio's lower clip 1 - clip_range must stay above 0 to bind")
    """Policy ratio clip epsilon."""
    clip_range_value: float = ranged(0.2, gt=0)
    """Value clip range."""
    vf_coef: float = ranged(0.1, gt=0, fix="at 0 the value model never learns, and GAE's advantages read its "
                                             "initial values throughout")
    """Value loss weight."""
    entropy_coef: float = ranged(0.0, ge=0)
    """Entropy bonus weight."""
    max_approx_kl: float | None = ranged(None, gt=0, fix="use null for no early stop")
    """Stop the epoch loop early when approximate KL exceeds this."""
    max_grad_norm: float | None = ranged(1.0, gt=0, fix="use null for no clipping")
    """Clip the policy's and the value model's gradient norms to this, each separately, on every backend
    (None = no clipping)."""
    missing_eos_penalty: float | None = ranged(1.0, ge=0, fix="use null to turn the penalty off")
    """Subtracted from the (normalised) score of responses that never emit EOS (None = off)."""
    reward_normalization: str = one_of("initial", "initial", "running", "none")
    """initial: a fixed gain and bias from rollouts of the initial policy, so its scores have mean 0 and
    std 1 (Ziegler et al. 2019, sec. 2.2); the value model is read in the same units. running: running
    mean/std of every score seen (drifts during training). none: raw scores."""
    reward_normalization_samples: int = ranged(256, ge=2)
    """Initial-policy rollouts (over all processes) that fix the gain and bias of `initial` normalisation."""
    max_prompt_length: int = ranged(512, ge=1)
    """Longest prompt in tokens (after the chat template); longer prompts are dropped and counted before the first
    rollout, and the stage refuses to start when more than max_truncated_fraction of them would be dropped."""
    max_truncated_fraction: float = ranged(0.05, ge=0, le=1)
    """Refuse to train when more than this fraction of the prompts are longer than max_prompt_length."""
    gradient_checkpointing: bool = False
    """Recompute the policy's and the value model's activations in the backward pass (about a third more compute
    per update, activations of one layer instead of all): what lets 8B PPO fit (`align estimate` says when)."""
    padding_free: bool = True
    """Score and train without pad tokens: each batch's sequences packed into rows with restarting positions (no
    query row of left padding attending to nothing: those gave NaN gradients under CUDA's SDPA kernels in bf16);
    log-probs, values and gradients equal the padded path's (tests/test_packing.py). A family whose forward cannot
    read packed positions (OPT) runs padded whatever this says."""
    fused_head: str = one_of("auto", "auto", "on", "off")
    """Log-probs and entropies of the policy and the reference straight from the last hidden state, 1,024 tokens at a
    time, never holding the batch's (tokens x vocabulary) logits, recomputed in the backward pass
    (align/modeling/fused_head.py): at 8B with a 128k vocabulary 0.5 GB of fp32 logits a copy instead of 4 GB per
    8,192 response tokens, for one more LM-head matmul per backward. auto = on a GPU wherever it is exact (a plain
    Linear head, not partitioned by ZeRO-3, nothing after the head such as logit soft-capping), off on a CPU (slower
    there: docs/benchmarks.md); on = wherever exact (refused where it is not); off = the logits as before. On an H200
    (2026-11-27, Llama-3.2-1B shape, bf16): 34% less peak memory, 15% more time per training pass."""
    save_every: int = ranged(10, ge=1)
    """Checkpoint every N iterations."""
    save_total_limit: int = ranged(2, ge=1)
    """Keep this many resumable checkpoints (the newest); 1 for large models (each holds policy and value weights
    and their optimiser states)."""
    sample_every: int = ranged(10, ge=1)
    """Log a table of sample responses every N iterations."""
    kl: KLSettings = field(default_factory=KLSettings)
    """KL penalty settings."""
    generation: Generation = field(default_factory=Generation)
    """Rollout decoding settings."""
    lora: PPOLoraSettings = field(default_factory=PPOLoraSettings)
    """LoRA adapters instead of full fine-tuning: the policy and the value model (whose scalar head is also
    trained) each get their own (value_init: shared: the policy's adapters and the value head); the reference is
    the policy's base with its adapters disabled, and with value_init: reward the reward model is the value model's
    base with its adapters disabled, so no extra copy of either is held. `model/` holds the policy's adapters beside
    their base's name, or with `merge` the merged policy."""

    def logit_tokens(self, mode: str, on_gpu: bool) -> int | None:
        """The fused head's chunk where `fused_head` applies (auto: on a GPU; never when ZeRO-3 partitions the head)."""
        if self.fused_head == "off" or (self.fused_head == "auto" and not on_gpu) or mode.startswith("zero3"):
            return None
        return FUSED_HEAD_CHUNK

    def held_logits(self) -> tuple[int, int]:
        """(positions a sequence, bytes a vocabulary entry) of the policy's logits in a training forward without the
        fused head (the memory estimate): the response's positions alone (logits_to_keep), ~16 bytes an entry at the
        peak of the backward (an fp32 log-softmax and the gradients), 24 when the entropy trains (entropy_coef > 0:
        autograd keeps p): the peak resident memory of bf16 logits' forward and backward on CPU, 16.1 and 24.1 bytes
        an entry (2026-12-02, an Intel Xeon)."""
        return self.generation.max_new_tokens, 24 if self.entropy_coef > 0 else 16

    def mode_problem(self, mode: str) -> str | None:
        """What `fused_head: on` cannot do under this accelerate mode (checked at validate, not when PPO starts)."""
        if self.fused_head == "on" and mode.startswith("zero3"):
            return ("fused_head: on under ZeRO-3: the output head is partitioned across processes, so its chunks cannot "
                    "be computed from the hidden states; set fused_head: auto (off under ZeRO-3) or use zero2")
        return None

    def unread_settings(self) -> dict[str, str]:
        """Settings this stage does not read as it is set (dotted key -> why): a sweep over one trains twins."""
        kl = self.kl
        if not kl.adaptive:
            unread = dict.fromkeys(("kl.controller", "kl.target", "kl.kp", "kl.ki", "kl.horizon"), "kl.adaptive is false")
        else:
            unread = dict.fromkeys(("kl.kp", "kl.ki") if kl.controller == "ziegler" else ("kl.horizon",),
                                   f"kl.controller is {kl.controller}")
        if self.reward_normalization != "initial":
            unread["reward_normalization_samples"] = f"reward_normalization is {self.reward_normalization}"
        return {**self.lora.unread(), **unread}

    def check(self, ctx: CheckContext) -> None:
        ctx.check_judge("reward", self.reward)
        if ctx.pipeline.precision == "float16":  # align/stages/ppo/optim.py works on unscaled gradients
            raise ValueError("precision: float16 (the pipeline's): PPO clips the policy's and the value model's "
                             "gradients separately and skips non-finite steps, on gradients float16 would leave "
                             "multiplied by its loss scale (each overflow counted as a failed step); use precision: "
                             "bfloat16 (GPUs from Ampere on) or float32")
        problem = lora_sync_problem(self.generation, self.lora) or self.generation.truncation_problem(
            "PPO's KL penalty, its held-out KL (kl.max) and its policy gradient each")
        if problem:
            raise ValueError(problem)
        reward_stages = {n for n, st in ctx.pipeline.stages.items() if st.PRODUCES == REWARD_MODEL}
        used = [n for n in judge_weights(self.reward) if n in reward_stages]
        if self.value_init == "reward" and len(used) != 1:
            raise ValueError(f"value_init: 'reward' starts the value model from the reward model, but reward "
                             f"{self.reward!r} names {len(used)} reward stages; set value_init: policy")
        if self.value_init == "reward" and self.reward_normalization == "running":
            raise ValueError("value_init: 'reward' with reward_normalization: running; the value model would start at "
                             "the reward model's raw scores while its returns are in running-normalised units (mean "
                             "0, std 1), an offset its clipped loss (clip_range_value) closes by a little per "
                             "iteration, biasing every advantage meanwhile; use reward_normalization: initial (its "
                             "gain and bias start the value model in the same units) or value_init: policy")
        if self.kl.adaptive and self.kl.controller == "ziegler" and self.kl.coef == 0:
            raise ValueError("kl.coef: 0 with kl.controller: ziegler; that controller scales beta by a factor, so it "
                             f"never leaves 0 and the KL target ({self.kl.target:g}) is never enforced; start from a "
                             "positive coef (e.g. 0.05), use kl.controller: pi (which adds to coef), or set "
                             "kl.adaptive: false to train without a KL penalty")
        if self.kl.adaptive and self.kl.controller == "pi" and not (self.kl.kp or self.kl.ki):
            raise ValueError("kl.kp and kl.ki: both 0 with kl.controller: pi; beta would stay at coef whatever the KL, "
                             "so the target is never enforced; set a gain (e.g. kp 0.1, ki 0.1), or kl.adaptive: false "
                             "for a fixed beta")
        if self.kl.max is not None and self.kl.heldout_prompts < 2:
            raise ValueError(f"kl.max: {self.kl.max:g} with kl.heldout_prompts: {self.kl.heldout_prompts}; the budget "
                             "is checked on held-out prompts after every update, against an upper confidence bound "
                             "that needs at least 2 of them; set kl.heldout_prompts (e.g. 64)")
        if self.kl.max is not None and self.kl.adaptive and self.kl.target >= self.kl.max:
            raise ValueError(f"kl.target: {self.kl.target:g} is not below kl.max: {self.kl.max:g}; the controller "
                             "would steer to a KL the budget stops training at; set kl.target below kl.max (e.g. "
                             f"{self.kl.max * 2 / 3:g})")
        self.lora.check()
        if self.lora.enabled and self.lora.dropout:
            raise ValueError(f"lora.dropout: {self.lora.dropout}; PPO runs every model without dropout, so the "
                             "rollout's and the update's log-probs agree (ratio 1 at the first step); set it to 0")
        step = self.mini_batch_size * self.gradient_accumulation_steps
        if self.rollout_batch_size % step:
            raise ValueError(f"rollout_batch_size ({self.rollout_batch_size}) must be divisible by mini_batch_size "
                             f"x gradient_accumulation_steps ({self.mini_batch_size} x "
                             f"{self.gradient_accumulation_steps})")

    def pipeline_problems(self, name: str, stages: dict[str, StageBase]) -> list[str]:
        """PPO optimises responses of `generation.max_new_tokens`; its reward model learned from pairs sampled
        at the preferences stage's length, and the evaluation samples at its own. When they differ, PPO learns
        what a reward model says of responses it never saw (e.g. cut off before EOS) and is judged at yet
        another length."""
        longest = self.max_prompt_length + self.generation.max_new_tokens
        return (response_length_problems(name, "PPO", self.generation.max_new_tokens, self.reward, stages)
                + reward_length_problems(name, longest, "max_prompt_length + generation.max_new_tokens", self.reward,
                                         stages))

    def checkpoints_written(self) -> int:
        """The checkpoints a run writes: one every save_every iterations, none at the last (align/stages/ppo/__init__.py
        `after_iteration`; the model is published then). Read by the disk estimate (align/orchestrator/disk.py)."""
        return (self.iterations - 1) // self.save_every

    def card_split(self, fld: str) -> str:
        return self.split

    def length_check(self, fld: str, stages: dict[str, StageBase]) -> tuple[LengthRule, int, float] | None:
        return (DROPS_LONG_PROMPTS, self.max_prompt_length, self.max_truncated_fraction) if fld == "prompts" else None

    def deepspeed_settings(self) -> dict[str, Any]:
        """PPO sets DeepSpeed's accumulation itself and clips each model's gradient separately (ppo/optim.py)."""
        return {"gradient_accumulation_steps": self.gradient_accumulation_steps, "gradient_clipping": self.max_grad_norm}

    def generation_settings(self) -> Generation:
        return self.generation

    def check_positions(self, limit: int, fix: str) -> None:
        if self.max_prompt_length + self.generation.max_new_tokens > limit:
            raise ValueError(f"max_prompt_length + generation.max_new_tokens: {self.max_prompt_length} + "
                             f"{self.generation.max_new_tokens} is longer than the model accepts: {fix}")
        super().check_positions(limit, fix)

    def held_models(self, stages: dict[str, StageBase]) -> list[HeldModel]:
        held = [HeldModel("policy", "lm", True)]
        held += [] if self.value_init == "shared" else [HeldModel("value", "scalar", True)]
        if not self.lora.enabled:  # with LoRA the reference is the policy's base with adapters disabled
            held.append(HeldModel("reference", "lm", False))  # sharded under ZeRO-3 (ppo/models.py prepare_frozen)
        rewards = reward_stages(self.reward, stages)
        shared = self.lora.enabled and self.value_init == "reward"  # the reward model is the value model's base
        return held + [HeldModel("reward", "scalar", False)] * (len(rewards) - shared)

    def gathers_policy_for_generation(self) -> bool:
        """The hf engine samples from the policy gathered whole (generation.zero3_gather: whole; align/stages/ppo/
        models.py policy_for_generation); an engine with its own copy gathers one layer at a time as it syncs
        (align/engines/weight_sync.py) and never the whole policy."""
        return not holds_own_copy(self.generation.engine) and self.generation.zero3_gather == "whole"

    def keeps_policy_snapshot(self) -> bool:
        """kl.max undoes an update past the budget from a host copy (align/stages/ppo/budget.py PolicySnapshot)."""
        return self.kl.max is not None

    def workload(self) -> tuple[int, int, int, int]:
        seq = self.max_prompt_length + self.generation.max_new_tokens
        return self.mini_batch_size, seq, min(self.generation.batch_size, self.rollout_batch_size), seq
